"""`pytest suites/`: every YAML suite becomes test items, one per case × matrix cell.

Item ids read `quicksort[C-par-ngram-mod-tiny-hybrid-inproc]` (case, then mode, spec, model,
backend). Each item runs its checks; cells run once per session (per xdist worker) and are shared by
the items and by checks that compare cells. A malformed suite file becomes one failing item naming
file and line, and the other suites still run.
"""

import contextlib
import json
import shlex
import shutil
from pathlib import Path

import pytest

from harness import MODES, interrupt
from harness.argtypes import count, csv
from harness.backends.base import KV_SCAN
from harness.backends.build.versions import UNKNOWN, planned_versions
from harness.backends.choose import backend_factories
from harness.backends.facts import run_backends
from harness.checks import evaluate_cell, harness_errors
from harness.engine import detok
from harness.errors import HarnessBug, HarnessError
from harness.execute import ExecOptions, Executor, case_keys
from harness.matrix import BACKEND_NAMES, Shard, cells, narrowing, shard
from harness.models import ModelUnavailable, resolve
from harness.models.facts import run_models
from harness.report import describe_run, publish, write_run
from harness.report.files import RunDir, now, reported_lines
from harness.report.merge import merge
from harness.running import known_failures
from harness.signatures.text import known_lines, summary_lines
from harness.suites import Suite, load_suite, user_suites_dir
from harness.verdict.baselines import BaselineStore, not_recorded_lines, uncalibrated_lines
from harness.verdict.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.verdict.known_failures import KnownFailure, scope_line, tag
from harness.verdict.known_failures import load as load_known

STATE = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("specharness", "specharness suites")
    group.addoption(
        "--backend", help=f"comma-separated backends ({', '.join(BACKEND_NAMES)}); default: each suite's matrix"
    )
    group.addoption("--mode", help=f"comma-separated modes ({', '.join(MODES)}); default: each suite's matrix")
    group.addoption(
        "--spec",
        help="comma-separated speculative configs (presets; `a+b` chains drafters); default: each suite's matrix",
    )
    group.addoption(
        "--model", help="comma-separated models (registry names or .gguf paths); default: each suite's matrix"
    )
    group.addoption("--server-bin", help="use this llama-server binary instead of building one")
    group.addoption("--source", help="build llama-server from this llama.cpp tree (default: the vendored one)")
    group.addoption("--update-baselines", action="store_true", help="write baselines from this run")
    group.addoption(
        "--baselines-dir",
        metavar="DIR",
        help="read (and with --update-baselines write) baselines here (ini: specharness_baselines_dir)",
    )
    group.addoption(
        "--suites-dir",
        metavar="DIR",
        help="also collect your own suites from DIR (same name: replaces an installed suite; ini: "
        "specharness_suites_dir); their baselines are fixtures/baselines beside DIR",
    )
    group.addoption(
        "--calibration-dir", metavar="DIR", help="read calibration files here first (ini: specharness_calibration_dir)"
    )
    parser.addini("specharness_suites_dir", "a directory of your own suites (relative to the ini file)")
    parser.addini("specharness_baselines_dir", "baselines directory (relative to the ini file)")
    parser.addini("specharness_calibration_dir", "calibration directory (relative to the ini file)")
    group.addoption("--repeat", type=count(1), default=1, help="run every suite's rounds this many times")
    group.addoption(
        "--report",
        metavar="DIR",
        help="write the run directory here: results, checks, junit.xml and the HTML report index.html",
    )
    group.addoption(
        "--shard",
        metavar="I/N",
        help="run the I-th of N balanced parts of the suite cells (merge with `specharness report --merge`)",
    )
    group.addoption(
        "--kv-scan",
        default="request",
        choices=KV_SCAN,
        help="scan KV state after every request (default), also after every speculative step, or off",
    )
    group.addoption("--logit-top-k", type=count(0), default=10, help="top-k logits logged per position (0 = off)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a long case (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a GPU backend build")
    _keep_cells_together(config)
    opt = config.getoption
    report = Path(opt("--report")) if opt("--report") else None
    baselines = path_setting(config, "baselines_dir")
    try:
        only = narrowing(csv(opt("--backend")), csv(opt("--mode")), csv(opt("--spec")), csv(opt("--model")))
        extra = user_suites_dir(path_setting(config, "suites_dir"))
        versions = planned_versions(
            Path(opt("--server-bin")) if opt("--server-bin") else None,
            Path(opt("--source")) if opt("--source") else None,
        )
        known, _ = known_failures(extra, versions)
        part = Shard.parse(opt("--shard")) if opt("--shard") else None
    except HarnessError as err:
        raise pytest.UsageError(str(err)) from None
    if extra is not None and str(extra) not in config.args:
        config.args.append(str(extra))
    config.stash[STATE] = {
        "extra": extra,
        "only": only,
        "shard": part,
        "started": now(),
        "planned": {},
        "ran": set(),
        "suites": {},
        "signals": contextlib.ExitStack(),
        "executor": Executor(
            ExecOptions(
                backends=backend_factories(
                    Path(opt("--server-bin")) if opt("--server-bin") else None,
                    Path(opt("--source")) if opt("--source") else None,
                    report,
                ),
                kv_scan=opt("--kv-scan"),
                logit_top_k=opt("--logit-top-k"),
            )
        ),
        "baselines": BaselineStore(
            baselines,
            update=opt("--update-baselines"),
            option=f" --baselines-dir {baselines}" if baselines else "",
            calibration_dir=path_setting(config, "calibration_dir"),
        ),
        "checks": [],
        "known": known,
        "versions": versions,
    }
    config.stash[STATE]["signals"].enter_context(interrupt.handled())  # SIGTERM stops the session as Ctrl-C does


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    if state is not None:
        state["signals"].close()


