"""Token ids → text for messages and reports, from a model's vocabulary alone (no weights loaded)."""

import ctypes
import functools
from pathlib import Path
from typing import Callable

import llama_cpp

from harness.engine import logging as _quiet  # noqa: F401  (llama.cpp stays silent)


@functools.cache
def detokenizer(model_path: Path) -> Callable[[list[int]], str]:
    """A function turning token ids into text with the vocabulary of `model_path`."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), params)
    if not model:
        return lambda tokens: " ".join(f"<{t}>" for t in tokens)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def detokenize(tokens: list[int]) -> str:
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            if 0 <= t < n_vocab:
                n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
                out += buf.raw[: max(n, 0)]
        return out.decode("utf-8", errors="replace")

    return detokenize
