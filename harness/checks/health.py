"""The checks of what lies behind a cell's outputs: a JSON output valid for its schema (`grammar-valid`), a
healthy KV cache (`kv-healthy`), and logits close to the `seq`, non-speculative run's (`logits-close`)."""

import json

import jsonschema

from harness.checks.base import (
    NO_OUTPUT,
    CheckContext,
    CheckResult,
    not_run,
    past_returned,
)
from harness.result import Result
from harness.result.logits import check as logits_within
from harness.result.logits import compare as compare_logits
from harness.suites import jsonschemas


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
