"""Named checks: each a small function of a CheckContext returning pass/fail plus evidence.

A check that does not apply to a case (e.g. `lossless` without speculation) returns None.
"""

import json
from typing import Callable, Optional

import jsonschema

from harness.checks.base import CheckContext, CheckResult
from harness.checks.compare import compare_outcome, tolerances
from harness.logits import check as logits_within, compare as compare_logits
from harness.matrix import spec_preset

Check = Callable[[CheckContext], Optional[CheckResult]]


def no_crash(ctx: CheckContext) -> CheckResult:
    """Every request ended with output, or with an error the suite allows (never a crash or a timeout)."""
    bad = [o for o in ctx.outcomes if not o.result.ok and not ctx.allowed(o)]
    crashed = [o for o in ctx.outcomes if o.result.stop_reason in ("crashed", "timeout")]
    evidence = {"requests": len(ctx.outcomes), "errors": len(bad),
                "crashed": sum(o.result.stop_reason == "crashed" for o in crashed),
                "timeouts": sum(o.result.stop_reason == "timeout" for o in crashed),
                "allowed_errors": sum(1 for o in ctx.outcomes if not o.result.ok and ctx.allowed(o))}
    if not bad and not crashed:
        return CheckResult("no-crash", True, evidence=evidence)
    first = (crashed or bad)[0]
    return CheckResult("no-crash", False, f"{len(bad)} of {len(ctx.outcomes)} requests failed; round {first.round}: "
                       f"{first.result.error}", evidence)


def repeat_identical(ctx: CheckContext) -> Optional[CheckResult]:
    """All rounds of the case produced the same tokens (count of unique outputs must be 1)."""
    done = ctx.completed()
    if len(ctx.run.suite.rounds) < 2 or len(done) < 2:
        return None
    unique = len({tuple(o.result.tokens) for o in done})
    passed, message, evidence = compare_outcome(ctx, done[0], f"output of round {done[0].round}")
    evidence["unique_outputs"] = unique
    evidence["runs"] = len(done)
    if not passed:
        message = f"{unique} unique outputs over {len(done)} runs; " + message
    return CheckResult("repeat-identical", passed, message, evidence)


def _tokens_decide_sampler_state(sampling) -> bool:
    """Whether the sampler state before a token depends on the earlier tokens alone: penalties and DRY
    count tokens and `dist` draws once per token; a grammar (a rejected sample is drawn again), XTC
    (draws only over two or more candidates), mirostat and adaptive-p (they learn from probabilities)
    depend on the earlier logits too."""
    xtc = "xtc" in sampling.samplers and sampling.xtc_probability > 0 and sampling.xtc_threshold <= 0.5
    return (sampling.grammar is None and sampling.json_schema is None and sampling.mirostat == 0
            and "adaptive_p" not in sampling.samplers and not xtc)


def _sampler_state_differed(ctx: CheckContext, reference, outcome) -> bool:
    """A seeded-sampling divergence that numerics cannot explain: the logit rows behind the diverging
    token are bit-identical in both runs (same digest), and so are all rows before it unless the tokens
    alone decide the sampler state. Then llama.cpp's sampler saw the same logits in a different state."""
    ref, mine = reference.result, outcome.result
    n = next((i for i, (a, b) in enumerate(zip(ref.tokens, mine.tokens)) if a != b), None)
    if n is None or len(ref.logits) <= n or len(mine.logits) <= n:
        return False
    same = [bool(a.digest) and a.digest == b.digest for a, b in zip(ref.logits[: n + 1], mine.logits[: n + 1])]
    return same[n] and (_tokens_decide_sampler_state(ctx.case_def.sampling) or all(same))


