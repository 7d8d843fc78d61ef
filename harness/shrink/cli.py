"""`specharness shrink` and `specharness repro`: the smallest case that still fails with the same signature,
and the reproducer bundle of a failing case (repro.sh, repro.py, ISSUE.md).

Exit status: 0 a bundle was written (the failure reproduced: the same signature), 1 the failure did not
reproduce (every run passed), 4 a different failure showed instead (no bundle), 2 bad input, 130 interrupted
by Ctrl-C, 143 by SIGTERM (the smallest case found so far is still written).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness import interrupt
from harness.argtypes import count, csv
from harness.bisect.plan import failing_records
from harness.errors import HarnessError
from harness.execute.run_options import new_run_dir, prepare_out, run_defaults
from harness.matrix import Cell
from harness.paths import reports_dir
from harness.report.files import status
from harness.repro.rate import HOLD, RATE_RUNS, comparable, is_comparable
from harness.shrink.candidate import Candidate, initial
from harness.shrink.failure_id import parse as parse_failure_id
from harness.shrink.trial import BASELINE_CHECKS, Policy, Runner, Trial, reference_of
from harness.signatures import classify

EXIT_WRITTEN, EXIT_NOT_REPRODUCED, EXIT_DIFFERENT = 0, 1, 4


def _load(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HarnessError(f"{path.parent} is not a complete run directory: no {path.name} ({what})") from None
    except (OSError, ValueError) as err:
        raise HarnessError(f"unreadable {path}: {' '.join(str(err).split())}") from None


def take_failure_id(args: argparse.Namespace, records: list[dict]) -> str | None:
    """Fill `args.case` and the cell flags from a printed failure ID (`args.failure`, the positional argument); its
    suite, or None without an ID. A flag given beside the ID must agree with it."""
    text = getattr(args, "failure", None)
    if not text:
        if args.case is None:
            raise HarnessError(
                "name the failing case: its failure ID as the console prints it "
                "(e.g. categories[code_python-par-draft-simple-tiny-hybrid-server]), or --case ID"
            )
        return None
    parsed = parse_failure_id(text, records)
    for name, value in (("case", parsed.case), *parsed.cell.items()):
        given = getattr(args, name, None)
        if given is not None and given != value:
            raise HarnessError(f"--{name} {given} contradicts the failure ID {text} ({name} {value})")
        setattr(args, name, value)
    return parsed.suite


def _no_suite(run_dir: Path, args: argparse.Namespace, suite: str, failing: list[dict]) -> list[dict]:
    raise HarnessError(
        f"case '{args.case}' did not fail in suite '{suite}' of {run_dir} (it failed in: "
        f"{', '.join(sorted({str(v.get('suite')) for v in failing}))})"
    )


class Origin:
    """The failing verdict a shrink starts from: its run, cell, check, signature and the run's options."""

    def __init__(self, args: argparse.Namespace, what: str):
        run_dir = Path(args.from_run)
        self.meta = _load(run_dir / "run.json", "what ran")
        self.results = _load(run_dir / "results.json", "the requests")
        self.checks = _load(run_dir / "checks.json", "the verdicts")
        suite = take_failure_id(args, self.checks)
        failing = failing_records(
            run_dir,
            args.case,
            csv(args.check),
            what=what,
            mode=args.mode,
            spec=args.spec,
            model=args.model,
            backend=args.backend,
        )
        if suite is not None:
            failing = [v for v in failing if v.get("suite") == suite] or _no_suite(run_dir, args, suite, failing)

        def requests(v: dict) -> list[dict]:
            return [
                r
                for r in self.results
                if all(r.get(k) == v.get(k) for k in ("suite", "case", "model", "backend", "mode", "spec"))
            ]

        own = [v for v in failing if not classify(v, requests(v)).consequence]
        self.verdict = (own or failing)[0]
        self.signature = classify(self.verdict, requests(self.verdict)).text
        v = self.verdict
        self.cell = Cell(v["backend"], v["mode"], v["spec"], v["model"])
        self.check = v["check"]
        self.suite = (self.meta.get("suites") or {}).get(v["suite"]) or v["suite"]
        self.options = argparse.Namespace(**{**run_defaults(), **(self.meta.get("options") or {})})
        self.server_bin = args.server_bin or self.options.server_bin
        self.source = args.source or self.options.source
        self.describe = f"{v['suite']}[{v['case']}-{self.cell.id}] {self.check}: {self.signature}"

    def pattern(self) -> str | None:
        """The run's failure pattern of this signature, as one reading plus its axes."""
        from harness.signatures.group import case_key
        from harness.signatures.pattern import failure_patterns

        for failure, p in failure_patterns(self.checks, self.results, self.meta, lambda v: status(v) == "failed"):
            if any(  # its signature, as the run grouped it (a text in unrelated cells is keyed by where it shows)
                v.get("check") == self.check and case_key(v) == case_key(self.verdict)
                for v in failure.verdicts + failure.consequences
            ):
                axes = [
                    f"- {axis}: " + ", ".join(f"{value} {state}" for value, state in values.items())
                    for axis, values in p.axes.items()
                ]
                return "\n".join([p.reading, "", *axes])
        return None


