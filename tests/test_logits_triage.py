"""Logit records (capture, llama-server conversion, Parquet), their comparison, and first-divergence
triage: pure logic on hand-made arrays, then real tiny-model runs that diverge for a logic bug (a rollback
fault) and for a numerical near-tie (flash attention on vs off)."""

import math

import numpy as np
import pytest

from harness.engine import ContextParams, Engine
from harness.engine.drafters.scripted import Scripted
from harness.engine.model import Model
from harness.engine.spec_config import SpecConfig
from harness.result.logits import (
    PositionLogits,
    Tolerances,
    capture,
    check,
    compare,
    from_frame,
    from_server_probs,
    larger_curves,
    load_case,
    load_parquet,
    save_parquet,
    to_frame,
    window_largest,
)
from harness.suites.request import Request, Sampling
from harness.verdict.noise import NEAR_TIE, NoiseFloor
from harness.verdict.triage import triage

QUICKSORT_C = "Write a quicksort demo in C. Please, write just code. Do not write any extra comments."


def lp(ids, logprobs):
    """A record whose values are log-probabilities."""
    return PositionLogits(np.array(ids, dtype=np.int32), np.array(logprobs, dtype=np.float32))


def same(n, ids=(1, 2, 3), values=(-1.0, -2.0, -3.0)):
    return [lp(ids, values) for _ in range(n)]


# --- records ---------------------------------------------------------------------------------------------


def test_capture_records_the_normaliser_of_the_whole_row():
    row = np.array([0.5, 3.0, -1.0, 2.0, 2.0], dtype=np.float32)
    rec = capture(row, 3)
    assert rec.top_ids.tolist() == [1, 3, 4]  # ties broken by id
    logsoftmax = row - np.log(np.exp(row.astype(np.float64)).sum())
    np.testing.assert_allclose(rec.logprobs(), logsoftmax[[1, 3, 4]], rtol=0, atol=1e-6)
    assert rec.margin == pytest.approx(1.0)


def test_server_logprobs_convert_sorted_with_empty_speculative_entries():
    probs = [
        {
            "id": 7,
            "logprob": -0.4,
            "top_logprobs": [{"id": 9, "logprob": -2.5}, {"id": 7, "logprob": -0.4}, {"id": 4, "logprob": -2.5}],
        },
        {"id": 5, "logprob": 0.0, "top_logprobs": []},  # accepted through speculation
    ]
    first, spec = from_server_probs(probs)
    assert first.top_ids.tolist() == [7, 4, 9] and first.top_ids.dtype == np.int32
    assert first.top_logits.dtype == np.float32 and first.top_logits[0] == np.float32(-0.4)
    assert first.digest == "" and first.log_z == 0.0 and first.margin == pytest.approx(2.1)
    assert len(spec.top_ids) == 0 and len(spec.top_logits) == 0 and spec.margin is None


def test_server_post_sampling_probs_become_logs_and_zero_becomes_float_lowest():
    (rec,) = from_server_probs(
        [{"id": 3, "prob": 0.6, "top_probs": [{"id": 3, "prob": 0.6}, {"id": 8, "prob": 0.0}, {"id": 2, "prob": 0.3}]}]
    )
    assert rec.top_ids.tolist() == [3, 2, 8]
    assert rec.top_logits[:2] == pytest.approx([math.log(0.6), math.log(0.3)])
    assert rec.top_logits[2] == np.finfo(np.float32).min


def test_server_margin_equals_the_raw_logit_margin():
    row = np.array([1.25, 4.0, 3.5, -2.0], dtype=np.float32)
    raw = capture(row, 3)
    logprobs = raw.logprobs()
    server = from_server_probs(
        [{"top_logprobs": [{"id": int(i), "logprob": float(v)} for i, v in zip(raw.top_ids, logprobs, strict=False)]}]
    )[0]
    assert server.margin == pytest.approx(raw.margin, abs=1e-6)


