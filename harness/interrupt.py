"""Ctrl-C and SIGTERM, the same in every command: stop within seconds, keep what finished, exit 130 / 143.

`handled()` (around every command in harness.cli, and around a pytest session in the plugin) makes SIGINT,
SIGTERM and SIGHUP (a closed terminal) raise `Interrupted`, a KeyboardInterrupt, in the main thread, so
every `finally` on the way out runs: llama-servers and engine workers stop, a bisect resets its checkout.
The first signal is remembered: `status()` is the exit status it asks for (128 + its number: 130 for
Ctrl-C, 143 for SIGTERM, 129 for SIGHUP), and `check()` raises it again where something underneath
swallowed the exception. A command writing what finished does so inside `deferred()`: a signal then lets
the files be completed (a second one does not).

Phases: each command says where it is with `phase(name)` — planning, building, serving, checking, triage,
writing, report, exit (the command returned, servers and workers have stopped: the last thing the process
does), and in a bisect step bisect-<role>
(bisect-step, bisect-verify-good, ...). Two
environment variables let tests interrupt in a given phase instead of after a guessed time:
SPECHARNESS_PHASE_FILE, a file each process appends the name of every phase it enters to (child
processes inherit it: a bisect's steps write to the same file), and SPECHARNESS_HOLD_PHASE=NAME[:N],
which stops the process at the start of the N-th entry into phase NAME (default the first; counted in the
phase file, across processes) until a signal comes. Neither is set in a normal run.

A signal that was ignored when the process started stays ignored: SIGINT in a background job of a
non-interactive shell (that shell meant Ctrl-C not to reach it), SIGHUP under nohup.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

PHASE_FILE = "SPECHARNESS_PHASE_FILE"
HOLD_PHASE = "SPECHARNESS_HOLD_PHASE"
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
HOLD_POLL_S = 0.05

_received: list[int] = []
"""The signals received so far, first first."""
_deferring = 0
"""How many `deferred()` blocks are open."""
_decided: int | None = None
"""Signals received when the program's command returned its exit status (`handled(until_exit=True)`)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP (`signum`): a KeyboardInterrupt, so code that handles Ctrl-C handles all."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _handler(signum: int, frame) -> None:
    _received.append(signum)
    if _deferring and len(_received) == 1:
        return  # raised at the end of the deferred block
    raise Interrupted(signum)


@contextlib.contextmanager
def handled(until_exit: bool = False) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise `Interrupted` while the block runs (no-op outside the main thread).

    `until_exit` (the program's command, not a call from other code): after the block, until the process
    has exited (servers and workers stopping at exit included), a first signal is only remembered, and the
    process then exits 128 + its number instead of the status the command returned."""
    global _deferring, _decided
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            previous[sig] = signal.signal(sig, _handler)
    try:
        yield
    finally:
        if until_exit:
            _deferring += 1
            _decided = len(_received)
        else:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal during the block is only remembered (`received()`; a second one raises at once): for
    writing results and reports, which must not be left half-written."""
    global _deferring
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1


def received() -> int | None:
    """The first signal received, None when none was."""
    return _received[0] if _received else None


def status() -> int:
    """The exit status of an interrupted command: 128 + the first signal's number (130 when none came, for
    a KeyboardInterrupt raised by other means)."""
    return 128 + (received() or signal.SIGINT)


def check() -> None:
    """Raise `Interrupted` if a signal came and was swallowed on its way (outside a deferred block)."""
    if _received and not _deferring:
        raise Interrupted(_received[0])


def phase(name: str) -> None:
    """The command enters phase `name`: recorded in SPECHARNESS_PHASE_FILE, held there when
    SPECHARNESS_HOLD_PHASE names it; raises `Interrupted` if a signal already came."""
    check()
    path = os.environ.get(PHASE_FILE)
    if path:
        with open(path, "a") as f:
            f.write(name + "\n")
    hold, _, nth = os.environ.get(HOLD_PHASE, "").partition(":")
    if hold != name or _entries(path, name) != int(nth or 1):
        return
    print(f"specharness: holding in phase {name} until a signal comes ({HOLD_PHASE})", file=sys.stderr, flush=True)
    while not _received:  # the handler raises inside sleep(), or (deferred) records and returns
        time.sleep(HOLD_POLL_S)
    check()


@atexit.register  # registered when harness.cli is imported, before whatever stops servers at exit: runs after it
def _exit_status() -> None:
    if _decided is not None:
        phase("exit")
    if _decided == 0 and _received:  # the command said 0, 1, ...; a signal came while the process was exiting
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status())


_entered: dict[str, int] = {}


def _entries(path: str | None, name: str) -> int:
    """How many times phase `name` was entered: in the phase file (every process), else in this process."""
    if path:
        with open(path) as f:
            return sum(1 for line in f if line.rstrip("\n") == name)
    _entered[name] = _entered.get(name, 0) + 1
    return _entered[name]