def _measure(runner: Runner, candidate: Candidate, tries: int) -> tuple[int, int, list]:
    """(shown, runs, attempts): `tries` runs of `candidate`, and up to RATE_RUNS when they disagree."""
    attempts = [runner.attempt(candidate) for _ in range(tries)]
    shown = sum(a.shows(runner.signature) for a in attempts)
    if 0 < shown < tries:  # intermittent: measure its rate on more runs
        attempts += [runner.attempt(candidate) for _ in range(max(0, RATE_RUNS - tries))]
        shown = sum(a.shows(runner.signature) for a in attempts)
    return shown, len(attempts), attempts


def _reproduce(runner: Runner, start: Candidate, tries: int, say) -> tuple[Policy, list]:
    """Run the original case `tries` times, and up to RATE_RUNS when they disagree: its rate decides each step's
    policy (harness.repro.rate.comparable: a smaller case must reproduce at a comparable rate) and how many runs
    its repro.sh makes."""
    shown, runs, attempts = _measure(runner, start, tries)
    if shown == 0:
        seen = sorted({s for a in attempts for s in a.signatures})
        if seen:
            raise NotReproduced(
                f"a different failure: {'; '.join(seen)} (the signature {runner.signature} showed in 0 of {tries} "
                "runs)",
                EXIT_DIFFERENT,
            )
        raise NotReproduced(f"not reproduced: every one of {tries} runs passed (signature {runner.signature})")
    policy = Policy(1, 1) if shown == runs else Policy(*comparable(shown, runs))
    runner.rate = (shown, runs)
    say(
        f"shrink: the original case shows the signature {shown} of {runs} runs: "
        + (
            "in every run, so each step runs once and the shrunk case's rate is measured at the end"
            if shown == runs
            else f"intermittent, a step holds when it shows the signature {policy} runs (a comparable rate: a case "
            f"reproducing at {shown}/{runs} holds with probability >= {HOLD:.0%})"
        )
    )
    return policy, attempts


def _settle(runner: Runner, shrinker, tries: int, say) -> tuple[Trial, tuple[int, int] | None]:
    """The smallest kept case whose measured rate is comparable to the original's (harness.repro.rate.
    is_comparable), with that rate: the shrunk case when it is; otherwise a bisection of the kept steps (the
    original is comparable by definition), each measured with `_measure`. A step that held once may have held by
    luck: this is what keeps a shrink from drifting to a rarer failure than the original's."""
    kept, original = shrinker.kept, runner.rate
    if len(kept) == 1 or original is None:
        return kept[0], original
    runs_before = runner.count

    def measure(i: int) -> tuple[bool, tuple[int, int]]:
        shown, runs, attempts = _measure(runner, kept[i].candidate, tries)
        ok = is_comparable((shown, runs), original)
        k, n = comparable(*original)
        say(
            f"shrink: kept step {i} of {len(kept) - 1} ({kept[i].candidate.describe()}) shows the signature {shown} "
            f"of {runs} runs: " + ("comparable" if ok else f"not comparable (the original: {k} of {n} at least)")
        )
        if ok:
            kept[i].attempts += attempts
        return ok, (shown, runs)

    last = len(kept) - 1
    ok, rate = measure(last)
    if ok:
        say(f"shrink: the shrunk case's rate measured in {runner.count - runs_before} runs")
        return kept[last], rate
    good, good_rate, bad = 0, original, last
    while bad - good > 1:
        mid = (good + bad) // 2
        ok, rate = measure(mid)
        if ok:
            good, good_rate = mid, rate
        else:
            bad = mid
    say(
        f"shrink: back to kept step {good} of {last}, the smallest case at a comparable rate "
        f"({runner.count - runs_before} runs to find it)"
    )
    return kept[good], good_rate


