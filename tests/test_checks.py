"""Each check on small hand-made outcomes: one case it must pass and one it must fail."""

import numpy as np
import pytest

from harness.checks import CHECKS, evaluate
from harness.checks.base import CheckContext
from harness.execute import CellRun, Outcome
from harness.matrix import Cell
from harness.result import Result
from harness.result.logits import PositionLogits
from harness.signatures import signature_of
from harness.suites import Case, Suite
from harness.suites.request import Sampling
from harness.verdict import noise
from harness.verdict.baselines import BaselineStore

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def suite(rounds=("par",), schema=None, allow=(), expect_accepts=True, **sampling):
    sampling = Sampling(json_schema=schema, **sampling)
    return Suite(
        name="demo",
        path=None,
        cases=[Case("a", sampling, prompt="x", expect_accepts=expect_accepts)],
        matrix={},
        checks=list(CHECKS),
        rounds=list(rounds),
        allow_errors=list(allow),
    )


def ok(tokens, text="", logits=(), **stats):
    return Result(tokens=list(tokens), text=text, stop_reason="limit", spec_stats=stats, logits=list(logits))


def rows(*digests):
    """Logged logits whose only telling part is the full row's digest."""
    return [PositionLogits(np.array([1], np.int32), np.array([0.0], np.float32), digest=d) for d in digests]


class NoRescore:
    """Nothing to re-score: the hand-made outcomes carry all the logits there are."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def score(self, *args):
        return None


class Runs:
    """Stands in for the Executor: the cells' outcomes are given, nothing is run."""

    def __init__(self, s, cells):
        self.cells = {
            cell: CellRun(s, cell, [Outcome("a", r, res) for r, res in enumerate(results)])
            for cell, results in cells.items()
        }

    def run(self, _suite, cell):
        return self.cells[cell]

    def environment(self, cell):
        return {"device": "cpu"}

    def rescorer(self):
        return NoRescore()


SEQ = Cell("inproc", "seq", "none", "m")


def context(cells, cell, s=None, baselines=None):
    s = s or suite()
    runs = Runs(s, cells)
    return CheckContext(runs.run(s, cell), "a", runs, baselines, lambda t: " ".join(map(str, t)), "repro")


def verdict(ctx, name):
    result = CHECKS[name](ctx)
    assert result is not None, f"{name} should apply"
    return result


def test_no_crash():
    assert verdict(context({SEQ: [ok([1])]}, SEQ), "no-crash").passed
    failed = verdict(context({SEQ: [Result(stop_reason="crashed", error="killed by SIGABRT")]}, SEQ), "no-crash")
    assert not failed.passed and "SIGABRT" in failed.message
    allowed = Result(stop_reason="error", error="context_full: no free KV cells")
    assert verdict(context({SEQ: [allowed]}, SEQ, suite(allow=["context_full"])), "no-crash").passed


def test_repeat_identical():
    s = suite(rounds=("seq", "seq", "par"))
    assert verdict(context({SEQ: [ok([1, 2])] * 3}, SEQ, s), "repeat-identical").passed
    failed = verdict(context({SEQ: [ok([1, 2]), ok([1, 2]), ok([1, 3])]}, SEQ, s), "repeat-identical")
    assert not failed.passed and failed.evidence["unique_outputs"] == 2 and "at token 1" in failed.message


def test_lossless():
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({SEQ: [ok([1, 2, 3])], spec: [ok([1, 2, 3])]}, spec), "lossless").passed
    failed = verdict(context({SEQ: [ok([1, 2, 3])], spec: [ok([1, 9, 3])]}, spec), "lossless")
    assert not failed.passed and "at token 1" in failed.message
    assert CHECKS["lossless"](context({SEQ: [ok([1])]}, SEQ)).not_run == "the cell does not speculate"
    shorter = verdict(context({SEQ: [ok([1, 2, 3])], spec: [ok([1])]}, spec), "lossless")  # ended at the context end
    assert shorter.failures == [
        "round 0: unexplained at token 1 (the output ended there, stop: limit; the reference has 3 tokens)"
    ]


def test_within_n_predict():
    five = suite(n_predict=5)
    assert verdict(context({SEQ: [ok([1, 2, 3, 4, 5]), ok([1, 2])]}, SEQ, five), "within-n-predict").passed
    over = verdict(context({SEQ: [ok([1, 2, 3, 4, 5]), ok([1, 2, 3, 4, 5, 6])]}, SEQ, five), "within-n-predict")
    assert not over.passed and over.failures == ["round 1: 6 tokens returned for n_predict 5"]
    eos = Result(tokens=[1, 2, 3, 4, 5], stop_reason="eos")
    wrong_stop = verdict(context({SEQ: [eos]}, SEQ, five), "within-n-predict")
    assert not wrong_stop.passed and "stop reason is eos, not limit" in wrong_stop.message
    assert CHECKS["within-n-predict"](context({SEQ: [ok([1] * 300)]}, SEQ, suite(n_predict=-1))).not_run


