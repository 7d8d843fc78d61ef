"""What the draft heads fed with the target's hidden states share (`draft-eagle3`, `draft-dflash`, `draft-dspark`):
the head's own model and context, and the target's layer inputs it reads after every target decode.

A head's GGUF (`general.architecture` eagle3 or dflash) names the target layers whose inputs it reads
(`llama_model_target_layer_ids`); the target context extracts them for every token it decodes
(`llama_set_embeddings_layer_inp`), and `features` gathers them, layer after layer, into one row per token of the
last target batch, as common/speculative.cpp does. The head's context is made as llama-server makes it
(common/speculative.cpp `common_speculative_init_result`): the target's context parameters with no recurrent
snapshots and `ctx_other` the target (a head without `token_embd` / `output` of its own uses the target's).

These calls are libllama's with C++ linkage (src/llama-ext.h), bound here by their mangled names as
llama-cpp-python's own `llama_cpp_ext` binds the nextn ones."""

import ctypes
from dataclasses import replace

import llama_cpp
import numpy as np

from harness.engine.context import Context, seq_state, set_seq_state
from harness.engine.drafters.base import Drafter
from harness.engine.drafters.draft_model import f32, top10_best
from harness.engine.rollback import LlamaRefused
from harness.errors import HarnessError
from harness.llama.defaults import INVALID_BATCH


