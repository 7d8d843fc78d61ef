"""`specharness report` (render, merge, history) and `specharness diff`."""

import argparse
import sys
from pathlib import Path

from rich.console import Console

from harness.errors import HarnessError


def _console() -> Console:
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def cmd_report(args: argparse.Namespace) -> int:
    """Re-render one run directory, merge shards, or show the history of several runs."""
    from harness.report import publish
    from harness.report.files import RunDir
    from harness.report.history import history, print_history, write_history_html
    from harness.report.merge import merge

    chosen = [bool(args.run_dir), bool(args.merge), bool(args.history)]
    if sum(chosen) != 1:
        raise HarnessError("report takes one of: RUN_DIR, --merge DIR... --out DIR, --history DIR...")
    console = _console()
    if args.run_dir:
        console.print(f"report: {publish(Path(args.run_dir))}", markup=False)
        return 0
    if args.merge:
        if not args.out:
            raise HarnessError("--merge needs --out DIR for the merged run directory")
        results = merge([Path(d) for d in args.merge], Path(args.out))
        console.print(f"results: {results}", markup=False)
        console.print(f"report: {publish(Path(args.out))}", markup=False)
        return 0
    runs = [RunDir.load(Path(d)) for d in args.history]
    rows = history(runs)
    print_history(runs, rows, console)
    target = Path(args.out) if args.out else runs[-1].path / "history.html"
    console.print(f"history report: {write_history_html(runs, rows, target)}", markup=False)
    return 1 if any(c.category == "new failure" for c in rows) else 0


def cmd_diff(args: argparse.Namespace) -> int:
    """Compare two runs; exit 1 when something regressed."""
    from harness.report.diff import compare, print_diff, write_diff_html
    from harness.report.files import RunDir

    a, b = RunDir.load(Path(args.run_a)), RunDir.load(Path(args.run_b))
    diff = compare(a, b, args.speed_threshold, args.acceptance_threshold)
    console = _console()
    print_diff(diff, console)
    target = Path(args.out) if args.out else b.path / "diff.html"
    console.print(f"diff report: {write_diff_html(diff, target)}", markup=False)
    return 1 if diff.regressed else 0


def fraction(text: str) -> float:
    """An argparse type: a non-negative fraction."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a fraction >= 0 (0.1 = 10 %), got '{text}'")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness report` and `specharness diff`."""
    from harness.report.diff import ACCEPTANCE_THRESHOLD, SPEED_THRESHOLD

    p = sub.add_parser("report", help="re-render a run's index.html, merge shard runs, or show the history of runs")
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="run directory to re-render (index.html, junit.xml)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="shard run directories to merge (with --out)")
    p.add_argument(
        "--history",
        nargs="+",
        metavar="DIR",
        help="run directories, oldest first: stable / flaky / new failure / fixed per case",
    )
    p.add_argument(
        "--out",
        metavar="PATH",
        help="--merge: the merged run directory; --history: the HTML file "
        "(default history.html in the last run directory)",
    )
    p.set_defaults(func=cmd_report)
    d = sub.add_parser("diff", help="compare two runs (before, after); exit 1 when something regressed")
    d.add_argument("run_a", metavar="RUN_A", help="the earlier run directory (e.g. the previous release)")
    d.add_argument("run_b", metavar="RUN_B", help="the later run directory (e.g. the candidate)")
    d.add_argument(
        "--speed-threshold",
        type=fraction,
        default=SPEED_THRESHOLD,
        metavar="FRACTION",
        help=f"a speed-up over no speculation that fell by more than this fraction of RUN_A's, outside both runs' "
        f"noise bands, regresses (default {SPEED_THRESHOLD})",
    )
    d.add_argument(
        "--acceptance-threshold",
        type=fraction,
        default=ACCEPTANCE_THRESHOLD,
        metavar="FRACTION",
        help=f"flag draft-acceptance changes beyond this (absolute); a drop beyond it regresses (default "
        f"{ACCEPTANCE_THRESHOLD})",
    )
    d.add_argument("--out", metavar="FILE", help="where to write diff.html (default RUN_B/diff.html)")
    d.set_defaults(func=cmd_diff)