def logged(tokens, rows):
    """A result whose positions carry top-2 logits: rows of (id, logit, id, logit)."""
    import numpy as np

    from harness.result.logits import PositionLogits

    result = ok(tokens)
    result.logits = [
        PositionLogits(np.array([a, b], dtype=np.int32), np.array([x, y], dtype=np.float32)) for a, x, b, y in rows
    ]
    return result


def test_lossless_under_seeded_sampling_fails_only_where_the_logits_are_identical():
    spec = SEQ.reference(spec="draft-simple")
    sampled = suite(temperature=0.7, seed=42, repeat_penalty=1.5)
    reference = ok([1, 2, 3], logits=rows("a", "b", "c"))
    proven = verdict(
        context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "b", "c"))]}, spec, sampled), "lossless"
    )
    assert not proven.passed and "bit-identical" in proven.message and "at token 1" in proven.message
    numerics = verdict(
        context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "B", "c"))]}, spec, sampled), "lossless"
    )
    assert numerics.passed and numerics.evidence["reported_only"] and numerics.evidence["matching"] == 0
    # under a grammar the sampler state also depends on earlier logits (re-samples): every row must match
    grammar = suite(temperature=0.7, seed=42, grammar='root ::= "x"')
    earlier = ok([1, 9, 3], logits=rows("A", "b", "c"))
    assert verdict(context({SEQ: [reference], spec: [earlier]}, spec, grammar), "lossless").passed
    assert not verdict(context({SEQ: [reference], spec: [earlier]}, spec, sampled), "lossless").passed
    unseeded = suite(temperature=0.7, seed=-1)
    assert CHECKS["lossless"](context({SEQ: [reference], spec: [ok([5])]}, spec, unseeded)).not_run
    greedy = suite(temperature=0, repeat_penalty=1.5)  # greedy with penalties always fails on a divergence
    assert not verdict(
        context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "B", "c"))]}, spec, greedy), "lossless"
    ).passed


def test_mode_invariant_fails_par_and_no_kv_unified_unless_a_proven_near_tie():
    split, par = SEQ.reference(mode="no-kv-unified"), SEQ.reference(mode="par")
    cells = {SEQ: [ok([1, 2])], split: [ok([1, 5])], par: [ok([1, 5])]}
    assert not verdict(context(cells, split), "mode-invariant").passed
    failed = verdict(context(cells, par), "mode-invariant")  # no logits: nothing proves a near-tie
    assert not failed.passed and failed.evidence["first_divergence"]["kind"] == "unexplained"
    assert failed.failures == ["round 0: unexplained at token 1"]
    tie_ref = logged([1, 2], [(1, 5.0, 2, 1.0), (2, 3.0, 5, 2.99)])
    tie_par = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.995)])
    excused = verdict(context({SEQ: [tie_ref], par: [tie_par]}, par), "mode-invariant")
    assert excused.passed and excused.evidence["near_ties"] == 1 and "proven near-tie" in excused.message
    assert excused.evidence["first_divergence"]["kind"] == "near-tie"
    hard_par = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.0)])  # the par run prefers 5 by a full nat
    assert not verdict(context({SEQ: [tie_ref], par: [hard_par]}, par), "mode-invariant").passed
    tie_split = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.995)])
    assert verdict(context({SEQ: [tie_ref], split: [tie_split]}, split), "mode-invariant").passed


def test_in_seq_mode_even_a_proven_near_tie_fails():
    s = suite(rounds=("seq", "seq"))
    tie_a = logged([1, 2], [(1, 5.0, 2, 1.0), (2, 3.0, 5, 2.99)])
    tie_b = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.995)])
    failed = verdict(context({SEQ: [tie_a, tie_b]}, SEQ, s), "repeat-identical")
    assert not failed.passed and failed.evidence["first_divergence"]["kind"] == "near-tie"


