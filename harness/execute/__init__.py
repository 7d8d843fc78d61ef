"""Running one matrix cell of a suite: one session (engine or server) serving every case, round after round.

A round sends the cases the way the suite says (`seq`: one request at a time, `par`: all at once);
a chat case sends its turns one after another, each turn carrying the model's earlier replies. Each
cell runs once per executor (memoized), so checks that compare cells reuse the runs.

Cells that differ only in their speculative config are run together when the executor knows they will be
asked for (`expect`): their sessions open side by side and take turns round by round, the one without
speculation included, so each speculative request's speed-up over the same request without speculation
(report.files.speedups) compares requests made moments apart, on an equally busy machine.
"""

import atexit
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from harness import interrupt
from harness.backends.base import Backend, ServeConfig
from harness.backends.server_rescore import replay_of, shape_of
from harness.errors import HarnessBug, HarnessError, LlamaAbort, Unservable
from harness.execute.slot_restore import SlotRestore
from harness.matrix import Cell, served_options, spec_preset
from harness.models import draft_for, resolve
from harness.models.registry import HEAD_TYPES, has_mtp_block, head_draft_for
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome  # noqa: F401 - the executor's products, imported from here too
from harness.result.logits import PositionLogits
from harness.suites import REGENERATE, RESTORE_ROUNDS, Case, Suite, case_keys  # noqa: F401 - case_keys is used from here too
from harness.suites.request import Request, Sampling


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