def lossless(ctx: CheckContext) -> Optional[CheckResult]:
    """Speculative output equals non-speculative output: for greedy decoding always; for seeded sampling
    where llama.cpp guarantees it, i.e. where the logits behind the first diverging token are bit-identical
    in both runs (it draws one random number per emitted token and a checkpoint restore rewinds the
    generator, so the same logits in the same sampler state give the same token). Other sampled
    divergences are measured and reported without failing: a verification batch's logits differ from a
    single-token decode's in the last bits, and truncation (top-p, min-p) and the draw magnify that."""
    sampling = ctx.case_def.sampling
    if not spec_preset(ctx.cell.spec).speculative or sampling.random_seed:
        return None
    reference = ctx.reference_outcome(ctx.cell.reference(spec="none"))
    passed, message, evidence = compare_outcome(ctx, reference, "non-speculative output")
    if passed or sampling.greedy or reference is None or not reference.result.ok:
        return CheckResult("lossless", passed, message, evidence)
    proven = [o for o in ctx.completed() if _sampler_state_differed(ctx, reference, o)]
    evidence["seeded_sampling"] = True
    if proven:
        evidence["identical_logits_at_divergence"] = len(proven)
        return CheckResult("lossless", False, f"{message}; round {proven[0].round}: the logits there are "
                           "bit-identical in both runs, so the sampler state differed", evidence)
    evidence["reported_only"] = True
    return CheckResult("lossless", True, f"{message} (seeded sampling, logits differ there: reported only)", evidence)


def mode_invariant(ctx: CheckContext) -> Optional[CheckResult]:
    """`no-kv-unified` equals `seq`; `par` is compared with `seq` and reported without failing."""
    if ctx.cell.mode == "seq":
        return None
    passed, message, evidence = compare_outcome(ctx, ctx.reference_outcome(ctx.cell.reference(mode="seq")), "seq output")
    if ctx.cell.mode == "par":
        evidence["reported_only"] = True
        return CheckResult("mode-invariant", True, message, evidence)
    return CheckResult("mode-invariant", passed, message, evidence)


def baseline(ctx: CheckContext) -> Optional[CheckResult]:
    """Tokens equal the stored baseline of (suite, case, model, backend, device)."""
    return ctx.baselines.check(ctx)


def spec_ran(ctx: CheckContext) -> Optional[CheckResult]:
    """Drafts were generated for the case (and some accepted, where both the config and the case expect
    it: a grammar the drafter does not see may reject every draft)."""
    preset = spec_preset(ctx.cell.spec)
    if not preset.speculative:
        return None
    stats = [o.result.spec_stats for o in ctx.completed()]
    drafted = sum(s.get("draft_n", 0) for s in stats)
    accepted = sum(s.get("draft_n_accepted", 0) for s in stats)
    expect_accepts = preset.expect_accepts and ctx.case_def.expect_accepts
    evidence = {"draft_n": drafted, "draft_n_accepted": accepted, "expect_accepts": expect_accepts,
                "acceptance": round(accepted / drafted, 3) if drafted else 0.0}
    if drafted == 0:
        return CheckResult("spec-ran", False, f"no drafts at all for the case ({len(stats)} requests)", evidence)
    if expect_accepts and accepted == 0:
        return CheckResult("spec-ran", False, f"{drafted} tokens drafted, none accepted", evidence)
    return CheckResult("spec-ran", True, evidence=evidence)


def grammar_valid(ctx: CheckContext) -> Optional[CheckResult]:
    """The output parses as JSON and satisfies the case's schema."""
    schema = ctx.case_def.sampling.json_schema
    if schema is None:
        return None
    problems = []
    for o in ctx.completed():
        try:
            jsonschema.validate(json.loads(o.result.text), schema)
        except (ValueError, jsonschema.ValidationError) as err:
            problems.append(f"round {o.round}: {str(err).splitlines()[0]} in {o.result.text[:80]!r}")
    evidence = {"outputs": len(ctx.completed()), "invalid": len(problems)}
    if problems:
        return CheckResult("grammar-valid", False, f"{len(problems)} invalid outputs; " + problems[0], evidence)
    return CheckResult("grammar-valid", True, evidence=evidence)