def test_in_seq_mode_a_proven_near_tie_is_excused_where_calibration_measured_speculation_not_bit_exact(monkeypatch):
    spec = SEQ.reference(spec="draft-simple")
    tie_ref = logged([1, 2], [(1, 5.0, 2, 1.0), (2, 3.0, 5, 2.99)])
    tie_spec = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.995)])
    measured = {"tolerances": {"near_tie": 0.05}, "measured": {"seq/draft-simple": {"max_abs_max": 0.0}}}
    exact = noise.from_data(measured, "calibrated (exact)")
    monkeypatch.setattr(noise, "load", lambda *a, **k: exact)
    assert exact.seq_bit_exact and not verdict(context({SEQ: [tie_ref], spec: [tie_spec]}, spec), "lossless").passed
    # a 7-token micro-batch split is no configuration a cell runs: it does not make seq noisy
    measured["measured"]["seq/ngram-mod/n_ubatch=7"] = {"max_abs_max": 0.39, "margin_delta_max": 0.03}
    assert noise.from_data(measured, "calibrated (split only)").seq_bit_exact
    # nor does a variant without speculation, whatever its batch: the policy is about what speculation does to seq
    measured["measured"]["seq/none/in-order"] = {"max_abs_max": 0.39, "margin_delta_max": 0.03}
    assert noise.from_data(measured, "calibrated (no speculation)").seq_bit_exact
    # a verification batch of k+1 tokens runs other kernels than a one-token decode (every committed model)
    measured["measured"]["seq/ngram-mod"] = {"max_abs_max": 0.39, "margin_delta_max": 0.03}
    noisy = noise.from_data(measured, "calibrated (noisy)")
    monkeypatch.setattr(noise, "load", lambda *a, **k: noisy)
    excused = verdict(context({SEQ: [tie_ref], spec: [tie_spec]}, spec), "lossless")
    assert not noisy.seq_bit_exact and excused.passed and excused.evidence["near_ties"] == 1
    hard = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.0)])  # the other run prefers 5 by a full nat: no tie
    assert not verdict(context({SEQ: [tie_ref], spec: [hard]}, spec), "lossless").passed


class ChatRuns(Runs):
    """Runs of a two-turn chat `c`: each cell's replies to turn 1 and turn 2."""

    def __init__(self, s, cells):
        self.cells = {
            cell: CellRun(s, cell, [Outcome(f"c.turn{i + 1}", 0, res) for i, res in enumerate(turns)])
            for cell, turns in cells.items()
        }


def test_a_chat_turn_is_compared_only_with_a_reference_that_sent_it_the_same_prompt():
    s = Suite(
        name="demo",
        path=None,
        cases=[Case("c", Sampling(), turns=["u1", "u2"])],
        matrix={},
        checks=list(CHECKS),
        rounds=["par"],
    )
    spec = SEQ.reference(spec="draft-simple")

    def lossless(turn, ref, other):
        runs = ChatRuns(s, {SEQ: ref, spec: other})
        return verdict(CheckContext(runs.run(s, spec), f"c.turn{turn}", runs, None, str, "repro"), "lossless")

    first, second = (
        lossless(1, [ok([1, 2]), ok([5])], [ok([1, 9]), ok([7])]),
        lossless(2, [ok([1, 2]), ok([5])], [ok([1, 9]), ok([7])]),
    )
    assert not first.passed  # the divergence is reported once, on the turn it happened in
    assert second.status == "not run", second  # nothing compared: no pass
    assert second.evidence["not_compared"] == 1 and second.evidence["prompt_differs_at"] == "c.turn1"
    assert "c.turn1" in second.not_run and "that turn's verdict reports it" in second.not_run
    assert not lossless(2, [ok([1, 2]), ok([5])], [ok([1, 2]), ok([7])]).passed  # same prompt: compared, fails


def test_a_kv_finding_is_never_a_near_tie():
    par = SEQ.reference(mode="par")
    tie_ref = logged([1, 2], [(1, 5.0, 2, 1.0), (2, 3.0, 5, 2.99)])
    tie_par = logged([1, 5], [(1, 5.0, 2, 1.0), (5, 3.0, 2, 2.995)])
    tie_par.kv_scan = scan(False, duplicates=(1,))
    failed = verdict(context({SEQ: [tie_ref], par: [tie_par]}, par), "mode-invariant")
    assert not failed.passed and failed.evidence["first_divergence"]["kind"] == "kv-corrupt"
    assert "1 duplicate (seq_id, pos) cells" in failed.message


def test_a_comparison_that_compared_no_request_is_not_run_with_the_reason(tmp_path):
    """A reference request that ended with an error the suite allows, or a chat turn whose every request sent
    another prompt than the reference's: nothing was compared, so no pass (as logits-close and acceptance)."""
    allow = suite(allow=["context_full"])
    full = Result(stop_reason="error", error="context_full: no free KV cells")
    spec, par = SEQ.reference(spec="draft-simple"), SEQ.reference(mode="par")
    for cell, name in ((spec, "lossless"), (par, "mode-invariant")):
        result = verdict(context({SEQ: [full], cell: [ok([1, 2])]}, cell, allow), name)
        assert result.status == "not run", result
        assert "reference failed" in result.not_run and "context_full: no free KV cells" in result.not_run
    s = Suite(name="demo", path=None, cases=[Case("c", Sampling(), turns=["u1", "u2"])], matrix={}, checks=[])
    writer = BaselineStore(tmp_path, update=True)
    recorded = ChatRuns(s, {SEQ: [ok([1, 2]), ok([5])]})
    for turn in (1, 2):
        writer.recorded(CheckContext(recorded.run(s, SEQ), f"c.turn{turn}", recorded, writer, str, "repro"))
    runs = ChatRuns(s, {SEQ: [ok([1, 9]), ok([5])]})  # turn 1 replied otherwise: turn 2 had another prompt
    ctx = CheckContext(runs.run(s, SEQ), "c.turn2", runs, BaselineStore(tmp_path), str, "repro")
    moot = verdict(ctx, "baseline")
    assert moot.status == "not run" and "c.turn1" in moot.not_run, moot


