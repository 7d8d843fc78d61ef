"""Judging one llama-server build on the pinned cell: the harness's own checks and triage decide.

A verdict is `good` (every pinned check passed), `bad` (a check failed; a divergence triage proves to
be a `near-tie` counts only with `strict`) or `skip` (the cell could not be served: the server did not
start or stopped answering, so this build says nothing about the case).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.backends.build import BuildInfo
from harness.backends.server_backend import ServerBackend
from harness.baselines import BaselineStore
from harness.bisect.plan import BACKEND, Plan
from harness.checks import evaluate
from harness.checks.base import CheckContext, CheckResult
from harness.detok import detokenizer
from harness.execute import ExecOptions, Executor, case_keys
from harness.models import resolve

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
    status = "passed" if result.passed else "near-tie (excused)" if excused(result, strict) else "failed"
    return {
        "check": result.name,
        "passed": result.passed,
        "status": status,
        "message": result.message,
        "evidence": result.evidence,
    }


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
    ctx = CheckContext(
        run,
        plan.case,
        executor,
        BaselineStore(Path(plan.baselines)),
        detokenizer(resolve(plan.model).path) if run.error is None else str,
        repro,
    )
    results = evaluate(ctx, plan.checks)
    errors = [f"{r.cell.id}: {r.error}" for r in executor.runs() if r.error]  # reference cells run on demand
    checks = [check_record(r, plan.strict) for r in results]
    if errors:
        return {"verdict": SKIP, "reason": f"llama-server could not serve the case: {errors[0]}", "checks": checks}
    failed = [r for r in results if not r.passed and not excused(r, plan.strict)]
    if failed:
        first = failed[0]
        kind = divergence_kind(first)
        reason = f"{first.name} failed" + (f" ({kind})" if kind else "") + f": {first.message.splitlines()[0]}"
        return {"verdict": BAD, "reason": reason, "checks": checks}
    near = [r.name for r in results if excused(r, plan.strict)]
    reason = f"passed ({', '.join(near)}: near-tie divergence, excused without --strict)" if near else "passed"
    return {"verdict": GOOD, "reason": reason, "checks": checks}
