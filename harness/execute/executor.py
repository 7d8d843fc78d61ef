"""Running one matrix cell of a suite: one session (engine or server) serving every case, round after round.

A round sends the cases the way the suite says (`seq`: one request at a time, `par`: all at once);
a chat case sends its turns one after another, each turn carrying the model's earlier replies. Each
cell runs once per executor (memoized), so checks that compare cells reuse the runs.

Cells that differ only in their speculative config are run together when the executor knows they will be
asked for (`expect`): their sessions open side by side and take turns round by round, the one without
speculation included, so each speculative request's speed-up over the same request without speculation
(report.files.speedups) compares requests made moments apart, on an equally busy machine."""

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from harness import interrupt
from harness.backends.base import Backend, ServeConfig
from harness.errors import HarnessBug, HarnessError, LlamaAbort, Unservable
from harness.execute.rescore import Rescorer, TokenScorer
from harness.execute.slot_restore import SlotRestore
from harness.matrix import Cell
from harness.models import resolve
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome
from harness.suites import FRESH, REGENERATE, RESTORE_ROUNDS, Case, Suite, case_keys
from harness.suites.request import Request


@dataclass
class ExecOptions:
    """What the executor needs beyond the suite and the cell."""

    backends: dict[str, Callable[[], Backend]]
    parallel: int = 4
    logit_top_k: int = 10
    kv_scan: str = "request"
    draft_model: str | None = None
    spec_overrides: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    """In-process speculative options (rollback, checkpoint_flags, checkpoint_attempts, fault)."""
    stall_s: float | None = None
    """The stall window's floor (ServeConfig.stall_s) where a suite's `serve` does not set one."""


CELL_COUNTERS = "SPECHARNESS_CELL_COUNTERS"
"""Set to a directory: each cell's llama-server writes the line counters of a `--coverage` build under DIR/<cell id>
(GCOV_PREFIX), so `specharness mutate` knows which cells execute a line (harness/mutate/coverage.py)."""


def counters_env(cell: Cell) -> dict:
    """The environment a cell's llama-server gets beyond the harness's own: its coverage counters' directory when
    CELL_COUNTERS is set (nothing otherwise)."""
    where = os.environ.get(CELL_COUNTERS)
    return {"GCOV_PREFIX": os.path.join(where, cell.id)} if where else {}


def serve_config(
    cell: Cell, options: ExecOptions, serve: dict | None = None, engine: dict | None = None
) -> ServeConfig:
    """How a cell is served: its model, mode and speculative preset (with the draft model a `draft-simple`
    preset needs), the run's logging options, and a suite's `serve` / in-process `engine` settings."""
    spec = cell.served_options(options.spec_overrides)
    draft = cell.draft_model(spec, options.draft_model)
    serve = dict(serve or {})
    return ServeConfig(
        model=resolve(cell.model).path,
        mode=cell.mode,
        parallel=serve.pop("parallel", options.parallel),
        stall_s=serve.pop("stall_s", options.stall_s),
        draft_model=draft,
        spec=spec,
        engine=dict(options.engine if engine is None else engine),
        logit_top_k=options.logit_top_k,
        kv_scan=options.kv_scan,
        env=counters_env(cell),
        **serve,
    )