def test_baseline(tmp_path):
    store = BaselineStore(tmp_path)
    new = verdict(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), "baseline")  # a model with no baselines
    assert new.passed and new.evidence["no_baseline"] and "no baseline yet" in new.message
    assert "--update-baselines" in new.message
    BaselineStore(tmp_path, update=True).recorded(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store))
    assert verdict(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), "baseline").passed
    failed = verdict(context({SEQ: [ok([4, 6])]}, SEQ, baselines=store), "baseline")
    assert not failed.passed and "at token 1" in failed.message
    store.path("demo", "a", "m", "inproc", "cpu").rename(store.path("demo", "b", "m", "inproc", "cpu"))
    missing = verdict(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), "baseline")  # it has others: a failure
    assert not missing.passed and "--update-baselines" in missing.message


def test_a_corrupt_baseline_file_is_a_harness_error_naming_the_file_not_a_failure(tmp_path):
    store = BaselineStore(tmp_path)
    path = store.path("demo", "a", "m", "inproc", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    (result,) = evaluate(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), ["baseline"])
    assert result.status == "harness error" and not result.is_verdict, result
    assert path.name in result.harness_error and "(fix or delete it" in result.harness_error


def test_spec_ran():
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=2)]}, spec), "spec-ran").passed
    assert not verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=0)]}, spec), "spec-ran").passed
    assert not verdict(context({spec: [ok([1])]}, spec), "spec-ran").passed
    crashed = Result(stop_reason="crashed", error="llama-server was killed by SIGABRT")
    assert CHECKS["spec-ran"](context({spec: [crashed]}, spec)).not_run  # no-crash reports it
    reject = SEQ.reference(spec="scripted-reject")
    assert verdict(context({reject: [ok([1], draft_n=4, draft_n_accepted=0)]}, reject), "spec-ran").passed
    grammar_case = suite(expect_accepts=False)  # a drafter that does not see the grammar: drafts suffice
    assert verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=0)]}, spec, grammar_case), "spec-ran").passed
    assert not verdict(context({spec: [ok([1])]}, spec, grammar_case), "spec-ran").passed


@pytest.mark.parametrize("spec", ["synth-reject", "scripted-reject"])
def test_spec_ran_under_forced_rejection_fails_on_any_accepted_token_or_a_request_without_drafts(spec):
    cell = Cell("server" if spec == "synth-reject" else "inproc", "seq", spec, "m")
    rejected = ok([1, 2, 3], draft_n=8, draft_n_accepted=0)
    assert verdict(context({cell: [rejected, rejected]}, cell), "spec-ran").passed
    one_token = ok([1], draft_n=0, draft_n_accepted=0)  # ended at its first token: no step to draft in
    assert verdict(context({cell: [rejected, one_token]}, cell), "spec-ran").passed
    accepted = verdict(context({cell: [rejected, ok([1, 2, 3], draft_n=8, draft_n_accepted=1)]}, cell), "spec-ran")
    assert not accepted.passed and accepted.failures == ["round 1: 8 drafted, 1 accepted"]
    undrafted = verdict(context({cell: [ok([1, 2, 3], draft_n=0), rejected]}, cell), "spec-ran")
    assert not undrafted.passed and undrafted.failures == ["round 0: 0 drafted, 0 accepted"]
    # the same accepted token is no finding where drafts are merely not expected to be accepted
    p_min = Cell("server", "seq", "draft-p-min-0.2", "m")
    assert verdict(context({p_min: [rejected, ok([1, 2, 3], draft_n=8, draft_n_accepted=1)]}, p_min), "spec-ran").passed


def test_spec_ran_counts_per_case_not_per_cell():
    spec = SEQ.reference(spec="draft-simple")
    two = Suite(
        name="demo",
        path=None,
        cases=[Case("a", Sampling(), prompt="x"), Case("b", Sampling(), prompt="y")],
        matrix={},
        checks=list(CHECKS),
    )
    run = CellRun(two, spec, [Outcome("a", 0, ok([1], draft_n=8, draft_n_accepted=3)), Outcome("b", 0, ok([1]))])
    runs = Runs(two, {})
    runs.cells[spec] = run

    def check(case):
        return CHECKS["spec-ran"](CheckContext(run, case, runs, None, str, "repro"))

    assert check("a").passed
    failed = check("b")
    assert not failed.passed and "no drafts at all for the case" in failed.message


