"""Judging one llama-server build on the pinned cell: the harness's own checks and triage decide.

The judged checks are the pinned ones with `no-crash` always among them (a build whose every request crashes
gives a comparison check nothing to compare, which must not read as good). The cell is served as `run` serves it
(every case of the suite on one session, the KV cache scanned after each request; the in-process engine scores
sampled tokens for `distribution`, as in `run`), and the pinned case judged.
Each check applies the one policy of `run` (a proven near-tie is excused only where numerics can move a token:
harness.checks.compare), so a step fails exactly where `run` would. The step's verdict (good, bad, skip) is
harness.verdict.outcome's, against the pinned failure's signatures (`Plan.signatures`: set from the run
the bisect started from, else from the bad end's own failure).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.backends.build import BuildInfo
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.bisect.plan import BACKEND, Plan
from harness.checks import evaluate_cell
from harness.execute import ExecOptions, Executor
from harness.verdict.baselines import BaselineStore
from harness.verdict.outcome import BAD, GOOD, SKIP, verdict_of

__all__ = ["BAD", "GOOD", "SKIP", "judge", "judged_checks", "verdict_of"]


def judged_checks(plan: Plan) -> list[str]:
    """The checks a step judges: `no-crash` first, then the pinned ones."""
    return list(dict.fromkeys(["no-crash", *plan.checks]))


def judge(plan: Plan, build: BuildInfo, logs: Path) -> dict[str, Any]:
    """Serve the pinned cell on `build` (server logs into `logs`), judge the pinned case; {verdict, reason,
    checks, signatures}."""
    suite = plan.load_suite()
    backends = {
        BACKEND: lambda: ServerBackend(build=build, run_dir=logs),
        "inproc": lambda: InprocBackend(logs / "engine-logs"),  # scores sampled tokens (`distribution`), as in run
    }
    executor = Executor(ExecOptions(backends=backends))
    run = executor.run(suite, plan.cell)
    repro = (
        f"specharness run --suite {plan.suite} --backend {BACKEND} --mode {plan.mode} --spec {plan.spec} "
        f"--model {plan.model} --server-bin {build.server_bin}"
    )
    baselines = BaselineStore(Path(plan.baselines))
    results = [r for _, r in evaluate_cell(run, executor, baselines, judged_checks(plan), repro, [plan.case])]
    records = [{"error": o.result.error, "stop_reason": o.result.stop_reason} for o in run.of_case(plan.case)]
    return verdict_of(results, plan.strict, plan.signatures, records)
