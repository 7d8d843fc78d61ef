"""A loaded GGUF model: vocabulary, tokenizer, kind (dense / hybrid / recurrent) and chat template."""

import ctypes
from pathlib import Path

import llama_cpp

from harness.errors import HarnessError
from harness.engine import logging as _logging  # noqa: F401  (silences llama.cpp before the first load)

FALLBACK_CHAT_TEMPLATE = b"chatml"
"""Used for models without a template of their own (the tiny models), as llama-server does."""


def model_kind(is_recurrent: bool, is_hybrid: bool) -> str:
    """The project's three words for how a model's memory rolls back."""
    if is_hybrid:
        return "hybrid"
    return "recurrent" if is_recurrent else "dense"


class Model:
    """A llama.cpp model loaded through llama-cpp-python's low-level API."""

    def __init__(self, path: Path):
        path = Path(path)
        if not path.is_file():
            raise HarnessError(f"model file not found: {path}")
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise HarnessError(f"llama.cpp could not load model {path} (run with --verbose for its log)")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.kind = model_kind(
            bool(llama_cpp.llama_model_is_recurrent(self.ptr)), bool(llama_cpp.llama_model_is_hybrid(self.ptr))
        )
        self.arch = self.meta("general.architecture") or "unknown"
        self._pieces: dict[int, bytes] = {}

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
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
            cached = self._pieces[token] = buf.raw[:n]
        return cached

    def detokenize(self, tokens: list[int]) -> str:
        """Token ids → text (invalid UTF-8 at the edges replaced)."""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

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
