"""Judging one llama-server build on the pinned cell: the harness's own checks and triage decide.

The judged checks are the pinned ones with `no-crash` always among them (a build whose every request crashes
gives a comparison check nothing to compare, which must not read as good). A verdict is:
- `bad`: a check failed (a divergence triage proves to be a `near-tie` counts only with `strict`), llama.cpp
  crashing included, at start-up too (an assert in llama-server's warm-up is a failed `no-crash`);
- `skip`: a judged check gave no verdict (not run, e.g. no request completed without a crash to blame) or the
  harness could not judge the build (a harness error: a start-up timeout, a flag the build lacks), so this build
  says nothing about the case;
- `good`: every judged check passed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.backends.build import BuildInfo
from harness.backends.server_backend import ServerBackend
from harness.baselines import BaselineStore
from harness.bisect.plan import BACKEND, Plan
from harness.checks import evaluate_cell
from harness.checks.base import CheckResult
from harness.execute import ExecOptions, Executor, case_keys

GOOD, BAD, SKIP = "good", "bad", "skip"


def divergence_kind(result: CheckResult) -> str | None:
    """The triage class of a comparison check's first divergence (None when it has none)."""
    first = result.evidence.get("first_divergence")
    return first.get("kind") if isinstance(first, dict) else None


def excused(result: CheckResult, strict: bool) -> bool:
    """A failing verdict that is not a regression (unless strict): every divergence it failed on is a proven
    near-tie (one line per failing output in `failures`, e.g. "round 0: near-tie at token 12")."""
    if result.passed or strict or divergence_kind(result) != "near-tie":
        return False
    return all(": near-tie at token " in line for line in result.failures)


def check_record(result: CheckResult, strict: bool) -> dict[str, Any]:
    """A check verdict as it goes into the bisect log and report."""
    if not result.is_verdict:
        status = result.status
    else:
        status = "passed" if result.passed else "near-tie (excused)" if excused(result, strict) else "failed"
    return {
        "check": result.name,
        "passed": result.passed and result.is_verdict,
        "status": status,
        "message": result.message,
        "evidence": result.evidence,
    }


def judged_checks(plan: Plan) -> list[str]:
    """The checks a step judges: `no-crash` first, then the pinned ones."""
    return list(dict.fromkeys(["no-crash", *plan.checks]))


def judge(plan: Plan, build: BuildInfo, logs: Path) -> dict[str, Any]:
    """Run the pinned case on `build` (server logs into `logs`) and return {verdict, reason, checks}."""
    suite = plan.load_suite()
    case_def = next(c for c in suite.cases if plan.case in case_keys(c))
    suite = replace(suite, cases=[case_def])
    kv_scan = "request" if "kv-healthy" in plan.checks else "off"  # a scan nobody judges could only get in the way
    executor = Executor(
        ExecOptions(backends={BACKEND: lambda: ServerBackend(build=build, run_dir=logs)}, kv_scan=kv_scan)
    )
    run = executor.run(suite, plan.cell)
    repro = (
        f"specharness run --suite {plan.suite} --backend {BACKEND} --mode {plan.mode} --spec {plan.spec} "
        f"--model {plan.model} --server-bin {build.server_bin}"
    )
    baselines = BaselineStore(Path(plan.baselines))
    results = [r for _, r in evaluate_cell(run, executor, baselines, judged_checks(plan), repro, [plan.case])]
    return verdict_of(results, plan.strict)


def verdict_of(results: list[CheckResult], strict: bool) -> dict[str, Any]:
    """{verdict, reason, checks} of one step's results (see the module docstring)."""
    checks = [check_record(r, strict) for r in results]
    faults = [r for r in results if r.harness_error is not None]
    failed = [r for r in results if r.is_verdict and not r.passed and not excused(r, strict)]
    crashed = next((r for r in failed if r.name == "no-crash"), None)
    if faults and crashed is None:
        first = faults[0]
        return {"verdict": SKIP, "reason": f"harness error in {first.name}: {_line(first.message)}", "checks": checks}
    if failed:
        first = crashed or failed[0]
        kind = divergence_kind(first)
        reason = f"{first.name} failed" + (f" ({kind})" if kind else "") + f": {_line(first.message)}"
        return {"verdict": BAD, "reason": reason, "checks": checks}
    unjudged = [r for r in results if not r.is_verdict]
    if unjudged:
        first = unjudged[0]
        return {"verdict": SKIP, "reason": f"{first.name} gave no verdict: {_line(first.message)}", "checks": checks}
    near = [r.name for r in results if excused(r, strict)]
    reason = f"passed ({', '.join(near)}: near-tie divergence, excused without --strict)" if near else "passed"
    return {"verdict": GOOD, "reason": reason, "checks": checks}


def _line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]
