"""Named checks: each a small function of a CheckContext returning pass/fail plus evidence.

A check that does not apply to a case (e.g. `lossless` without speculation), or lacks what it judges, returns
`not_run(name, reason)`: recorded and reported, never a pass (`evaluate` gives each check exactly one of passed,
failed, not run, harness error). Every token
comparison follows one policy (harness.checks.compare): a proven near-tie is reported but excused where
numerics can move a token (outside `seq` mode, and in `seq` for a model whose calibrated speculative runs are
not bit-identical to no speculation); any other divergence fails. A chat turn is compared only with a run that
sent it the same prompt.
"""

import json
import traceback
from collections.abc import Callable

import jsonschema

from harness import interrupt
from harness.checks import seeded
from harness.checks.acceptance import check as acceptance_check
from harness.checks.base import (
    NO_OUTPUT,
    NOT_SPECULATIVE,
    CellSource,
    CheckContext,
    CheckResult,
    harness_fault,
    not_run,
    past_returned,
)
from harness.checks.budget import within_n_predict
from harness.checks.compare import NOT_RUN, compare_outcome, compare_tokens
from harness.checks.distribution import output_distribution
from harness.checks.metrics import metrics_agree
from harness.checks.probs import probs_complete
from harness.checks.restore import restore_identical
from harness.checks.reuse import prompt_reuse
from harness.checks.synth import NOT_VALID, accepts_synthetically, synth_acceptance
from harness.checks.work import work
from harness.engine import detok as detokenizers
from harness.errors import HarnessBug, HarnessError
from harness.matrix import spec_preset
from harness.result import Result
from harness.result.cellrun import CellRun
from harness.result.logits import check as logits_within
from harness.result.logits import compare as compare_logits
from harness.suites import case_keys, jsonschemas
from harness.verdict.baselines import BaselineError, compared_length, request_shape, shape_mismatch, shown
from harness.verdict.check_result import DID_NOT_COMPLETE

Check = Callable[[CheckContext], CheckResult | None]


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
    preset = spec_preset(ctx.cell.spec)
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
    if accepts_synthetically(spec_preset(ctx.cell.spec).options):
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


def spec_ran(ctx: CheckContext) -> CheckResult | None:
    """Drafts were generated for the case (and some accepted, where both the config and the case expect
    it: a grammar the drafter does not see may reject every draft). Under forced rejection
    (`SpecPreset.rejects_all`) every request drafted (each that generated more than one token: a request ending
    at its first token has no step to draft in) and none accepted a drafted token. A case none of whose
    requests completed is `no-crash`'s to report; one with `n_predict` 1 or 2 never drafts (the first token is
    sampled after the prompt, and a step's draft must leave room for the token sampled after it: at most
    `n_remaining - 1` tokens, llama-server's get_n_draft_max)."""
    preset = spec_preset(ctx.cell.spec)
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