class Executor:
    """Runs cells on demand and remembers them."""

    def __init__(self, options: ExecOptions):
        self.options = options
        self._runs: dict[tuple[str, Cell], CellRun] = {}
        self._backends: dict[str, Backend] = {}
        self._expected: dict[tuple, list[Cell]] = {}
        self._planned: set[tuple[str, Cell]] = set()

    def expect(self, jobs) -> None:
        """The (suite, cell) pairs this executor will be asked for: the cells of one suite, backend, model and
        mode, with the one without speculation their speed-ups compare with, then run together, taking turns
        round by round (A B, then B A); the one without speculation only where a check of the suite reads it
        (Suite.reads_none_cell). A scripted config runs alone (its script is the reference's output)."""
        for suite, cell in jobs:
            self._planned.add((suite.name, cell))
            group = self._expected.setdefault((suite.name, cell.backend, cell.model, cell.mode), [])
            for c in (cell.reference(spec="none"), cell) if suite.reads_none_cell else (cell,):
                if c not in group and not c.preset.scripted:
                    group.append(c)

    def run(self, suite: Suite, cell: Cell, on_request: Callable[[], None] | None = None) -> CellRun:
        """The cell's run (executed on first use, with the cells expected beside it; `on_request` is called
        after each request of this cell and of the other planned cells run with it)."""
        key = (suite.name, cell)
        if key not in self._runs:
            group = [
                c
                for c in self._expected.get((suite.name, cell.backend, cell.model, cell.mode), [])
                if (suite.name, c) not in self._runs
            ]
            cells = group if cell in group else [cell]
            ticks = {c: on_request if c == cell or (suite.name, c) in self._planned else None for c in cells}
            for c, run in self._execute(suite, cells, ticks).items():
                self._runs[(suite.name, c)] = run
        return self._runs[key]

    def planned(self, suite: Suite, cell: Cell) -> bool:
        """Whether the run plans to serve (or has served) `cell` of `suite`."""
        return (suite.name, cell) in self._planned or (suite.name, cell) in self._runs

    def runs(self) -> list[CellRun]:
        """Every cell run so far, in execution order."""
        return list(self._runs.values())

    def forget(self, suite: Suite, cell: Cell) -> None:
        """Drop the kept run of `cell` of `suite` (a caller that judged it and needs the memory back)."""
        self._runs.pop((suite.name, cell), None)

    def adopt(self, run: CellRun) -> None:
        """Take `run` as this executor's run of its suite and cell (served by another executor whose serving of
        that cell is the same as this one's would be): the cell is not served again."""
        self._runs.setdefault((run.suite.name, run.cell), run)

    def rescorer(self) -> Rescorer:
        """Re-scores positions whose logits a backend withheld (a context manager; sessions close on exit)."""
        return Rescorer(self)

    def token_scorer(self) -> TokenScorer:
        """Scores returned tokens under their request's sampler chain: one scorer per executor, its engine kept
        open from check to check (the worker is a daemon: it ends with the harness)."""
        if getattr(self, "_scorer", None) is None:
            self._scorer = TokenScorer(self)
        return self._scorer

    def backends(self) -> dict[str, Backend]:
        """The backends started so far, by name (what a report describes)."""
        return dict(self._backends)

    def environment(self, cell: Cell) -> dict:
        """What produced a cell's outputs: the backend's build facts (device, llama.cpp) and the model's sha256."""
        env = dict(self._backend(cell.backend).environment())
        env["model_sha256"] = resolve(cell.model).sha256
        return env

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            if name not in self.options.backends:
                raise HarnessError(f"unknown backend '{name}' (known: {', '.join(self.options.backends)})")
            self._backends[name] = self.options.backends[name]()
        return self._backends[name]

    def _config(self, suite: Suite, cell: Cell) -> ServeConfig:
        engine = {**self.options.engine, **suite.engine}
        preset = cell.preset
        if preset.scripted:
            reference = self.run(suite, cell.reference(spec="none"))
            script = {tuple(o.result.prompt_tokens): o.result.tokens for o in reference.outcomes if o.round == 0}
            engine["script"] = {"kind": preset.scripted, "outputs": script}  # the backend builds the drafter
        if any(how in RESTORE_ROUNDS for how in suite.rounds):
            engine["slot_save"] = True  # the engine keeps each finished request's slot state for a save
        return serve_config(cell, self.options, serve=suite.serve, engine=engine)

    def _execute(self, suite: Suite, cells: list[Cell], ticks: dict) -> dict[Cell, CellRun]:
        """Run `cells` side by side: every session open, round r of each in turn (reversed every other round)."""
        runs = {cell: CellRun(suite, cell) for cell in cells}
        sessions = {}
        try:
            for cell in cells:
                try:
                    config = self._config(suite, cell)
                    runs[cell].spec = dict(config.spec)
                    sessions[cell] = self._backend(cell.backend).open(config)
                except Unservable as err:  # the model lacks what the spec needs: its checks are not run
                    runs[cell].unservable = str(err)
                except LlamaAbort as err:  # llama.cpp aborted in its start-up: a finding, `no-crash` fails on it
                    runs[cell].crash = str(err)
                except HarnessError as err:
                    runs[cell].error = str(err)
                except Exception as err:  # noqa: BLE001 - a bug of ours: reported as a harness error, not a verdict
                    _harness_error(runs[cell], err)
            interrupt.phase("serving")  # the cells' servers or engine workers are up
            for r, how in enumerate(suite.rounds):
                for cell, session in list(sessions.items()) if r % 2 == 0 else list(sessions.items())[::-1]:
                    run = runs[cell]
                    if run.error is not None or run.crash is not None:
                        continue
                    try:
                        self._round(session, suite, run, r, how, ticks[cell])
                    except LlamaAbort as err:  # a restart after a crash aborted in its start-up: llama.cpp's
                        run.crash = str(err)
                    except HarnessError as err:  # a backend that broke mid-run: keep what was done, report the rest
                        run.error = f"{cell.backend} failed during the run: {str(err).splitlines()[0]}"
                    except Exception as err:  # noqa: BLE001
                        _harness_error(run, err)
        finally:
            for session in sessions.values():
                session.close()
        for cell, run in runs.items():
            on_request = ticks[cell]
            if run.error is not None or run.crash is not None:
                done = {(o.case, o.round) for o in run.outcomes}
                unserved = (
                    Result(stop_reason="error", error=run.error)
                    if run.error is not None
                    else Result(stop_reason="crashed", error=run.crash)
                )
                for r in range(len(suite.rounds)):
                    for case in suite.cases:
                        for key in case_keys(case):
                            if (key, r) not in done:
                                run.outcomes.append(Outcome(key, r, replace(unserved)))
                                if on_request:
                                    on_request()
        return runs

    def _round(self, session, suite: Suite, run: CellRun, r: int, how: str, on_request) -> None:
        cases = [suite.sent_case(case, run.cell) for case in suite.cases]
        histories = {case.name: [] for case in cases if case.is_chat}
        alive = {case.name for case in cases}
        restore = SlotRestore(session, how, suite.restore_after, lambda: self._open_fresh(suite, run.cell))
        try:
            for step in range(max(len(case.turns) or 1 for case in cases)):
                todo = [
                    (case, self._request(case, step, histories, suite.deadline_s, how, suite.prompt_cache))
                    for case in cases
                    if case.name in alive and step < (len(case.turns) or 1)
                ]
                if how != "par":  # each recorded as it comes: a request served stays served if a later one breaks
                    for case, request in todo:
                        result = restore.serve(case.name, step, request)
                        self._record(run, r, step, case, result, histories, alive, on_request)
                else:
                    self._par_step(session, run, r, step, todo, histories, alive, on_request)
        finally:
            restore.close()

    def _open_fresh(self, suite: Suite, cell: Cell):
        """A fresh session of `cell` (a `restore-fresh` round continues its chats there)."""
        return self._backend(cell.backend).open(self._config(suite, cell))

    def _par_step(self, session, run: CellRun, r: int, step: int, todo, histories, alive, on_request) -> None:
        """One chat step of a `par` round: every case's request at once."""
        results = session.run([request for _, request in todo])
        for (case, _), result in zip(todo, results, strict=False):
            self._record(run, r, step, case, result, histories, alive, on_request)

    @staticmethod
    def _record(run: CellRun, r: int, step: int, case: Case, result: Result, histories, alive, on_request) -> None:
        """One request's outcome; a chat turn's reply joins its history, and a failed turn ends its chat (the
        later turns are recorded as not sent)."""
        run.outcomes.append(Outcome(case_keys(case)[step], r, result))
        if on_request:
            on_request()
        if not case.is_chat:
            return
        if result.ok:
            histories[case.name] += [{"role": "assistant", "content": result.text}]
            return
        alive.discard(case.name)
        for key in case_keys(case)[step + 1 :]:
            skipped = Result(stop_reason="error", error=f"{result.error} (so {key} was not sent)")
            run.outcomes.append(Outcome(key, r, skipped))
            if on_request:
                on_request()

    @staticmethod
    def _request(
        case: Case,
        step: int,
        histories: dict[str, list[dict]],
        deadline_s: float | None,
        how: str = "seq",
        prompt_cache: bool = True,
    ) -> Request:
        """The case's request at chat step `step` (a `fresh` round's, or any without `prompt_cache`, without the
        prompt cache)."""
        cache_prompt = how != FRESH and prompt_cache
        if not case.is_chat:
            return replace(case.request(deadline_s), cache_prompt=cache_prompt)
        history = histories[case.name]
        if case.turns[step] is REGENERATE:
            del history[-1]  # the last reply, asked again: its new reply takes its place
        else:
            history.append({"role": "user", "content": case.turns[step]})
        return Request(
            messages=list(history),
            sampling=case.sampling,
            tag=case_keys(case)[step],
            deadline_s=deadline_s,
            cache_prompt=cache_prompt,
        )


def _harness_error(run: CellRun, err: Exception) -> None:
    """Record a Python exception of the harness (in this process or the engine's worker) on the cell."""
    trace = err.args[0] if isinstance(err, HarnessBug) else traceback.format_exc()
    last = trace.strip().splitlines()[-1] if trace.strip() else type(err).__name__
    run.error = f"harness error (a bug of specharness, not a llama.cpp finding): {last}"
    run.harness_error = trace
