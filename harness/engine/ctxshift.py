"""Context shift: llama-server's `--context-shift` arithmetic (tools/server/server-context.cpp, `pre_decode`).

A generating slot whose sequence holds `n_tokens` positions with `n_tokens + 1 >= n_ctx` (the slot's
context) keeps its first `n_keep` positions, discards the `n_discard` after them (llama_memory_seq_rm) and
moves the rest down by `n_discard` (llama_memory_seq_add); its token list loses the same tokens, and it
generates on. The request fields `n_keep` / `n_discard` and the model's BOS flag decide the span.
"""


def needs_shift(n_tokens: int, n_ctx: int) -> bool:
    """Whether a generating slot holding `n_tokens` positions of a context of `n_ctx` shifts before its next
    step (llama-server: `slot.prompt.n_tokens() + 1 >= slot.n_ctx`)."""
    return n_tokens + 1 >= n_ctx


def shift_span(n_tokens: int, n_prompt: int, n_ctx: int, n_keep: int, n_discard: int, add_bos: bool) -> tuple[int, int]:
    """(n_keep, n_discard) of one shift, as llama-server computes them: `n_keep` is the request's (-1: the
    prompt's `n_prompt` tokens), plus one when the model adds BOS, at most `n_ctx - 4`; `n_discard` is the
    request's, or half of the `n_left = n_tokens - n_keep` tokens after the kept ones when 0 (C++ integer
    division), clamped to [0, max(0, n_left - 1)] (upstream PR #24786)."""
    keep = n_prompt if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = min(n_ctx - 4, keep)
    n_left = n_tokens - keep
    discard = n_discard if n_discard else int(n_left / 2)
    return keep, min(max(discard, 0), max(0, n_left - 1))
