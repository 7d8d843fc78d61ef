"""`prompt-reuse`: speculation changes nothing about how much of a prompt a slot reuses from its cache.

A request reuses the prompt tokens its slot still holds from the previous request (llama-server's timings
`cache_n`: a chat turn reuses the earlier turns and the reply). What the slot holds after a reply must not
depend on speculation: a slot that kept tokens it never returned (drafts accepted past an end-of-generation
token, ggml-org/llama.cpp#28049) no longer ends in a prefix of the next turn's prompt; a dense model then
drops the extra cells and reuses the same prefix, but a hybrid or recurrent model cannot drop cells and
re-processes the prompt from a context checkpoint or from the start: the same output, at the cost of time.
"""

from harness.checks.base import NO_OUTPUT, NOT_SPECULATIVE, CheckContext, CheckResult, not_run, past_returned
from harness.result.cellrun import Outcome
from harness.suites import RESTORE_ROUNDS

NO_ENGINE_REUSE = (
    "the in-process engine reports no prompt-cache reuse (it clears a slot after every request and reads each "
    "prompt whole: cache_n is 0 in both cells; only a request served right after a slot restore reuses a state)"
)


def engine_reuses(ctx: CheckContext, outcome: Outcome) -> bool:
    """Whether the request could reuse a prompt cache and report it: always on llama-server; in-process only the
    chat turn right after a slot restore (harness.engine.slot_state.reuse), as every other request starts on a
    cleared slot."""
    if ctx.cell.backend != "inproc":
        return True
    suite = ctx.run.suite
    turn = ctx.case.rpartition(".turn")[2]
    return (
        suite.restore_after is not None
        and turn.isdigit()
        and int(turn) == suite.restore_after + 1
        and outcome.round < len(suite.rounds)
        and suite.rounds[outcome.round] in RESTORE_ROUNDS
    )


def left_behind(ctx: CheckContext, outcome: Outcome) -> str:
    """' (<previous turn> left positions a..b past its returned tokens)' for a chat turn whose previous turn's
    KV scan found the slot holding more than that turn returned (`past_returned`), else ''."""
    name, _, turn = ctx.case.rpartition(".turn")
    if not name or not turn.isdigit() or int(turn) < 2:
        return ""
    before = f"{name}.turn{int(turn) - 1}"
    previous = next((o for o in ctx.run.of_case(before) if o.round == outcome.round and o.result.ok), None)
    past = past_returned(previous.result) if previous is not None else None
    if past is None:
        return ""
    return (
        f" ({before} left positions {past[0]}..{past[1]} past its {len(previous.result.tokens)} returned tokens, "
        f"stop: {previous.result.stop_reason})"
    )


def prompt_reuse(ctx: CheckContext) -> CheckResult | None:
    """Per round, the speculative cell's request of this case (a chat turn) reuses as many prompt tokens from
    the slot's cache (`Result.timings.cache_n`) as the non-speculative cell's request of the same round, where
    both sent the same prompt (a prompt that differs follows an earlier reply that differed: `lossless`'s to
    report). The in-process engine reuses no prompt cache between requests (cache_n 0 in both cells): on its cells
    only the chat turn right after a slot restore is compared (`engine_reuses`), else the check is not run.
    Meaningful where the slot a request lands on and what it served before follow from the suite: one case at a
    time (`run_order: [seq]`, or one case). A failing chat turn names what its previous turn left in the slot
    (`left_behind`)."""
    if not ctx.cell.preset.speculative:
        return not_run("prompt-reuse", NOT_SPECULATIVE)
    if not ctx.completed():
        return not_run("prompt-reuse", NO_OUTPUT)
    reusing = [o for o in ctx.completed() if engine_reuses(ctx, o)]
    if not reusing:
        return not_run("prompt-reuse", NO_ENGINE_REUSE)
    reference = ctx.cell.reference(spec="none")
    theirs = {o.round: o.result for o in ctx.other(reference) if o.result.ok}
    pairs = [
        (o, theirs[o.round])
        for o in reusing
        if o.round in theirs and theirs[o.round].prompt_tokens == o.result.prompt_tokens
    ]
    if not pairs:
        return not_run("prompt-reuse", f"no round of {reference.id} completed with the same prompt")
    differ = [(o, ref, left_behind(ctx, o)) for o, ref in pairs if o.result.timings.cache_n != ref.timings.cache_n]
    failures = [
        f"round {o.round}: {ctx.case} reused {o.result.timings.cache_n} of its {len(o.result.prompt_tokens)} "
        f"prompt tokens from the cache, {ref.timings.cache_n} in {reference.id}{behind}"
        for o, ref, behind in differ
    ]
    evidence = {
        "compared": len(pairs),
        "cache_n": [o.result.timings.cache_n for o, _ in pairs],
        "reference_cache_n": [ref.timings.cache_n for _, ref in pairs],
    }
    if failures:
        # the differing rounds that follow a turn which left positions past its returned tokens (signatures: a
        # consequence)
        evidence["left_behind"] = sum(1 for *_, behind in differ if behind)
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult("prompt-reuse", False, f"{ctx.cell.id}, {failures[0]}{more}", evidence, failures=failures)
    return CheckResult("prompt-reuse", True, evidence=evidence)
