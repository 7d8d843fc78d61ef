"""`draft-mtp`: the target model's own MTP (nextn) head drafts, in an MTP context of its own
(`common_speculative_impl_draft_mtp` of common/speculative.cpp for a single trained head, the Qwen3.5 family).

The target context outputs its nextn hidden row for every token it decodes; the MTP context takes each token
paired with the target's row of the position before it (`process`), so that drafting `id_last` with the row of
the last accepted position predicts the token after it, and each drafted token is fed back with the MTP's own
row. Everything goes through llama-cpp-python's ctypes bindings: `load_mtp`, `ctx_type`, `llama_process` on a
`llama_batch_ext` whose rows carry a token and an embedding, and the nextn calls of `llama_cpp_ext`."""

import ctypes
from dataclasses import replace

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp_ext

from harness.engine.context import Context, seq_state, set_seq_state
from harness.engine.drafters.base import Drafter, DraftRequest
from harness.engine.drafters.draft_model import f32, top10_best
from harness.engine.sampler import Dist, DraftSamplers
from harness.errors import HarnessError


class DraftMTP(Drafter):
    """llama.cpp `--spec-type draft-mtp` with the target's single MTP block: greedy drafting (top-10
    probability at or above `p_min`) up to `n_max` tokens; drafts shorter than `n_min` are dropped.
    `draft_sampled` samples them instead (`--spec-draft-sampling probabilistic` at temperature > 0, b11434), as
    draft-simple does; `wrong_q` is fault `q-wrong-temperature`."""

    name = "draft-mtp"

    def __init__(
        self,
        target: Context,
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        wrong_row: bool = False,
        wrong_q: bool = False,
    ):
        self.n_max, self.n_min, self.p_min = n_max, n_min, f32(p_min)
        self.samplers = DraftSamplers(target.model, target.model.n_vocab, wrong_q)
        self.wrong_row = wrong_row
        """Fault `mtp-wrong-row`: `accept` keeps the row of the last verified position, not the last accepted."""
        self.target = target
        params = llama_cpp.llama_model_default_params()
        params.load_mtp = True
        params.use_extra_bufts = target.params.repack
        self.model = llama_cpp.llama_model_load_from_file(str(target.model.path).encode(), params)
        if not self.model:
            raise HarnessError(f"llama.cpp could not load {target.model.path.name} with its MTP layers")
        self.ctx = None
        n_nextn = llama_cpp.llama_model_n_layer_nextn(self.model)
        if n_nextn != 1:
            self.close()
            raise HarnessError(
                f"draft-mtp needs a model with one MTP (nextn) block: {target.model.path.name} has {n_nextn}"
            )
        cparams = replace(target.params, n_rs_seq=0).to_llama()
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise HarnessError(f"llama.cpp could not create an MTP context for {target.model.path.name}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_embd = llama_cpp.llama_model_n_embd_out(self.model)
        self.n_vocab = target.model.n_vocab
        llama_cpp_ext.llama_set_embeddings_nextn(target.ptr, True, False)  # a row for every target token
        llama_cpp_ext.llama_set_embeddings_nextn(self.ctx, True, True)
        self.batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self.pending: dict[int, np.ndarray] = {}
        """seq → the target's row to pair with the sequence's next token (kept across requests, as in llama.cpp)."""
        self.verify: dict[int, np.ndarray] = {}
        """seq → the target's rows of the sequence's tokens in the last target batch (row 0: the sampled token)."""
        self.meter = None
        """Switched on by harness.engine.work.meter_drafts: counts the MTP context's decodes per sequence."""
        self.batch_seqs: list[int] = []
        """The sequence of each token in `batch` (what `meter` counts once the batch decodes)."""

    def _row(self, seq_id: int) -> np.ndarray:
        return self.pending.setdefault(seq_id, np.zeros(self.n_embd, dtype=np.float32))

    def _add(self, token: int, pos: int, seq_id: int, row: np.ndarray, output: bool, keep: list) -> int:
        row = np.ascontiguousarray(row, dtype=np.float32)
        keep.append(row)  # the batch holds a pointer to it until llama_process returns
        idx = llama_cpp.llama_batch_ext_add_token(self.batch, seq_id, token)
        if idx < 0:
            raise HarnessError(f"draft-mtp: the MTP batch refused a token ({idx})")
        self.batch_seqs.append(seq_id)
        embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
        llama_cpp.llama_batch_ext_set_embd_token(self.batch, idx, embd)
        llama_cpp.llama_batch_ext_set_pos(self.batch, idx, (llama_cpp.llama_pos * 1)(pos))
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(self.batch, idx, True)
        return idx

    def _clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self.batch)
        self.batch_seqs = []

    def _process(self) -> int:
        status = llama_cpp.llama_process(self.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self.batch)
        if status == 0 and self.meter is not None:
            self.meter.add(self.batch_seqs)
        return status

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """The MTP context already holds the prompt (it followed every prompt batch); the sequence's draft
        sampler starts again (llama.cpp's draft-mtp `begin` resets it)."""
        self.samplers.reset(seq_id)

    def shift_context(self, seq_id: int, n_keep: int, n_discard: int, history: list[int]) -> None:
        """Nothing: the MTP context and the draft sampler stay as they are (llama-server calls no `begin` there)."""

    def process(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Each token of the target's batch into the MTP context with the target's row of the position before it
        (the first of a sequence with its pending row); keep the sequences' rows for `accept`."""
        if not entries:
            return
        h = np.ctypeslib.as_array(
            llama_cpp_ext.llama_get_embeddings_nextn(self.target.ptr), shape=(len(entries), self.n_embd)
        ).copy()
        first: dict[int, int] = {}
        self._clear()
        keep: list = []
        for k, (token, pos, seq_id, _) in enumerate(entries):
            first.setdefault(seq_id, k)
            self._add(token, pos, seq_id, self._row(seq_id) if first[seq_id] == k else h[k - 1], False, keep)
        status = self._process()
        if status != 0:
            raise HarnessError(f"draft-mtp: llama_process on the MTP context returned {status}")
        for seq_id in first:
            rows = [k for k, e in enumerate(entries) if e[2] == seq_id]
            self.verify[seq_id] = h[rows]
            self.pending[seq_id] = h[rows[-1]].copy()

    def draft(self, req: DraftRequest) -> list[int]:
        """Decode id_last at its position with the pending row, then each argmax token with the MTP's own row;
        the drafted positions leave the MTP context afterwards (llama-server removes them before verifying)."""
        return self._draft(req, None)

    def draft_sampled(self, req: DraftRequest, temperature: float, seed: int) -> tuple[list[int], list[Dist]]:
        """Probabilistic drafting (common/speculative.cpp draft-mtp `draft` with `result_q` set, b11434): each
        token sampled at the target's `temperature` by the sequence's draft sampler (top-k 10, `seed`), p_min
        compared with its top candidate's probability; (draft, q per drafted token)."""
        q: list[Dist] = []
        return self._draft(req, (temperature, seed, q)), q

    def _next(self, seq_id: int, logits: np.ndarray, sampled: tuple | None) -> tuple[int, float]:
        """The next draft token and the probability p_min is compared with; a sampled draft's q is appended to
        `sampled`'s list when it passes p_min."""
        if sampled is None:
            return top10_best(logits)
        temperature, seed, q = sampled
        token, top, dist = self.samplers.get(seq_id, temperature, seed).sample(logits)
        if top >= self.p_min:
            q.append(dist)
        return token, top

    def _draft(self, req: DraftRequest, sampled: tuple | None) -> list[int]:
        seq_id, pos0 = req.seq_id, len(req.history)
        n_max = min(self.n_max, req.n_max)
        result: list[int] = []
        self._clear()
        keep: list = []
        idx = self._add(req.id_last, pos0, seq_id, self._row(seq_id), True, keep)
        while True:
            if self._process() != 0:
                break
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            token, p = self._next(seq_id, logits, sampled)
            if p < self.p_min:
                break
            result.append(token)
            if len(result) >= n_max:
                break
            row = np.ctypeslib.as_array(
                llama_cpp_ext.llama_get_embeddings_nextn_ith(self.ctx, idx), shape=(self.n_embd,)
            ).copy()
            self._clear()
            keep = []
            idx = self._add(token, pos0 + len(result), seq_id, row, True, keep)
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, pos0, -1)
        if len(result) >= self.n_min:
            return result
        if sampled is not None:
            sampled[2].clear()
        return []

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """The pending row becomes the target's row of the last accepted position (with the `mtp-wrong-row` fault,
        that of the last verified position: a rejected draft token's)."""
        rows = self.verify.get(seq_id)
        if rows is not None and len(rows):
            self.pending[seq_id] = rows[len(rows) - 1 if self.wrong_row else min(n_accepted, len(rows) - 1)].copy()

    def truncate(self, seq_id: int, n_keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_keep, -1)

    def end(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        self.samplers.reset(seq_id)

    def save_seq(self, seq_id: int) -> tuple[bytes, np.ndarray | None]:
        """The MTP context's sequence (its nextn KV) and the target's row that waits for the next token."""
        row = self.pending.get(seq_id)
        return seq_state(self.ctx, seq_id), None if row is None else row.copy()

    def load_seq(self, seq_id: int, state: tuple[bytes, np.ndarray | None]) -> bool:
        data, row = state
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        self.pending.pop(seq_id, None)
        if not set_seq_state(self.ctx, seq_id, data):
            return False
        if row is not None:
            self.pending[seq_id] = row.copy()
        return True

    def keep_seq(self, seq_id: int, n_keep: int) -> bool:
        """The MTP context holds attention KV only (the nextn block): a suffix drops exactly."""
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_keep if n_keep else -1, -1))

    def close(self) -> None:
        self.samplers.close()
        if getattr(self, "batch", None):
            llama_cpp.llama_batch_ext_free(self.batch)
            self.batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
