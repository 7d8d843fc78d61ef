"""`probs-complete`: the token probabilities a request asked for (`n_probs`) come back for every generated
token, with and without speculation, and a speculative cell's agree with the non-speculative cell's.

It reads `Result.logits` as the backend returned them: llama-server's empty lists stay empty there (triage's
re-scoring of such positions, harness.execute.Rescorer, never writes into a Result).
"""

from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, not_run
from harness.result.cellrun import Outcome
from harness.result.logits import check as logits_within
from harness.result.logits import compare as compare_logits
from harness.suites.request import Sampling


def list_size(sampling: Sampling) -> tuple[int, int]:
    """(fewest, most) entries a token's list must have. The model's probabilities (`logprob`): exactly
    `n_probs` (a vocabulary is far larger). Post-sampling ones (`prob`): only the candidates the sampler
    chain left with a probability above 0, so 1 to `n_probs`; exactly 1 for a greedy request, whose
    temperature-0 sampler leaves the picked token alone at probability 1."""
    n = sampling.n_probs or 0
    if not sampling.post_sampling_probs:
        return n, n
    return (1, 1) if sampling.greedy else (1, n)


def judged(sampling: Sampling) -> bool:
    """Whether the probabilities are compared with the non-speculative cell's: the model's always (within
    the calibrated tolerances: they are what `specharness calibrate` measures), post-sampling ones of a
    greedy request too (each is the picked token at probability 1, so on a correct run the values agree
    exactly). Post-sampling probabilities of a sampled request are not: last-bit logit noise can move a
    candidate across a top-p / min-p edge, and its probability p (at least min_p × the top one: 0.01 at
    min_p 0.05 and a top of 0.2) renormalises every other candidate by log(1 / (1 − p)) ≈ p nats, ten
    times the calibrated max |Δ| of the tiny models; their presence and size are still checked."""
    return not sampling.post_sampling_probs or sampling.greedy


def gaps(outcome: Outcome, sampling: Sampling) -> tuple[list[int], list[tuple[int, int]]]:
    """One request's (positions without probabilities, (position, entries) of lists of a wrong size). A
    position past the end of the list counts as without, except after a stop string (llama-server drops
    the entries of the tokens that spell it)."""
    tokens, records = outcome.result.tokens, outcome.result.logits
    covered = min(len(tokens), len(records)) if outcome.result.stop_reason == "word" else len(tokens)
    fewest, most = list_size(sampling)
    sizes = [len(records[p].top_ids) if p < len(records) else 0 for p in range(covered)]
    return (
        [p for p, k in enumerate(sizes) if k == 0],
        [(p, k) for p, k in enumerate(sizes) if k and not fewest <= k <= most],
    )


def _no_entry(outcome: Outcome, missing: list[int]) -> str:
    """' (k of them with no entry at all, ...)' for the missing tokens llama-server gave no entry (Result.probs_absent:
    not an empty list, no entry), else ''."""
    none = [p for p in missing if p in set(outcome.result.probs_absent)]
    if not none:
        return ""
    return (
        f" ({len(none)} of them with no entry at all, first at token {none[0]}: llama-server adds a token's entry "
        "only when the text after it does not end inside a UTF-8 character)"
    )


def probs_complete(ctx: CheckContext) -> CheckResult | None:
    """With `n_probs` > 0, every generated token carries its top-n probabilities (n entries of the model's
    log-probabilities; with `post_sampling_probs` 1 to n of the sampler chain's, exactly 1 when greedy) in
    every cell, and in a speculative cell they agree with the non-speculative cell's over the tokens both
    produced alike, within the calibrated tolerances of (model, backend, device) (see `judged`)."""
    sampling = ctx.case_def.sampling
    done = ctx.completed()
    if not sampling.n_probs:
        return not_run("probs-complete", "the case asks for no probabilities (n_probs 0)")
    if not done:
        return not_run("probs-complete", NO_OUTPUT)
    fewest, most = list_size(sampling)
    expected = str(most) if fewest == most else f"{fewest} to {most}"
    absent, others = [], []  # one line per failing request: no probabilities; wrong size or disagreement
    n_missing = n_tokens = 0
    first = None
    for o in done:
        missing, wrong = gaps(o, sampling)
        n_tokens += len(o.result.tokens)
        n_missing += len(missing)
        if missing:
            first = first or (o.round, missing[0])
            absent.append(
                f"round {o.round}: {len(missing)} of {len(o.result.tokens)} tokens without "
                f"probabilities, first at token {missing[0]}" + _no_entry(o, missing)
            )
        if wrong:
            others.append(
                f"round {o.round}: {len(wrong)} of {len(o.result.tokens)} tokens with a top list of the "
                f"wrong size, first at token {wrong[0][0]} ({wrong[0][1]} entries, expected {expected})"
            )
    evidence = {
        "n_probs": sampling.n_probs,
        "post_sampling_probs": sampling.post_sampling_probs,
        "tokens": n_tokens,
        "without_probs": n_missing,
    }
    if ctx.cell.preset.speculative and judged(sampling):
        others += _disagreements(ctx, done, evidence)
    if not absent and not others:
        return CheckResult("probs-complete", True, evidence=evidence)
    if first:
        head = (
            f"{n_missing} of {n_tokens} generated tokens without probabilities (n_probs {sampling.n_probs}"
            f"{', post_sampling_probs' if sampling.post_sampling_probs else ''}), first at token {first[1]} "
            f"of round {first[0]}"
        )
        rest = others
    else:
        head, rest = others[0], others[1:]
    message = (
        f"{ctx.cell.id}: {head}"
        + (f"; also {rest[0]}" if rest else "")
        + (f" (and {len(rest) - 1} more)" if len(rest) > 1 else "")
    )
    return CheckResult("probs-complete", False, message, evidence, failures=absent + others)


def _disagreements(ctx: CheckContext, done: list[Outcome], evidence: dict) -> list[str]:
    """Per request, where its probabilities differ from the same round's in the non-speculative cell beyond
    the calibrated tolerances, over the positions before the outputs part and where both have a list."""
    floor = ctx.noise_floor
    reference = ctx.cell.reference(spec="none")
    evidence.update(compared_positions=0, noise_floor=floor.describe())
    problems = []
    for o in done:
        ref = ctx.reference_outcome(reference, o.round)
        if ref is None or not ref.result.ok:
            continue
        a, b = ref.result.tokens, o.result.tokens
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        comparison = compare_logits(ref.result.logits[:same], o.result.logits[:same])
        if comparison.n_compared == 0:
            continue
        evidence["compared_positions"] += comparison.n_compared
        evidence["max_abs"] = max(evidence.get("max_abs", 0.0), comparison.max_abs)
        passed, message = logits_within(comparison, floor.tolerances)
        if not passed:
            problems.append(
                f"round {o.round}: probabilities differ from the non-speculative run's beyond the "
                f"{floor.describe()}: {message}"
            )
    return problems
