"""`restore-identical`: a chat continued from a saved and restored slot drafts and accepts what it did uninterrupted.

Restore rounds (harness.execute.slot_restore) save the slot after turn `restore.after_turn` of each chat and restore it,
into the same session after erasing the slot or into a fresh session, before the next turn. The restored state
must be the whole of what the slot held: the target's sequence and, under speculation, the draft context's copy
of it. Their outputs are `repeat-identical`'s and `lossless`'s to judge (the target's state decides them); a draft
context the restore did not bring back changes no token, only the drafts: fewer accepted, more drafted, the
cost of speculation without its gain (ggml-org/llama.cpp#28619: llama-server's slot files hold the target
context only).
"""

from harness.checks.base import NO_OUTPUT, NOT_SPECULATIVE, CheckContext, CheckResult, not_run
from harness.suites import RESTORE_ROUNDS

COUNTERS = ("draft_n", "draft_n_accepted")


def restore_identical(ctx: CheckContext) -> CheckResult | None:
    """Each chat turn served after a slot restore (rounds `restore` and `restore-fresh`) drafted and accepted exactly
    as many tokens (`draft_n`, `draft_n_accepted`) as the same turn of the suite's first uninterrupted round in
    the same cell, where both sent the same prompt (a prompt that differs follows a reply that differed:
    `repeat-identical`'s to report). Exact: restore rounds send one request at a time to one slot, and a draft
    context restored with the target drafts from the same tokens. On llama-server the turn also reuses as many
    prompt tokens from the slot (`cache_n`) as the uninterrupted turn, with or without speculation: the restored
    slot holds the same tokens, so it must serve the next prompt from the same prefix; a slot brought back
    without its context checkpoints makes a hybrid or recurrent model that has to go back inside its tokens (a
    regenerated reply, a prompt that is not an extension of the restored tokens) read the prompt from the start
    (ggml-org/llama.cpp#28194). The in-process engine keeps no prompt cache between requests (an uninterrupted turn
    reads its whole prompt, a restored one the part after the restored tokens), so there `cache_n` is evidence
    only; a prompt read in other batches changes the draft model's logits in the last bits at most (measured on
    tiny-dense and tiny-hybrid: cache_n 0 against 73, 85 and 152, the counts identical).
    """
    suite = ctx.run.suite
    kinds = suite.rounds
    if not any(k in RESTORE_ROUNDS for k in kinds):
        return not_run("restore-identical", "the suite restores no slot (run_order has no restore round)")
    speculative = ctx.cell.preset.speculative
    reuse = ctx.cell.backend == "server"  # the engine keeps no prompt cache: its cache_n is evidence only
    if not speculative and not reuse:
        return not_run("restore-identical", f"{NOT_SPECULATIVE}, and the in-process engine keeps no prompt cache")
    turn = ctx.case.rpartition(".turn")[2]
    if not turn.isdigit() or int(turn) <= (suite.restore_after or 0):
        return not_run("restore-identical", f"{ctx.case} is served before the slot is saved and restored")
    done = {o.round: o for o in ctx.completed()}
    if not done:
        return not_run("restore-identical", NO_OUTPUT)
    reference = next((done[r] for r, k in enumerate(kinds) if k not in RESTORE_ROUNDS and r in done), None)
    if reference is None:
        return not_run("restore-identical", "no uninterrupted round of the case completed (no-crash says why)")
    earlier = ctx.earlier_replies(ctx.cell, reference.round)
    compared, failures, skipped, said = [], [], [], []
    for r, outcome in sorted(done.items()):
        if kinds[r] not in RESTORE_ROUNDS:
            continue
        if ctx.prompt_differs(outcome, earlier):
            skipped.append(r)
            continue
        mine, theirs = outcome.result, reference.result
        compared.append(
            {
                "round": r,
                "kind": kinds[r],
                **{k: mine.spec_stats.get(k, 0) for k in COUNTERS},
                "cache_n": mine.timings.cache_n,
                "reference": {**{k: theirs.spec_stats.get(k, 0) for k in COUNTERS}, "cache_n": theirs.timings.cache_n},
            }
        )
        if reuse and mine.timings.cache_n != theirs.timings.cache_n:
            line = (
                f"{ctx.case} reused {mine.timings.cache_n} prompt tokens of the restored slot, "
                f"{theirs.timings.cache_n} in the uninterrupted round {reference.round}"
            )
            failures.append(f"round {r} ({kinds[r]}): {line}")
            said.append(f"round {r} ({kinds[r]}): {line}")
        if speculative and any(mine.spec_stats.get(k, 0) != theirs.spec_stats.get(k, 0) for k in COUNTERS):
            counts = (
                f"accepted {mine.spec_stats.get('draft_n_accepted', 0)} of {mine.spec_stats.get('draft_n', 0)} "
                f"drafted tokens, {theirs.spec_stats.get('draft_n_accepted', 0)} of "
                f"{theirs.spec_stats.get('draft_n', 0)} in the uninterrupted round {reference.round}"
                + (" (same output)" if mine.tokens == theirs.tokens else " (another output)")
            )
            failures.append(f"round {r} ({kinds[r]}): {ctx.case} {counts}")
            said.append(f"round {r} ({kinds[r]}): the restored turn {counts}")
    evidence = {"reference_round": reference.round, "compared": compared, "not_compared": skipped}
    if not compared:
        return not_run("restore-identical", "every restored round sent another prompt (repeat-identical says why)")
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        # the message names neither the cell nor the case: its signature is the same in a run and in a
        # `specharness repro` / `shrink` trial (whose verdicts carry no cell to take out of it)
        return CheckResult("restore-identical", False, f"{said[0]}{more}", evidence, failures=failures)
    return CheckResult("restore-identical", True, evidence=evidence)