def serve_config(
    cell: Cell, options: ExecOptions, serve: dict | None = None, engine: dict | None = None
) -> ServeConfig:
    """How a cell is served: its model, mode and speculative preset (with the draft model a `draft-simple`
    preset needs), the run's logging options, and a suite's `serve` / in-process `engine` settings."""
    preset = spec_preset(cell.spec)
    spec = served_options(preset, options.spec_overrides)
    draft = None
    types = str(spec.get("spec-type", "")).split(",")
    if "draft-simple" in types:
        name = options.draft_model or draft_for(cell.model)
        if name is None:
            raise Unservable(f"draft-simple needs a draft model: {cell.model} has no registered draft (--draft-model)")
        draft = resolve(name).path
    elif heads := [t for t in types if t in HEAD_TYPES]:  # draft-eagle3 / -dflash / -dspark: a generated head
        if options.draft_model is None:
            try:
                draft = resolve(head_draft_for(cell.model, heads[0])).path
            except HarnessError as err:
                raise Unservable(f"{err} or --draft-model") from None
        else:
            draft = resolve(options.draft_model).path
    if "draft-mtp" in types and not has_mtp_block(resolve(cell.model)):
        raise Unservable(f"draft-mtp needs a model with an MTP (nextn) block: {cell.model} has none")
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
        round by round (A B, then B A). A scripted config runs alone (its script is the reference's output)."""
        for suite, cell in jobs:
            self._planned.add((suite.name, cell))
            group = self._expected.setdefault((suite.name, cell.backend, cell.model, cell.mode), [])
            for c in (cell.reference(spec="none"), cell):
                if c not in group and not spec_preset(c.spec).scripted:
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

    def adopt(self, run: CellRun) -> None:
        """Take `run` as this executor's run of its suite and cell (served by another executor whose serving of
        that cell is the same as this one's would be): the cell is not served again."""
        self._runs.setdefault((run.suite.name, run.cell), run)

    def rescorer(self) -> "Rescorer":
        """Re-scores positions whose logits a backend withheld (a context manager; sessions close on exit)."""
        return Rescorer(self)

    def token_scorer(self) -> "TokenScorer":
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
        preset = spec_preset(cell.spec)
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
        cases = [suite.cell_case(case, run.cell.model) for case in suite.cases]
        histories = {case.name: [] for case in cases if case.is_chat}
        alive = {case.name for case in cases}
        restore = SlotRestore(session, how, suite.restore_after, lambda: self._open_fresh(suite, run.cell))
        try:
            for step in range(max(len(case.turns) or 1 for case in cases)):
                todo = [
                    (case, self._request(case, step, histories, suite.deadline_s))
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
    def _request(case: Case, step: int, histories: dict[str, list[dict]], deadline_s: float | None) -> Request:
        if not case.is_chat:
            return case.request(deadline_s)
        history = histories[case.name]
        if case.turns[step] is REGENERATE:
            del history[-1]  # the last reply, asked again: its new reply takes its place
        else:
            history.append({"role": "user", "content": case.turns[step]})
        return Request(messages=list(history), sampling=case.sampling, tag=case_keys(case)[step], deadline_s=deadline_s)


class Rescorer:
    """The logits of a run at one position, recomputed in the configuration that produced its tokens, where a backend
    withheld them. Sessions open on first use (a cell's own serve config: on llama-server the run's command line,
    speculation flags included) and close on exit.

    - llama-server (any cell): through the server itself, in the batch shape the run computed the position in
      (harness.backends.server_rescore: the prompt cache holds the batch's prefix, the batch's rows up to the
      position go as one prompt batch, the first generated token carries its probabilities). llama-server at
      0c1e570 returns no probabilities for any token a verification step emits (upstream #27972); this gives them
      back from the server, not from another configuration. Each row says how it was computed (`how`).
    - a llama-server build that runs the engine's own libllama (the vendored CPU build links llama-cpp-python's
      libraries: the same code on the same CPU): the request's batches replayed through that libllama, with the
      cell's context options, as its log lists them (harness.backends.server_rescore.Replay): its prompt batches,
      each step's rows with logits on every row and the rejected ones cut back, then the batch that computed the
      position. llama-server's prompt cache gives a verification row with fewer rows and one output row, from a
      prefix computed in one batch; a repacked quantized matrix multiplies 4 rows at a time from 4 rows on and a
      recurrent state depends on the batches it was computed in, so that moves a row by up to 0.05 nats where the
      run's batches did not (the `numerics` suite's flips).
    - the in-process engine without speculation: a decode of the same prefix in the same cell (one request with
      the prompt and the output before the position, one token generated, its top-k logged).
    - the in-process engine with speculation: nothing (None). It logs every verification row itself, so a missing
      row is one it did not compute, and a plain decode would give the reference's view, not the run's."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.sessions: dict[tuple[str, Cell], object] = {}
        self.cache: dict[tuple, PositionLogits | None] = {}

    def score(self, suite: Suite, cell: Cell, result: Result, pos: int) -> PositionLogits | None:
        if self.executor.options.logit_top_k <= 0 or pos > len(result.tokens):
            return None
        if cell.backend == "server":
            return self._through_server(suite, cell, result, pos)
        if cell.spec != "none":
            return None
        prompt = [*result.prompt_tokens, *result.tokens[:pos]]
        key = (suite.name, cell, tuple(prompt))
        if key not in self.cache:
            session = self._session(suite, cell)
            scored = session.run([Request(prompt=prompt, sampling=Sampling(n_predict=1, temperature=0.0))])[0]
            self.cache[key] = scored.logits[0] if scored.ok and scored.logits else None
        return self.cache[key]

    def _through_server(self, suite: Suite, cell: Cell, result: Result, pos: int) -> PositionLogits | None:
        """Position `pos` of a llama-server request re-scored through a server of the cell's command line, in the
        batch shape its log says the run computed it in (None where the log does not say)."""
        shape = shape_of(result, pos)
        if shape is None or pos >= len(result.tokens) + 1:
            return None
        sequence = [*result.prompt_tokens, *result.tokens]
        prefix, tail = sequence[: shape.start], sequence[shape.start : shape.start + shape.row + 1]
        replay = replay_of(result, pos) if self._engine_libllama() else None
        key = (suite.name, cell, tuple(sequence[: shape.start + shape.row + 1]), replay is not None)
        if key not in self.cache:
            top_k = self.executor.options.logit_top_k
            if replay is not None:
                scored, how = self._engine(suite, cell).replay_row(replay.decodes, replay.row, top_k), replay.describe()
            else:
                scored, how = self._session(suite, cell).rescore(prefix, tail, top_k), shape.describe(len(prefix))
            self.cache[key] = None if scored is None else replace(scored, how=how)
        return self.cache[key]

    def _engine_libllama(self) -> bool:
        """Whether the llama-server build runs the engine's libllama (the vendored CPU build links it)."""
        build = getattr(self.executor._backend("server"), "build", None)
        return bool(build is not None and build.backend == "cpu" and build.linked_libraries)

    def _engine(self, suite: Suite, cell: Cell):
        """An engine serving the server cell's context options (its speculative options too: they size the
        recurrent snapshots, `n_rs_seq`, as llama-server's), nothing else."""
        key = (suite.name, cell, "engine")
        if key not in self.sessions:
            config = self.executor._config(suite, cell)
            engine = {k: v for k, v in config.engine.items() if k not in ("fault", "script", "slot_save")}
            config = replace(config, kv_scan="off", logit_top_k=0, engine=engine)
            self.sessions[key] = self.executor._backend("inproc").open(config)
        return self.sessions[key]

    def _session(self, suite: Suite, cell: Cell):
        session = self.sessions.get((suite.name, cell))
        if session is None:
            backend = self.executor._backend(cell.backend)
            session = self.sessions[(suite.name, cell)] = backend.open(self.executor._config(suite, cell))
        return session

    def __enter__(self) -> "Rescorer":
        return self

    def __exit__(self, *exc) -> None:
        for session in self.sessions.values():
            session.close()


def _harness_error(run: CellRun, err: Exception) -> None:
    """Record a Python exception of the harness (in this process or the engine's worker) on the cell."""
    trace = err.args[0] if isinstance(err, HarnessBug) else traceback.format_exc()
    last = trace.strip().splitlines()[-1] if trace.strip() else type(err).__name__
    run.error = f"harness error (a bug of specharness, not a llama.cpp finding): {last}"
    run.harness_error = trace


class TokenScorer:
    """The probability of each token a request returned, under the target and the request's sampler chain
    (harness.engine.score), for any backend's results: an in-process engine serving nothing but the scoring (no
    speculation, one slot, no fault switch, the cell's context size), for one model at a time (another model's
    request closes it and opens the next). Scores are cached per (model, prompt, output, sampling)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.session = None
        self.config = None
        self.cache: dict[tuple, dict] = {}

    def score(self, suite: Suite, cell: Cell, pairs: list[tuple[Request, Result]]) -> list[dict]:
        """Each (request, result)'s scores: {"scores": [[p, below], ...]} (and `impossible_at`), or
        {"unscorable": why}."""
        plain = cell.reference(backend="inproc", spec="none", mode="seq")
        config = self.executor._config(suite, plain)
        engine = {k: v for k, v in config.engine.items() if k not in ("fault", "script", "slot_save")}
        config = replace(config, parallel=1, spec={}, draft_model=None, kv_scan="off", logit_top_k=0, engine=engine)
        keys = [(config.model, tuple(r.prompt_tokens), tuple(r.tokens), repr(q.sampling)) for q, r in pairs]
        todo = [(k, pair) for k, pair in zip(keys, pairs, strict=True) if k not in self.cache]
        if todo:
            if self.config != config:
                self.close()
                self.session, self.config = self.executor._backend("inproc").open(config), config
                # the worker ignores SIGTERM (the harness stops it itself): multiprocessing's own exit handler
                # would wait for it forever, so the session closes before that handler runs (atexit: LIFO)
                atexit.register(self.close)
            for (key, _), scored in zip(todo, self.session.score([pair for _, pair in todo]), strict=True):
                self.cache[key] = scored
        return [self.cache[k] for k in keys]

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            atexit.unregister(self.close)
        self.session = self.config = None

    def __enter__(self) -> "TokenScorer":
        return self

    def __exit__(self, *exc) -> None:
        pass  # kept open for the next check (close() ends it)
