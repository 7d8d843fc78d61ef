"""`draft-size`: every verified draft lies within the drafter's bounds.

A drafter proposes at most `--spec-draft-n-max` tokens a step, and a draft shorter than `--spec-draft-n-min` is
dropped before the target sees it (common/speculative.cpp, in every drafter's `draft`: `if (result.size() <
n_min) result.clear()`). The output cannot show either bound (a longer draft or a short one kept is still
verified, so the tokens stay lossless), but the work does: a step that verifies a draft outside the bounds did
work the options forbid. Each step's draft length is read from what the backend reports per step: llama-server's
log (`Work.steps`, one `[n_draft, ...]` per verification batch) and the in-process engine's per-position counts
(`drafted_per_pos[k]`: the steps whose draft had a token at position k).

Judged for the drafter types whose bounds are the options as given (BOUNDED); DFlash, DSpark and EAGLE3 clamp
both to their trained block, which the harness does not read. A request's cap near n_predict or the context end
(`n_remaining - 1`, llama-server's get_n_draft_max) only lowers the upper bound, and `within-n-predict` judges it.
"""

from harness.checks.base import NO_OUTPUT, NOT_SPECULATIVE, CheckContext, CheckResult, not_run

NAME = "draft-size"
BOUNDED = ("draft-simple", "draft-mtp")
"""The `--spec-type`s whose drafts are bounded by `--spec-draft-n-min` / `-n-max` as given."""


def bounds(ctx: CheckContext) -> tuple[int, int] | None:
    """(n_min, n_max) of the cell's drafts as served (its preset's options under the run's `--spec-*` overrides),
    or None where the type is not one of BOUNDED or no n_max is given."""
    overrides = getattr(getattr(ctx.executor, "options", None), "spec_overrides", {})
    options = ctx.cell.served_options(overrides)
    if options.get("spec-type") not in BOUNDED or "spec-draft-n-max" not in options:
        return None
    return int(options.get("spec-draft-n-min", 0)), int(options["spec-draft-n-max"])


def draft_lengths(result) -> list[int] | None:
    """The length of each draft a request's target verified, in order where the backend says (None where it
    reports no per-step drafts): llama-server's verifications from its log; the engine's from its per-position
    counts (a length per step, in no particular order)."""
    steps = result.work.steps if result.work is not None else None
    if steps is not None and steps.get("verifications") is not None:
        return [int(v[0]) for v in steps["verifications"]]
    per_pos = result.spec_stats.get("drafted_per_pos")
    if per_pos is None:
        return None
    counts = list(per_pos) + [0]
    return [k + 1 for k in range(len(per_pos)) for _ in range(counts[k] - counts[k + 1])]


def draft_size(ctx: CheckContext) -> CheckResult | None:
    """Every verified draft of the case's requests holds between n_min and n_max tokens (module docstring)."""
    if not ctx.cell.preset.speculative:
        return not_run(NAME, NOT_SPECULATIVE)
    limits = bounds(ctx)
    if limits is None:
        return not_run(NAME, f"spec type {ctx.cell.spec} clamps its draft sizes to its own block, or sets no n_max")
    if not ctx.completed():
        return not_run(NAME, NO_OUTPUT)
    n_min, n_max = limits
    failures, judged, steps = [], 0, 0
    for o in ctx.completed():
        lengths = draft_lengths(o.result)
        if lengths is None:
            continue
        judged += 1
        drafts = [n for n in lengths if n > 0]
        steps += len(drafts)
        short = [n for n in drafts if n < n_min]
        long = [n for n in drafts if n > n_max]
        if short:
            failures.append(
                f"round {o.round}: {len(short)} drafts of {sorted(set(short))} tokens verified, below n_min {n_min}"
            )
        if long:
            failures.append(
                f"round {o.round}: {len(long)} drafts of {sorted(set(long))} tokens verified, above n_max {n_max}"
            )
    if not judged:
        return not_run(NAME, "the backend reported no per-step drafts for these requests")
    evidence = {"n_min": n_min, "n_max": n_max, "requests": judged, "drafts": steps}
    if failures:
        return CheckResult(
            NAME,
            False,
            f"{len(failures)} of {judged} requests verified drafts outside [{n_min}, {n_max}]; {failures[0]}",
            evidence,
            failures=failures,
        )
    return CheckResult(NAME, True, evidence=evidence)