class NotReproduced(Exception):
    """The original case did not show its signature: `status` EXIT_NOT_REPRODUCED (it passed) or EXIT_DIFFERENT."""

    def __init__(self, message: str, status: int = EXIT_NOT_REPRODUCED):
        super().__init__(message)
        self.status = status


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cmd_shrink(args: argparse.Namespace, shrink: bool = True) -> int:
    from harness.repro.write import write_bundle
    from harness.shrink.driver import Shrinker, require_shrinkable

    origin = Origin(args, "shrink" if shrink else "reproduce")
    if shrink:
        require_shrinkable(
            origin.check, reference_of(origin.options, origin.server_bin, origin.source, origin.cell.backend)
        )
    start = initial(origin.suite, args.case, origin.check, origin.cell)
    out = prepare_out(Path(args.out) if args.out else new_run_dir(reports_dir()))
    _say(f"shrink: {origin.describe}")
    stopped = None
    with tempfile.TemporaryDirectory(prefix="specharness-shrink-") as logs:
        runner = Runner(
            origin.options, origin.server_bin, origin.source, origin.signature, Policy(), Path(logs), origin=start
        )
        try:
            runner.policy, attempts = _reproduce(runner, start, args.tries, _say)
        except NotReproduced as err:
            _say(f"shrink: {err}")
            return err.status
        except KeyboardInterrupt:
            _say("shrink: interrupted before the failure was reproduced; nothing written")
            return interrupt.status()
        if args.reproduce:
            runner.policy = args.reproduce
        best, trial = start, Trial(start, attempts, holds=True)
        shrinker = None
        if shrink:
            shrinker = Shrinker(runner, trial, out / "shrink-log.jsonl", _say, args.time_limit)
            best = shrinker.run()
            trial, stopped = shrinker.best_trial, shrinker.stopped
        rate = runner.rate
        if shrinker is not None and not interrupt.received():
            try:
                trial, rate = _settle(runner, shrinker, args.tries, _say)
                best = trial.candidate
            except KeyboardInterrupt:  # the smallest case, its rate not measured: the original's is written
                stopped = "interrupted"
        with interrupt.deferred():  # the bundle of the smallest case so far is written in full
            interrupt.phase("writing")
            attempt = trial.showing(origin.signature)
            note = _summary(start, best, runner, shrinker, args.from_run)
            build = runner.build() if best.cell.backend == "server" else None
            files = write_bundle(
                out, best, attempt, build, origin.options.draft_model, origin.pattern(), note, rate=rate
            )
            stopped = stopped or ("interrupted" if interrupt.received() else None)
            (out / "shrink.json").write_text(
                json.dumps(
                    {
                        "from_run": str(args.from_run),
                        "signature": origin.signature,
                        "policy": str(runner.policy),
                        "rate": {"original": list(runner.rate or ()), "bundle": list(rate or ())},
                        "original": start.to_json(),
                        "final": best.to_json(),
                        "trials": runner.count,
                        "seconds": round(shrinker.elapsed(), 1) if shrinker else None,
                        "stopped": stopped,
                        "files": {k: str(v) for k, v in files.items()},
                    },
                    indent=1,
                )
                + "\n"
            )
    print(note)
    for name, path in files.items():
        print(f"{name}: {path}")
    if stopped:
        _say(f"shrink: stopped ({stopped}): the bundle holds the smallest failing case found")
    return interrupt.status() if stopped == "interrupted" else EXIT_WRITTEN


