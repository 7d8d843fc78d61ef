"""Comparing outputs of the same case: match, or the first divergence with its triage, judged by the one
policy for every token comparison (`CheckContext.excuses_near_ties`); a chat turn is compared only with a
reference that sent it the same prompt (the same earlier replies)."""

from dataclasses import dataclass

from harness import interrupt
from harness.checks.base import CheckContext, kv_findings
from harness.matrix import Cell
from harness.result import Result
from harness.result.cellrun import Outcome
from harness.result.logits import PositionLogits
from harness.verdict.noise import NoiseFloor
from harness.verdict.triage import Divergence, triage

NOT_RUN = "not_run"
"""The evidence key of a comparison that compared no request, with why: its check is not run
(harness.checks.lossless.verdict), never passed."""


def compare_outcome(
    ctx: CheckContext, reference: Outcome | None, label: str, ref_cell: Cell | None = None
) -> tuple[bool, str, dict]:
    """Compare every completed outcome of this case with another outcome; (passed, message, evidence). A reference
    that ended with an error the suite allows leaves nothing to compare with: not run (`NOT_RUN`)."""
    if reference is None or not reference.result.ok:
        why = "missing" if reference is None else f"failed: {reference.result.error}"
        if reference is not None and ctx.allowed(reference):
            return _not_run(f"the {label} reference {why} (an error the suite allows)", {})
        return False, f"{label} reference {why}", {}
    earlier = ctx.earlier_replies(ref_cell, reference.round) if ref_cell else None
    return compare_tokens(
        ctx, reference.result.tokens, reference.result.logits, label, reference.result, ref_cell, earlier
    )


def compare_tokens(
    ctx: CheckContext,
    ref_tokens: list[int],
    ref_logits: list[PositionLogits],
    label: str,
    ref_result: Result | None = None,
    ref_cell: Cell | None = None,
    earlier: list[list[int] | None] | None = None,
    over: int | None = None,
) -> tuple[bool, str, dict]:
    """Compare every completed outcome of this case with reference tokens; (passed, message, evidence). With
    `over`, only the first `over` tokens of each (a baseline recorded at another `n_predict`).

    Each divergence is triaged with this cell's noise floor, the KV findings of both requests and, where
    llama-server withheld logits, a re-score. A proven near-tie is excused where numerics can move a token
    (`CheckContext.excuses_near_ties`, counted in `evidence["near_ties"]`); every other divergence fails, with
    one line per output in `failures`. A chat turn whose earlier replies (`earlier`: the reference's) differ
    from this run's has another prompt: it is not compared (`evidence["not_compared"]`); the earlier turn's
    verdict reports that divergence."""
    if ctx.case_def.sampling.post_sampling_probs:  # the sampler chain's probabilities are not the model's
        ref_logits = []  # re-score instead
    moot, mine = _same_prompt(ctx, earlier)
    if moot and not mine:
        return _not_compared(label, moot)
    reference = _Reference(
        ref_tokens[:over] if over is not None else ref_tokens, ref_logits, ref_result, ref_cell, label
    )
    floor = ctx.noise_floor
    diffs = _triaged(ctx, mine, reference, floor, over)
    return _judged(ctx, mine, moot, diffs, reference, floor)


@dataclass
class _Reference:
    """What the outcomes are compared with: its tokens and logits, the request and cell behind them (for
    re-scoring and KV findings, when known), and how messages name it."""

    tokens: list[int]
    logits: list[PositionLogits]
    result: Result | None
    cell: Cell | None
    label: str


def _same_prompt(ctx: CheckContext, earlier: list[list[int] | None] | None) -> tuple[dict[int, str], list[Outcome]]:
    """(round → the earlier turn whose reply differs from the reference's, the completed outcomes that sent the
    reference's prompt)."""
    moot = {o.round: key for o in ctx.completed() if (key := ctx.prompt_differs(o, earlier or []))}
    return moot, [o for o in ctx.completed() if o.round not in moot]


def _not_compared(label: str, moot: dict[int, str]) -> tuple[bool, str, dict]:
    """The result when no outcome sent the reference's prompt: nothing compared (the earlier turn reports it)."""
    first = min(moot)
    return _not_run(
        f"round {first}'s prompt carries the reply to {moot[first]}, which already differs from the {label}'s "
        "(that turn's verdict reports it)",
        {"compared": 0, "not_compared": len(moot), "prompt_differs_at": moot[first]},
    )


def _not_run(reason: str, evidence: dict) -> tuple[bool, str, dict]:
    """A comparison that compared no request: no verdict, and why (`NOT_RUN` in the evidence)."""
    return True, f"not run: {reason}", {**evidence, NOT_RUN: reason}


