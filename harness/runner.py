"""`specharness run`: the suites and checks of `pytest suites/`, outside pytest, with a summary table.

Exit status: 0 every check passed, 1 a check failed, 2 usage or configuration error, 3 an
infrastructure error (a backend that could not be started or built), 130 interrupted by Ctrl-C, 143 by
SIGTERM (in any phase: what finished is still written, with a report marked interrupted).
"""

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from harness import detok as detokenizers
from harness import interrupt
from harness.argtypes import csv
from harness.backends.choose import backend_factories
from harness.backends.facts import run_backends
from harness.baselines import BaselineStore, not_recorded_lines, uncalibrated_lines
from harness.errors import HarnessError
from harness.execute import CellRun, Executor
from harness.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.known_failures import tag
from harness.matrix import Cell, Shard, cells, narrowing
from harness.models import ModelUnavailable, resolve
from harness.paths import reports_dir
from harness.report import describe_run, frame, publish, records, write_run
from harness.report.files import RunDir, command_line, now, speedups
from harness.run_options import (
    DEFAULT_SUITE,
    add_run_options,
    exec_options,
    new_run_dir,
    prepare_out,
    run_defaults,
)
from harness.running import known_failures, plan_jobs, run_suites, wide_console
from harness.signatures.text import print_failures
from harness.suites import Suite, find_suite, suite_files, user_suites_dir

EXIT_FAILED, EXIT_INFRA = 1, 3


def summary_table(runs: list[CellRun], verdicts: list) -> Table:
    """Per cell: requests, errors, speed, draft acceptance, the speed-up over no speculation measured in this
    run, and check verdicts (pandas underneath)."""
    rows_ = records(runs)
    df, speed = frame(rows_), speedups(rows_)
    table = Table(title="specharness run")
    numeric = ("requests", "errors", "tok/s", "accepted", "speed-up")
    for column in ("suite", "model", "mode", "spec", "backend", *numeric, "checks"):
        table.add_column(column, justify="right" if column in numeric else "left")
    keys = ["suite", "model", "mode", "spec", "backend"]
    groups = df.groupby(keys, sort=False) if rows_ else ()  # no records: interrupted before any request
    for (suite, model, mode, spec, backend), rows in groups:
        ok = rows[rows["error"].isna()]
        ms, n = ok["timings.predicted_ms"].sum(), ok["timings.predicted_n"].sum()
        drafted, accepted = _total(ok, "spec_stats.draft_n"), _total(ok, "spec_stats.draft_n_accepted")
        mine = [
            r
            for s, _, c, r in verdicts
            if (s, c.model, c.mode, c.spec, c.backend) == (suite, model, mode, spec, backend)
        ]
        failed = sorted({r.name for r in mine if not r.passed and "known_failure" not in r.evidence})
        known = sorted({r.evidence["known_failure"] for r in mine if "known_failure" in r.evidence})
        pending = sum(1 for r in mine if r.passed and r.evidence.get("no_baseline"))
        errors = len(rows) - len(ok)
        up = speed.get(f"{suite} {mode}-{spec}-{model}-{backend}")
        table.add_row(
            suite,
            model,
            mode,
            spec,
            backend,
            str(len(rows)),
            f"[red]{errors}[/]" if errors else "0",
            f"{1000.0 * n / ms:.0f}" if ms else "-",
            f"{accepted}/{drafted}" if drafted else "-",
            f"{up['speedup']:.2f}x" if up else "-",
            f"[red]failed: {', '.join(failed)}[/]"
            if failed
            else f"[yellow]known llama.cpp defect: {', '.join(known)}[/]"
            if known
            else f"[green]{len(mine) - pending} passed[/], [blue]{pending} no baseline yet[/]"
            if pending
            else f"[green]{len(mine)} passed[/]",
        )
    return table


def _total(df, column: str) -> int:
    """Sum of a column that only exists when some record has it (speculative counters)."""
    return int(df[column].fillna(0).sum()) if column in df else 0


def available_models(models: list[str], asked: list[str] | None) -> dict[str, str]:
    """Resolve every model before anything runs (a missing one is bad input, exit 2); a model whose optional
    package is missing is skipped with its reason unless it was asked for by name. Returns the skipped."""
    skipped = {}
    for model in models:
        try:
            resolve(model)
        except ModelUnavailable as err:
            if asked and model in asked:
                raise
            skipped[model] = str(err)
            print(f"specharness: skipping the cells of {model}: {err}", file=sys.stderr)
    return skipped


