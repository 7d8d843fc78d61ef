"""The engine's side of a worker process: one Engine, driven over a pipe by `harness.backends.inproc`.

llama.cpp aborts the whole process on a failed GGML_ASSERT (and a segfault or an OOM kill ends it too),
so the in-process engine runs in a child process: what would kill the harness ends only the worker, and
the backend turns it into a `crashed` Result naming the assert, like a crashed llama-server.

Messages (tuples, pickled by multiprocessing):
  parent → worker: ("open", EngineArgs) · ("run", [Request, ...]) · ("save", slot) · ("restore", slot, state, erase)
                   · ("score", [(Request, Result), ...]) · ("replay_row", decodes, row, top_k)
                   · ("joint_law", sampling, prompt, k, min_mass) · ("close",)
  worker → parent: ("ready",) · ("result", index, Result) per finished request, then ("done",) ·
                   ("answer", dict) to a save, restore, score, replay_row or joint_law (Engine.save_slot /
                   restore_slot / score / replay_row / joint_law) ·
                   ("refused", one-line reason) for bad input · ("bug", traceback) for a harness exception
Progress goes through shared memory instead, read by the parent whenever it likes: `progress[STEPS]` counts
the engine's steps, `progress[PROMPT]` holds the prompt tokens the current step may have to read first
(Scheduler.run's `on_step`). A worker whose count stops moving is hung (the stall window).
"""

import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

from harness.engine.context import ContextParams
from harness.engine.engine import Engine
from harness.engine.logging import set_llama_verbose
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.llama.defaults import NO_BACKTRACE

WORKER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals a terminal or `kill -- -PGID` sends the whole process group, the worker included: the parent
handles each as Ctrl-C (harness.interrupt) and kills the worker itself, so a worker that died of one first would
read as `crashed ... SIGTERM`, a verdict on llama.cpp that it never earned."""

STEPS, PROMPT = 0, 1
"""Indices into the shared progress array (a RawArray of two 64-bit integers)."""


@dataclass
class EngineArgs:
    """What `Engine(...)` takes, sent to the worker once per session."""

    model: Path
    params: ContextParams
    spec: SpecConfig | None
    logit_top_k: int
    kv_scan: str
    keep_slot_states: bool = False


def serve(conn, log_path: str, verbose: bool, progress) -> None:
    """The worker's main loop (the target of the child process); `progress`: see the module docstring."""
    for sig in WORKER_IGNORES:  # the parent's to handle (harness.interrupt); it stops the worker (SIGKILL)
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault(NO_BACKTRACE, "1")  # read by ggml when it aborts
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)  # where llama.cpp prints `file:line: GGML_ASSERT(...) failed` and the backtrace
    set_llama_verbose(verbose)
    engine = None

    def step(prompt_tokens: int) -> None:
        progress[PROMPT] = prompt_tokens
        progress[STEPS] += 1

    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent went away
                return
            kind = message[0]
            try:
                if kind == "open":
                    a: EngineArgs = message[1]
                    engine = Engine(a.model, a.params, a.spec, a.logit_top_k, a.kv_scan, a.keep_slot_states)
                    conn.send(("ready",))
                elif kind == "run":
                    engine.run(
                        message[1], on_result=lambda index, result: conn.send(("result", index, result)), on_step=step
                    )
                    conn.send(("done",))
                elif kind == "score":
                    conn.send(("answer", {"scores": engine.score(message[1])}))
                elif kind == "joint_law":
                    conn.send(("answer", engine.joint_law(*message[1:])))
                elif kind == "replay_row":
                    conn.send(("answer", {"row": engine.replay_row(*message[1:])}))
                elif kind == "save":
                    conn.send(("answer", engine.save_slot(message[1])))
                elif kind == "restore":
                    conn.send(("answer", engine.restore_slot(message[1], message[2], message[3])))
                elif kind == "close":
                    return
            except HarnessError as err:
                conn.send(("refused", str(err)))
            except Exception:  # a bug of the harness: reported as such, never as a check verdict
                conn.send(("bug", traceback.format_exc()))
    finally:
        if engine is not None:
            engine.close()
