"""Running one matrix cell of a suite: one session (engine or server) serving every case, round after round.

A round sends the cases the way the suite says (`seq`: one request at a time, `par`: all at once);
a chat case sends its turns one after another, each turn carrying the model's earlier replies. Each
cell runs once per executor (memoized), so checks that compare cells reuse the runs.
"""

from dataclasses import dataclass, field
from typing import Callable, Optional

from harness.backends.base import Backend, ServeConfig
from harness.engine.drafters.scripted import Scripted
from harness.errors import HarnessError
from harness.matrix import Cell, spec_preset
from harness.models import draft_for, resolve
from harness.request import Request
from harness.result import Result
from harness.suites import Case, Suite

SCRIPTS = {"reject-all": {"reject_all": True}, "wrong-at-2": {"wrong_at": lambda seq, offset, pos: pos == 2}}


@dataclass
class Outcome:
    """One request of a cell: which case (chat turns get `.turnN`), which round, and its Result."""

    case: str
    round: int
    result: Result


@dataclass
class CellRun:
    """Everything one cell produced; `error` is set when the cell could not be served at all."""

    suite: Suite
    cell: Cell
    outcomes: list[Outcome] = field(default_factory=list)
    error: Optional[str] = None

    def of_case(self, case: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.case == case]


def case_keys(case: Case) -> list[str]:
    """The record names of a case: its name, or `<name>.turnN` for each turn of a chat."""
    return [f"{case.name}.turn{i + 1}" for i in range(len(case.turns))] if case.is_chat else [case.name]


@dataclass
class ExecOptions:
    """What the executor needs beyond the suite and the cell."""

    backends: dict[str, Callable[[], Backend]]
    parallel: int = 4
    logit_top_k: int = 10
    kv_scan: str = "request"
    draft_model: Optional[str] = None
    spec_overrides: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    """In-process speculative options (rollback, checkpoint_flags, checkpoint_attempts, fault)."""


class Executor:
    """Runs cells on demand and remembers them."""

    def __init__(self, options: ExecOptions):
        self.options = options
        self._runs: dict[tuple[str, Cell], CellRun] = {}
        self._backends: dict[str, Backend] = {}

    def run(self, suite: Suite, cell: Cell, on_request: Optional[Callable[[], None]] = None) -> CellRun:
        """The cell's run (executed on first use)."""
        key = (suite.name, cell)
        if key not in self._runs:
            self._runs[key] = self._execute(suite, cell, on_request)
        return self._runs[key]

    def runs(self) -> list[CellRun]:
        """Every cell run so far, in execution order."""
        return list(self._runs.values())

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
        preset = spec_preset(cell.spec)
        model = resolve(cell.model).path
        spec = {**preset.options, **self.options.spec_overrides} if preset.options else {}
        draft = None
        if "draft-simple" in spec.get("spec-type", ""):
            name = self.options.draft_model or draft_for(cell.model)
            if name is None:
                raise HarnessError(f"draft-simple needs --draft-model: {cell.model} has no registered draft")
            draft = resolve(name).path
        engine = dict(self.options.engine)
        if preset.scripted:
            reference = self.run(suite, cell.reference(spec="none"))
            script = {tuple(o.result.prompt_tokens): o.result.tokens for o in reference.outcomes if o.round == 0}
            engine["drafters"] = [Scripted(lambda prompt: script.get(tuple(prompt), []), **SCRIPTS[preset.scripted])]
        serve = dict(suite.serve)
        return ServeConfig(
            model=model, mode=cell.mode, parallel=serve.pop("parallel", self.options.parallel),
            draft_model=draft, spec=spec, engine=engine, logit_top_k=self.options.logit_top_k,
            kv_scan=self.options.kv_scan, **serve,
        )

    def _execute(self, suite: Suite, cell: Cell, on_request) -> CellRun:
        run = CellRun(suite, cell)
        try:
            session = self._backend(cell.backend).open(self._config(suite, cell))
        except HarnessError as err:
            run.error = str(err)
        else:
            try:
                for r, how in enumerate(suite.rounds):
                    self._round(session, suite, run, r, how, on_request)
            except Exception as err:  # a backend that broke mid-run: keep what was done, report the rest
                run.error = f"{cell.backend} failed during the run: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            finally:
                session.close()
        if run.error is not None:
            done = {(o.case, o.round) for o in run.outcomes}
            for r in range(len(suite.rounds)):
                for case in suite.cases:
                    for key in case_keys(case):
                        if (key, r) not in done:
                            run.outcomes.append(Outcome(key, r, Result(stop_reason="error", error=run.error)))
                            if on_request:
                                on_request()
        return run

    def _round(self, session, suite: Suite, run: CellRun, r: int, how: str, on_request) -> None:
        histories = {case.name: [] for case in suite.cases if case.is_chat}
        alive = {case.name for case in suite.cases}
        for step in range(max(len(case.turns) or 1 for case in suite.cases)):
            todo = [(case, self._request(case, step, histories)) for case in suite.cases
                    if case.name in alive and step < (len(case.turns) or 1)]
            if how == "seq":
                results = [session.run([request])[0] for _, request in todo]
            else:
                results = session.run([request for _, request in todo])
            for (case, _), result in zip(todo, results):
                run.outcomes.append(Outcome(case_keys(case)[step], r, result))
                if on_request:
                    on_request()
                if case.is_chat:
                    if result.ok:
                        histories[case.name] += [{"role": "assistant", "content": result.text}]
                    else:
                        alive.discard(case.name)
                        for key in case_keys(case)[step + 1:]:
                            skipped = Result(stop_reason="error", error=f"{result.error} (so {key} was not sent)")
                            run.outcomes.append(Outcome(key, r, skipped))
                            if on_request:
                                on_request()

    @staticmethod
    def _request(case: Case, step: int, histories: dict[str, list[dict]]) -> Request:
        if not case.is_chat:
            return case.request()
        history = histories[case.name]
        history.append({"role": "user", "content": case.turns[step]})
        return Request(messages=list(history), sampling=case.sampling, tag=case_keys(case)[step])
