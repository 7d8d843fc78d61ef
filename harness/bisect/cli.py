"""`specharness bisect`: find the llama.cpp commit (or release) that broke one pinned case.

Exit status: 0 a first bad commit (or release) was found, 1 none could be named (the ends do not
give good and bad, or only unbuildable commits are left), 2 bad input, 130 interrupted by Ctrl-C, 143 by
SIGTERM (the checkout is back where it started; `--resume RUN_DIR` goes on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import interrupt
from harness.argtypes import accept_cmake_definitions, count, csv
from harness.backends.build import BACKENDS
from harness.bisect import plan as plans
from harness.bisect.result import Outcome, Stop, describe, write
from harness.errors import HarnessError
from harness.execute.run_options import new_run_dir, prepare_out
from harness.paths import reports_dir

EXIT_FOUND, EXIT_NOT_FOUND = 0, 1


def _plan(args: argparse.Namespace) -> plans.Plan:
    """The pinned cell from --suite ... or --from-run ..., plus the build options."""
    checks = csv(args.check)
    if args.from_run:
        plan = plans.from_run(args.from_run, args.case, checks, args.mode, args.spec, args.model, args.strict)
    elif args.suite:
        plan = plans.from_suite(args.suite, args.case, checks, args.mode, args.spec, args.model, args.strict)
    else:
        raise HarnessError("name the case to judge: --suite S [--case C ...] or --from-run RUN_DIR --case ID")
    plan.build_backend, plan.cmake_args, plan.jobs = args.backend, list(args.cmake_arg), args.jobs
    if bool(args.step_cmd) != bool(args.server_bin_pattern):
        raise HarnessError(
            "--step-cmd and --server-bin-pattern go together (the command builds, the pattern "
            "says where its llama-server appears)"
        )
    plan.step_cmd, plan.server_bin_pattern = args.step_cmd, args.server_bin_pattern
    return plan


def _run_dir(args: argparse.Namespace) -> Path:
    run_dir = prepare_out(Path(args.out) if args.out else new_run_dir(reports_dir()))
    if (run_dir / plans.PLAN_FILE).exists():
        raise HarnessError(f"{run_dir} already holds a bisect (continue it with --resume {run_dir})")
    return run_dir.resolve()


def cmd_bisect(args: argparse.Namespace) -> int:
    from harness.bisect.driver import bisect_checkout, prepare_checkout
    from harness.bisect.releases import bisect_releases, bisect_tags

    if args.resume:
        run_dir = Path(args.resume).resolve()
        plan = plans.Plan.load(run_dir)
        index = "releases" if plan.releases else "tags" if plan.tags else None
    else:
        if sum(bool(x) for x in (args.source, args.releases, args.tags)) != 1:
            raise HarnessError(
                "give one of --source DIR --good REV --bad REV, --releases OLD..NEW and --tags bOLD..bNEW"
            )
        if args.source and not (args.good and args.bad):
            raise HarnessError("--source needs --good REV and --bad REV")
        if args.fixed and not args.tags:
            raise HarnessError("--fixed goes with --tags (for a checkout, swap --good and --bad's meaning yourself)")
        plan = _plan(args)
        plan.fixed = args.fixed
        if args.source:
            plan.source, plan.good, plan.bad = str(Path(args.source).resolve()), args.good, args.bad
            prepare_checkout(plan)
        index = "releases" if args.releases else "tags" if args.tags else None
        run_dir = _run_dir(args)
        plan.save(run_dir)
    print(f"bisect: judging {plan.describe()}; log: {run_dir / 'bisect-log.jsonl'}", file=sys.stderr)
    outcome: Outcome | None = None
    stop: Stop | None = None
    try:
        if index == "releases":
            outcome = bisect_releases(plan, args.releases, run_dir)
        elif index == "tags":
            outcome = bisect_tags(plan, args.tags, run_dir)
        else:
            outcome = bisect_checkout(plan, run_dir)
    except Stop as err:
        stop = err
    except KeyboardInterrupt:
        print(
            f"specharness: bisect interrupted; the checkout is back where it started. Continue with: "
            f"specharness bisect --resume {run_dir}",
            file=sys.stderr,
        )
        return interrupt.status()
    with interrupt.deferred():  # the result of a finished bisect is written in full
        interrupt.phase("writing")
        html = write(run_dir, plan, outcome, stop)
    print(describe(outcome, stop))
    print(f"report: {html}")
    return EXIT_FOUND if outcome else EXIT_NOT_FOUND


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness bisect`."""
    p = sub.add_parser("bisect", help="find the llama.cpp commit or release that made a case fail (git bisect run)")
    where = p.add_argument_group("what to bisect")
    where.add_argument("--source", type=Path, metavar="DIR", help="llama.cpp git checkout (must be clean)")
    where.add_argument("--good", metavar="REV", help="a commit where the case passes")
    where.add_argument("--bad", metavar="REV", help="a later commit where it fails")
    where.add_argument(
        "--releases",
        metavar="OLD..NEW",
        help="instead of a checkout: the llama.cpp trees vendored in these llama-cpp-python releases",
    )
    where.add_argument(
        "--tags",
        metavar="bOLD..bNEW",
        help="instead of a checkout: upstream llama.cpp tags from the package index (log2 of the range built)",
    )
    where.add_argument(
        "--fixed",
        action="store_true",
        help="with --tags: find the tag that made the case pass (the older tag fails, the newer passes)",
    )
    where.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted bisect from its log")
    case = p.add_argument_group("the judged case (every dimension pinned)")
    case.add_argument("--suite", metavar="NAME|PATH", help="suite of the case")
    case.add_argument(
        "--from-run",
        type=Path,
        metavar="RUN_DIR",
        help="take suite, cell and failing checks of --case from a run directory",
    )
    case.add_argument(
        "--case", metavar="ID", help="case name (a chat turn: name.turnN); needed unless the suite has one"
    )
    case.add_argument(
        "--check",
        metavar="NAME[,NAME...]",
        help="the checks that judge (default: the suite's, or the failing ones of --from-run)",
    )
    case.add_argument("--mode", help="seq, par or no-kv-unified (default: the suite's only one)")
    case.add_argument("--spec", metavar="CONFIG", help="speculative config (default: the suite's only one)")
    case.add_argument("--model", metavar="NAME|PATH", help="model (default: the suite's only one)")
    case.add_argument(
        "--strict", action="store_true", help="a divergence triage proves to be a near-tie counts as bad too"
    )
    build = p.add_argument_group("building each step")
    build.add_argument(
        "--backend", choices=BACKENDS, default="cpu", help="what llama-server is built for (default cpu)"
    )
    build.add_argument(
        "--cmake-arg", action="append", default=[], metavar="ARG", help="extra CMake argument (repeatable)"
    )
    build.add_argument("--jobs", type=count(1), metavar="N", help="parallel compile jobs (default: all cores)")
    build.add_argument(
        "--step-cmd",
        metavar="CMD",
        help="shell command that builds llama-server in the checkout "
        "instead of specharness (run at every step; a failure twice skips the commit)",
    )
    build.add_argument(
        "--server-bin-pattern",
        metavar="GLOB",
        help="where --step-cmd's llama-server appears, relative to the checkout (e.g. build/bin/llama-server)",
    )
    p.add_argument("--out", metavar="DIR", help="run directory (default reports/<run-id>)")
    p.set_defaults(func=cmd_bisect)
    accept_cmake_definitions(p)