def _bind(names: tuple[str, ...], argtypes: list, restype):
    """The first of `names` libllama exports, typed; None when it exports none of them."""
    for name in names:
        fn = getattr(llama_cpp.llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    return None


_ctx, _model = llama_cpp.llama_context_p_ctypes, llama_cpp.llama_model_p_ctypes
set_embeddings_layer_inp = _bind(
    ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"),
    [_ctx, ctypes.c_uint32, ctypes.c_bool],
    None,
)
get_embeddings_layer_inp = _bind(
    ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"),
    [_ctx, ctypes.c_uint32],
    ctypes.POINTER(ctypes.c_float),
)
model_target_layer_ids = _bind(
    ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model"),
    [_model],
    ctypes.POINTER(ctypes.c_int32),
)
model_target_layer_ids_n = _bind(
    ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model"), [_model], ctypes.c_uint32
)
model_dflash_selector_top_k = _bind(
    ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model"),
    [_model],
    ctypes.c_int32,
)


def meta(model, key: str) -> str | None:
    """A string metadata value of a loaded model (`llama_model_meta_val_str`); None when it has no such key."""
    buf = ctypes.create_string_buffer(128)
    if llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    return buf.value.decode()


class Head(Drafter):
    """A draft head on the target's layer inputs: its model, its context (one sequence per slot, mirroring the
    target's positions as llama-server's draft context does), a `llama_batch_ext` and the features of the last
    target batch."""

    name = ""

    def __init__(
        self,
        path,
        target: Context,
        n_max: int,
        n_min: int,
        p_min: float,
        wrong_layer: bool = False,
        backend_sampling: bool = True,
        leave_draft: bool = False,
    ):
        self.backend_sampling = backend_sampling
        self.leave_draft = leave_draft
        """Fault `head-draft-left-in-cache`: `drop_draft` leaves the drafted positions in the head's context."""
        if None in (set_embeddings_layer_inp, get_embeddings_layer_inp, model_target_layer_ids):
            raise HarnessError(
                f"{self.name}: this libllama exports no layer inputs (llama_set_embeddings_layer_inp): "
                "install llama-cpp-python 0.3.36 or newer"
            )
        self.n_max, self.n_min, self.p_min = n_max, n_min, f32(p_min)
        self.target = target
        self.ctx = self.batch = None
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = target.params.repack
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise HarnessError(f"{self.name}: llama.cpp could not load the draft head {path} (--draft-model)")
        n_ids = model_target_layer_ids_n(self.model)
        ids = model_target_layer_ids(self.model)
        self.layers = [int(ids[k]) for k in range(n_ids)] if ids else []
        """The target layers whose inputs the head reads, in the order of its features."""
        self.read = self.layers[::-1] if wrong_layer else self.layers
        """The layers the features are read from, in order: the head's, or with fault `head-wrong-layer` the same
        layers in reverse order (each feature slot of the head's input gets another layer's hidden state)."""
        self.n_layer_tgt = llama_cpp.llama_model_n_layer(target.model.ptr)
        self.n_embd_tgt = llama_cpp.llama_model_n_embd(target.model.ptr)
        self.n_embd = llama_cpp.llama_model_n_embd(self.model)
        self.n_vocab = target.model.n_vocab
        self.path = path

    def _open(self, cparams=None) -> None:
        """The head's context and batch; the target extracts the inputs of the head's layers from now on."""
        if cparams is None:
            cparams = self.context_params()
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            self.close()
            raise HarnessError(f"{self.name}: llama.cpp could not create a context for the draft head {self.path}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_ext_init(self.ctx)
        self.n_ubatch = llama_cpp.llama_n_ubatch(self.ctx)
        for layer in self.read:
            if layer < self.n_layer_tgt:
                set_embeddings_layer_inp(self.target.ptr, layer, True)
            elif layer == self.n_layer_tgt:
                from llama_cpp import llama_cpp_ext

                llama_cpp_ext.llama_set_embeddings_nextn(self.target.ptr, True, False)
            else:
                self.close()
                raise HarnessError(
                    f"{self.name}: the head reads target layer {layer}, beyond the target's {self.n_layer_tgt}"
                )
        self.meter = None
        """Switched on by harness.engine.work.meter_drafts: counts the head context's decodes per sequence."""
        self.batch_seqs: list[int] = []
        self._attach_samplers()

    def _attach_samplers(self) -> None:
        """A top-k 10 sampler chain per sequence, attached to the head's context: llama-server's draft sampling on
        the backend (`--spec-draft-backend-sampling`, on by default), whose candidates `best` reads; a sequence
        whose chain llama.cpp refuses samples on the CPU, as llama-server falls back."""
        self.chains: list = []
        for seq_id in range(self.target.params.parallel if self.backend_sampling else 0):
            chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(10))
            if not llama_cpp.llama_set_sampler(self.ctx, seq_id, chain):
                llama_cpp.llama_sampler_free(chain)
                chain = None
            self.chains.append(chain)

    def context_params(self):
        cparams = replace(self.target.params, n_rs_seq=0).to_llama()
        cparams.ctx_other = self.target.ptr
        return cparams

    # --- the target's features

    def features(self, n_tokens: int) -> np.ndarray:
        """[n_tokens, len(layers) * n_embd_tgt]: the inputs of the head's layers for each token of the last target
        batch, layer after layer (the target's nextn row for a layer one past its last)."""
        from llama_cpp import llama_cpp_ext

        parts = []
        for layer in self.read:
            if layer < self.n_layer_tgt:
                ptr = get_embeddings_layer_inp(self.target.ptr, layer)
            else:
                ptr = llama_cpp_ext.llama_get_embeddings_nextn(self.target.ptr)
            if not ptr:
                raise HarnessError(f"{self.name}: target layer {layer}'s input was not extracted")
            parts.append(np.ctypeslib.as_array(ptr, shape=(n_tokens, self.n_embd_tgt)))
        return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)

    # --- the head's batch

    def _clear(self) -> None:
        llama_cpp.llama_batch_ext_clear(self.batch)
        self.batch_seqs = []

    def _add(self, token: int | None, pos: int, seq_id: int, row: np.ndarray | None, output: bool, keep: list) -> int:
        """One entry: a token (with `row` as its embedding where given), or an embedding row alone (`token` None)."""
        embd = None
        if row is not None:
            row = np.ascontiguousarray(row, dtype=np.float32)
            keep.append(row)  # the batch holds a pointer to it until llama_process returns
            embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[-1])
        if token is None:
            idx = llama_cpp.llama_batch_ext_add_embd(self.batch, seq_id, embd)
        else:
            idx = llama_cpp.llama_batch_ext_add_token(self.batch, seq_id, token)
            if idx >= 0 and embd is not None:
                llama_cpp.llama_batch_ext_set_embd_token(self.batch, idx, embd)
        if idx < 0:
            raise HarnessError(f"{self.name}: the head's batch refused an entry ({idx})")
        self.batch_seqs.append(seq_id)
        llama_cpp.llama_batch_ext_set_pos(self.batch, idx, (llama_cpp.llama_pos * 4)(pos, pos, pos, 0))
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(self.batch, idx, True)
        return idx

    def refused(self, status: int) -> LlamaRefused:
        """The head's context refused a batch of the target's (llama_process's status): the requests fail with it."""
        why = INVALID_BATCH if status == -1 else f"llama_process returned {status}"
        return LlamaRefused(f"the draft head's context refused the target's batch: {why}")

    def _process(self, kind: int = llama_cpp.LLAMA_PROCESS_TYPE_DECODE) -> int:
        status = llama_cpp.llama_process(self.ctx, kind, self.batch)
        if status == 0 and self.meter is not None and kind == llama_cpp.LLAMA_PROCESS_TYPE_DECODE:
            self.meter.add(self.batch_seqs)
        return status

    def _logits(self, idx: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))

    def best(self, idx: int) -> tuple[int, float]:
        """The draft token of output `idx` and its top-10 probability, as common_sampler_sample reads them: from the
        candidates the backend sampler left (`llama_get_sampled_candidates_ith` and their logits), else from the
        output's whole row of logits."""
        logits = llama_cpp.llama_get_sampled_logits_ith(self.ctx, idx)
        ids = llama_cpp.llama_get_sampled_candidates_ith(self.ctx, idx)
        if not logits or not ids:
            return top10_best(self._logits(idx))
        n = llama_cpp.llama_get_sampled_logits_count_ith(self.ctx, idx)
        values = np.ctypeslib.as_array(logits, shape=(n,))
        k, p = top10_best(values)
        return int(ids[k]), p

    def drop_draft(self, seq_id: int, n_past: int) -> None:
        """The drafted positions leave the head's context: everything after the target's last (`n_past` - 1), as
        llama-server removes it after drafting."""
        if not self.leave_draft:
            llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_past, -1)

    def pos_max(self, seq_id: int) -> int:
        return llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)

    # --- the Drafter calls every head answers alike

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """The head's context already holds the prompt (it followed every prompt batch)."""

    def shift_context(self, seq_id: int, n_keep: int, n_discard: int, history: list[int]) -> None:
        """Nothing: llama-server calls no `begin` after a context shift."""

    def truncate(self, seq_id: int, n_keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_keep, -1)

    def end(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def save_seq(self, seq_id: int) -> tuple[bytes, object]:
        """The head context's sequence and what the head keeps of it beside (`_extra`)."""
        return seq_state(self.ctx, seq_id), self._get_extra(seq_id)

    def load_seq(self, seq_id: int, state: tuple[bytes, object]) -> bool:
        """The head context's sequence, and what the head keeps beside it where it saved any (llama-server's
        `set_state` ignores an empty stash: the head keeps what it has)."""
        data, extra = state
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        if not set_seq_state(self.ctx, seq_id, data):
            return False
        if extra is not None:
            self._set_extra(seq_id, extra)
        return True

    def keep_seq(self, seq_id: int, n_keep: int) -> bool:
        """The head's context holds attention KV only: a suffix drops exactly."""
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, n_keep if n_keep else -1, -1))

    def _get_extra(self, seq_id: int) -> object:
        return None

    def _set_extra(self, seq_id: int, extra: object) -> None:
        """Replace what the head keeps of `seq_id` beside its context with a `_get_extra` value."""

    def close(self) -> None:
        for seq_id, chain in enumerate(getattr(self, "chains", [])):
            if chain is not None:
                if self.ctx:
                    llama_cpp.llama_set_sampler(self.ctx, seq_id, None)
                llama_cpp.llama_sampler_free(chain)
        self.chains = []
        if getattr(self, "batch", None):
            llama_cpp.llama_batch_ext_free(self.batch)
            self.batch = None
        if getattr(self, "ctx", None):
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama_cpp.llama_model_free(self.model)
            self.model = None
