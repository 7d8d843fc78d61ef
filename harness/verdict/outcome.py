"""A verdict on one llama.cpp build from its checks' results: GOOD, BAD or SKIP (`specharness bisect`'s steps and
release walks use it; the rule lives here only).

- `bad`: a check failed with the pinned failure's signature (harness.verdict.signature; none pinned: any
  failure), llama.cpp crashing included, at start-up too; with `strict`, also a comparison that passed only by
  excusing proven near-ties;
- `skip`: a check failed with another signature (another defect at this commit says nothing about the pinned
  one), a judged check gave no verdict (not run), or the harness could not judge the build (a harness error);
- `good`: every judged check passed.
"""

from __future__ import annotations

from typing import Any

from harness.verdict.check_result import CheckResult
from harness.verdict.signature import signature_of

GOOD, BAD, SKIP = "good", "bad", "skip"


def divergence_kind(result: CheckResult) -> str | None:
    """The triage class of a comparison check's first divergence (None when it has none)."""
    first = result.evidence.get("first_divergence")
    return first.get("kind") if isinstance(first, dict) else None


def near_ties_only(result: CheckResult) -> bool:
    """A passing comparison that excused proven near-ties (`--strict` counts it as bad)."""
    return result.passed and result.is_verdict and bool(result.evidence.get("near_ties"))


def check_record(result: CheckResult, strict: bool, signature: str | None = None) -> dict[str, Any]:
    """A check verdict as it goes into the bisect log and report."""
    if not result.is_verdict:
        status = result.status
    else:
        status = "failed" if not result.passed or (strict and near_ties_only(result)) else "passed"
    return {
        "check": result.name,
        "passed": result.passed and result.is_verdict,
        "status": status,
        "message": result.message,
        "evidence": result.evidence,
        **({"signature": signature} if signature else {}),
    }


def verdict_of(
    results: list[CheckResult], strict: bool, pinned: list[str] | None = None, records: list[dict] | None = None
) -> dict[str, Any]:
    """{verdict, reason, checks, signatures} of one step's results (see the module docstring); `pinned`: the
    signatures a failure must have to be bad (none: any failure is), `records` the case's requests (their errors
    name a crash's signature)."""
    failed = [r for r in results if r.is_verdict and not r.passed]
    signatures = {id(r): signature_of(r, records or []) for r in failed}
    checks = [check_record(r, strict, signatures.get(id(r))) for r in results]
    out = {"checks": checks, "signatures": sorted(set(signatures.values()))}
    faults = [r for r in results if r.harness_error is not None]
    ours = [r for r in failed if not pinned or signatures[id(r)] in pinned]
    crashed = next((r for r in ours if r.name == "no-crash"), None)
    if faults and crashed is None:
        first = faults[0]
        return {"verdict": SKIP, "reason": f"harness error in {first.name}: {_line(first.message)}", **out}
    if ours:
        first = crashed or ours[0]
        kind = divergence_kind(first)
        reason = f"{first.name} failed" + (f" ({kind})" if kind else "") + f": {_line(first.message)}"
        return {"verdict": BAD, "reason": reason, **out}
    if failed:  # another defect than the pinned one: this build says nothing about it
        first = failed[0]
        return {
            "verdict": SKIP,
            "reason": (
                f"another failure than the pinned one: {first.name}: {signatures[id(first)]} (pinned: "
                f"{'; '.join(pinned or [])}): {_line(first.message)}"
            ),
            **out,
        }
    unjudged = [r for r in results if not r.is_verdict]
    if unjudged:
        first = unjudged[0]
        return {"verdict": SKIP, "reason": f"{first.name} gave no verdict: {_line(first.message)}", **out}
    near = [r.name for r in results if near_ties_only(r)]
    if near and strict:
        return {"verdict": BAD, "reason": f"{', '.join(near)}: near-tie divergences (counted with --strict)", **out}
    reason = f"passed ({', '.join(near)}: proven near-ties, excused as `run` excuses them)" if near else "passed"
    return {"verdict": GOOD, "reason": reason, **out}


def _line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]
