"""ngram-mod: one hash table "n-gram → next token" shared by all sequences, drafts by chained lookups
(llama.cpp's `common_ngram_mod` and `common_speculative_impl_ngram_mod`)."""

from dataclasses import dataclass

import numpy as np

from harness.engine.drafters.base import Drafter, DraftRequest
from harness.engine.drafters.ngram_map import poly_hashes

HASH_BITS = 22
TABLE_SIZE = 1 << HASH_BITS  # 4,194,304 slots; "hash mod size" keeps the low 22 bits of the 64-bit hash
MULT = 6364136223846793005
EMPTY = -1
MAX_OCCUPANCY = 0.25  # begin() resets the table above this
CHUNK = 32  # new n-grams are inserted once more than this many tokens are pending
LOW_ACCEPT = 0.25  # accept(): a draft with a smaller accepted fraction counts as low
LOW_STREAK = 5  # consecutive low drafts that reset the table

_MASK = TABLE_SIZE - 1


@dataclass
class _SeqInfo:
    i_last: int = 0  # n-grams starting before this index are in the table
    n_draft_last: int = 0  # length of the last draft (before the caller's n_max cap)
    n_low: int = 0  # consecutive drafts with a low accepted fraction


class NgramMod(Drafter):
    """llama.cpp `--spec-type ngram-mod`. begin() inserts every prompt n-gram (n_match tokens → the token
    after it; last writer wins) and empties the table when more than 25 % is used; draft() first inserts the
    sequence's pending n-grams once more than 32 are pending, then looks up the next token of the last
    n_match tokens (ending with id_last) again and again, up to n_max tokens: a miss before n_min tokens
    means no draft, a later miss ends the draft. accept() empties the table after 5 consecutive drafts with
    accepted/drafted < 0.25. The table is shared by all sequences of this drafter."""

    name = "ngram-mod"

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64):
        self.n_match = n_match
        self.n_min = n_min
        self.n_max = n_max
        self.table = np.full(TABLE_SIZE, EMPTY, dtype=np.int32)
        self.used = 0
        self._seqs: dict[int, _SeqInfo] = {}
        self._shift_out = pow(MULT, n_match - 1, TABLE_SIZE)  # weight of a window's first token

    def reset(self) -> None:
        """Empty the table."""
        self.table.fill(EMPTY)
        self.used = 0

    def _add(self, tokens: list[int], lo: int, hi: int) -> None:
        """`common_ngram_mod::add` for the n-grams starting at lo..hi-1, in order (the last writer wins)."""
        if hi <= lo:
            return
        slots = poly_hashes(tokens, lo, hi, self.n_match, MULT, HASH_BITS)[::-1]
        nxt = np.asarray(tokens[lo + self.n_match : hi + self.n_match], dtype=np.int32)[::-1]
        slots, last = np.unique(slots, return_index=True)  # first in reversed order = last writer
        self.used += int(np.count_nonzero(self.table[slots] == EMPTY))
        self.table[slots] = nxt[last]

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """Insert the prompt's n-grams; reset the table if it is now more than 25 % full."""
        info = self._seqs.setdefault(seq_id, _SeqInfo())
        info.i_last = 0
        info.n_draft_last = 0
        n = self.n_match
        if len(prompt) < n:
            return
        self._add(prompt, 0, len(prompt) - n)
        info.i_last = len(prompt) - n
        if self.used / TABLE_SIZE > MAX_OCCUPANCY:
            self.reset()

    def draft(self, req: DraftRequest) -> list[int]:
        """Chained lookups as described on the class; capped at `req.n_max` after the bookkeeping."""
        info = self._seqs.setdefault(req.seq_id, _SeqInfo())
        info.n_draft_last = 0
        tokens, n = req.history, self.n_match
        cur_len = len(tokens)
        if cur_len < n:
            return []
        if info.i_last + CHUNK < cur_len:
            self._add(tokens, info.i_last, cur_len - n)
            info.i_last = cur_len - n

        window = tokens[cur_len - n + 1 :] + [req.id_last]
        h = int(poly_hashes(window, 0, 1, n, MULT, HASH_BITS)[0])
        result: list[int] = []
        for i in range(self.n_max):
            token = int(self.table[h])
            if token == EMPTY:
                if i < self.n_min:
                    return []
                break
            result.append(token)
            window.append(token)
            h = ((h - window[i] * self._shift_out) * MULT + token) & _MASK
        info.n_draft_last = len(result)
        return result[: req.n_max]

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """Track low-acceptance streaks of this drafter's own drafts; reset the table after 5 in a row."""
        info = self._seqs.get(seq_id)
        if is_other or info is None or info.n_draft_last == 0:
            return
        if n_accepted / info.n_draft_last < LOW_ACCEPT:
            info.n_low += 1
            if info.n_low >= LOW_STREAK:
                self.reset()
                info.n_low = 0
                info.i_last = 0
        else:
            info.n_low = 0