def cmd_run(args: argparse.Namespace) -> int:
    """`specharness run`."""
    started = now()
    only = narrowing(csv(args.backend), csv(args.mode), csv(args.spec), args.model)
    part = Shard.parse(args.shard) if args.shard else None
    extra = user_suites_dir(args.suites_dir)
    names = args.suite or ([path.stem for path in suite_files(extra)] if extra else [DEFAULT_SUITE])
    suites = [find_suite(name, extra) for name in names]
    if not any(cells(suite.matrix, only) for suite in suites):
        raise HarnessError(
            "nothing to run: the chosen backends, modes, spec configs and models leave no cell "
            "(scripted spec configs run only in-process, synth-reject only on llama-server)"
        )
    skipped = available_models(sorted({c.model for suite in suites for c in cells(suite.matrix, only)}), args.model)
    plan = [
        (suite, {**only, "models": models})
        for suite in suites
        if (models := [m for m in dict.fromkeys(c.model for c in cells(suite.matrix, only)) if m not in skipped])
    ]
    out = prepare_out(Path(args.out) if args.out else new_run_dir(reports_dir()))
    for suite in suites:
        suite.rounds = suite.rounds * args.repeat
    executor = Executor(exec_options(args, backend_factories(args.server_bin, args.source, out)))
    baselines = BaselineStore(
        args.baselines_dir,
        update=args.update_baselines,
        option=f" --baselines-dir {args.baselines_dir}" if args.baselines_dir else "",
        calibration_dir=args.calibration_dir,
    )
    console = Console(stderr=True, soft_wrap=True)
    done, verdicts = [], []

    def finished(suite: Suite, cell: Cell, mine: list) -> None:
        done.append((suite.name, cell))
        verdicts.extend(mine)

    try:
        with Progress(console=console, transient=True) as progress:
            run_suites(plan, executor, baselines, progress, part, finished)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report what finished (the backends are already stopped)
        pass
    with interrupt.deferred():  # a signal from here on lets what finished be written in full
        interrupt.phase("writing")
        interrupted = interrupt.received() is not None
        runs = executor.runs()
        known = known_failures(extra)
        failed = [r for suite, _, cell, r in verdicts if tag(known, suite, cell, [r])]
        wide_console().print(summary_table(runs, verdicts))
        for suite, key, cell, r in verdicts:
            if not r.passed:
                label = f"KNOWN {r.evidence['known_failure']}" if "known_failure" in r.evidence else "FAIL"
                console.print(f"{label} {suite}[{key}-{cell.id}] [{r.name}] {r.message}", markup=False, highlight=False)
        fixed = [
            e
            for e in known
            if any(e.covers(suite, cell) for suite, cell in done)
            and not any(r.evidence.get("known_failure") == e.id for *_, r in verdicts)
        ]
        for entry in fixed:
            console.print(
                f"FIXED? known failure {entry.id} did not reproduce: if llama.cpp fixed it, remove it from "
                f"suites/{KNOWN_FAILURES}",
                markup=False,
            )
        for run in runs:
            if run.error:
                console.print(f"error: {run.suite.name} {run.cell.id}: {run.error}", markup=False, highlight=False)
            if run.harness_error:
                console.print(run.harness_error, markup=False, highlight=False)
        for path in dict.fromkeys(baselines.written):
            console.print(f"baseline written: {path}", markup=False)
        for line in not_recorded_lines(verdicts):
            console.print(line, markup=False, highlight=False)
        uncalibrated = uncalibrated_lines(executor, baselines)
        for line in uncalibrated:
            console.print(f"uncalibrated: {line}", markup=False, highlight=False)
        planned = [(suite.name, cell) for suite, cell in plan_jobs(plan, part)]
        meta = describe_run(
            executor,
            tool="specharness run",
            command=getattr(args, "command_line", None) or command_line(),
            options=repro_options(args),
            started=started,
            planned=planned,
            done=done,
            suites={suite.name: suite.path for suite in suites},
            known=known,
            backends=run_backends(executor),
            shard=str(part) if part else None,
            interrupted=interrupted,
        )
        meta["uncalibrated"] = uncalibrated
        results = write_run(out, runs, verdicts, meta, detokenizers.for_model)
        interrupt.phase("report")
        stored = RunDir.load(out)  # the summary comes from the stored run, as every report
        print_failures(stored.failures(), console, stored.known())
        console.print(f"results: {results}", markup=False)
        console.print(f"report: {publish(out)}", markup=False)
        if interrupt.received():
            missing = len(planned) - len(done)
            console.print(
                f"interrupted: {missing} of {len(planned)} cells did not run (listed in the report)"
                if missing
                else "interrupted: every cell had finished; all of it is written",
                markup=False,
            )
            return interrupt.status()
        if any(run.error or run.harness_error for run in runs):
            return EXIT_INFRA
        return EXIT_FAILED if failed or fixed else 0


REPRO_SKIP = {
    "suite",
    "model",
    "mode",
    "backend",
    "spec",
    "out",
    "shard",
    "update_baselines",
    "func",
    "command",
    "verbose",
    "command_line",
}
"""Options that are not part of a case's re-run command (the cell names them, or they write things)."""


def repro_options(args: argparse.Namespace) -> dict:
    """The options this run changed from their defaults, as a re-run command needs them."""
    defaults = run_defaults()
    return {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in REPRO_SKIP and k in defaults and v != defaults[k]
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness run`."""
    p = sub.add_parser("run", help="run suites on a backend in seq / par / no-kv-unified modes and check them")
    add_run_options(p)
    p.set_defaults(func=cmd_run)