def test_parquet_round_trip_keeps_dtypes_and_exact_values(tmp_path):
    rng = np.random.default_rng(0)
    run = [capture(rng.normal(0, 2, 500).astype(np.float32), 10) for _ in range(128)]
    served = from_server_probs([{"top_logprobs": [{"id": 1, "logprob": -0.5}]}, {"top_logprobs": []}])
    path = tmp_path / "logits.parquet"
    save_parquet(path, {"dense/C": to_frame(run), "silent/C": to_frame([]), "server/C": to_frame(served)})
    loaded = load_parquet(path)
    assert list(loaded) == ["dense/C", "server/C"]  # a case without positions has no rows
    for case, original in (("dense/C", run), ("server/C", served)):
        # both readers: the frames (reports) and one case read with pyarrow alone (baselines)
        for back in (from_frame(loaded[case]), load_case(path, case)):
            assert len(back) == len(original)
            for x, y in zip(original, back, strict=True):
                assert y.top_ids.dtype == np.int32 and y.top_logits.dtype == np.float32
                assert np.array_equal(x.top_ids, y.top_ids) and np.array_equal(x.top_logits, y.top_logits)
                assert (x.digest, x.head, x.tail, x.log_z) == (y.digest, y.head, y.tail, y.log_z)
    assert len(from_frame(loaded["server/C"])[1].top_ids) == 0
    assert load_case(path, "silent/C") == [] and load_case(path, "absent/C") == []
    # 128 positions × k = 10 plus both runs' digests: a baseline stays small (real tiny-model logits: ~16.6 kB)
    assert path.stat().st_size < 20_000


# --- comparison -------------------------------------------------------------------------------------------


def test_compare_metrics_on_hand_computed_numbers():
    half, quarter = math.log(0.5), math.log(0.25)
    a, b = [lp([1, 2], [half, quarter])], [lp([2, 1], [half, quarter])]
    c = compare(a, b)
    assert c.max_abs == pytest.approx(math.log(2))
    # Σ(a−b)²/Σa² = 2 ln²2 / (ln²2 + 4 ln²2)
    assert c.nmse == pytest.approx(0.4)
    # both leave 0.25 for the rest bucket: 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln 1
    assert c.kl_max == pytest.approx(0.25 * math.log(2))
    assert c.top1_agreement == 0.0


def test_compare_bounds_ids_in_one_top_k_by_the_other_sides_kth_value():
    a = [lp([1, 2, 3], [-1.0, -2.0, -3.0])]
    b = [lp([1, 4, 2], [-1.5, -1.8, -2.5])]
    row = compare(a, b).per_position.iloc[0]
    # shared: |Δ1| = |Δ2| = 0.5; id 3 (a only): −3 − (−2.5) < 0 → 0; id 4 (b only): −1.8 − (−3) = 1.2
    assert row.max_abs == pytest.approx(1.2) and row.max_abs_id == 4
    assert bool(row.top1_agree)


def test_compare_skips_empty_positions_and_uses_the_common_length():
    a = same(4)
    b = same(3)
    b[1] = lp([], [])
    c = compare(a, b)
    assert (c.n_compared, c.n_skipped, c.n_a, c.n_b) == (2, 1, 4, 3)
    assert c.per_position.position.tolist() == [0, 2] and c.max_abs == 0.0 and c.kl_max == 0.0


