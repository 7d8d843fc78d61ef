"""`specharness run`: the suites and checks of `pytest suites/`, outside pytest, with a summary table.

Exit status: 0 every check passed, 1 a check failed, 2 usage or configuration error, 3 a harness error (a
backend that could not be started or built, a draft model that could not be made, a bug of the harness: no
verdict, see harness.checks.evaluate; llama.cpp aborting at start-up is a `no-crash` failure, 1), 130 interrupted
by Ctrl-C, 143 by SIGTERM (in any phase: what finished is still written, with a report marked interrupted).
"""

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from harness import interrupt
from harness.argtypes import csv
from harness.backends.build import require_executable
from harness.backends.build.versions import planned_versions
from harness.backends.choose import backend_factories
from harness.backends.facts import run_backends
from harness.calibration import ensure as ensure_calibrated
from harness.checks import harness_errors
from harness.engine import detok as detokenizers
from harness.errors import HarnessError
from harness.execute import CellRun, Executor
from harness.execute.run_options import (
    DEFAULT_SUITE,
    add_run_options,
    exec_options,
    new_run_dir,
    prepare_out,
    run_defaults,
)
from harness.matrix import Cell, Shard, canonical, cells, narrowing
from harness.models import ModelUnavailable, resolve
from harness.models.facts import run_models
from harness.paths import reports_dir
from harness.report import describe_run, frame, publish, records, write_run
from harness.report import work as work_report
from harness.report.files import RunDir, check_records, command_line, now, reported_lines, speedups
from harness.running import known_failures, plan_jobs, run_suites, wide_console
from harness.signatures.text import print_failures
from harness.suites import Suite, find_suite, suite_files, user_suites_dir
from harness.verdict.baselines import BaselineStore, not_recorded_lines, uncalibrated_lines
from harness.verdict.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.verdict.known_failures import tag

EXIT_FAILED, EXIT_INFRA = 1, 3


def summary_table(runs: list[CellRun], verdicts: list) -> Table:
    """Per cell: requests, errors, speed, draft acceptance, the speed-up over no speculation measured in this
    run, the work its requests did (harness.report.work, short), and check verdicts (pandas underneath)."""
    rows_ = records(runs)
    df, speed = frame(rows_), speedups(rows_)
    done: dict[tuple, list[dict]] = {}  # (suite, model, mode, spec, backend) → its records with output
    for r in rows_:
        if r["error"] is None:
            done.setdefault((r["suite"], r["model"], r["mode"], r["spec"], r["backend"]), []).append(r)
    table = Table(title="specharness run")
    numeric = ("requests", "errors", "tok/s", "accepted", "speed-up")
    for column in ("suite", "model", "mode", "spec", "backend", *numeric, "work", "checks"):
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
        faults = sorted({r.name for r in mine if r.harness_error is not None})
        skipped = sum(1 for r in mine if r.not_run is not None and r.harness_error is None)
        mine = [r for r in mine if r.is_verdict]
        failed = sorted({r.name for r in mine if not r.passed and "known_failure" not in r.evidence})
        known = sorted({r.evidence["known_failure"] for r in mine if "known_failure" in r.evidence})
        pending = sum(1 for r in mine if r.passed and r.evidence.get("no_baseline"))
        reported = sum(1 for r in mine if r.passed and r.evidence.get("reported_only"))
        notes = f", [cyan]{reported} with a sampled divergence reported only[/]" if reported else ""
        notes += f", [dim]{skipped} not run[/]" if skipped else ""
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
            work_report.text(work_report.totals(done.get((suite, model, mode, spec, backend), [])), short=True),
            f"[red]harness error: {', '.join(faults)}[/]"
            if faults
            else f"[red]failed: {', '.join(failed)}[/]"
            if failed
            else f"[yellow]known llama.cpp defect: {', '.join(known)}[/]"
            if known
            else f"[green]{len(mine) - pending} passed[/], [blue]{pending} no baseline yet[/]{notes}"
            if pending
            else f"[green]{len(mine)} passed[/]{notes}",
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


def require_cells(ids: list[str], suites: list[Suite], only: dict) -> None:
    """Every `--cell` id names a cell of the chosen suites (after the other choices): else a one-line error."""
    known = {cell.id for suite in suites for cell in cells(suite.matrix, only)}
    unknown = [i for i in ids if i not in known]
    if unknown:
        names = ", ".join(s.name for s in suites)
        raise HarnessError(
            f"--cell {unknown[0]}: no such cell in {names} with the other choices (an id is MODE-SPEC-MODEL-BACKEND "
            "as the report names it, e.g. seq-draft-simple-tiny-dense-server)"
        )


@dataclass
class RunPlan:
    """What `run` serves: the suites, each with the narrowing of its cells, the shard, a `--suites-dir`, and
    the run directory (created up front)."""

    suites: list[Suite]
    plan: list[tuple[Suite, dict]]
    part: Shard | None
    extra: Path | None
    out: Path
    calibration: list[str] = field(default_factory=list)
    """The header's calibration lines (harness.calibration.ensure); run.json records them."""


