"""`specharness run`: the suites and checks of `pytest suites/`, outside pytest, with a summary table.

Exit status: 0 every check passed, 1 a check failed, 2 usage or configuration error, 3 an
infrastructure error (a backend that could not be started or built), 130 interrupted by Ctrl-C, 143 by
SIGTERM (in any phase: what finished is still written, with a report marked interrupted).
"""

import argparse
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from harness import detok as detokenizers
from harness import interrupt
from harness.backends.base import KV_SCAN, STALL_FLOOR_S
from harness.backends.choose import backend_factories
from harness.backends.facts import run_backends
from harness.baselines import BaselineStore, not_recorded_lines, shown, uncalibrated_lines
from harness.checks import evaluate
from harness.checks.base import CheckContext
from harness.engine.faults import FAULTS
from harness.engine.rollback import CHECKPOINT_FLAGS, STRATEGIES
from harness.engine.speculative import SpecConfig
from harness.errors import HarnessError
from harness.execute import CellRun, ExecOptions, Executor, case_keys
from harness.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.known_failures import load as load_known
from harness.known_failures import tag
from harness.matrix import SPEC_PRESETS, Cell, Shard, cells, narrowing, shard
from harness.models import ModelUnavailable, resolve
from harness.paths import reports_dir
from harness.report import describe_run, frame, publish, records, write_run
from harness.report.files import RunDir, command_line, now, speedups
from harness.signatures.text import print_failures
from harness.suites import Suite, find_suite, suite_files, suites_dir, user_suites_dir

DEFAULT_SUITE = "quicksort"
SPEC_PARAMS = [
    f
    for f in SpecConfig.__dataclass_fields__.values()
    if f.name.startswith("spec_") and f.name not in ("spec_type", "spec_draft_model")
]
"""The `--spec-*` options (numbers, and the draft KV cache types), named exactly like llama-server's flags."""
EXIT_FAILED, EXIT_INFRA = 1, 3


def new_run_dir(parent: Path) -> Path:
    """A fresh run directory `<parent>/<UTC time>-<random>`."""
    return parent / (time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3))


def csv(value: str | None) -> list[str] | None:
    """A comma-separated option as a list (None when not given)."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def count(minimum: int):
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got '{text}'")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{text}'")
    return value


def prepare_out(out: Path) -> Path:
    """Create the run directory up front; refuse a file, an unwritable place or an existing results.json."""
    if (out / "results.json").exists():
        raise HarnessError(
            f"{out / 'results.json'} already exists (choose another --out; results are never overwritten)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as err:
        raise HarnessError(f"cannot write the run directory {out}: {err.strerror}") from None
    return out


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
        if run.harness_error is not None:  # no verdicts: reported as a harness error at the end of the run
            if on_cell:
                on_cell(suite, cell, [])
            continue
        detok = detokenizers.for_model(cell.model) or str if run.error is None else str
        mine = []
        for case in suite.cases:
            for key in case_keys(case):
                repro = (
                    f"specharness run --suite {suite_arg(suite)} --backend {cell.backend} --mode {cell.mode} "
                    f"--spec {cell.spec} --model {cell.model}"
                )
                ctx = CheckContext(run, key, executor, baselines, detok, repro)
                mine += [(suite.name, key, cell, r) for r in evaluate(ctx, suite.checks)]
        verdicts += mine
        if on_cell:
            on_cell(suite, cell, mine)
    return verdicts


def wide_console() -> Console:
    """stdout; tables keep their columns when stdout is a file or a pipe."""
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)


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


def exec_options(args: argparse.Namespace, backends: dict) -> ExecOptions:
    """The executor options of `run`'s arguments (or of a stored run's, `shrink`): slots, draft model,
    `--spec-*` overrides, in-process engine options, KV scan, logit logging, stall floor."""
    spec_overrides = {
        f.name.replace("_", "-"): getattr(args, f.name) for f in SPEC_PARAMS if getattr(args, f.name) is not None
    }
    engine = {
        "rollback": args.rollback,
        "fault": args.fault,
        "checkpoint_flags": args.checkpoint_flags,
        "checkpoint_attempts": args.checkpoint_attempts,
    }
    return ExecOptions(
        backends=backends,
        parallel=args.parallel,
        draft_model=args.draft_model,
        spec_overrides=spec_overrides,
        engine=engine,
        kv_scan=args.kv_scan,
        logit_top_k=args.logit_top_k,
        stall_s=args.stall_s,
    )


def known_failures(extra: Path | None = None) -> list:
    """The known-failures entries of the suites in use and of a `--suites-dir`."""
    return [*load_known(suites_dir() / KNOWN_FAILURES), *(load_known(extra / KNOWN_FAILURES) if extra else [])]


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
DEFAULTS: dict = {}
"""The `run` parser's defaults (filled by add_parser)."""


