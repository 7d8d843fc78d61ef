"""The engine's per-step hot paths against straightforward references: logit capture (top-k without a
full partition), the backwards n-gram search, sequence-state copies, and greedy drafting at p_min 0."""

import math
import random
import zlib

import numpy as np
import pytest
from helpers import quicksort

from harness.engine import ContextParams, Engine
from harness.engine import context as context_module
from harness.engine.context import Context
from harness.engine.drafters import draft_model
from harness.engine.drafters.draft_model import greedy_token, top10_best
from harness.engine.drafters.ngram_simple import RFIND_WINDOW, iter_ngram, rfind_ngram
from harness.engine.model import Model
from harness.engine.spec_config import SpecConfig
from harness.models import draft_for, resolve
from harness.result.logits import SAMPLE_STRIDE, capture

# --- logits.capture ------------------------------------------------------------------------------------


def capture_before(row: np.ndarray, k: int) -> tuple:
    """capture() as it was: a partition of the whole row, then (value desc, id asc); its pick among ids
    tied at the k-th value is numpy's."""
    k = min(k, row.shape[0])
    top = np.argpartition(row, -k)[-k:]
    order = top[np.lexsort((top, -row[top]))]
    peak = float(row[order[0]])
    log_z = peak + math.log(float(np.exp(row - np.float32(peak)).sum(dtype=np.float64)))
    return (
        order.astype(np.int32),
        row[order].astype(np.float32),
        f"{zlib.crc32(memoryview(row)):08x}",
        tuple(float(x) for x in row[:3]),
        tuple(float(x) for x in row[-3:]),
        log_z,
    )


