"""Named checks: each a small function of a CheckContext returning pass/fail plus evidence.

A check that does not apply to a case (e.g. `lossless` without speculation) returns None. Every token
comparison follows one policy (harness.checks.compare): a proven near-tie is reported but excused where
numerics can move a token (outside `seq` mode, and in `seq` for a model whose calibrated speculative runs are
not bit-identical to no speculation); any other divergence fails. A chat turn is compared only with a run that
sent it the same prompt.
"""

import json
from collections.abc import Callable

import jsonschema

from harness import interrupt
from harness.baselines import BaselineError, shown
from harness.checks.acceptance import Acceptance, fall, summed
from harness.checks.base import CheckContext, CheckResult, past_returned
from harness.checks.budget import within_n_predict
from harness.checks.compare import compare_outcome, compare_tokens
from harness.checks.probs import probs_complete
from harness.checks.reuse import prompt_reuse
from harness.errors import HarnessBug, HarnessError
from harness.logits import check as logits_within
from harness.logits import compare as compare_logits
from harness.matrix import spec_preset
from harness.result import Result

Check = Callable[[CheckContext], CheckResult | None]


def verdict(name: str, comparison: tuple[bool, str, dict]) -> CheckResult:
    """A CheckResult from a (passed, message, evidence) comparison; its per-output failures become `failures`."""
    passed, message, evidence = comparison
    return CheckResult(name, passed, message, evidence, failures=evidence.pop("failures", []))


def no_crash(ctx: CheckContext) -> CheckResult:
    """Every request ended with output, or with an error the suite allows (never a crash or a timeout)."""
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
    if len(ctx.run.suite.rounds) < 2 or len(done) < 2:
        return None
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
    if not spec_preset(ctx.cell.spec).speculative or sampling.random_seed or not ctx.completed():
        return None
    reference = ctx.cell.reference(spec="none")
    result = verdict(
        "lossless", compare_outcome(ctx, ctx.reference_outcome(reference), "non-speculative output", reference)
    )
    if result.passed or sampling.greedy or "first_divergence" not in result.evidence:
        return result
    result.evidence["seeded_sampling"] = True
    if result.evidence.get("identical_logits_at_divergence"):
        return result
    result.evidence["reported_only"] = True
    result.failures = []
    result.passed = True
    result.message = result.message.split("\n")[0] + " (seeded sampling, the logits differ there: reported only)"
    return result


def mode_invariant(ctx: CheckContext) -> CheckResult | None:
    """`par` and `no-kv-unified` produce the output of `seq` (a proven near-tie is reported, not failed)."""
    if ctx.cell.mode == "seq" or not ctx.completed():
        return None
    reference = ctx.cell.reference(mode="seq")
    return verdict("mode-invariant", compare_outcome(ctx, ctx.reference_outcome(reference), "seq output", reference))


def baseline(ctx: CheckContext) -> CheckResult | None:
    """Tokens equal the stored baseline of (suite, case, model, backend, device) (harness.baselines stores them;
    with `--update-baselines` this run's canonical output is stored first)."""
    if not (ctx.completed() or ctx.baselines.update):
        return None
    store = ctx.baselines
    try:
        data, path = store.recorded(ctx)
    except BaselineError as err:
        return CheckResult("baseline", False, f"{err} (fix or delete it; it is never replaced silently)")
    if data is None:
        pending = store.not_recorded(ctx)
        if pending:
            return CheckResult("baseline", True, pending, {"no_baseline": True, "baseline": shown(path)})
        return CheckResult(
            "baseline",
            False,
            f"no baseline {shown(path)}; create it with: {ctx.repro} --update-baselines{store.option}",
        )
    compared = compare_tokens(
        ctx, data["tokens"], store.load_logits(path), f"baseline {shown(path)}", earlier=store.earlier_replies(ctx)
    )
    result = verdict("baseline", compared)
    result.evidence["baseline"] = shown(path)
    return result


def spec_ran(ctx: CheckContext) -> CheckResult | None:
    """Drafts were generated for the case (and some accepted, where both the config and the case expect
    it: a grammar the drafter does not see may reject every draft). Under forced rejection
    (`SpecPreset.rejects_all`) every request drafted (each that generated more than one token: a request ending
    at its first token has no step to draft in) and none accepted a drafted token. A case none of whose
    requests completed is `no-crash`'s to report; one with `n_predict` 1 or 2 never drafts (the first token is
    sampled after the prompt, and a step's draft must leave room for the token sampled after it: at most
    `n_remaining - 1` tokens, llama-server's get_n_draft_max)."""
    preset = spec_preset(ctx.cell.spec)
    if not preset.speculative or not ctx.completed() or 0 < ctx.case_def.sampling.n_predict <= 2:
        return None
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