def repro_options(args: argparse.Namespace) -> dict:
    """The options this run changed from their defaults, as a re-run command needs them."""
    return {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in REPRO_SKIP and k in DEFAULTS and v != DEFAULTS[k]
    }


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness run`."""
    p = sub.add_parser("run", help="run suites on a backend in seq / par / no-kv-unified modes and check them")
    p.add_argument(
        "--suite",
        action="append",
        metavar="NAME",
        help=f"suite name or file, repeatable (default {DEFAULT_SUITE}; with --suites-dir, its suites)",
    )
    p.add_argument(
        "--suites-dir",
        type=Path,
        metavar="DIR",
        help="a directory of your own suites: they add to (same name: replace) the installed ones; their "
        "baselines are fixtures/baselines beside DIR (`specharness init` writes one)",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME|PATH",
        help="registry name or .gguf path, repeatable (default: the suite's models)",
    )
    p.add_argument("--mode", help="comma-separated: seq,par,no-kv-unified (default: the suite's modes)")
    p.add_argument("--backend", help="comma-separated: inproc,server (default: the suite's backends)")
    p.add_argument(
        "--spec",
        metavar="CONFIG[,CONFIG...]",
        help=f"speculative configs, each one of {', '.join(SPEC_PRESETS)} or `a+b` chained (default: the suite's)",
    )
    p.add_argument("--draft-model", metavar="NAME|PATH", help="draft model for draft-simple (default <model>-draft)")
    p.add_argument("--rollback", default="auto", choices=STRATEGIES, help="in-process rollback strategy (default auto)")
    p.add_argument("--fault", choices=sorted(FAULTS), help="switch on one fault of the in-process speculative engine")
    p.add_argument(
        "--checkpoint-flags",
        default="partial",
        choices=sorted(CHECKPOINT_FLAGS),
        help="in-process checkpoints: PARTIAL_ONLY state (default) or the full state",
    )
    p.add_argument(
        "--checkpoint-attempts",
        type=count(0),
        default=3,
        help="in-process: failed replays after which a slot stops speculating (default 3)",
    )
    for f in SPEC_PARAMS:
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(f.default),
            metavar="TYPE" if isinstance(f.default, str) else "N",
            help=f"as llama-server (default {f.default})",
        )
    p.add_argument("--server-bin", type=Path, metavar="PATH", help="llama-server binary to use instead of building one")
    p.add_argument("--source", type=Path, metavar="DIR", help="llama.cpp tree to build llama-server from")
    p.add_argument("--parallel", type=count(1), default=4, help="slots in par and no-kv-unified modes (default 4)")
    p.add_argument("--repeat", type=count(1), default=1, help="run every suite's rounds this many times")
    p.add_argument("--update-baselines", action="store_true", help="write baselines from this run")
    p.add_argument(
        "--baselines-dir",
        type=Path,
        metavar="DIR",
        help="read (and with --update-baselines write) baselines here (default: fixtures/baselines beside the suites)",
    )
    p.add_argument(
        "--calibration-dir",
        type=Path,
        metavar="DIR",
        help="read calibration files here first (written by `specharness calibrate --calibration-dir`)",
    )
    p.add_argument(
        "--kv-scan",
        default="request",
        choices=KV_SCAN,
        help="scan KV state after every request (default), also after every speculative step, or off",
    )
    p.add_argument("--logit-top-k", type=count(0), default=10, help="top-k logits logged per position (0 = off)")
    p.add_argument(
        "--stall-s",
        type=seconds,
        metavar="S",
        help=f"floor of the stall window: a request with no token for that long ends `timeout` "
        f"(default {STALL_FLOOR_S:g}; a suite's `serve: stall_s` wins; see README Deadlines)",
    )
    p.add_argument("--out", metavar="DIR", help="run directory (default reports/<run-id>)")
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="run the I-th of N balanced parts of the cells (merge with `specharness report --merge`)",
    )
    p.set_defaults(func=cmd_run)
    DEFAULTS.update(vars(p.parse_args([])))