def _summary(start: Candidate, best: Candidate, runner: Runner, shrinker, run_dir) -> str:
    if shrinker is None:
        return f"Reproducer of a failing case of run {run_dir} (not shrunk: `specharness shrink` makes it smaller)."
    reference = reference_of(runner.options, runner.server_bin, runner.source, start.cell.backend)
    judged = (
        f" Each smaller case's `{start.check}` was judged against a baseline recorded for it {reference}."
        if start.check in BASELINE_CHECKS
        else ""
    )
    return (
        f"Shrunk by `specharness shrink` from run {run_dir} in {runner.count} trials, {shrinker.elapsed():.0f} s "
        f"(a step held when the signature showed {runner.policy} runs): {start.describe()} → {best.describe()}."
        + judged
    )


def cmd_repro(args: argparse.Namespace) -> int:
    if args.upstream:
        from harness.repro.upstream import write_upstream

        return write_upstream(args, cmd_shrink)
    if args.from_run is None:
        raise HarnessError("name the run with the failure (--from-run RUN_DIR), or a known failure (--upstream ID)")
    return cmd_shrink(args, shrink=False)


def _policy(text: str) -> Policy:
    try:
        k, n = (int(p) for p in text.split("/"))
    except ValueError:
        k = n = 0
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"expected K/N with 1 <= K <= N (e.g. 2/3), got '{text}'")
    return Policy(k, n)


def _common(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "failure",
        nargs="?",
        metavar="FAILURE_ID",
        help="the failure as the console and the report print it, e.g. "
        "categories[code_python-par-draft-simple-tiny-hybrid-server] (instead of --case and the cell flags)",
    )
    p.add_argument("--from-run", type=Path, required=required, metavar="RUN_DIR", help="run directory with the failure")
    p.add_argument("--case", metavar="ID", help="the failing case (a chat turn: name.turnN)")
    p.add_argument(
        "--check",
        metavar="NAME",
        help="the failing check whose signature is kept (default: the case's "
        "first failure that is not a consequence of another)",
    )
    for axis in ("mode", "spec", "model", "backend"):
        p.add_argument(f"--{axis}", help=f"the failing cell's {axis}, when the case failed in several")
    p.add_argument("--server-bin", type=Path, metavar="PATH", help="llama-server binary (default: the run's)")
    p.add_argument(
        "--source", type=Path, metavar="DIR", help="llama.cpp tree to build llama-server from (default: the run's)"
    )
    p.add_argument(
        "--tries",
        type=count(1),
        default=3,
        help="runs of the original case that measure how often it fails, up to 10 when they disagree (default 3; "
        "1 takes the failure as deterministic: its repro.sh runs once)",
    )
    p.add_argument("--out", metavar="DIR", help="where the bundle goes (default reports/<run-id>)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness shrink` and `specharness repro`."""
    p = sub.add_parser("shrink", help="delta-debug a failing case down to the smallest one with the same signature")
    _common(p)
    p.add_argument(
        "--reproduce",
        type=_policy,
        metavar="K/N",
        help="a step holds when K of N runs show the signature (default: 1/1 for a deterministic failure, "
        "1/tries for a nondeterministic one)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        metavar="S",
        help="stop after S seconds with the smallest failing case found (default 900)",
    )
    p.set_defaults(func=cmd_shrink)
    r = sub.add_parser("repro", help="write the reproducer bundle (repro.sh, repro.py, ISSUE.md) of a failing case")
    _common(r, required=False)
    r.add_argument(
        "--upstream",
        metavar="KNOWN_FAILURE",
        help="instead: serve the known failure's cells (suites/known-failures.yaml) on this build, bundle its first "
        "failure and write UPSTREAM.md, a report ready to post upstream (llama-server entries)",
    )
    r.set_defaults(func=cmd_repro, reproduce=None, time_limit=None)