def acceptance(ctx: CheckContext) -> CheckResult | None:
    """Speculation is as effective as it was: each request's acceptance (accepted / drafted and accepted /
    generated) against the baseline's same request in the same cell (so the same request order, for drafters
    that learn across a slot's requests) and, in `par` / `no-kv-unified` with drafters that keep no state
    between requests, against the same request in `seq` (a drafter state leaking between slots shows as a
    skew on some slots). A drop beyond the calibrated tolerance of (model, backend, device, spec) fails. A chat
    turn whose earlier replies differ from the reference's (another prompt) is not compared with it."""
    preset = spec_preset(ctx.cell.spec)
    if not preset.speculative or not ctx.completed():
        return None
    floor = ctx.noise_floor
    tolerance, source = floor.acceptance_tolerance(ctx.cell.spec)
    # rounds sent all at once: a drafter that learns across requests depends on the order llama-server serves
    # them in, so they take the tolerance calibrated for requests sent at once
    at_once = {
        r: floor.acceptance_tolerance(ctx.cell.spec, "concurrent")[0]
        for r, how in enumerate(ctx.run.suite.rounds)
        if how == "par" and preset.learns_across_requests
    }
    across_modes, _ = floor.acceptance_tolerance(ctx.cell.spec, "modes")
    try:
        stored, path = ctx.baselines.acceptance(ctx)
    except HarnessError as err:
        return CheckResult("acceptance", False, f"{err} (fix or delete it; it is never replaced silently)")
    mine = {o.round: Acceptance.of(o.result.spec_stats, len(o.result.tokens)) for o in ctx.completed()}
    references: list[tuple[str, dict[int, Acceptance]]] = []
    problems = []
    pending = ctx.baselines.not_recorded(ctx) if stored is None else None
    if stored is None and not pending:
        problems.append(
            f"no acceptance baseline for {ctx.cell.mode}/{ctx.cell.spec} in {path.name}; create it "
            f"with: {ctx.repro} --update-baselines{ctx.baselines.option}"
        )
    # a chat turn whose earlier replies differ from the reference's has another prompt: not compared
    done = {o.round: o for o in ctx.completed()}
    recorded = ctx.baselines.earlier_replies(ctx)
    moot = {r for r, o in done.items() if ctx.prompt_differs(o, recorded)}
    if stored is not None:
        references.append(
            (
                "baseline",
                {
                    row["round"]: Acceptance.of(row, mine[row["round"]].generated)
                    for row in stored
                    if row["round"] in mine and row["round"] not in moot
                },
            )
        )
    if ctx.cell.mode != "seq" and not preset.learns_across_requests:
        seq_cell = ctx.cell.reference(mode="seq")
        references.append(
            (
                "seq",
                {
                    o.round: Acceptance.of(o.result.spec_stats, len(o.result.tokens))
                    for o in ctx.other(seq_cell)
                    if o.result.ok
                    and o.round in mine
                    and not ctx.prompt_differs(done[o.round], ctx.earlier_replies(seq_cell, o.round))
                },
            )
        )
    for label, before in references:
        missing = sorted(set(mine) - set(before) - moot)
        if label == "baseline" and missing:
            problems.append(
                f"round {missing[0]}: no acceptance baseline for it; create it with: {ctx.repro} "
                f"--update-baselines{ctx.baselines.option}"
            )
        for r in sorted(set(mine) & set(before)):
            limit = across_modes if label == "seq" else at_once.get(r, tolerance)
            why = fall(before[r], mine[r], limit)
            if why:
                problems.append(f"round {r} against {label} (tolerance {limit:.3g}): {why}")
    evidence = {
        "tolerance": tolerance,
        "tolerance_source": source,
        "requests": len(mine),
        **({"tolerance_sent_at_once": next(iter(at_once.values()))} if at_once else {}),
        **({"tolerance_against_seq": across_modes} if any(label == "seq" for label, _ in references) else {}),
        "after": summed(list(mine.values())).to_evidence(),
    }
    for label, before in references:
        evidence[label] = summed(list(before.values())).to_evidence()
    if pending:
        evidence["no_baseline"] = True
    if moot:
        evidence["not_compared_with_baseline"] = len(moot)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(
            "acceptance",
            False,
            f"{ctx.cell.id}, {problems[0]}{more}; tolerances: {source}",
            evidence,
            failures=problems,
        )
    return CheckResult("acceptance", True, pending or "", evidence)