def test_grammar_valid():
    s = suite(schema=SCHEMA)
    assert verdict(context({SEQ: [ok([1], text='{"n": 3}')]}, SEQ, s), "grammar-valid").passed
    assert not verdict(context({SEQ: [ok([1], text='{"n": "x"}')]}, SEQ, s), "grammar-valid").passed
    assert not verdict(context({SEQ: [ok([1], text='{"n": 3')]}, SEQ, s), "grammar-valid").passed


def test_a_cell_the_harness_could_not_serve_gives_every_check_a_harness_error_and_no_verdict():
    ctx = context({SEQ: []}, SEQ)
    ctx.run.error = "model file not found: x.gguf"
    results = evaluate(ctx, list(CHECKS))
    assert [r.name for r in results] == list(CHECKS)
    assert all(r.status == "harness error" and not r.is_verdict and "x.gguf" in r.harness_error for r in results)
    assert all(r.passed for r in results)  # nothing failed: a known failure can never excuse one (it tags failures)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_is_documented(name):
    assert CHECKS[name].__doc__


def scan(healthy, duplicates=()):
    dups = [{"part": "kv", "stream": 0, "seq_id": 0, "pos": p, "count": 2} for p in duplicates]
    totals = {"duplicate_cells": len(dups), "orphans": 0, "missing_positions": 0}
    return {"healthy": healthy, "totals": totals, "duplicates": dups, "orphans": [], "holes": []}


def test_kv_healthy_reports_the_duplicate_positions():
    clean = ok([1])
    clean.kv_scan = scan(True)
    assert verdict(context({SEQ: [clean]}, SEQ), "kv-healthy").passed
    dirty = ok([1])
    dirty.kv_scan = scan(False, duplicates=(22, 23))
    failed = verdict(context({SEQ: [dirty]}, SEQ), "kv-healthy")
    assert not failed.passed and "(seq 0, pos 22)" in failed.message and failed.evidence["duplicate_cells"] == 2
    assert "KV scan of the 1 completed requests" in CHECKS["kv-healthy"](context({SEQ: [ok([1])]}, SEQ)).not_run


def test_kv_healthy_fails_on_a_draft_context_that_keeps_cells_the_target_dropped():
    stale = scan(True)
    stale["draft"] = {
        **scan(False),
        "totals": {"duplicate_cells": 0, "orphans": 3, "missing_positions": 0},
        "orphans": [{"part": "kv", "stream": 0, "seq_id": 0, "pos": p} for p in (7, 8, 9)],
    }
    dirty = ok([1])
    dirty.kv_scan = stale
    failed = verdict(context({SEQ: [dirty]}, SEQ), "kv-healthy")
    assert (
        not failed.passed
        and "the draft context: 0 duplicate cells, 3 orphans: orphan at (seq 0, pos 7)" in failed.message
    )
    assert failed.evidence["orphans"] == 0 and failed.evidence["draft_context"]["orphans"] == 3
    assert signature_of(failed) == "kv-healthy: orphans in the draft context"
    clean = ok([1])
    clean.kv_scan = {**scan(True), "draft": scan(True)}
    assert verdict(context({SEQ: [clean]}, SEQ), "kv-healthy").passed


def test_logits_close():
    import numpy as np

    from harness.result.logits import capture

    rows = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    ref = ok([1, 2, 3])
    ref.logits = [capture(r, 10) for r in rows]
    near = ok([1, 2, 3])
    near.logits = [capture(r + 1e-4, 10) for r in rows]
    far = ok([1, 2, 3])
    far.logits = [capture(r * 1.5, 10) for r in rows]
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({SEQ: [ref], spec: [near]}, spec), "logits-close").passed
    failed = verdict(context({SEQ: [ref], spec: [far]}, spec), "logits-close")
    assert not failed.passed and "NMSE" in failed.message and "uncalibrated" in failed.message


def test_every_check_name_a_suite_may_use_has_its_function():
    from harness.suites import CHECK_NAMES

    assert tuple(CHECKS) == CHECK_NAMES


def test_exercised_needs_completed_requests_and_the_counted_path():
    s = suite()
    s.expect = {"completed_min": 0.5, "spec_stats_min": {"draft_dropped": 1}}
    full = Result(stop_reason="error", error="context_full: no free KV cells")
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({spec: [ok([1], draft_dropped=3), full]}, spec, s), "exercised").passed
    never = verdict(context({spec: [ok([1], draft_dropped=0), full]}, spec, s), "exercised")
    assert not never.passed and "draft_dropped totals 0" in never.message
    starved = verdict(context({spec: [full, full, ok([1], draft_dropped=3)]}, spec, s), "exercised")
    assert not starved.passed and "only 1 of 3 requests completed" in starved.message
    server = verdict(context({spec: [ok([1])]}, spec, s), "exercised")  # llama-server reports no such counter
    assert server.passed and server.evidence["unmeasured"] == ["draft_dropped"]