def reference_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The top k by (value desc, id asc) from a full sort: lowest ids first among ties, also at the k-th."""
    return np.lexsort((np.arange(row.shape[0]), -row))[: min(k, row.shape[0])].astype(np.int32)


def rows(rng: np.random.Generator):
    """Random float32 rows: continuous, few distinct values (ties everywhere), top values all equal,
    a constant row, a single hot id, and negative-only rows; small and full Gemma-size vocabularies."""
    for n in (1, 3, 40, 1000, 32000, 262144):
        yield (rng.standard_normal(n, dtype=np.float32) * 3).astype(np.float32)
        yield rng.integers(-4, 4, n).astype(np.float32)
        yield rng.integers(-3, 1, n).astype(np.float32) * np.float32(0.5)
        top_equal = (rng.standard_normal(n, dtype=np.float32) - 10).astype(np.float32)
        top_equal[rng.choice(n, size=min(n, 50), replace=False)] = np.float32(7.25)
        yield top_equal
        yield np.full(n, np.float32(-1.5))
        hot = np.zeros(n, dtype=np.float32)
        hot[rng.integers(n)] = 30.0
        yield hot
        yield (-np.abs(rng.standard_normal(n, dtype=np.float32)) * 20).astype(np.float32)


@pytest.mark.parametrize("k", [1, 10, 40])
def test_capture_equals_the_full_partition_with_ties_broken_by_id(k):
    rng = np.random.default_rng(k)
    for row in rows(rng):
        rec = capture(row, k)
        ids, values, digest, head, tail, log_z = capture_before(row, k)
        np.testing.assert_array_equal(rec.top_ids, reference_ids(row, k))
        assert rec.top_ids.dtype == np.int32 and rec.top_logits.dtype == np.float32
        assert rec.top_logits.tobytes() == values.tobytes()  # the same k values as before, in the same order
        above = values > values[-1]  # ids above the k-th value: no tie to break, the same ids as before
        np.testing.assert_array_equal(rec.top_ids[above], ids[above])
        assert (rec.digest, rec.head, rec.tail) == (digest, head, tail)
        assert rec.log_z == log_z


def test_capture_without_ties_at_the_kth_value_is_what_it_was():
    rng = np.random.default_rng(7)
    for _ in range(40):
        n = int(rng.choice([50, 5000, 262144]))
        row = (rng.standard_normal(n, dtype=np.float32) * rng.uniform(0.5, 8)).astype(np.float32)
        k = int(rng.choice([1, 10, 40]))
        rec = capture(row, k)
        ids, values, digest, head, tail, log_z = capture_before(row, k)
        np.testing.assert_array_equal(rec.top_ids, ids)
        assert rec.top_logits.tobytes() == values.tobytes()
        assert (rec.digest, rec.head, rec.tail, rec.log_z) == (digest, head, tail, log_z)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_capture_of_a_row_with_nan_or_inf_is_what_it_was(bad):
    rng = np.random.default_rng(3)
    for n, where in ((262144, 5), (262144, 262100), (262144, 64 * 100), (100, 3)):
        row = rng.standard_normal(n, dtype=np.float32)
        row[where] = bad
        rec = capture(row, 10)
        ids, values, digest, head, tail, log_z = capture_before(row, 10)
        np.testing.assert_array_equal(rec.top_ids, ids)
        assert rec.top_logits.tobytes() == values.tobytes()
        assert (rec.digest, rec.head, rec.tail) == (digest, head, tail)
        assert math.isnan(rec.log_z) and math.isnan(log_z)


def test_capture_sample_bound_holds_when_the_top_k_hide_between_samples():
    """Every top value off the sampled ids: the sample's k-th largest still bounds the row's from below."""
    n, k = 262144, 40
    row = np.zeros(n, dtype=np.float32)
    hidden = np.arange(1, n, SAMPLE_STRIDE)[: 3 * k]
    row[hidden] = np.linspace(10, 20, hidden.size, dtype=np.float32)
    rec = capture(row, k)
    np.testing.assert_array_equal(rec.top_ids, reference_ids(row, k))


# --- ngram search --------------------------------------------------------------------------------------


def rfind_brute(tokens, pattern, lo, hi):
    return max((j for j in range(lo, hi + 1) if tokens[j : j + len(pattern)] == pattern), default=0)


def test_rfind_ngram_equals_a_brute_force_search():
    rnd = random.Random(13)
    for case in range(1500):
        n_tokens = rnd.choice([5, 40, RFIND_WINDOW - 1, RFIND_WINDOW + 3, 700, 3000])
        alphabet = rnd.choice([2, 3, 5, 50])
        tokens = [rnd.randrange(alphabet) for _ in range(n_tokens)]
        size = rnd.choice([1, 2, 3, 4, 12])
        if case % 3 == 0 and n_tokens > size:  # a pattern that surely occurs
            start = rnd.randrange(n_tokens - size + 1)
            pattern = tokens[start : start + size]
        else:
            pattern = [rnd.randrange(alphabet) for _ in range(size)]
        lo = rnd.choice([0, 1, rnd.randrange(max(1, n_tokens))])
        hi = rnd.choice([n_tokens - size, n_tokens - size - 1, rnd.randrange(max(1, n_tokens))])
        assert rfind_ngram(tokens, pattern, lo, hi) == rfind_brute(tokens, pattern, lo, hi), (case, lo, hi)
        assert list(iter_ngram(tokens, pattern, lo, hi)) == [
            j for j in range(max(lo, 0), hi + 1) if tokens[j : j + size] == pattern
        ]


def test_rfind_ngram_finds_the_only_match_far_from_the_end():
    tokens = [7] * 5000
    tokens[3:6] = [1, 2, 3]
    assert rfind_ngram(tokens, [1, 2, 3], 1, len(tokens) - 4) == 3
    assert rfind_ngram(tokens, [1, 2, 3], 4, len(tokens) - 4) == 0


# --- sequence state ------------------------------------------------------------------------------------


def test_state_seq_round_trip_restores_identically(tiny_models, monkeypatch):
    model = Model(tiny_models["tiny-dense"].path)
    ctx = Context(model, ContextParams(n_ctx=1024, parallel=2))
    batch = ctx.new_batch()
    try:
        tokens = model.tokenize(quicksort("C").prompt) * 4
        for i, t in enumerate(tokens):
            batch.add(t, i, 0, i == len(tokens) - 1)
        assert ctx.decode(batch) == 0
        state = ctx.state_seq(0)
        assert type(state) is bytes and len(state) > 10_000
        kept = bytes(bytearray(state))

        # the bytes do not alias the context's buffer: a later, different dump leaves them as they were
        batch.clear()
        batch.add(tokens[0], len(tokens), 0, True)
        assert ctx.decode(batch) == 0
        assert ctx.state_seq(0) != state and state == kept

        assert ctx.seq_rm(0)
        assert ctx.seq_pos_max(0) == -1
        assert ctx.set_state_seq(0, state)
        assert ctx.seq_pos_max(0) == len(tokens) - 1
        assert ctx.state_seq(0) == state
        assert ctx.set_state_seq(1, bytearray(state))  # other buffers are copied, into another sequence
        assert ctx.seq_pos_max(1) == len(tokens) - 1
        assert ctx.set_state_seq(0, memoryview(state))
        assert ctx.state_seq(0) == state
        assert not ctx.set_state_seq(0, state[: len(state) // 2])  # a truncated state is refused
        assert ctx.set_state_seq(0, state)
        monkeypatch.setattr(context_module, "KEEP_STATE_BUFFER", len(state) - 1)  # too large to keep
        ctx._state_buf = None
        assert ctx.state_seq(0) == state and ctx._state_buf is None
    finally:
        batch.free()
        ctx.close()
        model.close()


# --- draft-simple at p_min 0 ---------------------------------------------------------------------------


def test_greedy_token_and_top10_best_take_the_lowest_of_tied_maxima():
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.choice([20, 1000, 32000]))
        logits = rng.standard_normal(n, dtype=np.float32)
        tied = rng.choice(n, size=int(rng.integers(1, 6)), replace=False)
        logits[tied] = logits.max() + 1
        best, p = top10_best(logits)
        assert best == greedy_token(logits) == int(tied.min())
        top = np.sort(logits.astype(np.float64))[-10:]
        # llama.cpp's float arithmetic (expf per candidate, a double sum, the probability stored as a float): within
        # a float's precision of the exact value, and a float
        assert p == pytest.approx(1 / np.exp(top - top[-1]).sum(), rel=1e-6)
        assert p == float(np.float32(p))


def test_draft_simple_at_p_min_0_drafts_the_argmax_without_top10(tiny_models, monkeypatch):
    target = tiny_models["tiny-dense"]
    draft = resolve(draft_for("tiny-dense")).path
    requests = [quicksort("C", 48), quicksort("Python", 48)]

    def run(p_min):
        spec = SpecConfig(
            spec_type=("draft-simple",), spec_draft_model=draft, spec_draft_n_max=4, spec_draft_p_min=p_min
        )
        with Engine(target.path, ContextParams(), spec) as engine:
            return engine.run(requests)

    with_top10 = run(1e-30)  # the top-10 path, whose probability never stops a draft
    monkeypatch.setattr(draft_model, "top10_best", lambda logits: pytest.fail("top10_best at p_min 0"))
    greedy = run(0.0)
    for a, b in zip(with_top10, greedy, strict=False):
        assert a.ok and b.ok
        assert a.tokens == b.tokens
        stats = ("draft_n", "draft_n_accepted", "spec_cycles", "spec_skip")
        assert {s: a.spec_stats[s] for s in stats} == {s: b.spec_stats[s] for s in stats}
        assert b.spec_stats["draft_n_accepted"] > 0


def test_deferred_capture_settles_to_the_immediate_record():
    rng = np.random.default_rng(7)
    for trial in range(12):
        row = rng.normal(0, 3, 262144).astype(np.float32)
        if trial == 3:
            row[11] = np.nan
        if trial == 4:
            row[13] = np.inf
        now = capture(row, 10)
        later = capture(row, 10, deferred=True)
        row += 1  # the caller's buffer changes after the call (the next decode): the record must not
        later.settle()
        assert later.pending is None and later.digest == now.digest
        assert np.array_equal(later.top_ids, now.top_ids)
        assert np.array_equal(later.top_logits, now.top_logits, equal_nan=True)
        assert (later.head, later.tail) == (now.head, now.tail)
        assert np.array_equal(np.float64(later.log_z), np.float64(now.log_z), equal_nan=True)
