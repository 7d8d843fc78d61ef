"""ngram-cache: classic lookup decoding from 1..4-gram → next-token counts (llama.cpp's `common/ngram-cache.cpp`
and `common_speculative_impl_ngram_cache` of `common/speculative.cpp`)."""

from dataclasses import dataclass, field

from harness.engine.drafters.base import Drafter, DraftRequest

NGRAM_MIN = 1
NGRAM_MAX = 4
N_DRAFT = 8
"""llama-server drafts at most 8 tokens with ngram-cache (hard-coded in `create_state_ngram_cache`)."""
TOKEN_NULL = -1
MIN_SAMPLE_LAX = (2, 2, 1, 1)
"""`draft_min_sample_size_lax`, by n-gram size 1..4: the context cache's counts must sum to at least this."""
MIN_PERCENT_LAX = (66, 50, 50, 50)
"""`draft_min_percent_lax`: the most frequent next token's share of those counts, in percent."""

Ngram = tuple[int, int, int, int]


def _ngram(tokens: list[int]) -> Ngram:
    """`common_ngram`: up to 4 tokens, padded with LLAMA_TOKEN_NULL."""
    return tuple(tokens) + (TOKEN_NULL,) * (NGRAM_MAX - len(tokens))  # type: ignore[return-value]


def cache_update(cache: dict[Ngram, dict[int, int]], tokens: list[int]) -> None:
    """`common_ngram_cache_update(cache, 1, 4, tokens, nnew = len(tokens))`: every n-gram lying wholly
    inside `tokens` counts the token after it (n-grams reaching into earlier updates are never added)."""
    for size in range(NGRAM_MIN, NGRAM_MAX + 1):
        for i in range(size, len(tokens)):
            part = cache.setdefault(_ngram(tokens[i - size : i]), {})
            part[tokens[i]] = part.get(tokens[i], 0) + 1


def _pick(part: dict[int, int]) -> tuple[int, int, int]:
    """(max token, its count, the sum of counts) of one cache entry. The C++ keeps the first maximum in
    the iteration order of its `std::unordered_map<llama_token, int32_t>`; a tie can only pass the
    thresholds between exactly two tokens at 50 %, and libstdc++ iterates a two-element map newest insert
    first, so ties go to the later-inserted token: iterate in reverse insertion order."""
    best, best_count, total = TOKEN_NULL, 0, 0
    for token, count in reversed(part.items()):
        if count > best_count:
            best, best_count = token, count
        total += count
    return best, best_count, total


def cache_draft(tokens: list[int], id_last: int, cache: dict[Ngram, dict[int, int]], n_draft: int) -> list[int]:
    """`common_ngram_cache_draft` with empty dynamic and static caches (llama-server without `-lcd` / `-lcs`):
    extend [id_last] one token at a time from the context cache, the longest n-gram (4) first, each size
    held to its lax thresholds, until no size yields a token or `n_draft` tokens are drafted."""
    seq = tokens + [id_last]
    n_inp = len(seq)
    if n_inp < 2:  # LLAMA_NGRAM_STATIC
        return []
    draft: list[int] = []
    while len(draft) < n_draft:
        drafted = TOKEN_NULL
        for i in range(NGRAM_MAX - 1, NGRAM_MIN - 2, -1):  # n-gram size i + 1, largest first
            size = i + 1
            if size > len(seq):  # the C++ reads out of bounds here; llama-server's histories are longer
                continue
            part = cache.get(_ngram(seq[len(seq) - size :]))
            if part is None:
                continue
            token, count, total = _pick(part)
            if total < MIN_SAMPLE_LAX[i] or 100 * count < MIN_PERCENT_LAX[i] * total:
                continue
            drafted = token
            break
        if drafted == TOKEN_NULL:
            break
        draft.append(drafted)
        seq.append(drafted)
    return draft


@dataclass
class _SeqInfo:
    cache_size: int = 0
    """Tokens of the sequence's history already counted (plus the id_last counted with them)."""
    context: dict[Ngram, dict[int, int]] = field(default_factory=dict)


class NgramCache(Drafter):
    """llama.cpp `--spec-type ngram-cache` (no static or dynamic cache files). Per sequence, a context cache of
    1..4-gram → next-token counts. At each draft the history past `cache_size` plus id_last is counted (as a
    separate token list: n-grams that straddle the previous update are not added), then up to 8 tokens are
    drafted (`cache_draft`). begin() empties the sequence's cache: at 0c1e570 llama-server's begin() is a no-op,
    so a slot drafts from its previous request's cache and counts only the part of the new history that is longer
    than any history it saw before (ggml-org/llama.cpp#27852); `keep_across_requests` reproduces that."""

    name = "ngram-cache"
    n_max = N_DRAFT

    def __init__(self, keep_across_requests: bool = False):
        self.keep_across_requests = keep_across_requests
        self._seqs: dict[int, _SeqInfo] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """A new request: an empty cache for the sequence (unless `keep_across_requests`, as at 0c1e570)."""
        if not self.keep_across_requests or seq_id not in self._seqs:
            self._seqs[seq_id] = _SeqInfo()

    def draft(self, req: DraftRequest) -> list[int]:
        info = self._seqs.setdefault(req.seq_id, _SeqInfo())
        tokens = req.history
        if info.cache_size < len(tokens) + 1:
            cache_update(info.context, tokens[info.cache_size :] + [req.id_last])
            info.cache_size = len(tokens) + 1
        return cache_draft(tokens, req.id_last, info.context, N_DRAFT)[: req.n_max]
