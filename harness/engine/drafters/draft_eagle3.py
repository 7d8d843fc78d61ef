"""`draft-eagle3`: an EAGLE3 head drafts from the target's layer inputs (common/speculative.cpp
`common_speculative_impl_draft_eagle3` at 0c1e570).

After every target batch the head encodes the inputs of its three target layers into one row g per token (an
ENCODE of the head's context), then decodes the pairs (token[P+1], g[P]) at each position P of the batch but the
last of each sequence: that last position is the *deferred boundary*, completed by the next batch of the sequence
(the bridge) or by `draft`, which decodes (id_last, g) there and then each drafted token with the head's own
pre-norm row. `accept` moves the boundary to the last accepted position, with that position's g. For a hybrid or
recurrent target the boundary (position and g) is saved and restored with the slot's head state, as llama-server
stashes it in its context checkpoints (`get_state` / `set_state`); for other targets it is not."""

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from harness.engine.context import Context
from harness.engine.drafters.base import DraftRequest
from harness.engine.drafters.heads import Head, meta
from harness.errors import HarnessError


class DraftEagle3(Head):
    """llama.cpp `--spec-type draft-eagle3 -md HEAD`: greedy drafting (top-10 probability at or above `p_min`)
    of up to `n_max` tokens; drafts shorter than `n_min` are dropped. `stale_boundary` is fault
    `eagle3-stale-boundary` (`accept` leaves the boundary at the last verified position, a rejected draft's)."""

    name = "draft-eagle3"

    def __init__(
        self,
        path,
        target: Context,
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        stale_boundary: bool = False,
        **options,
    ):
        super().__init__(path, target, n_max, n_min, p_min, **options)
        arch = meta(self.model, "general.architecture")
        if arch != "eagle3" or len(self.layers) != 3:
            self.close()
            raise HarnessError(
                f"draft-eagle3: {path} is not an EAGLE3 head (architecture {arch}, {len(self.layers)} extract layers; "
                "expected eagle3 with 3)"
            )
        cparams = self.context_params()
        cparams.n_outputs_max = target.params.parallel  # common_base_params_to_speculative
        cparams.n_outputs_max_per_seq = 1
        self._open(cparams)
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, True)  # the head's pre-norm row of each output
        self.stale_boundary = stale_boundary
        self.stash = bool(
            llama_cpp.llama_model_is_recurrent(target.model.ptr) or llama_cpp.llama_model_is_hybrid(target.model.ptr)
        )
        """llama-server's `need_boundary_stash()`: a hybrid or recurrent target's checkpoints carry the boundary."""
        self.pending: dict[int, tuple[int, np.ndarray]] = {}
        """seq → the deferred boundary (its position, the g row to pair with the token that follows it)."""
        self.verify: dict[int, tuple[int, np.ndarray]] = {}
        """seq → the position of the sequence's first token in the last target batch and the g rows of its tokens."""

    def _encode(self, features: np.ndarray) -> np.ndarray:
        """The head's g row of each feature row (ENCODE in chunks of n_ubatch; the per-token encoder reads no
        positions, so they are placeholders after sequence 0's last, as in llama.cpp)."""
        out = []
        for i in range(0, len(features), self.n_ubatch):
            chunk = features[i : i + self.n_ubatch]
            self._clear()
            keep: list = []
            pos = self.pos_max(0) + 1
            for j, row in enumerate(chunk):
                self._add(None, pos + j, 0, row, True, keep)
            status = self._process(llama_cpp.LLAMA_PROCESS_TYPE_ENCODE)
            if status != 0:
                raise self.refused(status)
            g = llama_cpp_ext.llama_get_embeddings_nextn(self.ctx)
            if not g:
                raise HarnessError("draft-eagle3: the head's encoder produced no output")
            out.append(np.ctypeslib.as_array(g, shape=(len(chunk), self.n_embd)).copy())
        return np.concatenate(out) if out else np.zeros((0, self.n_embd), dtype=np.float32)

    def process(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Per sequence of the target's batch, in sequence order: the bridge to its previous batch's boundary,
        the pairs (token[k+1], g[k]) at each position but the last, and the new boundary."""
        if not entries:
            return
        g = self._encode(self.features(len(entries)))
        spans: dict[int, list[int]] = {}
        for k, (_, _, seq_id, _) in enumerate(entries):
            spans.setdefault(seq_id, [k, k])[1] = k  # each sequence's tokens are contiguous in the batch
        self._clear()
        keep: list = []
        for seq_id in sorted(spans):
            beg, end = spans[seq_id]
            pos_beg = entries[beg][1]
            pending = self.pending.get(seq_id)
            if pending is not None and pending[0] + 1 == pos_beg and pending[0] > self.pos_max(seq_id):
                self._add(entries[beg][0], pending[0], seq_id, pending[1], False, keep)
            for k in range(beg, end):
                self._add(entries[k + 1][0], entries[k][1], seq_id, g[k], False, keep)
            self.verify[seq_id] = (pos_beg, g[beg : end + 1].copy())
            self.pending[seq_id] = (entries[end][1], g[end].copy())
        if self.batch_seqs:
            status = self._process()
            if status != 0:
                raise self.refused(status)

    def draft(self, req: DraftRequest) -> list[int]:
        return self.draft_many([req])[req.seq_id]

    def draft_many(self, reqs: list[DraftRequest]) -> dict[int, list[int]]:
        """Draft for every sequence of `reqs` in one batch per step, as common/speculative.cpp does: complete each
        boundary with its id_last, then draft each sequence's argmax token with the head's pre-norm row while its
        top-10 probability stays at or above p_min, up to n_max; the drafted positions leave the head's context
        afterwards (llama-server removes what follows the target's last)."""
        results: dict[int, list[int]] = {req.seq_id: [] for req in reqs}
        start: dict[int, int] = {}
        self._clear()
        keep: list = []
        for req in sorted(reqs, key=lambda r: r.seq_id):
            pending = self.pending.get(req.seq_id)
            if pending is None:
                continue
            start[req.seq_id] = pending[0]
            llama_cpp.llama_memory_seq_rm(self.memory, req.seq_id, pending[0], -1)
            self._add(req.id_last, pending[0], req.seq_id, pending[1], True, keep)
        drafting = sorted(start)
        step = 0
        while drafting and self._process() == 0:
            rows, still = [], []
            for idx, seq_id in enumerate(drafting):
                token, p = self.best(idx)
                if p < self.p_min:
                    continue
                results[seq_id].append(token)
                if len(results[seq_id]) >= self.n_max:
                    continue
                prenorm = llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx, idx)
                rows.append(
                    (
                        token,
                        start[seq_id] + step + 1,
                        seq_id,
                        np.ctypeslib.as_array(prenorm, shape=(self.n_embd,)).copy(),
                    )
                )
                still.append(seq_id)
            self._clear()
            keep = []
            for token, pos, seq_id, row in rows:
                self._add(token, pos, seq_id, row, True, keep)
            drafting = still
            step += 1
        for req in reqs:
            self.drop_draft(req.seq_id, len(req.history))
            if len(results[req.seq_id]) < self.n_min:
                results[req.seq_id] = []
        return results

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """The boundary moves to the last accepted position, with its g (`eagle3-stale-boundary`: it stays at the
        last verified one)."""
        verify = self.verify.get(seq_id)
        if verify is None or self.stale_boundary:
            return
        pos_first, rows = verify
        i = min(n_accepted, len(rows) - 1)
        self.pending[seq_id] = (pos_first + i, rows[i].copy())

    def _get_extra(self, seq_id: int) -> object:
        pending = self.pending.get(seq_id)
        return None if not self.stash or pending is None else (pending[0], pending[1].copy())

    def _set_extra(self, seq_id: int, extra: object) -> None:
        if self.stash and extra is not None:
            pos, row = extra
            self.pending[seq_id] = (pos, row.copy())
