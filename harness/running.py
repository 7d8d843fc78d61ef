"""Running suites: every cell of a plan on the executor, each case's checks evaluated on what it served.
`specharness run`, `selftest` and the tests share it (not a command module)."""

import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from harness.checks import evaluate_cell
from harness.execute import Executor, case_keys
from harness.matrix import Cell, Shard, cells, shard
from harness.suites import Suite, suites_dir
from harness.verdict.baselines import BaselineStore, shown
from harness.verdict.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.verdict.known_failures import load as load_known
from harness.verdict.known_failures import scoped


def plan_jobs(plan: list[tuple[Suite, dict]], part: Shard | None = None) -> list[tuple[Suite, Cell]]:
    """The (suite, cell) jobs of each (suite, narrowing) pair; only shard `part`'s when given."""
    jobs = [(suite, cell) for suite, only in plan for cell in cells(suite.matrix, only)]
    return shard(jobs, part) if part else jobs


def suite_arg(suite: Suite) -> str:
    """How `--suite` names a suite in a re-run command: by name when it is one of the suites in use, else by
    its file (a `--suites-dir` suite)."""
    path = Path(suite.path) if suite.path else None
    return suite.name if path is None or path.resolve() == (suites_dir() / path.name).resolve() else shown(path)


def run_suites(
    plan: list[tuple[Suite, dict]],
    executor: Executor,
    baselines: BaselineStore,
    progress: Progress | None = None,
    part: Shard | None = None,
    on_cell: Callable[[Suite, Cell, list], None] | None = None,
) -> list:
    """Run every cell of each (suite, narrowing) pair (of shard `part` only, when given) and evaluate its
    checks; returns (suite, case, cell, CheckResult) tuples. `on_cell` gets each cell's verdicts as soon
    as they are complete (what an interrupted run still reports)."""
    jobs = plan_jobs(plan, part)
    executor.expect(jobs)
    total = sum(len(s.rounds) * sum(len(case_keys(c)) for c in s.cases) for s, _ in jobs)
    task = progress.add_task("run", total=total) if progress else None
    verdicts = []
    for suite, cell in jobs:
        if progress:
            progress.update(task, description=f"{suite.name} · {cell.id}")
        run = executor.run(suite, cell, on_request=(lambda: progress.advance(task)) if progress else None)
        repro = (
            f"specharness run --suite {suite_arg(suite)} --backend {cell.backend} --mode {cell.mode} "
            f"--spec {cell.spec} --model {cell.model}"
        )
        mine = [(suite.name, key, cell, r) for key, r in evaluate_cell(run, executor, baselines, suite.checks, repro)]
        verdicts += mine
        if on_cell:
            on_cell(suite, cell, mine)
    return verdicts


def wide_console() -> Console:
    """stdout; tables keep their columns when stdout is a file or a pipe."""
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def known_failures(extra: Path | None = None, versions: dict | None = None) -> tuple[list, list[str]]:
    """The known-failures entries of the suites in use and of a `--suites-dir` that apply to the backends'
    llama.cpp `versions` (harness/backends/build/versions.py `planned_versions`; None: every entry), and a line for each
    entry that does not apply (fixed in a tag, or not known for this version)."""
    entries = [*load_known(suites_dir() / KNOWN_FAILURES), *(load_known(extra / KNOWN_FAILURES) if extra else [])]
    return scoped(entries, versions) if versions is not None else (entries, [])
