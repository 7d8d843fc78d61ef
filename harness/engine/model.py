"""A loaded GGUF model: vocabulary, tokenizer, kind (dense / hybrid / recurrent) and chat template."""

import ctypes
from functools import cached_property
from pathlib import Path

import llama_cpp

from harness.engine.logging import ensure_quiet
from harness.errors import HarnessError
from harness.llama.defaults import default_repack

FALLBACK_CHAT_TEMPLATE = b"chatml"
"""Used for models without a template of their own (the tiny models), as llama-server does."""


def model_kind(is_recurrent: bool, is_hybrid: bool) -> str:
    """The project's three words for how a model's memory rolls back."""
    if is_hybrid:
        return "hybrid"
    return "recurrent" if is_recurrent else "dense"


class Vocab:
    """A model's vocabulary: token pieces and end-of-generation ids, both cached per token id.

    The one detokenizer of the project: the engine's Result.text and `harness.engine.detok.detokenizer` (failure
    messages, reports) both go through `piece`, so they show the same text."""

    SPECIAL = False
    """Whether control/special tokens render as their text (llama_token_to_piece's `special`): not, like
    llama-server's `content`."""

    def __init__(self, ptr, model_ptr=None):
        self.ptr = ptr
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(ptr)
        self._model_ptr = model_ptr
        """The vocab-only model this vocabulary belongs to when `load` created it (freed by `close`)."""
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    @classmethod
    def load(cls, path: Path) -> "Vocab | None":
        """The vocabulary of a GGUF file, without loading its weights; None when llama.cpp cannot read it."""
        ensure_quiet()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        return cls(llama_cpp.llama_model_get_vocab(ptr), model_ptr=ptr) if ptr else None

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens render as nothing; ids outside the vocabulary too)."""
        cached = self._pieces.get(token)
        if cached is None:
            if not 0 <= token < self.n_tokens:
                return b""
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, self.SPECIAL)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, self.SPECIAL)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        """Token ids → text (invalid UTF-8 at the edges replaced)."""
        piece = self.piece
        return b"".join(piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        cached = self._eog.get(token)
        if cached is None:
            cached = self._eog[token] = bool(llama_cpp.llama_vocab_is_eog(self.ptr, token))
        return cached

    @cached_property
    def eog_tokens(self) -> list[int]:
        """Every end-of-generation token id (llama-server biases them to -inf for `ignore_eos`)."""
        return [t for t in range(self.n_tokens) if self.is_eog(t)]

    @cached_property
    def suppress_tokens(self) -> list[int]:
        """Token ids the model says never to sample (GGUF `tokenizer.ggml.suppress_token_ids`)."""
        n = ctypes.c_int32(0)
        ids = llama_cpp.llama_vocab_get_suppress_tokens(self.ptr, ctypes.byref(n))
        return [ids[i] for i in range(n.value)] if ids else []

    def close(self) -> None:
        """Free the vocab-only model `load` created (a Model's own vocabulary goes with the Model)."""
        if self._model_ptr:
            llama_cpp.llama_model_free(self._model_ptr)
            self._model_ptr = None


class Model:
    """A llama.cpp model loaded through llama-cpp-python's low-level API."""

    def __init__(self, path: Path, repack: bool | None = None):
        path = Path(path)
        if not path.is_file():
            raise HarnessError(f"model file not found: {path}")
        ensure_quiet()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.use_extra_bufts = default_repack() if repack is None else repack  # llama-server's --repack
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise HarnessError(f"llama.cpp could not load model {path} (run with --verbose for its log)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.vocabulary = Vocab(self.vocab)
        """Pieces and end-of-generation ids (`piece`, `detokenize` and `is_eog` delegate to it)."""
        self.n_vocab = self.vocabulary.n_tokens
        self.kind = model_kind(
            bool(llama_cpp.llama_model_is_recurrent(self.ptr)), bool(llama_cpp.llama_model_is_hybrid(self.ptr))
        )
        self.arch = self.meta("general.architecture") or "unknown"
        self.n_swa = llama_cpp.llama_model_n_swa(self.ptr)
        """Sliding-window size of the attention layers (0: none)."""
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        """The tokenizer adds a BOS token (llama-server's `add_bos_token`: a context shift keeps one more)."""

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when absent."""
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text → token ids, as llama-server tokenizes a prompt (BOS added, special tokens parsed)."""
        data = text.encode("utf-8")
        cap = len(data) + 8
        out = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            out = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, cap, add_special, parse_special)
        return list(out[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens render as nothing, like llama-server's text)."""
        return self.vocabulary.piece(token)

    def detokenize(self, tokens: list[int]) -> str:
        """Token ids → text (invalid UTF-8 at the edges replaced)."""
        return self.vocabulary.detokenize(tokens)

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return self.vocabulary.is_eog(token)

    def render_chat(self, messages: list[dict]) -> str:
        """Messages → prompt text with the model's chat template (chatml for models without one)."""
        template = llama_cpp.llama_model_chat_template(self.ptr, None) or FALLBACK_CHAT_TEMPLATE
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(keep))(*[llama_cpp.llama_chat_message(r, c) for r, c in keep])
        size = 4 * sum(len(r) + len(c) for r, c in keep) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(template, chat, len(keep), True, buf, size)
            if n < 0:
                raise HarnessError(f"llama.cpp does not support the chat template of {self.path.name}")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise HarnessError(f"chat template of {self.path.name} rendered inconsistently")

    def close(self) -> None:
        """Free the weights."""
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None
