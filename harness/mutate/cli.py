"""`specharness mutate`: how much of llama.cpp's speculative code the harness guards (a mutation score).

Exit status: 0 the campaign was judged and its report written, 2 bad input, 3 a harness error (e.g. the unmutated
build fails the battery), 130 interrupted by Ctrl-C, 143 by SIGTERM (the tree is clean; `--resume DIR` goes on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import interrupt
from harness.argtypes import count, csv
from harness.backends.build import source_identity, vendored_source
from harness.errors import HarnessError
from harness.execute.run_options import new_run_dir, prepare_out
from harness.mutate.battery import STAGE1, server_suites
from harness.mutate.campaign import PLAN_FILE, TAGGED, VENDORED, Campaign, Judge, append_result, read_results
from harness.mutate.generate import pool, sample
from harness.mutate.score import load_judgements, score, write_report
from harness.mutate.targets import DEFAULT_TARGETS, parse_target
from harness.mutate.tree import MutationTree
from harness.paths import reports_dir

DEFAULT_SAMPLE = 20


def _source(args: argparse.Namespace) -> tuple[Path, str]:
    if args.source and args.tag:
        raise HarnessError("give --source DIR or --tag bN, not both")
    if args.tag:
        from harness.backends.build.tags import resolve_tag, tag_source

        tag = resolve_tag(args.tag)
        return tag_source(tag), tag
    source = Path(args.source).expanduser() if args.source else vendored_source()
    if not (source / "CMakeLists.txt").is_file():
        raise HarnessError(f"--source {source}: not a llama.cpp source tree (no CMakeLists.txt)")
    return source, ""


def _stages(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    known = server_suites()
    stage1 = csv(args.stage1) or list(STAGE1)
    if args.stage2 is None:
        stage2 = [s for s in known if s not in stage1]
    else:
        stage2 = [s for s in csv(args.stage2) if s != "none"]
    unknown = [s for s in stage1 + stage2 if s not in known]
    if unknown:
        raise HarnessError(f"no llama-server suite named {', '.join(unknown)} (known: {', '.join(known)})")
    return stage1, stage2


def _new_campaign(args: argparse.Namespace) -> tuple[Campaign, Path]:
    source, tag = _source(args)
    targets = tuple(parse_target(t) for t in args.target) if args.target else DEFAULT_TARGETS
    stage1, stage2 = _stages(args)
    mutants = pool(source, targets)
    if args.list:
        for t in targets:
            print(f"{t.describe()}: {sum(1 for m in mutants if m.file == t.file)} mutants")
        print(f"{len(mutants)} mutants in all")
        raise SystemExit(0)
    chosen = sample(mutants, args.sample, args.seed)
    campaign = Campaign(
        source=TAGGED if tag else VENDORED if args.source is None else str(source.resolve()),
        identity=str(source_identity(source)),
        targets=[t.describe() for t in targets],
        seed=args.seed,
        sample=args.sample,
        pool_size=len(mutants),
        mutants=[m.to_json() for m in chosen],
        stage1=stage1,
        stage2=stage2,
        tag=tag,
        peers=not args.no_peers,
        coverage=not args.no_coverage,
    )
    run_dir = prepare_out(Path(args.out) if args.out else new_run_dir(reports_dir())).resolve()
    if (run_dir / PLAN_FILE).exists():
        raise HarnessError(f"{run_dir} already holds a campaign (continue it with --resume {run_dir})")
    campaign.save(run_dir)
    return campaign, run_dir


def cmd_mutate(args: argparse.Namespace) -> int:
    if args.resume:
        run_dir = Path(args.resume).resolve()
        campaign = Campaign.load(run_dir)
    else:
        campaign, run_dir = _new_campaign(args)
    judgements = load_judgements()
    tree = MutationTree(campaign.tree_source())
    print(f"mutate: {len(campaign.mutants)} of {campaign.pool_size} mutants (seed {campaign.seed}); {run_dir}")
    try:
        with tree.held():
            judge = Judge(campaign, run_dir, tree, keep_builds=args.keep_builds)
            done = {r["id"] for r in read_results(run_dir)}
            todo = [m for m in campaign.sampled() if m.id not in done]
            for i, mutant in enumerate(todo, len(done) + 1):
                print(f"mutate: [{i}/{len(campaign.mutants)}] {mutant.id} {mutant.file}:{mutant.line}", flush=True)
                record = judge.judge(mutant)
                append_result(run_dir, record)
                print(f"mutate:   {_outcome(record)}", flush=True)
    except KeyboardInterrupt:
        print(
            f"specharness: mutate interrupted; the llama.cpp tree is clean. Continue with: "
            f"specharness mutate --resume {run_dir}",
            file=sys.stderr,
        )
        return interrupt.status()
    records = read_results(run_dir)
    with interrupt.deferred():
        interrupt.phase("report")
        html = write_report(run_dir, campaign, records, judgements)
    print(f"mutate: {score(records, judgements).line()}")
    print(f"report: {html}")
    return 0


def _outcome(record: dict) -> str:
    status = record["status"]
    if status == "killed":
        where = record["cell"] and "-".join(record["cell"][k] for k in ("mode", "spec", "model"))
        by = f"{record['suite']}: {record['check']} ({where})"
        return f"killed in stage {record['stage']} by {by}: {record['signature']}"
    if status in ("stillborn", "error"):
        return f"{status}: {record.get('reason', '')}"
    if record.get("reached") is False:
        return f"survived: no run executes line {record['line']} (built, not served)"
    skipped = record.get("unreached_suites") or []
    met = f", {len(record['runs'])} suites run, {len(skipped)} never execute its line" if skipped else ""
    return f"survived ({record['seconds']:.0f} s{met})"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness mutate`."""
    p = sub.add_parser("mutate", help="mutation score: mutate llama.cpp's speculative code, count what the suites kill")
    p.add_argument("--source", metavar="DIR", help="llama.cpp tree to mutate (default: the vendored one; never edited)")
    p.add_argument("--tag", metavar="bN", help="instead of --source: an upstream tag from the package index")
    p.add_argument(
        "--target",
        action="append",
        metavar="FILE[:A-B,...]",
        help="file (and line ranges) to mutate, repeatable (default: common/speculative.cpp, the speculative "
        "functions of common/sampling.cpp, the speculative lines of tools/server/server-context.cpp)",
    )
    p.add_argument("--sample", type=count(1), default=DEFAULT_SAMPLE, metavar="N", help="mutants to judge (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    p.add_argument("--stage1", metavar="SUITE[,SUITE...]", help="stage 1 suites (default quicksort: the default job)")
    p.add_argument(
        "--stage2", metavar="SUITE[,SUITE...]|none", help="stage 2 suites (default: every other llama-server suite)"
    )
    p.add_argument(
        "--no-peers",
        action="store_true",
        help="leave out llama.cpp's own server tests of speculation (run offline on each compiled mutant by default)",
    )
    p.add_argument(
        "--no-coverage",
        action="store_true",
        help="build and serve every mutant, also those on lines no run executes (measured once by default)",
    )
    p.add_argument("--list", action="store_true", help="only count the mutants of each target")
    p.add_argument("--keep-builds", action="store_true", help="keep each mutant's llama-server in the build cache")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted campaign")
    p.add_argument("--out", metavar="DIR", help="campaign directory (default reports/<run-id>)")
    p.set_defaults(func=cmd_mutate)