def test_identical_positions_get_the_numbers_of_the_general_comparison(monkeypatch):
    """compare's shortcut for bit-identical positions gives what its general arithmetic gives: the lowest id as
    the worst, a zero KL where probabilities fall under the 1e-12 floor, its share of the pooled NMSE's Σa²."""
    rng = np.random.default_rng(7)
    a = []
    for _ in range(300):
        n = int(rng.integers(2, 13))
        ids = rng.permutation(1000)[:n].astype(np.int32)  # not ascending: the lowest id is rarely the top-1
        scale = float(rng.choice([0.01, 3.0, 40.0]))  # 40: log-probabilities far below log(1e-12)
        values = np.sort(rng.normal(scale=scale, size=n).astype(np.float32))[::-1].copy()
        a.append(PositionLogits(ids, values, log_z=float(rng.choice([0.0, 2.5, 60.0]))))
    b = [PositionLogits(p.top_ids.copy(), p.top_logits.copy(), log_z=p.log_z) for p in a]
    for p in b[::3]:  # a third differ: the pooled NMSE then sums the identical positions' Σa² too
        p.top_logits = (p.top_logits - np.float32(0.01)).astype(np.float32)
    for k in (1, 3, 10):
        fast = compare(a, b, k)
        monkeypatch.setattr("harness.result.logits._identical", lambda *_: False)
        general = compare(a, b, k)
        monkeypatch.undo()
        assert fast.per_position.equals(general.per_position)
        assert (fast.nmse, fast.kl_mean, fast.kl_max, fast.max_abs) == (
            general.nmse,
            general.kl_mean,
            general.kl_max,
            general.max_abs,
        )


def test_check_judges_aggregates_names_the_worst_position_and_fails_without_positions():
    a = same(5)
    b = same(5)
    b[3] = lp([1, 2, 3], [-1.0, -2.3, -3.0])
    b[4] = lp([1, 2, 3], [-1.0, -2.01, -3.0])
    assert check(compare(a, b), Tolerances(max_abs=0.5, nmse=1, kl=1))[0]
    ok, message = check(compare(a, b), Tolerances())
    # NMSE pooled over the 15 values: (0.3² + 0.01²) / (5 × 14) = 1.29e-3
    assert not ok and "NMSE 0.00129 > 1e-05" in message and "max |Δ| 0.3 at position 3 on id 2" in message
    # one outlier position of five does not decide alone through max |Δ|: its p60 is 0.01
    ok, message = check(compare(a, b), Tolerances(nmse=1, kl=1, max_abs=0.02, max_abs_quantile=0.6))
    assert ok, message
    ok, message = check(compare(a, [lp([2, 1, 3], [-1.0, -1.01, -3.0])] + b[1:]), Tolerances(max_abs=1, nmse=1, kl=1))
    assert not ok and "top-1 agreement 0.8000" in message and "position 0: id 1 vs 2" in message
    ok, message = check(compare(a, [lp([], [])] * 5), Tolerances())
    assert not ok and "no position has logits on both sides" in message


def _drifting(kls: list[float]) -> tuple[list[PositionLogits], list[PositionLogits]]:
    """Two runs whose positions differ by a shifted top-1 log-probability, one shift per position."""
    a = same(len(kls), ids=(1, 2), values=(math.log(0.5), math.log(0.25)))
    b = [lp([1, 2], [math.log(0.5) - d, math.log(0.25)]) for d in kls]
    return a, b


def test_window_curves_are_the_largest_statistic_over_n_consecutive_positions():
    a, b = _drifting([0.0, 0.02, 0.0, 0.0, 0.01, 0.01])
    c = compare(a, b)
    curves = window_largest(c)
    kl = c.per_position["kl"].to_numpy()
    assert len(curves["kl"]) == 6
    assert curves["kl"][0] == pytest.approx(kl.max())  # one position: the largest single KL
    assert curves["kl"][1] == pytest.approx(max(kl[i : i + 2].mean() for i in range(5)))
    assert curves["kl"][-1] == pytest.approx(c.kl_mean)  # the whole comparison: check's own mean
    assert curves["nmse"][-1] == pytest.approx(c.nmse) and curves["nmse"][0] >= c.nmse
    assert curves["max_abs"][0] == pytest.approx(0.02, abs=1e-6)
    assert len(window_largest(c, n_max=3)["kl"]) == 3
    assert larger_curves({"kl": [3.0, 1.0]}, {"kl": [2.0, 2.0, 1.0]}) == {"kl": [3.0, 2.0, 1.0]}