def spec_ok(tokens, drafted, accepted, per_pos=None):
    stats = {"draft_n": drafted, "draft_n_accepted": accepted}
    if per_pos:
        stats.update(drafted_per_pos=per_pos[0], accepted_per_pos=per_pos[1])
    return ok(tokens, **stats)


def test_acceptance_against_the_baseline_fails_a_drop_and_names_the_draft_position(tmp_path):
    spec = SEQ.reference(spec="draft-simple")
    tokens = list(range(40))
    store = BaselineStore(tmp_path)
    clean = {SEQ: [ok(tokens)], spec: [spec_ok(tokens, 40, 24, ([20, 20], [14, 10]))]}
    new = verdict(context(clean, spec, baselines=store), "acceptance")  # a model with no baselines at all
    assert new.passed and new.evidence["no_baseline"] and "no baseline yet" in new.message
    writer = BaselineStore(tmp_path, update=True)
    writer.recorded(context(clean, spec, baselines=writer))  # the tokens first, as the suites order the checks
    missing = verdict(context(clean, spec, baselines=store), "acceptance")  # a cell outside the recorded matrix
    assert missing.passed and missing.evidence["no_baseline"]  # as a missing token baseline: counted apart
    assert missing.message.startswith("no baseline yet: no acceptance baseline for seq/draft-simple")
    updated = verdict(context(clean, spec, baselines=writer), "acceptance")  # records the rows, compares nothing
    assert updated.status == "not run" and "baselines updated in this run" in updated.not_run
    one_token = {SEQ: [ok(tokens)], spec: [spec_ok(tokens, 40, 23, ([20, 20], [14, 9]))]}
    assert verdict(context(one_token, spec, baselines=store), "acceptance").passed  # below one token: no verdict
    worse = {SEQ: [ok(tokens)], spec: [spec_ok(tokens, 40, 12, ([20, 20], [12, 0]))]}
    failed = verdict(context(worse, spec, baselines=store), "acceptance")
    assert not failed.passed
    assert "acceptance 60.0 % (24/40 drafted, 1.20 accepted per draft) -> 30.0 % (12/40" in failed.message
    assert "steepest fall at draft position 2 (50 % -> 0 % accepted)" in failed.message
    assert "uncalibrated" in failed.message and failed.evidence["baseline"]["accepted"] == 24
    fewer_drafts = {SEQ: [ok(tokens)], spec: [spec_ok(tokens, 10, 6)]}  # as good a rate, far fewer accepted
    failed = verdict(context(fewer_drafts, spec, baselines=store), "acceptance")
    assert not failed.passed and "accepted tokens 24 -> 6 of 40 generated" in failed.message
    plain = CHECKS["acceptance"](context(clean, SEQ, baselines=store))  # nothing drafted without speculation
    assert plain.status == "not run" and plain.not_run == "the cell does not speculate"


def test_acceptance_in_par_compares_each_request_with_seq_unless_the_drafter_learns(tmp_path):
    store = BaselineStore(tmp_path, update=True)
    tokens = list(range(40))
    for spec_name in ("draft-simple", "ngram-map-k"):
        seq, par = (Cell("inproc", mode, spec_name, "m") for mode in ("seq", "par"))
        skewed = {
            SEQ: [ok(tokens)],
            SEQ.reference(mode="par"): [ok(tokens)],
            seq: [spec_ok(tokens, 40, 30)],
            par: [spec_ok(tokens, 40, 10)],
        }
        store.recorded(context(skewed, par, baselines=store))
        result = verdict(context(skewed, par, baselines=store), "acceptance")  # its own baseline holds: 10 of 40
        if spec_name == "draft-simple":
            line = "round 0 (par) against seq (tolerance 0.05): acceptance 75.0 %"
            assert not result.passed and line in result.message
        else:  # ngram-map-k learns across a slot's requests: par's order is not seq's, only its baseline counts
            assert result.passed and "seq" not in result.evidence


def test_a_corrupt_acceptance_baseline_is_a_harness_error_naming_the_file(tmp_path):
    spec = SEQ.reference(spec="draft-simple")
    store = BaselineStore(tmp_path, update=True)
    cells = {SEQ: [ok([1, 2])], spec: [spec_ok([1, 2], 4, 2)]}
    store.recorded(context(cells, spec, baselines=store))
    path = next(tmp_path.rglob("*.json"))
    path.write_text(path.read_text().replace('"tokens"', '"acceptance": {"seq/draft-simple": 3}, "tokens"'))
    (error,) = evaluate(context(cells, spec, baselines=BaselineStore(tmp_path)), ["acceptance"])
    assert error.status == "harness error" and not error.is_verdict, error
    assert "corrupt baseline file" in error.harness_error and path.name in error.harness_error


