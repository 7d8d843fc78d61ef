"""The `stale-partial-rollback` fault (harness.engine.rollback.stale_partial) hands back, through llama.cpp's own
snapshot planes, the recurrent state of one token before the kept ones, labelled with the right position (the stale
snapshot of ggml-org/llama.cpp PR #29117); the right partial rollback hands back the state of the kept tokens."""

import numpy as np
import pytest

from harness.engine import rollback
from harness.engine.context import Context, ContextParams
from harness.engine.model import Model
from harness.models import resolve

TOKENS = [11, 220, 3000, 400, 57, 9000]
PARTIAL = rollback.CHECKPOINT_FLAGS["partial"]


@pytest.fixture(scope="module")
def model():
    m = Model(resolve("tiny-hybrid").path)
    yield m
    m.close()


def decoded(model: Model, tokens: list[int]) -> Context:
    """A context with 3 recurrent snapshots that decoded `tokens` in one batch (sequence 0)."""
    ctx = Context(model, ContextParams(n_ctx=256, n_rs_seq=3, threads=1))
    assert ctx.n_rs_seq == 3
    batch = ctx.new_batch()
    for pos, token in enumerate(tokens):
        batch.add(token, pos, 0, pos == len(tokens) - 1)
    assert ctx.decode(batch) == 0
    batch.free()
    return ctx


def recurrent(ctx: Context) -> tuple[int, np.ndarray]:
    """The sequence's recurrent tail: its position and its rows (the PARTIAL_ONLY blob of a hybrid)."""
    blob = ctx.state_seq(0, PARTIAL)
    return int(np.frombuffer(blob, np.int32, 1, 12)[0]), np.frombuffer(blob[16:], np.float32)


def close_to(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.allclose(a, b, rtol=0, atol=1e-5, equal_nan=True)


def test_the_fault_restores_the_state_one_token_stale_at_the_right_position(model):
    contexts = [decoded(model, TOKENS[:n]) for n in (3, 4)]
    before_last, kept = (recurrent(c)[1] for c in contexts)
    assert not close_to(before_last, kept)  # the last kept token moved the state

    right = decoded(model, TOKENS)
    assert right.seq_rm(0, 4, -1)  # 2 rejected: the snapshot plane of position 3
    pos, rows = recurrent(right)
    assert pos == 3 and close_to(rows, kept)

    stale = decoded(model, TOKENS)
    assert rollback.stale_partial(stale, 0, 4)
    pos, rows = recurrent(stale)
    assert pos == 3 and stale.seq_pos_max(0) == 3
    assert close_to(rows, before_last) and not close_to(rows, kept)
    batch = stale.new_batch()  # positions are right: the next token follows
    batch.add(TOKENS[4], 4, 0, True)
    assert stale.decode(batch) == 0
    batch.free()
    for c in (*contexts, right, stale):
        c.close()


def test_outside_the_snapshot_window_it_does_nothing(model):
    ctx = decoded(model, TOKENS)
    assert not rollback.stale_partial(ctx, 0, 3)  # 4 tokens back: beyond 3 snapshots
    assert ctx.seq_pos_max(0) == 5
    ctx.close()
