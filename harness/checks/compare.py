"""Comparing two outputs of the same case: match, or the first divergence with its triage."""

from typing import Optional

from harness.checks.base import CheckContext
from harness.execute import Outcome
from harness.logits import Tolerances
from harness.triage import Divergence, triage


def tolerances(ctx: CheckContext) -> tuple[Tolerances, dict]:
    """The suite's logits tolerances and the triage keywords (near-tie margin) it declares."""
    declared = dict(ctx.run.suite.tolerances)
    near_tie = declared.pop("near_tie", None)
    return Tolerances(**declared), ({"near_tie": near_tie} if near_tie is not None else {})


def divergence(ctx: CheckContext, ref_tokens: list[int], ref_logits: list, other: Outcome) -> Optional[Divergence]:
    """None when `other` produced exactly `ref_tokens`, else the triaged first divergence."""
    if ref_tokens == other.result.tokens:
        return None
    tol, triage_options = tolerances(ctx)
    return triage(ref_tokens, other.result.tokens, ref_logits or None, other.result.logits or None,
                  detokenize=ctx.detokenize, tol=tol, **triage_options)


def compare_outcome(ctx: CheckContext, reference: Optional[Outcome], label: str) -> tuple[bool, str, dict]:
    """Compare every completed outcome of this case with another outcome; (passed, message, evidence)."""
    if reference is None or not reference.result.ok:
        why = "missing" if reference is None else f"failed: {reference.result.error}"
        return (ctx.allowed(reference) if reference else False), f"{label} reference {why}", {}
    return compare_tokens(ctx, reference.result.tokens, reference.result.logits, label)


def compare_tokens(ctx: CheckContext, ref_tokens: list[int], ref_logits: list, label: str) -> tuple[bool, str, dict]:
    """Compare every completed outcome of this case with reference tokens; (passed, message, evidence)."""
    mine = ctx.completed()
    diffs = [(o, d) for o in mine if (d := divergence(ctx, ref_tokens, ref_logits, o)) is not None]
    evidence = {"compared": len(mine), "matching": len(mine) - len(diffs)}
    if not diffs:
        return True, "", evidence
    outcome, first = diffs[0]
    evidence["first_divergence"] = {
        "round": outcome.round, "index": first.index, "kind": first.kind, "reason": first.reason,
        "ref_token": first.ref_token, "other_token": first.other_token, "ref_text": first.ref_text,
        "other_text": first.other_text, "before": first.before, "margin": first.margin, "reference": label,
        "reference_tokens": list(ref_tokens), "tokens": list(outcome.result.tokens),
        "reference_margins": [None if p.margin is None else round(p.margin, 4) for p in ref_logits or []],
    }
    message = (f"{len(diffs)} of {len(mine)} outputs differ from the {label}; round {outcome.round}: "
               f"{first.describe()}")
    return False, message, evidence