def path_setting(config: pytest.Config, name: str) -> Path | None:
    """A directory given as `--<name>` (relative to the working directory) or as the ini key
    `specharness_<name>` (relative to the ini file); None when neither."""
    option = config.getoption("--" + name.replace("_", "-"))
    if option:
        return Path(option).resolve()
    value = config.getini(f"specharness_{name}")
    return (config.inipath.parent if config.inipath else config.rootpath) / value if value else None


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    extra = parent.config.stash[STATE]["extra"]
    if file_path.suffix != ".yaml" or file_path.parent.name != "suites" and file_path.parent != extra:
        return None
    if (
        extra is not None
        and file_path.parent != extra
        and (extra / file_path.name).is_file()
        and file_path.name != KNOWN_FAILURES
    ):
        return None  # replaced by the --suites-dir suite of that name
    if file_path.name == KNOWN_FAILURES:
        return KnownFailuresFile.from_parent(parent, path=file_path)
    return SuiteFile.from_parent(parent, path=file_path)


def _keep_cells_together(config: pytest.Config) -> None:
    """Under pytest-xdist, `--dist loadgroup` whenever the items are spread by load (`-n N` alone, run outside
    this project's pyproject.toml): a cell and the cells its checks compare it with run on one worker, once, and
    an interrupted worker reports what it finished. The controller picks the scheduler; a worker re-reads the
    command line, so the controller tells it (`pytest_configure_node`) to mark its items with their groups."""
    if getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"
    worker = getattr(config, "workerinput", None)
    if worker is not None and worker.get(LOADGROUP):
        config.option.loadgroup = True


LOADGROUP = "specharness_loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    node.workerinput[LOADGROUP] = node.config.getoption("dist", "no") == "loadgroup"


def worker_group(suite: Suite, cell) -> str:
    """The xdist group of a suite item (`--dist loadgroup`): a cell and the cells its checks compare it with
    (the same model and backend: no speculation, `seq`) run on one worker, once; in a suite of `per-cell` seeds
    every backend's cells of the model (the pooled `distribution` test adds up all of them: one pool per law,
    whichever worker serves it)."""
    if suite.seeds == "per-cell":
        return f"{suite.name}:{cell.model}"
    return f"{suite.name}:{cell.model}:{cell.backend}"


def _only(config: pytest.Config) -> dict:
    return config.stash[STATE]["only"]


class SuiteFile(pytest.File):
    """One suite file."""

    def collect(self):
        try:
            suite = load_suite(str(self.path))
        except HarnessError as err:
            yield BrokenSuite.from_parent(self, name=f"{self.path.stem}[load]", error=str(err))
            return
        suite.rounds = suite.rounds * self.config.getoption("--repeat")
        for cell in cells(suite.matrix, _only(self.config)):
            for case in suite.cases:
                for key in case_keys(case):
                    item = SuiteItem.from_parent(
                        self, name=f"{suite.name}[{key}-{cell.id}]", suite=suite, cell=cell, key=key
                    )
                    item.add_marker(pytest.mark.xdist_group(worker_group(suite, cell)))
                    if suite.slow:
                        item.add_marker(pytest.mark.slow)
                    yield item


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