def plan_run(args: argparse.Namespace) -> RunPlan:
    """The suites and cells `run` serves (nothing to run, or a model that is missing, is a one-line error; a model
    whose optional package is missing is skipped), and its run directory."""
    only = narrowing(csv(args.backend), csv(args.mode), csv(args.spec), args.model, args.cell)
    part = Shard.parse(args.shard) if args.shard else None
    if args.server_bin is not None:  # bad input, said before anything is served (not a cell's harness error)
        require_executable(Path(args.server_bin).expanduser())
    extra = user_suites_dir(args.suites_dir)
    names = args.suite or ([path.stem for path in suite_files(extra)] if extra else [DEFAULT_SUITE])
    suites = [find_suite(name, extra) for name in names]
    if args.cell:
        require_cells(args.cell, suites, {**only, "cells": None})
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
    return RunPlan(suites, plan, part, extra, out)


def baseline_store(args: argparse.Namespace) -> BaselineStore:
    """The baselines the run reads (and with `--update-baselines` writes)."""
    option = f" --baselines-dir {args.baselines_dir}" if args.baselines_dir else ""
    option += f" --baselines-range {args.baselines_range}" if args.baselines_range else ""
    return BaselineStore(
        args.baselines_dir,
        update=args.update_baselines,
        option=option,
        calibration_dir=args.calibration_dir,
        version_range=args.baselines_range or "",
    )


AUTO_CALIBRATE = "SPECHARNESS_AUTO_CALIBRATE"
"""Set to 0: `run` never measures a missing calibration (as `--no-auto-calibrate`); the test session sets it."""


def calibrate_first(
    args: argparse.Namespace, run_plan: RunPlan, executor: Executor, baselines: BaselineStore, console: Console
) -> None:
    """The run's header: each (model, backend) it serves calibrated on its device and build before anything is
    judged — committed, cached, or measured once now and cached (not with `--no-auto-calibrate`, nor where
    $SPECHARNESS_AUTO_CALIBRATE is 0)."""
    run_plan.calibration = ensure_calibrated(
        plan_jobs(run_plan.plan, run_plan.part),
        executor,
        baselines.calibration_of,
        args.server_bin,
        args.source,
        measure=not getattr(args, "no_auto_calibrate", False) and os.environ.get(AUTO_CALIBRATE, "1") != "0",
        say=lambda line: console.print(line, markup=False, highlight=False),
    )


def serve(run_plan: RunPlan, executor: Executor, baselines: BaselineStore, console: Console) -> tuple[list, list]:
    """Serve and check every planned cell with a progress bar: the (suite name, cell) pairs that finished and
    their verdicts, (suite, case, cell, CheckResult) tuples. Ctrl-C or SIGTERM ends it early with what finished
    (the backends are already stopped)."""
    done, verdicts = [], []

    def finished(suite: Suite, cell: Cell, mine: list) -> None:
        done.append((suite.name, cell))
        verdicts.extend(mine)

    try:
        with Progress(console=console, transient=True) as progress:
            run_suites(run_plan.plan, executor, baselines, progress, run_plan.part, finished)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report what finished (the backends are already stopped)
        pass
    return done, verdicts


def print_verdicts(
    console: Console, runs: list[CellRun], verdicts: list, done: list, known: list, overrides: dict | None = None
) -> list:
    """The summary table, a line per failing (or known) verdict, how many seeded sampled divergences were reported
    only with a line per such verdict, and a line per known failure that did not reproduce in the cells that ran
    (served under the run's `--spec-*` `overrides`); returns those known failures, less the intermittent ones
    (`tries`)."""
    wide_console().print(summary_table(runs, verdicts))
    for run in runs:
        if run.unservable is not None:  # served nothing, so no row above: say which cells and why
            console.print(f"NOT RUN {run.suite.name}[{run.cell.id}]: {run.unservable}", markup=False, highlight=False)
    for suite, key, cell, r in verdicts:
        if r.harness_error is not None:
            console.print(
                f"HARNESS ERROR {suite}[{key}-{cell.id}] [{r.name}] {r.message}", markup=False, highlight=False
            )
        elif not r.passed:
            label = f"KNOWN {r.evidence['known_failure']}" if "known_failure" in r.evidence else "FAIL"
            console.print(f"{label} {suite}[{key}-{cell.id}] [{r.name}] {r.message}", markup=False, highlight=False)
    for line in reported_lines(check_records(verdicts)):  # passed, yet an output changed: never silent
        console.print(line, markup=False, highlight=False)
    served_otherwise = {
        (r.suite.name, r.cell)
        for r in runs
        if r.spec is not None and canonical(r.spec) != canonical(r.cell.preset.options)
    }
    shown = {r.evidence.get("known_failure") for *_, r in verdicts}
    covering = [e for e in known if any(e.covers(s, c, overrides) for s, c in done) and e.id not in shown]
    absent = [
        e
        for e in covering
        if any(
            e.covers(s, c, overrides) and e.measured_in(c, overrides) for s, c in done if (s, c) not in served_otherwise
        )
    ]
    for entry in (e for e in covering if e not in absent):  # its cells were served otherwise than measured
        console.print(
            f"not judged: known failure {entry.id} did not show, but its cells were served with this run's --spec-* "
            "options, not as it was measured",
            markup=False,
        )
    for entry in absent:
        if entry.tries > 1:  # intermittent: one run without it proves nothing (its strict pytest item tries again)
            console.print(
                f"not reproduced this run: known failure {entry.id} (intermittent; `pytest` serves its cells up to "
                f"{entry.tries} times before it counts as gone)",
                markup=False,
            )
        else:
            console.print(
                f"FIXED? known failure {entry.id} did not reproduce: if llama.cpp fixed it, remove it from "
                f"suites/{KNOWN_FAILURES}",
                markup=False,
            )
    return [e for e in absent if e.tries == 1]