def test_a_comparison_of_few_positions_is_judged_by_the_bound_calibrated_for_that_many():
    """The false alarm of the statistical job (2026-12-07: numerics-shared, tiny-hybrid-mtp-wide-q4_k on llama-server,
    1 compared position, mean KL 1.3e-05 > 1.3e-05, the largest mean KL of a whole case): a mean of one KL spreads
    far wider than a case's. The bound for one position is the largest single position's; a drift beyond it fails."""
    windows = {"kl": (4e-5, 2e-5, 1.5e-5), "nmse": (1e-3,), "max_abs": (0.05, 0.04)}
    tol = Tolerances(kl=1.3e-5, nmse=1e-5, max_abs=0.03, windows=windows)
    assert tol.for_positions(1).kl == 4e-5 and tol.for_positions(2).kl == 2e-5
    assert tol.for_positions(3).kl == 1.5e-5 and tol.for_positions(500).kl == 1.5e-5  # the longest window beyond
    assert tol.for_positions(9).nmse == 1e-3 and tol.for_positions(9).max_abs == 0.04
    low = Tolerances(kl=1e-4, windows={"kl": (2e-5,)})
    assert low.for_positions(1).kl == 1e-4  # never below the whole-case bound
    assert Tolerances().for_positions(1) == Tolerances()  # uncalibrated: unchanged
    a, b = _drifting([0.0015])  # one position, a small KL
    one = compare(a, b)
    ok, message = check(one, Tolerances(kl=one.kl_mean * 0.99, nmse=1, max_abs=1))
    assert not ok and "mean KL" in message  # a case-level bound alone: the false alarm
    ok, message = check(one, Tolerances(kl=one.kl_mean * 0.99, nmse=1, max_abs=1, windows={"kl": (one.kl_mean * 3,)}))
    assert ok, message
    ok, message = check(one, Tolerances(kl=one.kl_mean / 9, nmse=1, max_abs=1, windows={"kl": (one.kl_mean / 3,)}))
    assert not ok and f"> {one.kl_mean / 3:.3g}" in message  # a drift beyond the one-position bound still fails


# --- triage -----------------------------------------------------------------------------------------------


def test_equal_streams_have_no_divergence():
    assert triage([1, 2, 3], [1, 2, 3], same(3), same(3)) is None


def test_near_tie_when_logits_agree_and_both_margins_are_small():
    ref = same(4)
    ref[2] = lp([5, 6], [-0.70, -0.72])
    other = same(4)
    other[2] = lp([6, 5], [-0.70, -0.71])
    d = triage([9, 9, 5, 9], [9, 9, 6, 9], ref, other, detokenize=lambda ts: "".join(f"<{t}>" for t in ts))
    assert (d.index, d.kind, d.ref_token, d.other_token) == (2, "near-tie", 5, 6)
    assert d.margin == pytest.approx(0.02, abs=1e-6) and d.before == "<9><9>"
    assert list(d.margins) == [0, 1, 2]
    text = d.describe()
    assert "token 2" in text and "'<5>' (id 5)" in text and "'<6>' (id 6)" in text and "0.02 nats" in text
    assert "the other run its own by 0.01 nats" in d.reason and "uncalibrated" in d.reason


def test_near_tie_needs_the_other_runs_logits_at_the_divergence():
    ref = same(3)
    ref[2] = lp([5, 6], [-0.70, -0.72])
    other = same(3)
    other[2] = lp([], [])  # llama-server withholds the logits of a speculatively accepted token
    d = triage([9, 9, 5], [9, 9, 6], ref, other)
    assert d.kind == "unexplained" and "withholds" in d.reason and "could not supply them" in d.reason
    rescored = triage(
        [9, 9, 5],
        [9, 9, 6],
        ref,
        other,
        rescore=lambda side, pos: lp([6, 5], [-0.70, -0.71]) if side == "other" else None,
    )
    assert rescored.kind == "near-tie" and rescored.rescored == ["other at 2"] and "re-scored" in rescored.reason


