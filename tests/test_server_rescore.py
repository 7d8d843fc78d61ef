"""Re-scoring a position through llama-server itself (harness.backends.server_rescore, ServerSession.rescore): the
logits llama-server withholds for the tokens a speculative verification step emitted (upstream #27972), computed
again by a server of the run's command line, in the batch the run computed them in (its prefix cached, the
batch's rows up to the position as one prompt batch).

Real llama-server, real tiny GGUF models. The log's generation batches must account for every output token, and
the probabilities llama-server did return say which of them came from a step without drafts: the two must agree
token for token. A re-scored one-token decode is the run's own row (the same shape); a re-scored verification row
picks the token the run emitted there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import numerics_stand_in, quicksort

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.server_backend import ServerBackend
from harness.backends.server_rescore import shape_of
from harness.models import resolve
from harness.verdict import noise

pytestmark = pytest.mark.xdist_group("server-rescore")

N_PREDICT = 64
TOP_K = 10


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    """(the session, still open for re-scoring, and its speculative request's Result): tiny-dense drafted by its
    draft model, four drafts a step, so some steps reject and some accept."""
    build = ensure_server(None, "cpu", [], jobs=None)
    config = ServeConfig(
        model=tiny_models["tiny-dense"].path,
        mode="seq",
        flash_attn="off",
        draft_model=resolve("tiny-dense-draft").path,
        spec={"spec-type": "draft-simple", "spec-draft-n-max": 4},
        logit_top_k=TOP_K,
    )
    with ServerBackend(build, run_dir=tmp_path_factory.mktemp("rescore")).open(config) as session:
        [result] = session.run([quicksort("C", n_predict=N_PREDICT)])
        assert result.ok, result.error
        yield session, result


def _rescored(session, result, pos):
    shape = shape_of(result, pos)
    sequence = [*result.prompt_tokens, *result.tokens]
    prefix, tail = sequence[: shape.start], sequence[shape.start : shape.start + shape.row + 1]
    return shape, session.rescore(prefix, tail, TOP_K)


def test_the_logs_batches_account_for_every_token_and_match_the_withheld_probabilities(served):
    _, result = served
    shapes = [shape_of(result, pos) for pos in range(len(result.tokens))]
    assert all(s is not None for s in shapes), [i for i, s in enumerate(shapes) if s is None]
    withheld = [i for i, p in enumerate(result.logits) if len(p.top_ids) == 0]
    verified = [i for i, s in enumerate(shapes) if s.kind == "verification"]
    assert withheld and withheld == verified, f"withheld {withheld}, verification rows {verified}"
    assert result.spec_stats["draft_n"] > result.spec_stats["draft_n_accepted"] > 0  # rejections and acceptances


def test_a_re_scored_one_token_decode_is_the_runs_own_row(served):
    session, result = served
    tolerance = noise.load("tiny-dense", "server", "cpu").tolerances.max_abs
    decodes = [p for p in range(len(result.tokens)) if shape_of(result, p).kind in ("decode", "prompt")]
    assert decodes
    for pos in decodes[:8]:
        shape, row = _rescored(session, result, pos)
        logged = result.logits[pos]
        assert row is not None, f"position {pos}: llama-server gave no re-scored row"
        assert row.top_ids.tolist() == logged.top_ids.tolist()
        delta = float(np.max(np.abs(row.top_logits.astype(np.float64) - logged.top_logits)))
        assert delta <= tolerance, f"position {pos} ({shape.kind}): |Δ log p| {delta:.3g} > {tolerance:.3g}"


def test_a_re_scored_verification_row_picks_the_token_the_run_emitted(served):
    session, result = served
    tolerance = noise.load("tiny-dense", "server", "cpu").tolerances.max_abs
    verified = [p for p in range(len(result.tokens)) if shape_of(result, p).kind == "verification"]
    for pos in verified[:12]:
        shape, row = _rescored(session, result, pos)
        assert row is not None, f"position {pos}: llama-server gave no re-scored row"
        ids = row.top_ids.tolist()
        token = result.tokens[pos]
        assert token in ids, f"position {pos}: the emitted token {token} is not in the re-scored top-{TOP_K}"
        behind = float(row.top_logits[0]) - float(row.top_logits[ids.index(token)])
        assert behind <= tolerance, f"position {pos} (row {shape.row} of {shape.rows}): {token} behind by {behind:.3g}"


def test_shape_of_walks_the_generation_batches_in_order():
    """Prompt of 10 tokens (batches at 0 and 8); then a one-token decode, a 5-row verification that kept 2 drafts
    (3 tokens), a restored 5-row verification (nothing emitted) and its 4-row replay (4 tokens)."""
    from harness.result import Result, Work

    result = Result(prompt_tokens=list(range(10)), tokens=list(range(100, 109)))
    result.work = Work(steps={"prompt_batches": [0, 8], "batches": [[1, 1], [5, 3], [5, 0], [4, 4]]})
    shapes = [shape_of(result, pos) for pos in range(9)]
    assert (shapes[0].kind, shapes[0].start, shapes[0].row, shapes[0].rows) == ("prompt", 8, 1, 2)
    assert (shapes[1].kind, shapes[1].start, shapes[1].row) == ("decode", 10, 0)
    assert [(s.start, s.row, s.rows) for s in shapes[2:5]] == [(11, 0, 5), (11, 1, 5), (11, 2, 5)]
    assert [(s.start, s.row, s.rows) for s in shapes[5:9]] == [(14, 0, 4), (14, 1, 4), (14, 2, 4), (14, 3, 4)]
    assert shape_of(result, 9) is None  # past the batches the log told
    result.work = Work(steps={"batches": [[1, 1], [5, None]]})  # a step whose outcome the log did not tell
    assert shape_of(result, 2) is None and shape_of(result, 1).kind == "decode"


def test_the_replayed_batches_pick_what_the_server_emitted_where_its_prompt_cache_cannot(tmp_path):
    """The CPU stand-in for GPU numerics (suites/numerics.yaml): tiny-dense-wide at Q4_K, repacked, multiplies 4 rows
    at a time from 4 batch rows on, so a verification row's logits differ from the same position decoded alone, and
    a near-tie can flip. The replay of the request's batches through the libllama this build runs (its prompt
    batches, each step's rows with the rejected ones cut back) must pick, at
    every token a verification step emitted, that token (a top-1 or an exact tie): it computed what the server did.
    The prompt cache's re-score (fewer rows, one output) is not held to that (a flip at 0.018 nats went the other
    way, suites/numerics.yaml's Rust case); it is what a build that runs another libllama gets."""
    from harness.backends.inproc import InprocBackend
    from harness.backends.server_rescore import replay_of

    build = ensure_server(None, "cpu", [], jobs=None)
    config = numerics_stand_in(TOP_K)
    requests = [quicksort(lang, n_predict=40) for lang in ("C", "Rust", "Java", "Python")]
    with ServerBackend(build, run_dir=tmp_path).open(config) as session:
        results = session.run(requests)
    replayed, shared = 0, 0
    engine = InprocBackend().open(replace(config, logit_top_k=0))
    try:
        for result in results:
            assert result.ok, result.error
            for pos in range(len(result.tokens)):
                if pos < len(result.logits) and len(result.logits[pos].top_ids):
                    continue  # logged by the server itself
                replay = replay_of(result, pos)
                assert replay is not None, f"position {pos}: the log does not tell its batch"
                row = engine.replay_row(replay.decodes, replay.row, TOP_K)
                ids, token = row.top_ids.tolist(), result.tokens[pos]
                assert token in ids, f"slot {result.slot_id} position {pos}: {token} not in the replayed top-{TOP_K}"
                behind = float(row.top_logits[0]) - float(row.top_logits[ids.index(token)])
                assert behind == 0.0, f"slot {result.slot_id} position {pos}: {token} behind by {behind:.3g} nats"
                replayed += 1
                shared += replay.shared
    finally:
        engine.close()
    assert replayed > 20 and shared == 0