def print_notes(console: Console, executor: Executor, baselines: BaselineStore, verdicts: list) -> list[str]:
    """The cells that ended in an error, the baselines written, the models without baselines or calibration;
    returns the uncalibrated lines (run.json records them)."""
    runs = executor.runs()
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
    return uncalibrated


def write_and_publish(
    args: argparse.Namespace,
    run_plan: RunPlan,
    executor: Executor,
    verdicts: list,
    done: list,
    known: list,
    started: str,
    interrupted: bool,
    uncalibrated: list[str],
    console: Console,
    known_scope: list[str] = (),
    baselines: BaselineStore | None = None,
) -> list:
    """Write the run directory, print its failures (read back from it, as every report) and publish its
    report; returns the planned (suite name, cell) pairs."""
    suites, plan, part, out = run_plan.suites, run_plan.plan, run_plan.part, run_plan.out
    runs = executor.runs()
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
        models=run_models(executor, planned),
        shard=str(part) if part else None,
        interrupted=interrupted,
    )
    meta["uncalibrated"] = uncalibrated
    meta["calibration"] = run_plan.calibration
    meta["known_failures_scope"] = list(known_scope)
    meta["versioned_baselines"] = sorted(baselines.versioned_used) if baselines else []
    results = write_run(out, runs, verdicts, meta, detokenizers.for_model)
    interrupt.phase("report")
    stored = RunDir.load(out)  # the summary comes from the stored run, as every report
    print_failures(stored.failures(), console, stored.known())
    console.print(f"results: {results}", markup=False)
    console.print(f"report: {publish(out)}", markup=False)
    return planned


def exit_status(
    console: Console, planned: list, done: list, runs: list[CellRun], verdicts: list, failed: list, fixed: list
) -> int:
    """1 a check failed (or a known failure did not reproduce), 3 a harness error, the signal's status when
    interrupted (saying how many cells did not run), else 0."""
    if interrupt.received():
        missing = len(planned) - len(done)
        console.print(
            f"interrupted: {missing} of {len(planned)} cells did not run (listed in the report)"
            if missing
            else "interrupted: every cell had finished; all of it is written",
            markup=False,
        )
        return interrupt.status()
    if any(run.fault for run in runs) or harness_errors(verdicts):
        return EXIT_INFRA
    return EXIT_FAILED if failed or fixed else 0


def cmd_run(args: argparse.Namespace) -> int:
    """`specharness run`: plan the cells, serve and check them, then write the run directory and summarise it (what
    finished is written in full, also when interrupted)."""
    started = now()
    run_plan = plan_run(args)
    executor = Executor(exec_options(args, backend_factories(args.server_bin, args.source, run_plan.out)))
    baselines = baseline_store(args)
    console = Console(stderr=True, soft_wrap=True)
    try:
        calibrate_first(args, run_plan, executor, baselines, console)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while building or calibrating: every cell is written as not run
        done, verdicts = [], []
    else:
        done, verdicts = serve(run_plan, executor, baselines, console)
    with interrupt.deferred():  # a signal from here on lets what finished be written in full
        interrupt.phase("writing")
        interrupted = interrupt.received() is not None
        runs = executor.runs()
        known, out_of_range = known_failures(run_plan.extra, planned_versions(args.server_bin, args.source))
        for line in out_of_range:
            console.print(line, markup=False, highlight=False)
        overrides = executor.options.spec_overrides
        failed = [r for suite, _, cell, r in verdicts if tag(known, suite, cell, [r], overrides)]
        fixed = print_verdicts(console, runs, verdicts, done, known, overrides)
        uncalibrated = print_notes(console, executor, baselines, verdicts)
        planned = write_and_publish(
            args,
            run_plan,
            executor,
            verdicts,
            done,
            known,
            started,
            interrupted,
            uncalibrated,
            console,
            out_of_range,
            baselines,
        )
        return exit_status(console, planned, done, runs, verdicts, failed, fixed)


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
    p.add_argument(
        "--no-auto-calibrate",
        action="store_true",
        help="judge a (model, backend) with no calibration on this device and build by the default floor, "
        "instead of measuring it once and caching it",
    )
    p.set_defaults(func=cmd_run)
