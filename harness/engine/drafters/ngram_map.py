"""ngram-map-k and ngram-map-k4v: a per-sequence map of n-gram keys found again in the history
(llama.cpp's `common_ngram_map_*`, common/ngram-map.cpp), translated step for step.

Keys and values are indices into the sequence's current history, and every comparison re-reads the
history, as in llama.cpp. The "hash → index" map has 2^18 buckets, is filled in llama.cpp's order and only
where a bucket is empty, so hash collisions and the ranges llama.cpp scans decide which occurrence of a key
is found, exactly as there.
"""

from dataclasses import dataclass, field
from functools import cache

import numpy as np

from harness.engine.drafters.base import Drafter, DraftRequest
from harness.engine.drafters.ngram_simple import iter_ngram, rfind_ngram

MAX_VALUES = 4  # COMMON_NGRAM_MAX_VALUES
MAX_COUNT = 16380  # COMMON_NGRAM_MAX_VALUE_COUNT
HASH_BITS = 18  # COMMON_NGRAM_HASH_MAP_SIZE = 2^18
LCG_FACTOR = 2654435761


@cache
def _weights(n: int, mult: int, bits: int) -> np.ndarray:
    return np.array([pow(mult, n - 1 - i, 1 << bits) for i in range(n)], dtype=np.int64)


def poly_hashes(tokens: list[int], lo: int, hi: int, n: int, mult: int, bits: int) -> np.ndarray:
    """(((t0 * mult + t1) * mult + t2) ...) mod 2^bits for the n-gram starting at each index in [lo, hi)
    (int64 array). Equals llama.cpp's hashes with 32- or 64-bit wrap followed by "mod 2^bits"."""
    if hi <= lo:
        return np.zeros(0, dtype=np.int64)
    mask = (1 << bits) - 1
    window = np.asarray(tokens[lo : hi + n - 1], dtype=np.int64) & mask
    return np.correlate(window, _weights(n, mult, bits), mode="valid") & mask


@dataclass(slots=True)
class _Value:
    idx: int = 0  # start of the value m-gram in the history (0: unused slot)
    num: int = 0  # occurrences after the key
    n_accepted: int = -1  # accepted tokens of the last draft made from this value


@dataclass(slots=True)
class _Key:
    idx: int  # start of the key n-gram in the history
    values: list[_Value]
    stat_idx: int = 0  # statistics counted up to this index
    num: int = 0  # hits of this key


@dataclass
class _SeqMap:
    keys: list[_Key] = field(default_factory=list)
    key_map: np.ndarray = field(default_factory=lambda: np.zeros(1 << HASH_BITS, dtype=np.uint32))
    key_map_last_idx: int = 0
    size_last_begin: int = 0
    idx_last_check: int = 0
    last_draft: tuple[_Key, int] | None = None  # (key, value slot) of the last draft, for accept()