def test_no_near_tie_when_the_other_runs_own_logits_prefer_the_references_token():
    """`0 ≤ other_gap < floor`: a run whose own logits rank the reference's token first, yet which emitted
    another, shows no preference for its token; a small negative gap used to pass as one."""
    ref = same(3)
    ref[2] = lp([5, 6], [-0.70, -0.72])
    other = same(3)
    other[2] = lp([5, 6], [-0.70, -0.71])  # the other run's logits prefer 5 (the reference's) by 0.01 nats
    d = triage([9, 9, 5], [9, 9, 6], ref, other)
    assert d.kind == "unexplained" and "prefer the reference's token by 0.01 nats" in d.reason
    tie = same(3)
    tie[2] = lp([5, 6], [-0.70, -0.70])  # an exact tie: the run may pick either
    assert triage([9, 9, 5], [9, 9, 6], ref, tie).kind == "near-tie"


def test_no_near_tie_when_the_references_own_logits_prefer_the_other_token():
    """`0 ≤ ref_gap < floor` too: a reference whose own logged row ranks the other run's token first (a negative
    gap for its own token) is below the floor, but shows no preference for the token it emitted. The other run's
    row alone must not make that a near-tie, however far the reference's row points the wrong way."""
    other = same(3)
    other[2] = lp([6, 5], [-0.70, -0.71])  # the other run prefers its own token 6 by 0.01 nats: fine
    for ref_values, shown in (([-0.70, -3.00], "2.3 nats"), ([-0.70, -0.71], "0.01 nats")):
        ref = same(3)
        ref[2] = lp([6, 5], ref_values)  # the reference's logits prefer 6 (the other's token), yet it emitted 5
        d = triage([9, 9, 5], [9, 9, 6], ref, other)
        assert d.kind == "unexplained", (shown, d.kind, d.reason)
        assert f"the reference's own logits prefer the other token by {shown}" in d.reason
        assert "not a near-tie" in d.reason
    tie = same(3)
    tie[2] = lp([5, 6], [-0.70, -0.70])  # an exact tie in the reference: it may pick either
    assert triage([9, 9, 5], [9, 9, 6], tie, other).kind == "near-tie"


def test_a_speculative_run_is_re_scored_only_in_its_own_configuration():
    """llama-server returns no probabilities for tokens a verification step emits; a plain decode would give the
    reference's view of the position, not the run's. So a speculative llama-server cell is re-scored by a server
    of its own cell (its command line), in the batch its log says computed the position (prefix cached, the batch's
    rows up to the position as one batch), and not at all where the log does not say; the in-process engine's
    speculative cells are never re-scored (it logs every verification row itself). A cell without speculation is
    re-scored in its own configuration."""
    from types import SimpleNamespace

    from harness.execute import ExecOptions, Rescorer
    from harness.matrix import Cell
    from harness.result import Result, Work

    opened, asked = [], []

    class Session:
        def run(self, requests):
            return [Result(tokens=[6], stop_reason="limit", logits=[lp([6, 5], [-0.7, -0.71])])]

        def rescore(self, prefix, tail, n_probs):
            asked.append((prefix, tail, n_probs))
            return lp([6, 5], [-0.7, -0.71])

        def close(self):
            pass

    executor = SimpleNamespace(
        options=ExecOptions(backends={}, logit_top_k=10),
        _backend=lambda name: SimpleNamespace(open=lambda config: opened.append(config) or Session()),
        _config=lambda suite, cell: cell,
    )
    suite = SimpleNamespace(name="demo")
    result = Result(prompt_tokens=[1, 2], tokens=[9, 9, 6], stop_reason="limit")
    with Rescorer(executor) as rescorer:
        for cell in (Cell("server", "par", "draft-simple", "m"), Cell("inproc", "par", "draft-simple", "m")):
            assert rescorer.score(suite, cell, result, 2) is None  # no steps known / the engine logs its rows
        assert opened == []  # no session of another configuration was opened
        result.work = Work(steps={"batches": [[3, 2]]})  # o_1 and o_2 from rows 0 and 1 of a 3-row verification
        spec = Cell("server", "par", "draft-simple", "m")
        row = rescorer.score(suite, spec, result, 2)
        assert opened == [spec] and asked == [([1, 2], [9, 9], 10)]  # prefix cached, the batch's rows 0..1
        assert row.top_ids.tolist() == [6, 5] and "row 1 of a 3-row verification batch" in row.how
        plain = Cell("inproc", "par", "none", "m")
        assert rescorer.score(suite, plain, result, 2).top_ids.tolist() == [6, 5]
        assert opened == [spec, plain]  # the run's own cell, not a stand-in


