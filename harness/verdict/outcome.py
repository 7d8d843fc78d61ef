"""A verdict on one llama.cpp build from its checks' results: GOOD, BAD or SKIP (`specharness bisect`'s steps and
release walks use it; the rule lives here only).

Only the checks that gave a verdict decide. A check that gave none because it does not apply to the cell
(`mode-invariant` of the seq cell, `lossless` of a case sampled with a random seed, `repeat-identical` of a suite
with one round) is not required of it: the same at every commit, it shows the pinned failure at none. In order:

- `skip`: the harness could not judge the build (a harness error), unless llama.cpp crashed with the pinned
  signature;
- `bad`: a check failed with the pinned failure's signature (harness.verdict.signature; none pinned: any
  failure), llama.cpp crashing included, at start-up too;
- `skip`: the cell was not served (`no-crash`, always judged, gave no verdict: the model lacks what the
  speculative config needs, or no request was sent);
- `skip`: a check failed with another signature (another defect at this commit says nothing about the pinned
  one);
- `skip`: a pinned signature's check gave no verdict, so this build cannot say whether it fails that way. A
  signature's check is the one it names (`kv-healthy: duplicate cells`: kv-healthy; a crash, a timeout or another
  error: no-crash); where that check is not judged (a `kv-corrupt` divergence of lossless, pinned as kv-healthy's
  damage without kv-healthy), every judged check but no-crash could show it, and one of them must give a verdict;
- `bad`: with `strict`, a comparison that passed only by excusing proven near-ties;
- `good`: every check that gave a verdict passed.

A bisect judges the failing end first, so every other step, the passing end included, is judged against the
failure it pinned there.
"""

from __future__ import annotations

from typing import Any

from harness.verdict.check_result import CheckResult
from harness.verdict.signature import CRASH, ERROR, TIMEOUT, signature_of

GOOD, BAD, SKIP = "good", "bad", "skip"
SERVED_BY = "no-crash"
"""The check always judged: it gives a verdict whenever the cell was served."""


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
    crashed = next((r for r in ours if r.name == SERVED_BY), None)
    if faults and crashed is None:
        first = faults[0]
        return {"verdict": SKIP, "reason": f"harness error in {first.name}: {_line(first.message)}", **out}
    if ours:
        first = crashed or ours[0]
        kind = divergence_kind(first)
        reason = f"{first.name} failed" + (f" ({kind})" if kind else "") + f": {_line(first.message)}"
        return {"verdict": BAD, "reason": reason, **out}
    served = next((r for r in results if r.name == SERVED_BY), None)
    if served is not None and not served.is_verdict:
        return {"verdict": SKIP, "reason": f"the cell was not served: {_line(served.message)}", **out}
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
    for signature in pinned or []:
        silent = unjudged_showing(signature, results)
        if silent is not None:
            reason = (
                f"{silent.name} gave no verdict, so this build cannot show the pinned failure ({signature}): "
                f"{_line(silent.message)}"
            )
            return {"verdict": SKIP, "reason": reason, **out}
    near = [r.name for r in results if near_ties_only(r)]
    if near and strict:
        return {"verdict": BAD, "reason": f"{', '.join(near)}: near-tie divergences (counted with --strict)", **out}
    reason = f"passed ({', '.join(near)}: proven near-ties, excused as `run` excuses them)" if near else "passed"
    return {"verdict": GOOD, "reason": reason, **out}


def check_of(signature: str) -> str:
    """The check a signature names: `kv-healthy: duplicate cells` kv-healthy's; a crash, a timeout or another
    error no-crash's."""
    head = signature.split(":", 1)[0]
    return SERVED_BY if head in (CRASH, TIMEOUT, ERROR) else head


def unjudged_showing(signature: str, results: list[CheckResult]) -> CheckResult | None:
    """Where no judged check that can show `signature` gave a verdict, the first of them (None when one did): the
    check the signature names, or, where that one is not judged, every judged check but no-crash (no-crash when
    it is the only one)."""
    named = [r for r in results if r.name == check_of(signature)]
    showing = named or [r for r in results if r.name != SERVED_BY] or results
    return None if not showing or any(r.is_verdict for r in showing) else showing[0]


def _line(message: str) -> str:
    return (message.strip().splitlines() or [""])[0]