def test_an_acceptance_change_one_token_undoes_is_no_finding():
    """Measured on llama-server (Gemma, par, ngram-map-k, a round sent at once): 35/41 then 34/42 — one draft
    token rejected instead of accepted, and one more drafted. Two tokens fewer is a finding at tolerance 0."""
    from harness.checks.acceptance import Acceptance, fall

    assert fall(Acceptance(41, 35, 64), Acceptance(42, 34, 64), 0.0) is None
    assert fall(Acceptance(41, 35, 64), Acceptance(43, 33, 64), 0.0) is not None


def test_acceptance_of_a_chat_turn_is_compared_only_with_a_baseline_of_the_same_prompt(tmp_path):
    s = Suite(
        name="demo",
        path=None,
        cases=[Case("c", Sampling(), turns=["u1", "u2"])],
        matrix={},
        checks=list(CHECKS),
        rounds=["par"],
    )
    spec = SEQ.reference(spec="draft-simple")
    t1, t2 = list(range(40)), list(range(50, 90))

    def ctx(cells, turn, store):
        runs = ChatRuns(s, cells)
        return CheckContext(runs.run(s, spec), f"c.turn{turn}", runs, store, str, "repro")

    clean = {SEQ: [ok(t1), ok(t2)], spec: [spec_ok(t1, 40, 24), spec_ok(t2, 40, 24)]}
    writer = BaselineStore(tmp_path, update=True)
    for turn in (1, 2):  # the tokens, then the acceptance (recorded by the check when updating)
        verdict(ctx(clean, turn, writer), "baseline")
        verdict(ctx(clean, turn, writer), "acceptance")
    store = BaselineStore(tmp_path)
    worse = spec_ok(t2, 40, 6)
    same_prompt = {SEQ: [ok(t1), ok(t2)], spec: [spec_ok(t1, 40, 24), worse]}
    assert not verdict(ctx(same_prompt, 2, store), "acceptance").passed
    other_reply = [99] + t1[1:]  # this run's turn-1 reply differs from the baseline's: turn 2 had another prompt
    moot = verdict(ctx({SEQ: [ok(t1), ok(t2)], spec: [spec_ok(other_reply, 40, 24), worse]}, 2, store), "acceptance")
    assert moot.passed and moot.evidence["not_compared_with_baseline"] == 1


def test_prompt_reuse_is_not_run_where_the_engine_reports_no_prompt_cache_reuse():
    """The in-process engine clears a slot after every request and reads each prompt whole (harness.engine
    scheduler: `seq_rm` after each request): `cache_n` is 0 in both cells by construction, and comparing 0 with 0
    proves nothing. Only the first request after a slot restore reuses a state (the restored one,
    `slot_state.reuse` reports it): that is compared; llama-server's cells as before."""

    def served(cache_n: int) -> Result:
        result = ok([7, 8])
        result.prompt_tokens = list(range(90))
        result.timings.cache_n = cache_n
        return result

    def ctx_of(backend: str, rounds: list[str], cache_n: dict, case: str = "c.turn2") -> CheckContext:
        s = Suite(
            name="demo",
            path=None,
            cases=[Case("c", Sampling(), turns=["u1", "u2", "u3"])],
            matrix={},
            checks=list(CHECKS),
            rounds=rounds,
            restore_after=1 if len(rounds) > 1 else None,
        )
        spec = Cell(backend, "seq", "draft-simple", "m")
        outcomes = {
            cell: [Outcome(t, r, served(n[r])) for r in range(len(rounds)) for t in ("c.turn1", "c.turn2", "c.turn3")]
            for cell, n in ((spec, cache_n["spec"]), (spec.reference(spec="none"), cache_n["none"]))
        }
        runs = Runs(s, {})
        runs.cells = {cell: CellRun(s, cell, found) for cell, found in outcomes.items()}
        return CheckContext(runs.run(s, spec), case, runs, None, str, "repro")

    engine = verdict(ctx_of("inproc", ["seq"], {"spec": [0], "none": [0]}), "prompt-reuse")
    assert engine.not_run is not None, engine
    assert "the in-process engine reports no prompt-cache reuse" in engine.not_run
    # llama-server reports its prompt cache: compared, 0 against 0 included
    assert verdict(ctx_of("server", ["seq"], {"spec": [0], "none": [0]}), "prompt-reuse").passed
    assert not verdict(ctx_of("server", ["seq"], {"spec": [27], "none": [57]}), "prompt-reuse").passed
    # after a slot restore the engine reuses the restored state and reports it: the turn after it is compared
    rounds = ["seq", "restore"]
    restored = verdict(ctx_of("inproc", rounds, {"spec": [0, 73], "none": [0, 73]}), "prompt-reuse")
    assert restored.passed and restored.evidence["cache_n"] == [73] and restored.evidence["compared"] == 1
    lost = verdict(ctx_of("inproc", rounds, {"spec": [0, 0], "none": [0, 73]}), "prompt-reuse")
    assert not lost.passed and lost.failures[0].startswith("round 1: c.turn2 reused 0 of its 90 prompt tokens")
    later = verdict(ctx_of("inproc", rounds, {"spec": [0, 0], "none": [0, 0]}, "c.turn3"), "prompt-reuse")
    assert later.not_run is not None and "the in-process engine reports no prompt-cache reuse" in later.not_run


