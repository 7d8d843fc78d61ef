"""`draft-dflash` and `draft-dspark`: a block-diffusion head drafts a whole block in one decode
(common/speculative.cpp `common_speculative_impl_draft_dflash` at 0c1e570; DSpark is the same drafter with an
anchor-first block).

After every target batch the inputs of the head's target layers are injected into the head's KV cache at the target's
positions (an embedding-only decode of the features, per sequence, in chunks of n_ubatch). To draft, the head decodes
the block [id_last, <mask> x (n_max)] at the positions after the target's last (DSpark with `sample_from_anchor`:
n_max tokens, [id_last, <mask> ...] read from its first slot) and reads the argmax of each slot; the block leaves the
head's context afterwards. Its trained block size (`dflash.block_size`) caps the draft: DFlash drafts at most
block - 1 tokens, anchor-first DSpark block. `accept` does nothing (the injected rows past the accepted ones are
rolled back with the target's)."""

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from harness.engine.context import Context
from harness.engine.drafters.base import DraftRequest
from harness.engine.drafters.heads import Head, meta, model_dflash_selector_top_k
from harness.errors import HarnessError


class DraftDFlash(Head):
    """llama.cpp `--spec-type draft-dflash -md HEAD` (`dspark`: `--spec-type draft-dspark`): greedy block drafting;
    a DFlash block stops at the first slot whose top-10 probability is below `p_min`, a DSpark block at the first
    whose confidence head says so; drafts shorter than `n_min` are dropped."""

    name = "draft-dflash"

    def __init__(
        self,
        path,
        target: Context,
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        dspark: bool = False,
        **options,
    ):
        if dspark:
            self.name = "draft-dspark"
        super().__init__(path, target, n_max, n_min, p_min, **options)
        arch = meta(self.model, "general.architecture")
        if arch != "dflash" or not self.layers:
            self.close()
            raise HarnessError(
                f"{self.name}: {path} is not a DFlash head (architecture {arch}, {len(self.layers)} extract layers)"
            )
        self.dspark = dspark
        self.block = int(meta(self.model, "dflash.block_size") or 16)
        self.from_anchor = meta(self.model, "dflash.sample_from_anchor") in (None, "true")
        causal = meta(self.model, "dflash.attention.causal") == "true"
        if model_dflash_selector_top_k is not None and model_dflash_selector_top_k(self.model) > 0:
            self.close()
            raise HarnessError(f"{self.name}: {path} is a DFlash2 head (a selector lattice), which the engine lacks")
        if dspark and p_min > 0 and meta(self.model, "dflash.has_confidence_head") not in (None, "true"):
            self.close()
            raise HarnessError("DSpark draft has no confidence head: please set --spec-draft-p-min 0")
        self.mask = llama_cpp.llama_vocab_mask(llama_cpp.llama_model_get_vocab(self.model))
        anchored = dspark and self.from_anchor
        n_draft_max = self.block if anchored else self.block - 1
        self.n_max, self.n_min = min(n_max, n_draft_max), min(n_min, n_draft_max)
        self.n_block = self.n_max + (0 if anchored else 1)
        """The block's slots: the anchor (id_last) and the masks."""
        self.first = 0 if anchored else 1
        """The block's first slot read as a draft token (DFlash and bonus-anchor DSpark read the masks only)."""
        cparams = self.context_params()
        per_seq = max(1, n_max + 1)  # common_base_params_to_speculative: the anchor and n_max masks
        cparams.n_outputs_max = target.params.parallel * per_seq
        cparams.n_outputs_max_per_seq = per_seq if self.backend_sampling else 1
        self._open(cparams)
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, True)
        llama_cpp.llama_set_causal_attn(self.ctx, causal)  # block-internal attention is non-causal unless told

    def process(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Inject each sequence's features at the target's positions, in chunks of n_ubatch."""
        if not entries:
            return
        features = self.features(len(entries))
        rows: dict[int, list[int]] = {}
        for k, (_, _, seq_id, _) in enumerate(entries):
            rows.setdefault(seq_id, []).append(k)
        for seq_id in sorted(rows):
            ks = rows[seq_id]
            for offset in range(0, len(ks), self.n_ubatch):
                self._clear()
                keep: list = []
                for k in ks[offset : offset + self.n_ubatch]:
                    self._add(None, entries[k][1], seq_id, features[k], False, keep)
                status = self._process()
                if status != 0:
                    raise self.refused(status)

    def draft(self, req: DraftRequest) -> list[int]:
        return self.draft_many([req])[req.seq_id]

    def draft_many(self, reqs: list[DraftRequest]) -> dict[int, list[int]]:
        """Decode every sequence's block in one batch, each after the target's last position of its sequence, and
        read its slots; the blocks leave the head's context afterwards."""
        reqs = sorted(reqs, key=lambda r: r.seq_id)
        self._clear()
        keep: list = []
        for req in reqs:
            for i in range(self.n_block):
                self._add(req.id_last if i == 0 else self.mask, len(req.history) + i, req.seq_id, None, True, keep)
        ok = self._process() == 0
        conf = None
        if ok and self.dspark and self.p_min > 0:
            conf = np.ctypeslib.as_array(
                llama_cpp_ext.llama_get_embeddings_nextn(self.ctx), shape=(len(reqs) * self.n_block, self.n_embd)
            )
        results = {}
        for k, req in enumerate(reqs):
            result = self._read_block(k * self.n_block, conf) if ok else []
            self.drop_draft(req.seq_id, len(req.history))
            results[req.seq_id] = result if len(result) >= self.n_min else []
        return results

    def _read_block(self, beg: int, conf) -> list[int]:
        """The draft of the block whose anchor is output `beg`: each slot's argmax from `first` on; DFlash stops at
        a slot below p_min, DSpark at one whose confidence (the first value of its nextn row) is below it."""
        result: list[int] = []
        for i in range(self.first, self.n_block):
            if conf is not None and conf[beg + i, 0] < self.p_min:
                break
            token, p = self.best(beg + i)
            if not self.dspark and p < self.p_min:
                break
            result.append(token)
        return result
