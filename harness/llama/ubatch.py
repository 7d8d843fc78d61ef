"""How libllama splits one `llama_decode` batch of a hybrid or recurrent model into micro-batches (ubatches).

A port of `llama_batch_allocr::split_equal` (src/llama-batch.cpp at 0c1e570) for a batch whose sequences each hold
one run of tokens, which is what llama-server decodes: every generating slot's sampled token and drafts, then the
prompt tokens of the slots reading a prompt, each slot its own sequence (`seq_id` = slot id). The hybrid memory
(src/llama-memory-hybrid.cpp `init_batch`) calls it with `sequential = !unified` and `n_keep_tail = n_rs_seq + 1`
when the recurrent memory keeps rollback snapshots (`[TAG_RECURRENT_ROLLBACK_SPLITS]`: the last 1 + n_rs_seq tokens
of a sequence stay in one ubatch); the recurrent-only memory always with `sequential = True`.

What the split says (and what it does not): a sequence put in a ubatch ahead of another ubatch of the same decode
has its recurrent cell where that later ubatch's `find_slot` ("gather and re-order") may move it; whether it moves
depends on the cell layout, which the whole history of the server shaped and which is not replayed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Geometry:
    """What decides the split: the target context's n_ubatch, unified KV or not, its recurrent memory's n_rs_seq,
    and whether the memory is hybrid (attention layers too) or recurrent only."""

    n_ubatch: int
    unified: bool
    n_rs_seq: int
    hybrid: bool

    def ubatches(self, seqs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """The micro-batches of one decode's `(slot, n_tokens)` (src/llama-memory-hybrid.cpp / -recurrent.cpp
        `init_batch`: sequential unless the hybrid memory's KV is unified; tails of 1 + n_rs_seq kept whole)."""
        tail = self.n_rs_seq + 1 if self.n_rs_seq > 0 else 0
        return split_equal(seqs, self.n_ubatch, n_keep_tail=tail, sequential=not (self.hybrid and self.unified))

    def placement(self, seqs: list[tuple[int, int]]) -> dict[int, tuple[int, int]]:
        """Each sequence of one decode → (its first micro-batch, 1-based; how many the decode has)."""
        ubatches = self.ubatches(seqs)
        out: dict[int, tuple[int, int]] = {}
        for i, ub in enumerate(ubatches):
            for seq, _ in ub:
                out.setdefault(seq, (i + 1, len(ubatches)))
        return out


def split_rollback(
    token: int, seq: int, step: int, n_draft: int, accepted: int, placed: tuple[int, int], batch: list
) -> dict | None:
    """The record of one verification that rolled drafts back (`accepted` < `n_draft`) by seq_rm after verifying
    them in a micro-batch ahead of another of the same decode (`placed`: its micro-batch, 1-based, and how many):
    `{"token": the first token generated from the rolled-back state, "slot", "step", "n_draft", "accepted", "plane":
    the snapshot plane the next decode reads (src/llama-memory-recurrent.cpp `seq_rm`: rs_idx = the positions rolled
    back), "ubatch", "ubatches", "batch": [[slot, n_tokens], ...]}`; None for any other step. One record for both
    backends (harness.backends.server_batches from llama-server's log, harness.engine from its own batches)."""
    if accepted >= n_draft or placed[0] >= placed[1]:
        return None
    return {
        "token": token, "slot": seq, "step": step, "n_draft": n_draft, "accepted": accepted,
        "plane": n_draft - accepted, "ubatch": placed[0], "ubatches": placed[1], "batch": [list(s) for s in batch],
    }  # fmt: skip


def split_equal(
    seqs: Sequence[tuple[int, int]], n_ubatch: int, *, n_keep_tail: int = 0, sequential: bool = False
) -> list[list[tuple[int, int]]]:
    """The ubatches of a batch whose sequences `seqs` are `(seq_id, n_tokens)` in batch order, each ubatch a list
    of `(seq_id, n_tokens)` in its order, as `split_equal` makes them one call after the other."""
    if n_keep_tail and n_ubatch <= n_keep_tail:
        raise ValueError(f"n_ubatch {n_ubatch} must exceed n_keep_tail {n_keep_tail} (llama.cpp asserts it)")
    remaining = {seq: n for seq, n in seqs if n > 0}
    order = [seq for seq, n in seqs if n > 0]
    ubatches: list[list[tuple[int, int]]] = []
    while any(remaining.values()):
        chosen = _sequence_sets(order, remaining, n_ubatch, sequential)
        taken = _equal_take(chosen, remaining, n_ubatch)
        if n_keep_tail:
            chosen, taken = _keep_tails(chosen, remaining, taken, n_ubatch, n_keep_tail)
        for seq in chosen:
            remaining[seq] -= taken[seq]
        ubatches.append([(seq, taken[seq]) for seq in chosen])
    return ubatches


def _sequence_sets(order: list[int], remaining: dict[int, int], n_ubatch: int, sequential: bool) -> list[int]:
    """The sequences of the next ubatch: each one with tokens left, in batch order (`sequential`: only a run of
    increasing consecutive ids from the first)."""
    chosen: list[int] = []
    for seq in order:
        if not remaining[seq]:
            continue
        if sequential and chosen and seq != chosen[-1] + 1:
            continue
        chosen.append(seq)
        if len(chosen) > n_ubatch:
            break
    return chosen


def _equal_take(chosen: list[int], remaining: dict[int, int], n_ubatch: int) -> dict[int, int]:
    """The same number of tokens from each chosen sequence: as many as the shortest has, within n_ubatch."""
    per_seq = max(1, n_ubatch // len(chosen))
    n = min(min(remaining[seq] for seq in chosen), per_seq)
    return dict.fromkeys(chosen, n)


def _keep_tails(
    chosen: list[int], remaining: dict[int, int], taken: dict[int, int], n_ubatch: int, n_keep_tail: int
) -> tuple[list[int], dict[int, int]]:
    """The longest prefix of the chosen sequences that either finish in this ubatch or keep at least n_keep_tail
    tokens for a later one; when none does, the first alone, extended to its end or cut to leave n_keep_tail."""
    keep = 0
    for seq in chosen:
        left = remaining[seq] - taken[seq]
        if left != 0 and left < n_keep_tail:
            break
        keep += 1
    if keep:
        return chosen[:keep], {seq: taken[seq] for seq in chosen[:keep]}
    first = chosen[0]
    if remaining[first] <= n_ubatch:
        return [first], {first: remaining[first]}
    return [first], {first: remaining[first] - n_keep_tail}
