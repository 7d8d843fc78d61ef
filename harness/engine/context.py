"""A llama context on a loaded model: creation options, decode, logits, memory and state calls."""

import ctypes
from dataclasses import dataclass, field

import llama_cpp
import numpy as np

from harness.engine.batch import Batch
from harness.engine.model import Model
from harness.errors import HarnessError
from harness.llama.defaults import default_repack, default_threads

CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
"""llama-server's `-ctk/-ctv` names → ggml_type ids."""
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
KEEP_STATE_BUFFER = 64 << 20
"""`Context.state_seq` keeps its buffer between calls up to this size (larger states get a buffer per call)."""
_U8_P = ctypes.POINTER(ctypes.c_uint8)


def _read_only_u8(data):
    """A `uint8_t *` argument for a C function that only reads `data`: for `bytes`, a pointer to the object's
    own buffer (no copy; the pointer object keeps `data` alive through the call); other buffers are copied."""
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), _U8_P)
    return (ctypes.c_uint8 * len(data)).from_buffer_copy(data)


@dataclass
class ContextParams:
    """Context creation options, named like llama.cpp's parameters behind llama-server's flags."""

    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    parallel: int = 1
    kv_unified: bool = False
    flash_attn: str = "off"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    threads: int = field(default_factory=default_threads)
    seed: int = 42
    n_rs_seq: int = 0
    swa_full: bool = False
    """llama-server's `--swa-full` (off there by default, unlike llama.cpp's context default): a sliding-window
    model keeps only its window's cells in the SWA cache."""
    repack: bool = field(default_factory=default_repack)
    """llama-server's `--repack` (a model-loading option, llama_model_params.use_extra_bufts): weights
    repacked into the CPU's extra buffer types; on by default except on a CPU whose AMX path crashes
    llama.cpp (harness.llama.defaults.default_repack)."""
    context_shift: bool = False
    """llama-server's `--context-shift` (common_params.ctx_shift): not a llama_context option; the scheduler
    shifts a generating slot's sequence at the context end (harness.engine.ctxshift) where the memory can."""

    def to_llama(self) -> llama_cpp.llama_context_params:
        """The C struct for `llama_init_from_model`."""
        for name, value in (("cache_type_k", self.cache_type_k), ("cache_type_v", self.cache_type_v)):
            if value not in CACHE_TYPES:
                raise HarnessError(f"unknown {name} '{value}' (use one of: {', '.join(CACHE_TYPES)})")
        if self.flash_attn not in FLASH_ATTN:
            raise HarnessError(f"flash_attn must be on, off or auto, not '{self.flash_attn}'")
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_ubatch
        p.n_seq_max = self.parallel
        p.n_rs_seq = self.n_rs_seq
        p.kv_unified = self.kv_unified
        p.swa_full = self.swa_full
        p.flash_attn_type = FLASH_ATTN[self.flash_attn]
        p.type_k = CACHE_TYPES[self.cache_type_k]
        p.type_v = CACHE_TYPES[self.cache_type_v]
        p.n_threads = p.n_threads_batch = self.threads
        p.no_perf = True
        return p


def seq_state(ctx_ptr, seq_id: int, flags: int = 0, buf=None) -> bytes:
    """The serialized state of one sequence of a llama_context (`llama_state_seq_get_data_ext`), written into
    `buf` when it is large enough (else into a new buffer)."""
    size = llama_cpp.llama_state_seq_get_size_ext(ctx_ptr, seq_id, flags)
    if buf is None or len(buf) < size:
        buf = (ctypes.c_uint8 * size)()
    n = llama_cpp.llama_state_seq_get_data_ext(ctx_ptr, buf, size, seq_id, flags)
    return ctypes.string_at(buf, n)


def set_seq_state(ctx_ptr, seq_id: int, data: bytes, flags: int = 0) -> bool:
    """Restore one sequence of a llama_context from `seq_state` bytes; False (and an empty sequence) on failure.
    llama.cpp reads `bytes` in place (it only reads); other buffers are copied first."""
    return llama_cpp.llama_state_seq_set_data_ext(ctx_ptr, _read_only_u8(data), len(data), seq_id, flags) > 0


class Context:
    """One llama_context: the slots' sequences live in its memory (seq id = slot id)."""

    def __init__(self, model: Model, params: ContextParams):
        self.model = model
        self.params = params
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, params.to_llama())
        if not self.ptr:
            raise HarnessError(
                f"llama.cpp could not create a context for {model.path.name} with {params} (see --verbose)"
            )
        self.memory = llama_cpp.llama_get_memory(self.ptr)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ptr)
        self.n_batch = llama_cpp.llama_n_batch(self.ptr)
        self.n_rs_seq = llama_cpp.llama_n_rs_seq(self.ptr)
        self.can_shift = bool(llama_cpp.llama_memory_can_shift(self.memory))
        """Whether positions can be shifted (`seq_add`): false for M-RoPE models (the qwen35 hybrids)."""
        self._state_buf = None
        self.meter = None
        """A `harness.engine.work.DecodeMeter` counting the tokens each sequence decoded (None: not counted)."""

    def new_batch(self) -> Batch:
        """A batch as large as the context accepts in one decode."""
        return Batch(self.n_batch)

    def decode(self, batch: Batch) -> int:
        """llama_decode's status: 0 ok, 1 no KV slot, 2 aborted, -1 invalid batch, < -1 compute error."""
        status = llama_cpp.llama_decode(self.ptr, batch.struct)
        if status == 0 and self.meter is not None:
            self.meter.count(batch)
        return status

    def logits(self, index: int) -> np.ndarray:
        """The logits of output row `index` of the last decode (a view, valid until the next decode)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, index)
        if not ptr:
            raise RuntimeError(f"batch row {index} has no logits")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence (-1 = open end); False when the memory refuses."""
        return bool(llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Add `delta` to positions [p0, p1) of a sequence (-1 = open end; llama_memory_seq_add)."""
        llama_cpp.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    def seq_pos_max(self, seq_id: int) -> int:
        """The last cached position of a sequence, -1 when empty."""
        return llama_cpp.llama_memory_seq_pos_max(self.memory, seq_id)

    def state_seq(self, seq_id: int, flags: int = 0) -> bytes:
        """The serialized state of one sequence (`llama_state_seq_get_data_ext`).

        llama.cpp writes into a buffer the context keeps (grown as needed, up to `KEEP_STATE_BUFFER`; no
        fresh pages at every checkpoint); the bytes come out of it in one memcpy."""
        size = llama_cpp.llama_state_seq_get_size_ext(self.ptr, seq_id, flags)
        if (self._state_buf is None or len(self._state_buf) < size) and size <= KEEP_STATE_BUFFER:
            self._state_buf = (ctypes.c_uint8 * size)()
        return seq_state(self.ptr, seq_id, flags, self._state_buf)

    def set_state_seq(self, seq_id: int, data: bytes, flags: int = 0) -> bool:
        """Restore one sequence from `state_seq` bytes; False (and an empty sequence) on failure.

        llama.cpp reads `bytes` in place (it only reads); other buffers are copied first."""
        return set_seq_state(self.ptr, seq_id, data, flags)

    def close(self) -> None:
        """Free the context (the model stays loaded)."""
        if self.ptr:
            llama_cpp.llama_free(self.ptr)
            self.ptr = None
        self._state_buf = None