class _NgramMap(Drafter):
    """Shared implementation of ngram-map-k (`key_only`) and ngram-map-k4v; state per sequence."""

    key_only: bool

    def __init__(self, size_n: int = 12, size_m: int = 48, min_hits: int = 1):
        self.size_n = size_n
        self.size_m = self.n_max = size_m
        self.min_hits = min_hits
        self._seqs: dict[int, _SeqMap] = {}

    def _state(self, seq_id: int) -> _SeqMap:
        if seq_id not in self._seqs:
            self._seqs[seq_id] = _SeqMap()
        return self._seqs[seq_id]

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """`common_ngram_map_begin`: if the history shrank since the last draft (e.g. a reasoning block was
        removed), forget hash entries, keys and values that lie in the dropped part."""
        st, n, m = self._state(seq_id), self.size_n, self.size_m
        size_begin = len(prompt)
        cleanup = st.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if size_begin < st.idx_last_check:
            st.key_map[st.key_map >= max(cleanup, 1)] = 0
            st.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            kept = []
            for key in st.keys:
                if key.idx >= cleanup:
                    continue
                if not self.key_only:
                    for j in range(MAX_VALUES - 1, -1, -1):
                        if key.values[j].idx != 0 and key.values[j].idx >= cleanup:
                            last = key.values[-1]
                            del key.values[j]
                            key.values.append(_Value(n_accepted=last.n_accepted))
                    if key.values[0].idx == 0:
                        continue
                kept.append(key)
            st.keys = kept
        st.idx_last_check = size_begin
        st.size_last_begin = size_begin

    def draft(self, req: DraftRequest) -> list[int]:
        """`common_ngram_map_draft`, capped at `req.n_max`."""
        st, n, m = self._state(req.seq_id), self.size_n, self.size_m
        inp = req.history
        st.last_draft = None
        cur_len = len(inp)
        if cur_len < 2 * n + m:
            return []
        if st.idx_last_check > cur_len or st.size_last_begin > cur_len:
            raise ValueError(f"history ({cur_len} tokens) is shorter than at the last begin()/draft()")
        st.idx_last_check = cur_len
        key = inp[cur_len - n + 1 :] + [req.id_last]

        # Where the not yet hashed n-grams lie (llama.cpp leaves a gap just below size_last_begin).
        head = (st.key_map_last_idx + 1, st.size_last_begin - n - m - 1) if st.size_last_begin > n + m + 1 else (1, 0)
        tail = (max(st.size_last_begin, st.key_map_last_idx) + 1, cur_len - n - m - 1)

        match_pos = 0
        idx_key = int(st.key_map[poly_hashes(key, 0, 1, n, LCG_FACTOR, HASH_BITS)[0]])
        if idx_key != 0 and idx_key < cur_len - n - m - 1 and inp[idx_key : idx_key + n] == key:
            match_pos = idx_key
        if match_pos == 0:
            match_pos = rfind_ngram(inp, key, *head)
        if match_pos == 0:
            match_pos = rfind_ngram(inp, key, *tail)

        # Hash the new n-grams, same order as the scans (descending in each range), only into empty buckets.
        starts = np.concatenate([np.arange(hi, lo - 1, -1) for lo, hi in (head, tail)])
        hashes = np.concatenate(
            [poly_hashes(inp, lo, hi + 1, n, LCG_FACTOR, HASH_BITS)[::-1] for lo, hi in (head, tail)]
        )
        buckets, first = np.unique(hashes, return_index=True)
        empty = st.key_map[buckets] == 0
        st.key_map[buckets[empty]] = starts[first[empty]]
        st.key_map_last_idx = max(cur_len - n - m - 1, st.key_map_last_idx)

        if match_pos == 0:
            return []
        cur = next((k for k in st.keys if inp[k.idx : k.idx + n] == key), None)
        if cur is None:
            cur = _Key(idx=match_pos, values=[_Value(n_accepted=m) for _ in range(MAX_VALUES)])
            st.keys.append(cur)
        cur.num = min(cur.num + 1, MAX_COUNT)

        if self.key_only:
            slot = 0
        else:
            if cur.num < self.min_hits:
                return []
            self._count_values(cur, inp, key, match_pos)
            nums = [v.num for v in cur.values]
            slot = nums.index(max(nums))
            others = sum(nums) - nums[slot]
            if others > 0 and nums[slot] < 2 * others:
                return []  # no dominant continuation
        st.last_draft = (cur, slot)
        n_draft = min(m, cur.values[slot].n_accepted, req.n_max)
        return inp[match_pos + n : match_pos + n + max(n_draft, 0)]

    def _count_values(self, cur: _Key, inp: list[int], key: list[int], match_pos: int) -> None:
        """k4v statistics: count the m-grams after each occurrence of the key in [stat_idx, match_pos]
        (the occurrence at stat_idx is counted again, as in llama.cpp); at most MAX_VALUES distinct ones."""
        n, m = self.size_n, self.size_m
        for i in iter_ngram(inp, key, cur.stat_idx, match_pos):
            value = inp[i + n : i + n + m]
            for v in cur.values:
                if v.idx == 0:
                    v.idx, v.num, v.n_accepted = i + n, 0, m
                elif inp[v.idx : v.idx + m] != value:
                    continue
                v.num = min(v.num + 1, MAX_COUNT)
                break
        cur.stat_idx = match_pos

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """Remember how many tokens of this drafter's last draft were accepted: the next draft from the same
        key value is no longer than that (0 stops it)."""
        st = self._seqs.get(seq_id)
        if is_other or st is None or st.last_draft is None:
            return
        cur, slot = st.last_draft
        cur.values[slot].n_accepted = n_accepted


class NgramMapK(_NgramMap):
    """llama.cpp `--spec-type ngram-map-k`: draft the size_m tokens after an earlier occurrence of the
    current size_n-gram (key = last size_n-1 history tokens + id_last), shortened to what was accepted the
    last time this key drafted. min_hits is unused (as in llama.cpp)."""

    name = "ngram-map-k"
    key_only = True


class NgramMapK4V(_NgramMap):
    """llama.cpp `--spec-type ngram-map-k4v`: like ngram-map-k, but draft only when the key was hit at least
    min_hits times and one of its (up to 4) continuations is at least twice as frequent as the others
    together; the tokens are still copied from the found occurrence."""

    name = "ngram-map-k4v"
    key_only = False
