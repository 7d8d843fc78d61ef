"""The checks of what speculation did: drafts generated and accepted (`spec-ran`), acceptance as effective as
the baseline's (`acceptance`), and the paths a suite is for exercised (`exercised`)."""

from harness.checks.acceptance import check as acceptance_check
from harness.checks.base import (
    NO_OUTPUT,
    NOT_SPECULATIVE,
    CheckContext,
    CheckResult,
    not_run,
)
from harness.verdict.check_result import DID_NOT_COMPLETE


def spec_ran(ctx: CheckContext) -> CheckResult | None:
    """Drafts were generated for the case (and some accepted, where both the config and the case expect
    it: a grammar the drafter does not see may reject every draft). Under forced rejection
    (`SpecPreset.rejects_all`) every request drafted (each that generated more than one token: a request ending
    at its first token has no step to draft in) and none accepted a drafted token. A case none of whose
    requests completed is `no-crash`'s to report; one with `n_predict` 1 or 2 never drafts (the first token is
    sampled after the prompt, and a step's draft must leave room for the token sampled after it: at most
    `n_remaining - 1` tokens, llama-server's get_n_draft_max)."""
    preset = ctx.cell.preset
    if not preset.speculative:
        return not_run("spec-ran", NOT_SPECULATIVE)
    if not ctx.completed():
        return not_run("spec-ran", NO_OUTPUT)
    if 0 < ctx.case_def.sampling.n_predict <= 2:
        return not_run("spec-ran", f"n_predict {ctx.case_def.sampling.n_predict} leaves no step to draft in")
    stats = [o.result.spec_stats for o in ctx.completed()]
    drafted = sum(s.get("draft_n", 0) for s in stats)
    accepted = sum(s.get("draft_n_accepted", 0) for s in stats)
    expect_accepts = preset.expect_accepts and ctx.case_def.expect_accepts
    evidence = {
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "expect_accepts": expect_accepts,
        "acceptance": round(accepted / drafted, 3) if drafted else 0.0,
    }
    if drafted == 0:
        return CheckResult("spec-ran", False, f"no drafts at all for the case ({len(stats)} requests)", evidence)
    if expect_accepts and accepted == 0:
        return CheckResult("spec-ran", False, f"{drafted} tokens drafted, none accepted", evidence)
    if preset.rejects_all:
        failures = [
            f"round {o.round}: {s.get('draft_n', 0)} drafted, {s.get('draft_n_accepted', 0)} accepted"
            for o, s in zip(ctx.completed(), stats, strict=False)
            if s.get("draft_n_accepted", 0) > 0 or (s.get("draft_n", 0) == 0 and len(o.result.tokens) > 1)
        ]
        if failures:
            return CheckResult(
                "spec-ran",
                False,
                f"forced rejection: every request must draft and accept nothing; {failures[0]}",
                evidence,
                failures=failures,
            )
    return CheckResult("spec-ran", True, evidence=evidence)


def acceptance(ctx: CheckContext) -> CheckResult:
    """Speculation is as effective as it was: each request's acceptance (accepted / drafted and accepted /
    generated) against the baseline's same request in the same cell (so the same request order, for drafters
    that learn across a slot's requests) and, in `par` / `no-kv-unified` with drafters that keep no state
    between requests, against the same request in `seq` (a drafter state leaking between slots shows as a
    skew on some slots). A drop beyond the calibrated tolerance of (model, backend, device, spec) fails. A chat
    turn whose earlier replies differ from the reference's (another prompt) is not compared with it."""
    return acceptance_check(ctx)


"""Marks `exercised`'s per-request failure lines (a request short of the completions it expects), as against
its counter lines: a known defect that killed requests explains the shortfall (harness.verdict.known_failures)."""


def exercised(ctx: CheckContext) -> CheckResult | None:
    """The cell exercised what the suite is for (`expect:`): enough requests completed, and the speculative
    counters it names reached their minimum over the cell. A cell-level check, reported on the suite's
    first case; a counter the backend does not report (llama-server has no drop-and-retry counter) is
    listed as unmeasured, never assumed."""
    expect = ctx.run.suite.expect
    if not expect:
        return not_run("exercised", "the suite declares no `expect:`")
    if ctx.case != ctx.run.suite.first_key:
        return not_run("exercised", f"a cell-level check, reported on {ctx.run.suite.first_key}")
    outcomes = ctx.run.outcomes
    completed = sum(o.result.ok for o in outcomes)
    share = completed / len(outcomes) if outcomes else 0.0
    evidence = {"requests": len(outcomes), "completed": completed}
    problems, failures = [], []
    if share < expect.get("completed_min", 0.0):
        evidence["completed_min"] = expect["completed_min"]
        problems.append(
            f"only {completed} of {len(outcomes)} requests completed (expected at least {expect['completed_min']:.0%})"
        )
        # one line per request that did not complete, with its error: what a known defect must explain
        failures += [
            f"{o.case} round {o.round}{DID_NOT_COMPLETE}{o.result.error or o.result.stop_reason}"
            for o in outcomes
            if not o.result.ok
        ]
    for counter, minimum in expect.get("spec_stats_min", {}).items():
        reported = [o.result.spec_stats[counter] for o in outcomes if counter in o.result.spec_stats]
        if not reported and outcomes:
            evidence.setdefault("unmeasured", []).append(counter)
            continue
        evidence[counter] = total = sum(reported)
        if total < minimum:
            problems.append(
                f"spec_stats.{counter} totals {total} over the cell (expected at least {minimum}): "
                "the path it counts never ran"
            )
            failures.append(problems[-1])
    if problems:
        return CheckResult("exercised", False, "; ".join(problems), evidence, failures=failures)
    return CheckResult("exercised", True, evidence=evidence)
