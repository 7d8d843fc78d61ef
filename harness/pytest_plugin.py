"""`pytest suites/`: every YAML suite becomes test items, one per case × matrix cell.

Item ids read `quicksort[C-par-ngram-mod-tiny-hybrid-inproc]` (case, then mode, spec, model,
backend). Each item runs its checks; cells run once per session (per xdist worker) and are shared by
the items and by checks that compare cells. A malformed suite file becomes one failing item naming
file and line, and the other suites still run.
"""

import json
import shlex
from pathlib import Path

import pytest

from harness import MODES
from harness.backends.choose import BACKEND_NAMES, backend_factories
from harness.baselines import BaselineStore
from harness.checks import evaluate
from harness.checks.base import CheckContext
from harness.detok import detokenizer
from harness.errors import HarnessError
from harness.execute import ExecOptions, Executor, case_keys
from harness.matrix import cells
from harness.models import resolve
from harness.report import write_run
from harness.suites import load_suite

STATE = pytest.StashKey[dict]()


def _csv(value):
    return [v for v in value.split(",") if v] if value else None


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specharness", "specharness suites")
    group.addoption("--backend", help=f"comma-separated backends ({', '.join(BACKEND_NAMES)}); default: each suite's matrix")
    group.addoption("--mode", help=f"comma-separated modes ({', '.join(MODES)}); default: each suite's matrix")
    group.addoption("--spec", help="comma-separated speculative configs (presets; `a+b` chains drafters); default: each suite's matrix")
    group.addoption("--model", help="comma-separated models (registry names or .gguf paths); default: each suite's matrix")
    group.addoption("--server-bin", help="use this llama-server binary instead of building one")
    group.addoption("--source", help="build llama-server from this llama.cpp tree (default: the vendored one)")
    group.addoption("--update-baselines", action="store_true", help="write baselines from this run")
    group.addoption("--repeat", type=int, help="run every suite's rounds this many times")
    group.addoption("--report", metavar="DIR", help="write results.json / results.parquet / checks.json here")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a long case (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a GPU backend build")
    opt = config.getoption
    report = Path(opt("--report")) if opt("--report") else None
    config.stash[STATE] = {
        "executor": Executor(ExecOptions(backends=backend_factories(
            Path(opt("--server-bin")) if opt("--server-bin") else None,
            Path(opt("--source")) if opt("--source") else None,
            report / "server-logs" if report else None))),
        "baselines": BaselineStore(config.rootpath / "fixtures" / "baselines", update=opt("--update-baselines"),
                                   update_command="pytest suites/{suite}.yaml --update-baselines"),
        "checks": [],
    }


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    if file_path.suffix == ".yaml" and file_path.parent.name == "suites":
        return SuiteFile.from_parent(parent, path=file_path)
    return None


class SuiteFile(pytest.File):
    """One suite file."""

    def collect(self):
        try:
            suite = load_suite(str(self.path))
        except HarnessError as err:
            yield BrokenSuite.from_parent(self, name=f"{self.path.stem}[load]", error=str(err))
            return
        opt = self.config.getoption
        if opt("--repeat"):
            suite.rounds = suite.rounds * opt("--repeat")
        only = {"backends": _csv(opt("--backend")), "modes": _csv(opt("--mode")),
                "specs": _csv(opt("--spec")),
                "models": _csv(opt("--model"))}
        for cell in cells(suite.matrix, only):
            for case in suite.cases:
                for key in case_keys(case):
                    yield SuiteItem.from_parent(self, name=f"{suite.name}[{key}-{cell.id}]", suite=suite, cell=cell, key=key)


class CheckFailure(Exception):
    """One or more checks failed; the message says which, where and how to reproduce."""


class BrokenSuite(pytest.Item):
    """A suite file that did not load: one failing item with the one-line error."""

    def __init__(self, *, error: str, **kwargs):
        super().__init__(**kwargs)
        self.error = error

    def runtest(self):
        raise CheckFailure(self.error)

    def repr_failure(self, excinfo):
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, None, self.name


class SuiteItem(pytest.Item):
    """One case of one cell: runs the cell (once per session) and the suite's checks on this case."""

    def __init__(self, *, suite, cell, key, **kwargs):
        super().__init__(**kwargs)
        self.suite, self.cell, self.key = suite, cell, key

    def runtest(self):
        state = self.config.stash[STATE]
        executor: Executor = state["executor"]
        run = executor.run(self.suite, self.cell)
        repro = (f"pytest {shlex.quote(self.nodeid)} --backend {self.cell.backend} --mode {self.cell.mode} "
                 f"--spec {self.cell.spec} --model {self.cell.model}")
        ctx = CheckContext(run, self.key, executor, state["baselines"], _detok(self.cell.model), repro)
        results = evaluate(ctx, self.suite.checks)
        state["checks"] += [(self.suite.name, self.key, self.cell, r) for r in results]
        for r in results:
            self.user_properties.append((r.name, json.dumps({"passed": r.passed, **r.evidence}, default=str)))
        failed = [r for r in results if not r.passed]
        if failed:
            raise CheckFailure("\n".join(f"[{r.name}] {r.message}" for r in failed))

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, CheckFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


def _detok(model: str):
    try:
        return detokenizer(resolve(model).path)
    except HarnessError:
        return lambda tokens: " ".join(map(str, tokens))


def pytest_sessionfinish(session: pytest.Session) -> None:
    report = session.config.getoption("--report")
    state = session.config.stash.get(STATE, None)
    if report and state and state["executor"].runs():
        write_run(Path(report), state["executor"].runs(), state["checks"])