def grammar_valid(ctx: CheckContext) -> CheckResult | None:
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
        return CheckResult(
            "grammar-valid", False, f"{len(problems)} invalid outputs; " + problems[0], evidence, failures=problems
        )
    return CheckResult("grammar-valid", True, evidence=evidence)


def _damage(scan: dict) -> str:
    """One scan verdict's damage, counted and with its first cells."""
    t = scan["totals"]
    return f"{t['duplicate_cells']} duplicate cells, {t['orphans']} orphans: " + "; ".join(
        [f"{d['count']} cells at (seq {d['seq_id']}, pos {d['pos']})" for d in scan["duplicates"]]
        + [f"orphan at (seq {o['seq_id']}, pos {o['pos']})" for o in scan["orphans"]]
        + [f"hole at seq {h['seq_id']} pos {h['first']}..{h['last']}" for h in scan["holes"]]
    )


def kv_problems(result: Result) -> list[str]:
    """What the KV scan of one request found wrong, one phrase per kind (empty: healthy, or not scanned): in the
    target's cache, in the draft model's context (the in-process engine scans it too) and past the returned
    tokens."""
    scan = result.kv_scan
    if scan is None:
        return []
    problems = []
    if not scan["healthy"]:
        problems.append(_damage(scan))
    draft = scan.get("draft")
    if draft and not draft["healthy"]:
        problems.append("the draft context: " + _damage(draft))
    past = past_returned(result)
    if past is not None:
        n = past[1] - past[0] + 1
        problems.append(
            f"{n} position{'s' if n > 1 else ''} past the returned tokens: the slot keeps positions "
            f"{past[0]}..{past[1]} after {len(result.prompt_tokens)} prompt + {len(result.tokens)} "
            f"returned tokens (stop: {result.stop_reason})"
        )
    return problems


def kv_healthy(ctx: CheckContext) -> CheckResult | None:
    """The KV scanner found no duplicate (seq_id, pos) cells, orphans past the sequence or holes, and the
    sequence holds no position past the request's prompt and returned tokens (`past_returned`); where a draft
    model's context was scanned too (in-process), its copy of the sequence holds exactly the target's positions
    (a draft context not rolled back keeps the rejected drafts' cells: orphans past the sequence)."""
    scanned = [o for o in ctx.completed() if o.result.kv_scan is not None]
    if not scanned:
        return None
    problems = {id(o): kv_problems(o.result) for o in scanned}
    bad = [o for o in scanned if problems[id(o)]]
    totals = [o.result.kv_scan["totals"] for o in scanned]
    counts = ("duplicate_cells", "orphans", "missing_positions")
    evidence = {
        "scanned": len(scanned),
        "unhealthy": len(bad),
        **{k: sum(t[k] for t in totals) for k in counts},
        "past_returned": sum(p[1] - p[0] + 1 for p in map(past_returned, (o.result for o in scanned)) if p),
    }
    drafts = [o.result.kv_scan["draft"]["totals"] for o in scanned if o.result.kv_scan.get("draft")]
    if drafts:
        evidence["draft_context"] = {"scanned": len(drafts), **{k: sum(t[k] for t in drafts) for k in counts}}
    if not bad:
        return CheckResult("kv-healthy", True, evidence=evidence)
    evidence["first"] = bad[0].result.kv_scan
    failures = [f"round {o.round}: {p}" for o in bad for p in problems[id(o)]]  # one finding a line
    draft = evidence.get("draft_context", {})
    in_draft = (
        f", {draft['duplicate_cells']} duplicate cells, {draft['orphans']} orphans and "
        f"{draft['missing_positions']} missing positions in the draft context"
        if any(draft.get(k) for k in counts)
        else ""
    )
    return CheckResult(
        "kv-healthy",
        False,
        f"{len(bad)} of {len(scanned)} requests left an unhealthy KV cache "
        f"({evidence['duplicate_cells']} duplicate cells, {evidence['orphans']} orphans, "
        f"{evidence['past_returned']} positions past the returned tokens{in_draft} in all); first: "
        f"{failures[0]}",
        evidence,
        failures=failures,
    )


