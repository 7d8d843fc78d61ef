"""Teacher-forced greedy agreement of a draft model with its target, via llama.cpp's low-level API.

Only used to calibrate and test the draft recipes; harness.engine is the real inference layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp
import numpy as np

PROMPTS = (
    "Write a quicksort function in Python.",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Explain how a hash table handles collisions.",
)


@contextlib.contextmanager
def _context(path: Path, n_ctx: int) -> Iterator[tuple[llama_cpp.llama_context_p, llama_cpp.llama_vocab_p]]:
    """A single-threaded llama.cpp context on the model at `path`, freed on exit."""
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
    params.n_threads = params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        yield ctx, llama_cpp.llama_model_get_vocab(model)
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def _decode_argmax(ctx: llama_cpp.llama_context_p, tokens: Sequence[int], n_vocab: int) -> int:
    """Decode `tokens` after what `ctx` holds; return the argmax of the last position's logits."""
    array = (llama_cpp.llama_token * len(tokens))(*tokens)
    if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(array, len(tokens))) != 0:
        raise RuntimeError("llama_decode failed")
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))


def _tokenize(vocab: llama_cpp.llama_vocab_p, text: str) -> list[int]:
    data = text.encode()
    out = (llama_cpp.llama_token * (len(data) + 2))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), out, len(out), True, False)
    return list(out[:n])


def teacher_forced_agreement(target: Path, draft: Path, prompts: Sequence[str] = PROMPTS, n_tokens: int = 64) -> float:
    """Fraction of positions where the draft's greedy token equals the target's, both fed the target's tokens.

    For each prompt the target generates `n_tokens` greedy tokens; both models see the same prefix at
    every position. The models must share a vocabulary.
    """
    llama_cpp.llama_backend_init()
    agree = 0
    with _context(target, 512) as (t_ctx, vocab), _context(draft, 512) as (d_ctx, _):
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        for prompt in prompts:
            for ctx in (t_ctx, d_ctx):
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            step = _tokenize(vocab, prompt)
            for _ in range(n_tokens):
                token = _decode_argmax(t_ctx, step, n_vocab)
                agree += token == _decode_argmax(d_ctx, step, n_vocab)
                step = [token]
    return agree / (len(prompts) * n_tokens)