class HarnessFault(Exception):
    """A harness error kept checks from judging (the cell could not be served, a reference cell could not, a check
    raised): raised in an item's setup, so pytest reports an ERROR, never a failure, a pass or an xfail."""


def _serve(item: pytest.Item, suite, cell, key: str | None, names: list[str], repro) -> list[tuple[str, object]]:
    """Serve `cell` (once per session) and evaluate `names` on its case `key` (every case when None) through the
    one evaluation (harness.checks.evaluate_cell). A model whose optional package is missing is skipped, unless
    `--model` names it: then it is an error (HarnessFault) with its fix."""
    state = item.config.stash[STATE]
    executor: Executor = state["executor"]
    try:
        resolve(cell.model)
    except ModelUnavailable as err:  # an optional model (Gemma without the [real] extra)
        if cell.model in (csv(item.config.getoption("--model")) or []):
            raise HarnessFault(f"--model {cell.model} was asked for, but {err}") from None
        pytest.skip(str(err))
    run = executor.run(suite, cell)
    return evaluate_cell(run, executor, state["baselines"], names, repro, None if key is None else [key])


def _raise_faults(results: list) -> None:
    """HarnessFault naming every check of `results` that met a harness error."""
    faults = harness_errors(results)
    if faults:
        raise HarnessFault("\n".join(f"[{r.name}] {r.harness_error}" for r in faults))


class _FaultsInOneLine:
    """A harness error raised in setup reads as its message, without a traceback of the plugin (pytest words
    setup errors with `_repr_failure_py`, not `repr_failure`)."""

    def _repr_failure_py(self, excinfo, style=None):
        if isinstance(excinfo.value, HarnessFault | HarnessError):
            return f"harness error (a fault of specharness, not a llama.cpp finding):\n{excinfo.value}"
        return super()._repr_failure_py(excinfo, style)


class SuiteItem(_FaultsInOneLine, pytest.Item):
    """One case of one cell: runs the cell (once per session) and the suite's checks on this case. The cell is
    served and the checks evaluated in setup, so that a harness error is an ERROR; the call judges."""

    def __init__(self, *, suite, cell, key, **kwargs):
        super().__init__(**kwargs)
        self.suite, self.cell, self.key = suite, cell, key
        self.results: list = []

    def setup(self):
        repro = (
            f"pytest {shlex.quote(self.nodeid)} --backend {self.cell.backend} --mode {self.cell.mode} "
            f"--spec {self.cell.spec} --model {self.cell.model}"
        )
        results = _serve(self, self.suite, self.cell, self.key, self.suite.checks, repro)
        self.results = [r for _, r in results]
        # recorded before any harness error is raised: the report lists the checks it kept from judging
        self.config.stash[STATE]["checks"] += [(self.suite.name, self.key, self.cell, r) for r in self.results]
        _raise_faults(self.results)

    def runtest(self):
        state = self.config.stash[STATE]
        results = self.results
        for r in results:
            record = {"passed": r.passed, **r.evidence}
            if r.not_run is not None:
                record["not_run"] = r.not_run
            self.user_properties.append((r.name, json.dumps(record, default=str)))
        unexplained = tag(state["known"], self.suite.name, self.cell, results)
        if unexplained:
            raise CheckFailure("\n".join(f"[{r.name}] {r.message}" for r in unexplained))
        known = [r.evidence["known_failure"] for r in results if "known_failure" in r.evidence]
        if known:
            pytest.xfail(next(e.summary for e in state["known"] if e.id == known[0]))
        if results and all(r.not_run is not None for r in results):  # nothing judged: not a pass
            pytest.skip(f"not run: {results[0].not_run}")

    def repr_failure(self, excinfo):
        # a known failure's xfail: pytest still asks for a failure text (which no report shows: they show the
        # reason, `wasxfail`), and formatting its traceback parses the plugin's source for every such case
        if isinstance(excinfo.value, CheckFailure | pytest.xfail.Exception):
            return str(excinfo.value)
        if isinstance(excinfo.value, HarnessFault | HarnessError):
            return f"harness error (a fault of specharness, not a llama.cpp finding):\n{excinfo.value}"
        if isinstance(excinfo.value, HarnessBug):
            return f"harness error (a bug of specharness, not a llama.cpp finding):\n{excinfo.value.args[0]}"
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, self.name