def logits_close(ctx: CheckContext) -> CheckResult | None:
    """Logits agree with the reference cell's (seq mode, no speculation) within the calibrated tolerances
    of this (model, backend, device), over the positions where both produced the same tokens (a chat turn only
    where the reference sent it the same prompt: the same earlier replies). A case asking
    for `post_sampling_probs` logs the sampler chain's probabilities, not the model's: `probs-complete`
    judges those."""
    if ctx.case_def.sampling.post_sampling_probs:
        return None
    canonical = ctx.cell.reference(mode="seq", spec="none")
    reference = ctx.reference_outcome(canonical) if ctx.cell != canonical else None
    if reference is None or not reference.result.logits:
        return None
    floor = ctx.noise_floor
    worst, problems = None, []
    evidence = {"compared_runs": 0, "noise_floor": floor.describe()}
    earlier = ctx.earlier_replies(canonical, reference.round)
    for o in ctx.completed():
        if not o.result.logits or ctx.prompt_differs(o, earlier):
            continue
        same = next(
            (i for i, (a, b) in enumerate(zip(reference.result.tokens, o.result.tokens, strict=False)) if a != b),
            min(len(reference.result.tokens), len(o.result.tokens)),
        )
        comparison = compare_logits(reference.result.logits[:same], o.result.logits[:same])
        if comparison.n_compared == 0:
            continue
        evidence["compared_runs"] += 1
        evidence["max_abs"] = max(evidence.get("max_abs", 0.0), float(comparison.max_abs))
        evidence["nmse"] = max(evidence.get("nmse", 0.0), float(comparison.nmse))
        passed, message = logits_within(comparison, floor.tolerances)
        if not passed:
            problems.append(f"round {o.round}: {message}")
            worst = worst or problems[-1]
    if evidence["compared_runs"] == 0:
        return None
    if worst:
        return CheckResult(
            "logits-close",
            False,
            f"logits differ from the seq / no-speculation run beyond the {floor.describe()}; {worst}",
            evidence,
            failures=problems,
        )
    return CheckResult("logits-close", True, evidence=evidence)


def exercised(ctx: CheckContext) -> CheckResult | None:
    """The cell exercised what the suite is for (`expect:`): enough requests completed, and the speculative
    counters it names reached their minimum over the cell. A cell-level check, reported on the suite's
    first case; a counter the backend does not report (llama-server has no drop-and-retry counter) is
    listed as unmeasured, never assumed."""
    expect = ctx.run.suite.expect
    if not expect or ctx.case != ctx.run.suite.first_key:
        return None
    outcomes = ctx.run.outcomes
    completed = sum(o.result.ok for o in outcomes)
    share = completed / len(outcomes) if outcomes else 0.0
    evidence = {"requests": len(outcomes), "completed": completed}
    problems, failures = [], []
    if share < expect.get("completed_min", 0.0):
        problems.append(
            f"only {completed} of {len(outcomes)} requests completed (expected at least {expect['completed_min']:.0%})"
        )
        # one line per request that did not complete, with its error: what a known defect must explain
        failures += [
            f"{o.case} round {o.round} did not complete: {o.result.error or o.result.stop_reason}"
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


CHECKS: dict[str, Check] = {
    "no-crash": no_crash,
    "repeat-identical": repeat_identical,
    "lossless": lossless,
    "mode-invariant": mode_invariant,
    "baseline": baseline,
    "spec-ran": spec_ran,
    "acceptance": acceptance,
    "grammar-valid": grammar_valid,
    "kv-healthy": kv_healthy,
    "logits-close": logits_close,
    "exercised": exercised,
    "probs-complete": probs_complete,
    "prompt-reuse": prompt_reuse,
    "within-n-predict": within_n_predict,
}


def evaluate(ctx: CheckContext, names: list[str]) -> list[CheckResult]:
    """Run the named checks that apply; a failing one's message ends with how to reproduce it.

    A cell that could not be served at all (no model, no server) fails `no-crash` and nothing else; a
    cell the harness itself broke on raises HarnessBug (a harness error is never a check verdict)."""
    interrupt.phase("checking")
    if ctx.run.harness_error is not None:
        raise HarnessBug(ctx.run.harness_error)
    if ctx.run.error is not None:
        return [
            CheckResult(
                "no-crash",
                False,
                f"the cell could not be served: {ctx.run.error}\n  reproduce: {ctx.repro}",
                failures=[ctx.run.error],
            )
        ]
    results = []
    for name in names:
        result = CHECKS[name](ctx)
        if result is None:
            continue
        if not result.passed:
            result.message += f"\n  reproduce: {ctx.repro}"
        results.append(result)
    return results
