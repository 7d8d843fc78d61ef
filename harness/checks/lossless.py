"""The checks that compare a cell's outputs: it ran (`no-crash`), and its tokens equal its repeat's, the
non-speculative run's (`lossless`), the `seq` run's (`mode-invariant`) and the baseline's. Every token
comparison follows one policy (harness.checks.compare): a proven near-tie is reported but excused where numerics
can move a token (outside `seq` mode, and in `seq` for a model whose calibrated speculative runs are not
bit-identical to no speculation); any other divergence fails. A chat turn is compared only with a run that sent it
the same prompt."""

from harness.checks import seeded
from harness.checks.base import (
    NO_OUTPUT,
    NOT_SPECULATIVE,
    CheckContext,
    CheckResult,
    harness_fault,
    not_run,
)
from harness.checks.compare import NOT_RUN, compare_outcome, compare_tokens
from harness.checks.synth import NOT_VALID, accepts_synthetically
from harness.verdict.baselines import BaselineError, compared_length, request_shape, shape_mismatch, shown


def verdict(name: str, comparison: tuple[bool, str, dict]) -> CheckResult:
    """A CheckResult from a (passed, message, evidence) comparison; its per-output failures become `failures`, and
    one that compared no request (compare.NOT_RUN: why) is not run."""
    passed, message, evidence = comparison
    reason = evidence.pop(NOT_RUN, None)
    return CheckResult(name, passed, message, evidence, failures=evidence.pop("failures", []), not_run=reason)


def no_crash(ctx: CheckContext) -> CheckResult:
    """Every request ended with output, or with an error the suite allows (never a crash or a timeout)."""
    if not ctx.outcomes:  # nothing was sent: no request to judge (a case the cell never reached)
        return not_run("no-crash", "no request of the case was sent")
    bad = [o for o in ctx.outcomes if not o.result.ok and not ctx.allowed(o)]
    crashed = [o for o in ctx.outcomes if o.result.stop_reason in ("crashed", "timeout")]
    evidence = {
        "requests": len(ctx.outcomes),
        "errors": len(bad),
        "crashed": sum(o.result.stop_reason == "crashed" for o in crashed),
        "timeouts": sum(o.result.stop_reason == "timeout" for o in crashed),
        "allowed_errors": sum(1 for o in ctx.outcomes if not o.result.ok and ctx.allowed(o)),
    }
    if not bad and not crashed:
        return CheckResult("no-crash", True, evidence=evidence)
    first = (crashed or bad)[0]
    return CheckResult(
        "no-crash",
        False,
        f"{len(bad)} of {len(ctx.outcomes)} requests failed; {ctx.case} round {first.round}: {first.result.error}",
        evidence,
        failures=[f"round {o.round}: {o.result.error}" for o in bad],
    )


def repeat_identical(ctx: CheckContext) -> CheckResult | None:
    """All rounds of the case produced the same tokens (count of unique outputs must be 1)."""
    done = ctx.completed()
    if len(ctx.run.suite.rounds) < 2:
        return not_run("repeat-identical", "the suite runs one round")
    if len(done) < 2:
        return not_run("repeat-identical", f"{len(done)} of {len(ctx.outcomes)} rounds completed (no-crash says why)")
    unique = len({tuple(o.result.tokens) for o in done})
    result = verdict("repeat-identical", compare_outcome(ctx, done[0], f"output of round {done[0].round}", ctx.cell))
    result.evidence.update(unique_outputs=unique, runs=len(done))
    if unique > 1:
        result.message = f"{unique} unique outputs over {len(done)} runs; " + result.message
    return result


def lossless(ctx: CheckContext) -> CheckResult | None:
    """Speculative output equals non-speculative output: for greedy decoding always; for seeded sampling
    where llama.cpp guarantees it, i.e. where the logits behind the first diverging token are bit-identical
    in both runs (it draws one random number per emitted token and a checkpoint restore rewinds the
    generator, so the same logits in the same sampler state give the same token: triage classes such a
    divergence `hard`, the sampler state differed). Other sampled divergences are measured and reported
    without failing: a verification batch's logits differ from a single-token decode's in the last bits,
    and truncation (top-p, min-p) and the draw magnify that."""
    sampling = ctx.case_def.sampling
    preset = ctx.cell.preset
    if not preset.speculative:
        return not_run("lossless", NOT_SPECULATIVE)
    if accepts_synthetically(preset.options):
        return not_run("lossless", NOT_VALID)
    if not ctx.run.keeps_seeded_tokens and not sampling.greedy:
        return not_run(
            "lossless", "rejection sampling does not keep seeded tokens (--spec-draft-sampling probabilistic)"
        )
    if sampling.random_seed:
        return not_run("lossless", "the case samples with a random seed: no output to compare with")
    if not ctx.completed():
        return not_run("lossless", NO_OUTPUT)
    reference = ctx.cell.reference(spec="none")
    result = verdict(
        "lossless", compare_outcome(ctx, ctx.reference_outcome(reference), "non-speculative output", reference)
    )
    if not sampling.greedy and result.not_run is None:
        result.evidence["sampled"] = True  # reports count the seeded sampled requests compared (files.reported_only)
    if result.passed or sampling.greedy or "first_divergence" not in result.evidence:
        return result
    result.evidence["seeded_sampling"] = True
    if result.evidence.get("identical_logits_at_divergence"):
        return result
    return _seeded_count(ctx, result)


