"""Fault switches: each one re-creates, on purpose, a bug class seen in llama.cpp's speculative path,
so that the harness can prove it catches it. All are off by default."""

from harness.errors import HarnessError

FAULTS = {
    "skip-seq-rm-after-restore": "after a checkpoint restore, leave the rejected drafts' attention cells in place "
    "(duplicate (seq_id, pos) cells pile up)",
    "no-sampler-restore": "after a checkpoint restore, keep the sampler that already accepted the rejected step "
    "(ghost tokens in grammar / penalty / RNG state)",
    "no-penalty-restore": "after a checkpoint restore, the repetition-penalty history keeps the rejected draft tokens "
    "(the rest of the sampler, grammar and RNG included, is restored)",
    "keep-drafts-on-decode-failure": "when a speculative step's decode fails, keep the drafts in the slot's "
    "bookkeeping "
    "(stale positions: the next decode is invalid)",
    "rollback-off-by-one": "remove one rejected position too few after a partial acceptance",
    "partial-checkpoint-only": "on a partial acceptance restore only the PARTIAL_ONLY checkpoint: no attention "
    "trim, no sampler "
    "restore, no re-decode (the recurrent state falls behind the attention cells)",
    "stale-draft-context": "after a rejection the draft model's context is not rolled back: the rejected draft "
    "tokens stay in it "
    "and the draft sequence runs on past them (outputs stay lossless; its drafts degrade)",
    "shared-drafter-state": "the n-gram drafters with a state per slot (ngram-map-k, ngram-map-k4v) share one, "
    "as if keyed by slot 0 "
    "(outputs stay lossless; the slots' drafts degrade, so only par / no-kv-unified show it)",
    "ngram-cache-kept-across-requests": "ngram-cache's begin() keeps the slot's cache of its previous request and "
    "counts only the part of a new history longer than any before (ggml-org/llama.cpp#27852; outputs stay "
    "lossless, drafts come from the old request's n-grams)",
    "full-checkpoint": "checkpoint the whole sequence state (the attention KV cells too) before each verification "
    "where the PARTIAL_ONLY state suffices (the kind of ggml-org/llama.cpp PR #28873 and #28118; outputs and "
    "acceptance stay the same, each step copies more bytes)",
    "mtp-wrong-row": "draft-mtp pairs the next token with the target's hidden row of the last verified position "
    "instead of the last accepted one after a rejection (the MTP head drafts from a neighbouring position's "
    "state; outputs stay lossless, its drafts degrade)",
    "eagle3-stale-boundary": "draft-eagle3 leaves its deferred boundary at the last verified position after a "
    "rejection, not the last accepted one (the head pairs the next token with a rejected draft's g row; outputs stay "
    "lossless, its drafts degrade)",
    "head-draft-left-in-cache": "the draft heads (draft-eagle3, -dflash, -dspark) leave the positions they drafted in "
    "their context's KV cache (the block's anchor and mask cells, EAGLE3's drafted pairs), beside what the next "
    "target batch writes there (rejected drafts left in the cache; outputs stay lossless, the drafts degrade)",
    "head-wrong-layer": "the draft heads (draft-eagle3, -dflash, -dspark) concatenate their target layers' inputs in "
    "reverse order (each slot of the head's input gets another layer's hidden state; outputs stay lossless, the "
    "drafts degrade)",
    "stale-partial-rollback": "a partial rollback (recurrent snapshots, n_rs_seq) restores the recurrent state "
    "one token stale: the state before the last kept token, as llama.cpp serves a snapshot plane a single-token "
    "step left behind (ggml-org/llama.cpp PR #29117); positions and attention cells stay right, the output drifts",
    # rejection sampling (--spec-draft-sampling probabilistic, temperature > 0): each keeps the output plausible
    # and changes the distribution of sampled outputs (or only the seeded tokens), which only a statistical check sees
    "lenient-accept": "rejection sampling accepts a drafted token whenever the target gives it any probability "
    "(p_x > 0) instead of with probability min(1, p/q) (the output leans to the draft's distribution)",
    "residual-unnormalised": "after a rejection the redraw walks the residual max(0, p - q) with a uniform in "
    "[0, 1) not scaled by the residual's sum (falling off the end picks its last token: the redraw leans to "
    "unlikely tokens)",
    "q-wrong-temperature": "the draft samples at the target's temperature but keeps q, its candidates' "
    "probabilities, at temperature 1 (acceptance p/q and the residual are computed against the wrong q)",
    "extra-draw-after-reject": "after a rejected draft one extra random number is drawn: under rejection sampling "
    "one uniform from the rejection stream before the residual draw, under sample-and-match (a mismatch at "
    "temperature > 0) one draw of the sampler chain's generator, the chain applied once more to the row without "
    "accepting (the distribution is kept; the seeded tokens change, so sample-and-match output leaves the "
    "non-speculative output where the logits are identical: on targets rolled back by seq_rm or recurrent "
    "snapshots, a checkpoint restore puts the sampler back)",
    "bonus-wrong-row": "after a draft accepted whole, the bonus token is sampled from the last drafted token's row "
    "(one row early: an off-by-one in the verification batch's output indices) instead of the row after it (sample-"
    "and-match and rejection sampling alike: the output leaves the target's distribution at the bonus token of a "
    "whole accepted draft, which a close draft reaches at most steps: suites/sampling-close.yaml)",
    "rejection-rng-rewound": "after a checkpoint restore, the rejection-sampling stream is rewound with the rest of "
    "the sampler, as llama-server b11434 does (common_sampler_copy copies `rng`; the replay draws none): the next "
    "verification reuses the uniforms that decided the rolled-back step (hybrid and recurrent targets; the "
    "distribution moves)",
}


GRADED = {
    "over-accept": "rejection sampling accepts a drafted token with probability min(1, (1 + ε)·p/q) instead of "
    "min(1, p/q) (`over-accept=ε`, ε ≥ 0: the output leans to the draft's distribution by a total variation that "
    "grows with ε; `specharness bench distribution --fault over-accept=ε` measures the check's power against it)",
}
"""Faults with a strength, given as `name=value`: a graded bias to measure a statistical check's power against
(issue 61). Not in FAULTS: the selftest's catch matrix is of the named bug classes."""


def check_fault(name: str | None) -> str | None:
    """Validate a fault name, or a graded fault's `name=value` (None = no fault)."""
    if name is None or name in FAULTS:
        return name
    base, _, value = name.partition("=")
    if base in GRADED:
        try:
            strength = float(value)
        except ValueError:
            strength = -1.0
        if not strength >= 0.0:
            raise HarnessError(f"fault '{name}': give its strength as {base}=ε with ε a number >= 0, e.g. {base}=0.1")
        return name
    graded = ", ".join(f"{g}=ε" for g in GRADED)
    raise HarnessError(f"unknown fault '{name}' (known: {', '.join(FAULTS)}; graded: {graded})")


def strength(fault: str | None, name: str) -> float | None:
    """The strength of graded fault `name` when `fault` is it (`name=ε`), else None."""
    if fault is None or not fault.startswith(name + "="):
        return None
    return float(fault.partition("=")[2])
