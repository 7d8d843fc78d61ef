"""ngram-simple: copy what followed the last earlier occurrence of the current n-gram (llama.cpp's
`common_ngram_simple_draft`). Also home of the n-gram search shared with ngram-map."""

from collections.abc import Iterator

from harness.engine.drafters.base import Drafter, DraftRequest


def iter_ngram(tokens: list[int], pattern: list[int], lo: int, hi: int) -> Iterator[int]:
    """Ascending start indices j in [lo, hi] with tokens[j:j+len(pattern)] == pattern.

    Candidates are located with `list.index` on the first pattern token (C speed), then compared whole.
    """
    n = len(pattern)
    first = pattern[0]
    j = lo
    while j <= hi:
        try:
            j = tokens.index(first, j, hi + 1)
        except ValueError:
            return
        if tokens[j : j + n] == pattern:
            yield j
        j += 1


RFIND_WINDOW = 256
"""`rfind_ngram` searches windows of this many start indices first, doubling them as it goes back."""


def rfind_ngram(tokens: list[int], pattern: list[int], lo: int, hi: int) -> int:
    """The largest j in [lo, hi] where `pattern` starts, or 0 (llama.cpp's "no match"; callers keep lo ≥ 1).

    Searched backwards from hi, as llama.cpp does, stopping at the first hit: windows of start indices
    (256, then twice as many each time) from the end, each scanned with `iter_ngram` (C-speed `list.index`);
    the first window with a match holds the largest one."""
    width = RFIND_WINDOW
    while hi >= lo:
        start = max(lo, hi - width + 1)
        found = 0
        for found in iter_ngram(tokens, pattern, start, hi):  # noqa: B007 - the last match is the largest
            pass
        if found:
            return found
        hi = start - 1
        width *= 2
    return 0


class NgramSimple(Drafter):
    """llama.cpp `--spec-type ngram-simple`: pattern = last size_n-1 history tokens + id_last; the latest
    earlier occurrence of the pattern (searched backwards from len-size_n-1 down to 1) supplies up to
    size_m following tokens. No draft if the history has ≤ size_n+size_m+1 tokens or fewer than size_n
    tokens follow the match. Stateless."""

    name = "ngram-simple"

    def __init__(self, size_n: int = 12, size_m: int = 48):
        self.size_n = size_n
        self.size_m = self.n_max = size_m

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """No state: nothing to do."""

    def draft(self, req: DraftRequest) -> list[int]:
        """See the class docstring; the result is capped at `req.n_max`."""
        tokens, n, m = req.history, self.size_n, self.size_m
        cur_len = len(tokens)
        if cur_len <= n + m + 1:
            return []
        pattern = tokens[cur_len - n + 1 :] + [req.id_last]
        match_pos = rfind_ngram(tokens, pattern, 1, cur_len - n - 1)
        if match_pos == 0:
            return []
        copy_max = min(m, cur_len - (match_pos + n))
        if copy_max < n:
            return []
        return tokens[match_pos + n : match_pos + n + min(copy_max, req.n_max)]