def _seeded_count(ctx: CheckContext, result: CheckResult) -> CheckResult:
    """A seeded sampled divergence the logits do not prove: judged by its group's count against the measured
    noise rate (harness.checks.seeded); a count within the noise passes, and says so (`reported_only`)."""
    passed, why, evidence = seeded.judge(ctx)
    result.evidence.update(evidence)
    first = result.message.split("\n")[0]
    if not passed:
        result.message = f"{first}\n  {why}"
        result.failures = [why]
        return result
    result.evidence["reported_only"] = True
    result.evidence["seeded_count"] = why
    result.failures = []
    result.passed = True
    counted = f"{evidence['group_diverged']} of {evidence['group_compared']} in its group, within the measured noise"
    result.message = f"{first} (seeded sampling, the logits differ there, {counted}: reported only)"
    return result


def mode_invariant(ctx: CheckContext) -> CheckResult | None:
    """`par` and `no-kv-unified` produce the output of `seq` (a proven near-tie is reported, not failed)."""
    if ctx.cell.mode == "seq":
        return not_run("mode-invariant", "the cell is the seq reference itself")
    if not ctx.completed():
        return not_run("mode-invariant", NO_OUTPUT)
    reference = ctx.cell.reference(mode="seq")
    return verdict("mode-invariant", compare_outcome(ctx, ctx.reference_outcome(reference), "seq output", reference))


def baseline(ctx: CheckContext) -> CheckResult | None:
    """Tokens equal the stored baseline of (suite, case, model, backend, device) (harness.verdict.baselines stores them;
    with `--update-baselines` this run's canonical output is stored first)."""
    if not (ctx.completed() or ctx.baselines.update):
        return not_run("baseline", NO_OUTPUT)
    if accepts_synthetically(ctx.cell.preset.options):
        return not_run("baseline", NOT_VALID)
    store = ctx.baselines
    try:
        data, path = store.recorded(ctx)
    except BaselineError as err:
        return harness_fault("baseline", f"{err} (fix or delete it; it is never replaced silently)")
    if store.update:  # comparing with what this run has just written proves nothing
        return not_run("baseline", "baselines updated in this run (not compared with what it wrote)")
    if data is None:
        pending = store.not_recorded(ctx)
        if pending:
            return CheckResult("baseline", True, pending, {"no_baseline": True, "baseline": shown(path)})
        return CheckResult(
            "baseline",
            False,
            f"no baseline {shown(path)}; create it with: {ctx.repro} --update-baselines{store.option}",
        )
    recorded, shape = data.get("request"), request_shape(ctx.run.suite, ctx.case_def)
    other = shape_mismatch(recorded, shape)
    if other:  # recorded for another request: none yet for this one, as for a model new to the harness
        return CheckResult(
            "baseline",
            True,
            f"no baseline yet for {ctx.case} under this run's request: {shown(path)} {other}; record it with: "
            f"{ctx.repro} --update-baselines{store.option}",
            {"no_baseline": True, "baseline": shown(path)},
        )
    produced = max((len(o.result.tokens) for o in ctx.completed()), default=0)
    over = compared_length(recorded, shape, len(data["tokens"]), produced)
    compared = compare_tokens(
        ctx,
        data["tokens"],
        store.load_logits(path),
        f"baseline {shown(path)}",
        earlier=store.earlier_replies(ctx),
        over=over,
    )
    result = verdict("baseline", compared)
    result.evidence["baseline"] = shown(path)
    if over is not None:
        at = f"n_predict {recorded['n_predict']}" if recorded else "a length it does not record"
        result.evidence["compared_over"] = over
        note = (
            f"compared over the first {over} tokens: the baseline was recorded at {at}, this run asks n_predict "
            f"{shape['n_predict']} ({max(produced - over, 0)} tokens of this run's output not compared)"
        )
        result.message = f"{result.message}; {note}" if result.message else note
    return result