def kv_healthy(ctx: CheckContext) -> Optional[CheckResult]:
    """The KV scanner found no duplicate (seq_id, pos) cells, orphans past the sequence or holes."""
    scanned = [o for o in ctx.completed() if o.result.kv_scan is not None]
    if not scanned:
        return None
    bad = [o for o in scanned if not o.result.kv_scan["healthy"]]
    totals = [o.result.kv_scan["totals"] for o in scanned]
    evidence = {"scanned": len(scanned), "unhealthy": len(bad),
                **{k: sum(t[k] for t in totals) for k in ("duplicate_cells", "orphans", "missing_positions")}}
    if not bad:
        return CheckResult("kv-healthy", True, evidence=evidence)
    scan = bad[0].result.kv_scan
    where = "; ".join(
        [f"{d['count']} cells at (seq {d['seq_id']}, pos {d['pos']})" for d in scan["duplicates"]]
        + [f"orphan at (seq {o['seq_id']}, pos {o['pos']})" for o in scan["orphans"]]
        + [f"hole at seq {h['seq_id']} pos {h['first']}..{h['last']}" for h in scan["holes"]])
    evidence["first"] = scan
    return CheckResult("kv-healthy", False, f"{len(bad)} of {len(scanned)} requests left an unhealthy KV cache "
                       f"(round {bad[0].round}: {scan['totals']['duplicate_cells']} duplicate cells, "
                       f"{scan['totals']['orphans']} orphans): {where}", evidence)


def logits_close(ctx: CheckContext) -> Optional[CheckResult]:
    """Logits agree with the reference cell's (seq mode, no speculation) within the suite's tolerances,
    over the positions where both produced the same tokens."""
    canonical = ctx.cell.reference(mode="seq", spec="none")
    reference = ctx.reference_outcome(canonical) if ctx.cell != canonical else None
    if reference is None or not reference.result.logits:
        return None
    tol, _ = tolerances(ctx)
    worst, evidence = None, {"compared_runs": 0}
    for o in ctx.completed():
        if not o.result.logits:
            continue
        same = next((i for i, (a, b) in enumerate(zip(reference.result.tokens, o.result.tokens)) if a != b),
                    min(len(reference.result.tokens), len(o.result.tokens)))
        comparison = compare_logits(reference.result.logits[:same], o.result.logits[:same])
        if comparison.n_compared == 0:
            continue
        evidence["compared_runs"] += 1
        evidence["max_abs"] = max(evidence.get("max_abs", 0.0), float(comparison.max_abs))
        passed, message = logits_within(comparison, tol)
        if not passed and worst is None:
            worst = f"round {o.round}: {message}"
    if evidence["compared_runs"] == 0:
        return None
    if worst:
        return CheckResult("logits-close", False, f"logits differ from the seq / no-speculation run beyond tolerance; {worst}", evidence)
    return CheckResult("logits-close", True, evidence=evidence)


CHECKS: dict[str, Check] = {
    "no-crash": no_crash,
    "repeat-identical": repeat_identical,
    "lossless": lossless,
    "mode-invariant": mode_invariant,
    "baseline": baseline,
    "spec-ran": spec_ran,
    "grammar-valid": grammar_valid,
    "kv-healthy": kv_healthy,
    "logits-close": logits_close,
}


def evaluate(ctx: CheckContext, names: list[str]) -> list[CheckResult]:
    """Run the named checks that apply; a failing one's message ends with how to reproduce it.

    A cell that could not be served at all (no model, no server) fails `no-crash` and nothing else."""
    if ctx.run.error is not None:
        return [CheckResult("no-crash", False, f"the cell could not be served: {ctx.run.error}\n  reproduce: {ctx.repro}")]
    results = []
    for name in names:
        result = CHECKS[name](ctx)
        if result is None:
            continue
        if not result.passed:
            result.message += f"\n  reproduce: {ctx.repro}"
        results.append(result)
    return results