class KnownFailuresFile(pytest.File):
    """`suites/known-failures.yaml`: one strict expected failure per entry whose cells are selected."""

    def collect(self):
        try:
            entries = load_known(self.path)
        except HarnessError as err:
            yield BrokenSuite.from_parent(self, name="known-failures[load]", error=str(err))
            return
        versions = self.config.stash[STATE]["versions"]
        for entry in entries:
            suite = load_suite(entry.suite, self.path.parent)
            out_of_range = scope_line(entry, versions.get(entry.backend, UNKNOWN), entry.backend)
            if out_of_range:
                item = KnownFailureItem.from_parent(
                    self, name=f"known-failures[{entry.id}]", entry=entry, suite=suite, cells=[]
                )
                item.add_marker(pytest.mark.skip(reason=out_of_range))
                yield item
                continue
            if entry.missing_cpu_flags:
                item = KnownFailureItem.from_parent(
                    self, name=f"known-failures[{entry.id}]", entry=entry, suite=suite, cells=[]
                )
                item.add_marker(
                    pytest.mark.skip(
                        reason=(
                            f"{entry.id} shows only on a CPU with "
                            f"{', '.join([*entry.cpu_flags, *(f'no {f}' for f in entry.without_cpu_flags)])}; this "
                            f"one does not have: {', '.join(entry.missing_cpu_flags)}"
                        )
                    )
                )
                yield item
                continue
            chosen = [c for c in cells(suite.matrix, _only(self.config)) if entry.covers(suite.name, c)]
            if chosen:
                item = KnownFailureItem.from_parent(
                    self, name=f"known-failures[{entry.id}]", entry=entry, suite=suite, cells=chosen
                )
                item.add_marker(pytest.mark.xdist_group(worker_group(suite, chosen[0])))
                item.add_marker(
                    pytest.mark.xfail(
                        strict=True,
                        raises=CheckFailure,  # anything else (a harness error) is an error, never an xfail
                        reason=(f"{entry.summary} — if this passes, the defect no longer reproduces: remove the entry"),
                    )
                )
                yield item