def _triaged(
    ctx: CheckContext, mine: list[Outcome], ref: _Reference, floor: NoiseFloor, over: int | None = None
) -> list[tuple[Outcome, Divergence]]:
    """Each outcome whose tokens (the first `over` of them, when given) differ from the reference's, with its first
    divergence triaged."""
    sampling = ctx.case_def.sampling
    greedy = sampling.picks_argmax  # a logit margin says nothing about a penalized or sampled pick
    diffs: list[tuple[Outcome, Divergence]] = []
    with ctx.executor.rescorer() as rescorer:
        for o in mine:
            tokens = o.result.tokens[:over] if over is not None else o.result.tokens
            if tokens == ref.tokens:
                continue

            def rescore(side: str, pos: int, o: Outcome = o):
                if side == "other":
                    return rescorer.score(ctx.run.suite, ctx.cell, o.result, pos)
                return rescorer.score(ctx.run.suite, ref.cell, ref.result, pos) if ref.cell and ref.result else None

            interrupt.phase("triage")
            findings = kv_findings(o.result, f"request (round {o.round})")
            findings += kv_findings(ref.result, "reference request") if ref.result is not None else []
            other_logits = None if sampling.post_sampling_probs else o.result.logits or None
            divergence = triage(
                ref.tokens,
                tokens,
                ref.logits or None,
                other_logits,
                detokenize=ctx.detokenize,
                floor=floor,
                greedy=greedy,
                kv_findings=findings,
                rescore=rescore,
                state_follows_tokens=sampling.state_follows_tokens,
            )
            diffs.append((o, divergence))
    return diffs


def _judged(
    ctx: CheckContext,
    mine: list[Outcome],
    moot: dict[int, str],
    diffs: list[tuple[Outcome, Divergence]],
    ref: _Reference,
    floor: NoiseFloor,
) -> tuple[bool, str, dict]:
    """The verdict on the triaged divergences: proven near-ties excused where the policy allows, any other
    divergence failing (one line per output in `failures`), with the evidence."""
    excused = [(o, d) for o, d in diffs if d.kind == "near-tie" and ctx.excuses_near_ties]
    failing = [(o, d) for o, d in diffs if (o, d) not in excused]
    evidence = {"compared": len(mine), "matching": len(mine) - len(diffs), "noise_floor": floor.describe()}
    if moot:
        evidence.update(not_compared=len(moot), prompt_differs_at=moot[min(moot)])
    if excused:
        evidence["near_ties"] = len(excused)
    if any(d.same_logits for _, d in diffs):
        evidence["identical_logits_at_divergence"] = sum(d.same_logits for _, d in diffs)
    if not diffs:
        return True, "", evidence
    outcome, first = (failing or excused)[0]
    evidence["first_divergence"] = first.to_evidence(
        outcome.round, ref.label, ref.tokens, outcome.result.tokens, ref.logits
    )
    if not failing:
        return (
            True,
            (
                f"{len(excused)} of {len(mine)} outputs differ from the {ref.label} at proven near-ties "
                f"(reported, not failed in {ctx.cell.mode} mode); round {outcome.round}: {first.describe()}"
            ),
            evidence,
        )
    evidence["failures"] = [
        f"round {o.round}: {d.kind} at token {d.index}{_ended(o.result, d, len(ref.tokens))}"
        + _rolled_back_before(o.result, ref, d.index)
        + _stale_checkpoint(o.result, ref)
        for o, d in failing
    ]
    return (
        False,
        f"{len(failing)} of {len(mine)} outputs differ from the {ref.label}; round {outcome.round}: {first.describe()}",
        evidence,
    )


def _rolled_back_before(result: Result, ref: _Reference, index: int) -> str:
    """What a failure line adds when a llama-server slot, this output's or the reference's, rolled drafts back
    after verifying them in a micro-batch ahead of another of the same decode, at or before the divergence
    (Result.split_rollback_before; the step of known failure server-par-partial-rollback-diverges)."""
    if mine := result.split_rollback_before(index):
        return mine
    theirs = ref.result.split_rollback_before(index) if ref.result is not None else ""
    return theirs.replace("; after", "; the reference's output came after", 1)  # the reference's own slot


def _stale_checkpoint(result: Result, ref: _Reference) -> str:
    """What a failure line adds when this output's prompt, or the reference's, went on from a llama-server context
    checkpoint made from other tokens (Result.stale_checkpoint; known failure server-stale-context-checkpoint)."""
    if result.stale_checkpoint:
        return f"; the {result.stale_checkpoint}"
    if ref.result is not None and ref.result.stale_checkpoint:
        return f"; the reference's {ref.result.stale_checkpoint}"
    return ""


def _ended(result: Result, divergence: Divergence, n_reference: int) -> str:
    """What a failure line adds when the output is a prefix of the reference: it ended there, and why."""
    if divergence.other_token is not None:
        return ""
    return f" (the output ended there, stop: {result.stop_reason}; the reference has {n_reference} tokens)"