def grammar_valid(ctx: CheckContext) -> CheckResult | None:
    """The output parses as JSON and satisfies the case's schema."""
    schema = ctx.case_def.sampling.json_schema
    if schema is None:
        return not_run("grammar-valid", "the case has no json_schema")
    if not ctx.completed():
        return not_run("grammar-valid", NO_OUTPUT)
    problems = []
    for o in ctx.completed():
        try:
            jsonschemas.validate(json.loads(o.result.text), schema)
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
    if scan is None or not scan.get("judged", True):  # not judged: the saved state is not provably the request's
        return []
    problems = []
    if not scan["healthy"]:
        problems.append(_damage(scan))
    draft = scan.get("draft")
    if draft and not draft["healthy"]:
        problems.append("the draft context: " + _damage(draft))
    lost = scan.get("lost")
    if lost:  # a seq slot of llama-server shorter than its own request (server_backend.lost_cells)
        parts = (
            f", its tokens part from the request's at token {lost['common']}" if lost["common"] < lost["held"] else ""
        )
        problems.append(
            f"{lost['lost']} cell{'s' if lost['lost'] > 1 else ''} lost: the slot, saved right after the request "
            f"with no other on the server, holds {lost['held']} cells after {lost['prompt']} prompt + "
            f"{lost['returned']} returned tokens (at least {lost['needed']} expected){parts}"
        )
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
    (a draft context not rolled back keeps the rejected drafts' cells: orphans past the sequence); and a `seq`
    slot of llama-server, saved right after its request with no other on the server, holds at least the request's
    prompt and returned tokens (fewer: cells lost, `server_backend.lost_cells`)."""
    scanned = [o for o in ctx.completed() if o.result.kv_scan is not None and o.result.kv_scan.get("judged", True)]
    unjudged = [o for o in ctx.completed() if o.result.kv_scan is not None and not o.result.kv_scan.get("judged", True)]
    if not scanned:
        return not_run(
            "kv-healthy",
            NO_OUTPUT
            if not ctx.completed()
            else f"no judged KV scan of the {len(ctx.completed())} completed requests"
            + (f" (round {unjudged[0].round}: {unjudged[0].result.kv_scan['reason']})" if unjudged else ""),
        )
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
    lost = sum(o.result.kv_scan["lost"]["lost"] for o in scanned if o.result.kv_scan.get("lost"))
    if lost:  # cells a seq slot lost (server_backend.lost_cells)
        evidence["lost_cells"] = lost
    if unjudged:  # saved states not provably the request's own (server_backend.slot_ownership)
        evidence["not_judged"] = {"requests": len(unjudged), "first": unjudged[0].result.kv_scan["reason"]}
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
    lost_part = f", {lost} cell{'s' if lost > 1 else ''} lost" if lost else ""
    return CheckResult(
        "kv-healthy",
        False,
        f"{len(bad)} of {len(scanned)} requests left an unhealthy KV cache "
        f"({evidence['duplicate_cells']} duplicate cells, {evidence['orphans']} orphans, "
        f"{evidence['past_returned']} positions past the returned tokens{in_draft}{lost_part} in all); first: "
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
        return not_run("logits-close", "the case logs post-sampling probabilities (probs-complete judges them)")
    canonical = ctx.cell.reference(mode="seq", spec="none")
    if ctx.cell == canonical:
        return not_run("logits-close", "the cell is the seq / no-speculation reference itself")
    reference = ctx.reference_outcome(canonical)
    if reference is None or not reference.result.logits:
        return not_run("logits-close", f"the reference cell {canonical.id} logged no logits for the case")
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
            worst_at = int(comparison.per_position.loc[comparison.per_position["max_abs"].idxmax()].position)
            problems.append(f"round {o.round}: {message}{o.result.split_rollback_before(worst_at)}")
            worst = worst or problems[-1]
    if evidence["compared_runs"] == 0:
        return not_run("logits-close", "no request with logits sent the reference's prompt")
    if worst:
        return CheckResult(
            "logits-close",
            False,
            f"logits differ from the seq / no-speculation run beyond the {floor.describe()}; {worst}",
            evidence,
            failures=problems,
        )
    return CheckResult("logits-close", True, evidence=evidence)


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
    "work": work,
    "metrics-agree": metrics_agree,
    "restore-identical": restore_identical,
    "distribution": output_distribution,
    "synth-acceptance": synth_acceptance,
}


def evaluate(ctx: CheckContext, names: list[str]) -> list[CheckResult]:
    """Every named check's outcome on one case of one cell, one result each, in order:

    - passed / failed: a verdict the software under test earned (a failing one's message ends with how to
      reproduce it); a llama.cpp crash, at start-up included, is a failed `no-crash`;
    - not run (`CheckResult.not_run`, with the reason): the check does not apply to the case, or what it needs
      did not happen (no request completed: `no-crash` says why);
    - harness error (`CheckResult.harness_error`): the harness could not serve this cell or a cell the check
      compares with, or a check raised. Never a verdict and never excused by a known failure: `specharness run`
      exits 3, the pytest item is an ERROR.
    """
    interrupt.phase("checking")
    if ctx.run.unservable is not None:  # the model has nothing the cell's speculative type needs: no verdict
        return [not_run(name, ctx.run.unservable) for name in names]
    if ctx.run.fault is not None:  # the cell was never (fully) served: nothing in it was earned
        trace = ctx.run.harness_error or ctx.run.fault
        return [harness_fault(name, f"the cell could not be served: {trace}") for name in names]
    results = []
    for name in names:
        try:
            result = CHECKS[name](ctx)
        except HarnessError as err:  # e.g. a reference cell the harness could not serve
            result = harness_fault(name, str(err))
        except HarnessBug as err:
            result = harness_fault(name, err.args[0] if err.args else repr(err))
        except Exception:  # noqa: BLE001 - a bug of ours in a check: a harness error, with its traceback
            result = harness_fault(name, traceback.format_exc())
        if result is None:
            result = not_run(name, "does not apply to this case")
        if result.is_verdict and not result.passed:
            result.message += f"\n  reproduce: {ctx.repro}"
        results.append(result)
    return results


def plain_detokenizer(tokens: list[int]) -> str:
    """Token ids as text where the model's vocabulary is not at hand."""
    return " ".join(f"<{t}>" for t in tokens)


def evaluate_cell(
    run: CellRun,
    cells: CellSource,
    baselines,
    names: list[str],
    repro: Callable[[str], str] | str,
    keys: list[str] | None = None,
) -> list[tuple[str, CheckResult]]:
    """The one loop over a cell's cases (every record name, or those in `keys`): each case's `evaluate` of the
    checks `names`, as (record name, result). `cells` serves the cells the checks compare with; `repro` is the
    command that reproduces the cell (or, given a record name, the case). Every caller (run, the pytest plugin,
    bisect, shrink) judges through here: one policy for harness errors, the detokenizer and what is not run."""
    detok = detokenizers.for_model(run.cell.model) if run.fault is None else None
    out = []
    for case in run.suite.cases:
        for key in case_keys(case):
            if keys is not None and key not in keys:
                continue
            command = repro(key) if callable(repro) else repro
            ctx = CheckContext(run, key, cells, baselines, detok or plain_detokenizer, command)
            out += [(key, r) for r in evaluate(ctx, names)]
    return out


def harness_errors(results) -> list[CheckResult]:
    """The results (CheckResults, or tuples ending with one) that are harness errors."""
    return [r for r in (x[-1] if isinstance(x, tuple) else x for x in results) if r.harness_error is not None]