def test_a_baseline_recorded_for_other_request_options_is_no_baseline_yet_not_a_failure(tmp_path):
    """A baseline says which request it was recorded for (`request`: n_predict and a digest of prompt, sampling and
    serve settings); a run whose case asks otherwise (another temperature, seed, grammar, ...) has no baseline yet."""
    store = BaselineStore(tmp_path)
    BaselineStore(tmp_path, update=True).recorded(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store))
    assert store.load(store.path("demo", "a", "m", "inproc", "cpu"))["request"]["n_predict"] == 128
    other = suite(repeat_penalty=1.3)
    moved = verdict(context({SEQ: [ok([4, 6])]}, SEQ, other, baselines=store), "baseline")
    assert moved.passed and moved.evidence["no_baseline"], moved
    assert "no baseline yet" in moved.message and "other request options" in moved.message
    assert "--update-baselines" in moved.message
    assert not verdict(context({SEQ: [ok([4, 6])]}, SEQ, baselines=store), "baseline").passed  # same request: fails


def test_a_baseline_recorded_at_another_n_predict_is_compared_over_the_shorter_length(tmp_path):
    """Recorded at n_predict 2, asked 4: the first 2 tokens are compared and the other 2 reported, never an
    `unexplained` failure for the reference stream ending; a divergence inside the 2 still fails."""
    store = BaselineStore(tmp_path)
    short = suite(n_predict=2)
    BaselineStore(tmp_path, update=True).recorded(context({SEQ: [ok([4, 5])]}, SEQ, short, baselines=store))
    longer = suite(n_predict=4)
    same = verdict(context({SEQ: [ok([4, 5, 6, 7])]}, SEQ, longer, baselines=store), "baseline")
    assert same.passed and same.evidence["compared_over"] == 2, same
    assert "recorded at n_predict 2" in same.message and "2 tokens of this run's output not compared" in same.message
    moved = verdict(context({SEQ: [ok([4, 9, 6, 7])]}, SEQ, longer, baselines=store), "baseline")
    assert not moved.passed and "at token 1" in moved.message
    # the other way round: asked fewer tokens than recorded, the baseline's prefix is compared
    BaselineStore(tmp_path, update=True).recorded(context({SEQ: [ok([4, 5, 6, 7])]}, SEQ, longer, baselines=store))
    assert verdict(context({SEQ: [ok([4, 5])]}, SEQ, short, baselines=store), "baseline").passed


def test_a_baseline_that_does_not_say_its_request_is_compared_over_its_own_length_where_shorter(tmp_path):
    store = BaselineStore(tmp_path)
    BaselineStore(tmp_path, update=True).recorded(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store))
    path = store.path("demo", "a", "m", "inproc", "cpu")
    import json

    data = json.loads(path.read_text())
    del data["request"]  # recorded before baselines said their request
    path.write_text(json.dumps(data))
    legacy = verdict(context({SEQ: [ok([4, 5, 6])]}, SEQ, baselines=store), "baseline")
    assert legacy.passed and legacy.evidence["compared_over"] == 2, legacy
    assert "a length it does not record" in legacy.message


def test_acceptance_and_work_rows_of_another_request_are_not_compared(tmp_path):
    """Rows measured at n_predict 64 say nothing of a request at 128 (work per generated token grows with the
    length): not compared, `no baseline yet` naming why."""
    spec = SEQ.reference(spec="draft-simple")
    short = suite(n_predict=2)
    cells = {SEQ: [ok([4, 5])], spec: [ok([4, 5], draft_n=4, draft_n_accepted=2)]}
    writer = BaselineStore(tmp_path, update=True)
    writer.recorded(context(cells, spec, short, baselines=writer))
    writer.acceptance(context(cells, spec, short, baselines=writer))
    rows, _ = BaselineStore(tmp_path).acceptance(context(cells, spec, short, baselines=writer))
    assert rows, "recorded for this request"
    longer = suite(n_predict=4)
    store = BaselineStore(tmp_path)
    ctx = context(cells, spec, longer, baselines=store)
    assert store.acceptance(ctx) == (None, store.file_of(ctx))
    why = store.rows_mismatch(ctx, store.load(store.file_of(ctx)))
    assert why == "the baseline was recorded at n_predict 2, this run asks 4"
    result = verdict(ctx, "acceptance")
    assert "recorded at n_predict 2" in (result.message + str(result.not_run)), result
