"""Serving calibration's runs side by side: each on a fresh executor (fresh sessions: a repeat is a fresh serving,
as before), `jobs` at a time, every executor sharing one backend.

A tiny model's serving keeps one core busy: llama-server and the engine run with `default_threads` (half the
cores), and the harness mostly waits on them. Measured 2026-12-05 on a 2-core AVX2-only machine, tiny-dense on
llama-server, one serving after another: 447 s wall with 498 s of CPU, so one of the two cores was idle. Several
servings at once change no `seq` serving (a one-slot serving is a function of its command line and its prompts:
`measure.timing_dependent`) and give the `par` / `no-kv-unified` ones the timing of a busy machine, which is the
machine the suites run on (and what the repeats measure the spread of).

Ctrl-C or a failed reference closes every session open at that moment: its in-flight requests fail at once
(a closed llama-server session starts no new server), servings not yet started never start.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from harness.errors import HarnessError
from harness.execute import ExecOptions, Executor
from harness.llama.defaults import default_threads

if TYPE_CHECKING:
    from collections.abc import Callable

    from harness.backends.base import Backend, ServeConfig, Session
    from harness.execute import CellRun
    from harness.matrix import Cell
    from harness.suites import Suite


def default_jobs() -> int:
    """How many servings at once: as many as the cores hold servers of `default_threads` threads (2 on 2 cores)."""
    return max(1, (os.cpu_count() or 2) // default_threads())


class _Shared:
    """One backend for every executor of the calibration, which knows the sessions open on it."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._open: set[_Tracked] = set()
        self._lock = threading.Lock()
        self.closing = False

    def open(self, config: ServeConfig) -> _Tracked:
        session = _Tracked(self._backend.open(config), self)
        with self._lock:
            self._open.add(session)
            stopped = self.closing
        if stopped:  # closed while this one started
            session.close()
            raise HarnessError("calibration stopped")
        return session

    def environment(self) -> dict:
        return self._backend.environment()

    def __getattr__(self, name: str) -> Any:  # anything else a backend offers: its own
        return getattr(self._backend, name)

    def closed(self, session: _Tracked) -> None:
        with self._lock:
            self._open.discard(session)

    def close_all(self) -> None:
        """Close every open session (from the main thread: their requests in flight fail at once)."""
        with self._lock:
            self.closing = True
            sessions = list(self._open)
        for session in sessions:
            session.close()


class _Tracked:
    """A session that tells the shared backend when it closes."""

    def __init__(self, session: Session, shared: _Shared):
        self._session = session
        self._shared = shared

    def run(self, requests):
        return self._session.run(requests)

    def close(self) -> None:
        self._session.close()
        self._shared.closed(self)

    def __getattr__(self, name: str) -> Any:  # save_slot, rescore, ...: the session's own
        return getattr(self._session, name)


class Servings:
    """Serves (suite, cell) pairs for calibration, `jobs` at a time (`default_jobs`)."""

    def __init__(self, backend_name: str, backend: Backend, jobs: int | None = None):
        self._shared = _Shared(backend)
        self.options = ExecOptions(backends={backend_name: lambda: self._shared}, kv_scan="off")
        self.jobs = max(1, jobs or default_jobs())

    def environment(self, cell: Cell) -> dict:
        """What produced the outputs (Executor.environment)."""
        return Executor(self.options).environment(cell)

    def serve(
        self, first: tuple[Suite, Cell], rest: list[tuple[Suite, Cell]], check_first: Callable[[CellRun], None]
    ) -> tuple[CellRun, list[CellRun]]:
        """`first`'s run and each of `rest`'s, in order. `first` is served first; `check_first(its run)` raising
        stops every other serving and is raised. Each serving runs on a fresh executor; one whose config is
        scripted takes `first`'s run as its script's reference (Executor.adopt), as it would on one executor."""
        futures: list[Future] = []
        with ThreadPoolExecutor(self.jobs, thread_name_prefix="calibrate") as pool:
            try:
                head = pool.submit(self._one, *first, None)
                futures = [pool.submit(self._one, suite, cell, head) for suite, cell in rest]
                reference = head.result()
                check_first(reference)
                return reference, [f.result() for f in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                self._shared.close_all()
                raise

    def _one(self, suite: Suite, cell: Cell, head: Future | None) -> CellRun:
        if self._shared.closing:
            raise HarnessError("calibration stopped")
        executor = Executor(self.options)
        if head is not None and cell.preset.scripted:
            executor.adopt(head.result())
        return executor.run(suite, cell)