def test_the_calibrated_floor_decides_what_is_a_near_tie():
    ref = same(3)
    ref[2] = lp([5, 6], [-0.70, -0.80])
    other = same(3)
    other[2] = lp([6, 5], [-0.70, -0.75])
    assert triage([9, 9, 5], [9, 9, 6], ref, other).kind == "hard"  # 0.1 nats > the default floor 0.05
    wide = NoiseFloor(near_tie=0.2, source="calibrated (demo)")
    d = triage([9, 9, 5], [9, 9, 6], ref, other, floor=wide)
    assert d.kind == "near-tie" and "near-tie floor 0.2 nats, calibrated (demo)" in d.reason


def test_a_kv_finding_makes_any_divergence_kv_corrupt():
    ref = same(3)
    ref[2] = lp([5, 6], [-0.70, -0.72])
    other = same(3)
    other[2] = lp([6, 5], [-0.70, -0.71])
    d = triage([9, 9, 5], [9, 9, 6], ref, other, kv_findings=["the KV scan of the request found 3 duplicate cells"])
    assert d.kind == "kv-corrupt" and "never a near-tie" in d.reason


def test_drift_when_logits_differ_before_the_divergence_even_at_a_near_tie():
    ref = same(4)
    ref[3] = lp([5, 6], [-0.70, -0.72])
    other = same(4)
    other[1] = lp([1, 2, 3], [-1.0, -2.4, -3.0])
    d = triage([9, 9, 9, 5], [9, 9, 9, 6], ref, other)
    assert d.kind == "drift" and "position 1" in d.reason and "NMSE" in d.reason


def test_hard_when_logits_agree_and_the_margin_is_large():
    d = triage([1, 1, 2], [1, 1, 3], same(3), same(3), context=1)
    assert d.kind == "hard" and d.margins == {1: 1.0, 2: 1.0}
    assert "margin there 1 nats" in d.describe() and "logic bug" in d.describe()


def test_unexplained_without_the_evidence_a_class_needs():
    assert triage([1, 2], [1, 3]).kind == "unexplained"
    assert triage([1, 2], [1, 3], same(2)).kind == "unexplained"  # large margin, nothing to rule out drift
    server = from_server_probs(
        [{"top_logprobs": [{"id": 1, "logprob": -1.0}, {"id": 2, "logprob": -2.0}]}, {"top_logprobs": []}]
    )
    d = triage([1, 2], [1, 3], server, same(2))
    assert d.kind == "unexplained" and d.margin is None and "margin there unknown (positions 0–0: 1)" in d.describe()
    assert triage([1, 2], [1, 3], same(2), same(2), greedy=False).kind == "unexplained"


def test_prefix_divergence_is_at_the_shorter_length():
    d = triage([1, 2, 3, 4], [1, 2], same(4), same(2))
    assert (d.index, d.ref_token, d.other_token) == (2, 3, None)
    assert "other stream ended" in d.describe() and d.kind == "unexplained"
    assert triage([1, 2], [1, 2, 3]).index == 2