class KnownFailureItem(_FaultsInOneLine, pytest.Item):
    """Fails (as expected) while the recorded llama.cpp defect still reproduces in its cells. Its cells are served
    and judged in setup: a harness error there is an ERROR (the xfail marker expects only CheckFailure)."""

    def __init__(self, *, entry: KnownFailure, suite, cells, **kwargs):
        super().__init__(**kwargs)
        self.entry, self.suite, self.cells = entry, suite, cells
        self.results: list = []

    def setup(self):
        self.results = self._judged(None)
        for _ in range(1, self.entry.tries):  # an intermittent defect: its cells again, served afresh
            if self._reproduced():
                break
            self.results = self._judged(Executor(self.config.stash[STATE]["executor"].options))

    def _judged(self, fresh: Executor | None) -> list:
        """The entry's checks on its cells, served once per session (`fresh`: by another executor, anew)."""
        checks = list(self.entry.check)
        if fresh is None:
            results = [(c, key, r) for c in self.cells for key, r in _serve(self, self.suite, c, None, checks, "")]
        else:
            baselines = self.config.stash[STATE]["baselines"]
            results = [
                (c, key, r)
                for c in self.cells
                for key, r in evaluate_cell(fresh.run(self.suite, c), fresh, baselines, checks, "", None)
            ]
        _raise_faults(results)
        return results

    def _reproduced(self) -> bool:
        return any(self.entry.explains(r) for _, _, r in self.results)

    def runtest(self):
        for cell, key, r in self.results:
            if self.entry.explains(r):
                raise CheckFailure(f"still reproduces in {key}-{cell.id}: {r.message}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, HarnessFault):
            return f"harness error (a fault of specharness, not a llama.cpp finding):\n{excinfo.value}"
        return str(excinfo.value)

    def reportinfo(self):
        # a line number, not None: pytest places a skip-marker's report at it (the cpu_flags skip)
        return self.path, 0, self.name


REPORT_DEFAULTS = {"server_bin": None, "source": None, "kv_scan": "request", "logit_top_k": 10, "repeat": 1}
"""The options a case's re-run command repeats when this session changed them."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Keep this shard's items (`--shard I/N`): suite items by their cell (harness.matrix.shard), a
    known-failure entry with its first cell, other items round robin; remember the cells to report."""
    state = config.stash[STATE]
    part = state["shard"]
    suites = {}
    for item in items:
        if isinstance(item, SuiteItem):
            suites.setdefault((item.suite.name, item.cell), item.suite)
    mine = {(s.name, c) for s, c in shard([(s, c) for (_, c), s in suites.items()], part)} if part else set(suites)
    keep, drop, others = [], [], 0
    for item in items:
        if isinstance(item, SuiteItem):
            chosen = (item.suite.name, item.cell) in mine
        elif isinstance(item, KnownFailureItem) and item.cells and (item.suite.name, item.cells[0]) in suites:
            chosen = (item.suite.name, item.cells[0]) in mine
        else:
            chosen = part is None or others % part.count == part.index - 1
            others += 1
        (keep if chosen else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    for item in keep:
        if isinstance(item, SuiteItem):
            state["planned"].setdefault((item.suite.name, item.cell), set()).add(item.nodeid)
            state["suites"][item.suite.name] = item.suite.path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tell the executor which cells will run (after every deselection), so the cells of one suite, backend,
    model and mode run side by side (harness.execute: speed-ups from requests made moments apart)."""
    state = session.config.stash.get(STATE, None)
    if state is not None:
        interrupt.phase("planning")  # the suites collected: what will run is known
        state["executor"].expect([(item.suite, item.cell) for item in session.items if isinstance(item, SuiteItem)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    state = item.config.stash.get(STATE, None)
    if state is not None:
        state["ran"].add(item.nodeid)


WORKERS_DIR = ".workers"
"""Under pytest-xdist each worker writes its part of `--report DIR` to `DIR/.workers/<worker id>`; the
controller merges them into DIR (as `specharness report --merge` merges shards) and removes them."""


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    with interrupt.deferred():  # what finished is written in full
        _write_report(session, state, exitstatus)
    if interrupt.received():  # Ctrl-C or SIGTERM in any phase: 130 / 143, as `specharness run`
        session.exitstatus = interrupt.status()


def _write_report(session: pytest.Session, state: dict, exitstatus) -> None:
    """`--report DIR`: the run directory of what finished (a worker's part under xdist)."""
    config = session.config
    report = config.getoption("--report")
    worker = getattr(config, "workerinput", None)
    parts = Path(report) / WORKERS_DIR if report else None
    if report and worker is None and not state["executor"].runs() and parts.is_dir():
        _merge_workers(config, state, parts)
        return
    if not (report and state["executor"].runs()):
        return
    interrupt.phase("writing")
    planned = list(state["planned"])
    done = [cell for cell, ids in state["planned"].items() if ids <= state["ran"]]
    options = {
        k: v
        for k, default in REPORT_DEFAULTS.items()
        if (v := config.getoption("--" + k.replace("_", "-"))) not in (None, default)
    }
    target = parts / worker["workerid"] if worker else Path(report)
    if worker:  # a worker reports the cells whose items it ran (xdist_group keeps a cell's items together)
        planned = [cell for cell, ids in state["planned"].items() if ids & state["ran"]]
    try:
        meta = describe_run(
            state["executor"],
            tool="pytest",
            command=["pytest", *config.invocation_params.args],
            options=options,
            started=state["started"],
            planned=planned,
            done=done,
            suites=state["suites"],
            known=state["known"],
            backends=run_backends(state["executor"]),
            models=run_models(state["executor"], planned),
            shard=str(state["shard"]) if state["shard"] else None,
            interrupted=exitstatus == pytest.ExitCode.INTERRUPTED or interrupt.received() is not None,
        )
        meta["uncalibrated"] = uncalibrated_lines(state["executor"], state["baselines"])
        write_run(target, state["executor"].runs(), state["checks"], meta, detok.for_model)
        if not worker:
            interrupt.phase("report")
            state["report"] = publish(target)
    except HarnessError as err:
        config.get_terminal_writer().line(f"specharness: --report not written: {err}", red=True)


def _merge_workers(config: pytest.Config, state: dict, parts: Path) -> None:
    """The controller of an xdist session: merge the workers' run directories into the report."""
    dirs = sorted(d for d in parts.iterdir() if (d / "results.json").is_file())
    try:
        merge(dirs, parts.parent)
        state["report"] = publish(parts.parent)
    except HarnessError as err:
        config.get_terminal_writer().line(f"specharness: --report not merged from {parts}: {err}", red=True)
        return
    shutil.rmtree(parts)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    state = config.stash.get(STATE, None)
    for line in not_recorded_lines(state["checks"]) if state else []:
        terminalreporter.write_line(f"specharness: {line}")
    if state and state.get("report"):
        stored = RunDir.load(state["report"].parent)
        for line in known_lines(stored.known()) + summary_lines(stored.failures()) + reported_lines(stored.checks):
            terminalreporter.write_line(f"specharness: {line}")
        terminalreporter.write_line(f"specharness report: {state['report']}")
