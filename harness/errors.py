"""User-facing errors: one line naming the thing that is wrong and how to fix it.

Three kinds of thing can stop a check from earning a verdict, and each has its class:
- HarnessError: we could not do what was asked (bad input, a missing model or flag, a server that did not become
  ready in time): the CLI prints one line; in a run it is a harness fault (exit 3, a pytest ERROR), never a verdict;
- HarnessBug: a Python exception inside the harness, with its traceback: a harness fault too;
- Unservable: the model cannot serve a cell's speculative configuration (no draft model, MTP block or draft head
  for it: a model of your own run over a suite's blocks): the cell's checks are not run, with that reason;
- LlamaAbort: llama.cpp itself aborted before it served a request (llama-server in its start-up or warm-up, the
  engine while loading the model): a finding of the software under test, which `no-crash` fails on with the abort
  line, like a crash mid-request. It is a HarnessError so that code which only reports one-line errors keeps
  working; the executor tells it apart.
"""


class HarnessError(Exception):
    """An error the CLI prints as one line (no traceback) before exiting with status 2."""


class HarnessBug(Exception):
    """A Python exception inside the harness (a bug of ours): reported as a harness error with its
    traceback, never counted as a check verdict or as a catch of a fault."""


class LlamaAbort(HarnessError):
    """llama.cpp aborted (an assert, an uncaught exception, a fatal signal) while starting: its message names how
    the process ended and the abort line. A `no-crash` failure of the cell, not a harness fault."""


class Unservable(HarnessError):
    """The model has nothing a cell's speculative type needs (a draft model, an MTP block, a draft head made for
    it): not a fault of the harness nor of llama.cpp. The cell is not served and every check of it is `not run`
    with this one-line reason, which names what would make it run."""