# --- real tiny models -------------------------------------------------------------------------------------


def generate(model, prompt, n_predict, spec=None, **params):
    with Engine(model.path, ContextParams(n_ctx=512, **params), spec, logit_top_k=10) as engine:
        result = engine.run([Request(prompt=prompt, sampling=Sampling(n_predict=n_predict))])[0]
    assert result.ok and len(result.logits) == len(result.tokens), result.error
    return result


@pytest.fixture
def detokenizer():
    """model info → its detokenize function (models stay loaded until the test ends)."""
    loaded = []

    def load(info):
        loaded.append(Model(info.path))
        return loaded[-1].detokenize

    yield load
    for model in loaded:
        model.close()


def test_rollback_fault_divergence_is_hard(tiny_models, detokenizer):
    model = tiny_models["tiny-hybrid"]
    reference = generate(model, QUICKSORT_C, 64)
    spec = SpecConfig(
        drafters=[Scripted(reference.tokens, wrong_at=lambda s, j, k: k == 1)], fault="partial-checkpoint-only"
    )
    faulty = generate(model, QUICKSORT_C, 64, spec)
    d = triage(reference.tokens, faulty.tokens, reference.logits, faulty.logits, detokenizer(model))
    # Measured: divergence at token 3, reference margin 0.854 nats; before it the two runs' logits differ
    # by ~1e-6 (verification batches vs single-token decodes), far inside tolerance. The fault corrupts
    # the recurrent state at the first partial acceptance, so the step's logits jump with nothing
    # leading up to it: not drift, not a near-tie, a logic bug → `hard`.
    assert d is not None and d.kind == "hard", d.describe()
    assert compare(reference.logits[: d.index], faulty.logits[: d.index]).max_abs < 1e-4
    assert d.margin > NEAR_TIE
    text = d.describe()
    assert f"token {d.index}" in text and f"{d.margin:.4g} nats" in text
    assert repr(d.ref_text) in text and repr(d.other_text) in text and d.ref_text


def test_flash_attention_flips_a_near_tie(tiny_models, detokenizer):
    # Found by generating 128 tokens for 8 prompts on the 3 tiny archs and their -loop variants under
    # flash attention on, n_ubatch 1 and 7, and a q8_0 K cache, against the defaults. This is the
    # earliest flash-attention divergence on tiny-dense: token 99, reference margin 0.00079 nats (other
    # run 0.00034), logits before it within |Δ| ≤ 0.0027; the same for 1–4 threads and n_ctx 256–4096.
    model = tiny_models["tiny-dense"]
    off = generate(model, "List three colors:", 100, flash_attn="off")
    on = generate(model, "List three colors:", 100, flash_attn="on")
    d = triage(off.tokens, on.tokens, off.logits, on.logits, detokenizer(model))
    assert d is not None and d.index == 99, d and d.describe()
    assert d.kind == "near-tie" and d.margin < 0.005, d.describe()
    assert off.logits[99].digest != on.logits[99].digest
    assert check(compare(off.logits[:99], on.logits[:99]), Tolerances())[0]
    assert "near-tie" in d.describe() and "token 99" in d.describe()


def test_real_logits_round_trip_through_parquet_in_a_small_file(tiny_models, tmp_path):
    result = generate(tiny_models["tiny-dense"], QUICKSORT_C, 128)
    path = tmp_path / "logits.parquet"
    save_parquet(path, {"quicksort/C": to_frame(result.logits)})
    back = from_frame(load_parquet(path)["quicksort/C"])
    ok, message = check(compare(result.logits, back), Tolerances(max_abs=0, nmse=0, kl=0))
    assert ok and [p.digest for p in back] == [p.digest for p in result.logits], message
    assert path.stat().st_size < 20_000  # measured 16.6 kB for 128 positions × k = 10
