"""Each check on small hand-made outcomes: one case it must pass and one it must fail."""

import numpy as np
import pytest

from harness.baselines import BaselineStore
from harness.checks import CHECKS, evaluate
from harness.checks.base import CheckContext
from harness.execute import CellRun, Outcome
from harness.logits import PositionLogits
from harness.matrix import Cell
from harness.request import Sampling
from harness.result import Result
from harness.suites import Case, Suite

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def suite(rounds=("par",), schema=None, allow=(), expect_accepts=True, **sampling):
    sampling = Sampling(json_schema=schema, **sampling)
    return Suite(name="demo", path=None, cases=[Case("a", sampling, prompt="x", expect_accepts=expect_accepts)],
                 matrix={}, checks=list(CHECKS), rounds=list(rounds), allow_errors=list(allow))


def ok(tokens, text="", logits=(), **stats):
    return Result(tokens=list(tokens), text=text, stop_reason="limit", spec_stats=stats, logits=list(logits))


def rows(*digests):
    """Logged logits whose only telling part is the full row's digest."""
    return [PositionLogits(np.array([1], np.int32), np.array([0.0], np.float32), digest=d) for d in digests]


class Runs:
    """Stands in for the Executor: the cells' outcomes are given, nothing is run."""

    def __init__(self, s, cells):
        self.cells = {cell: CellRun(s, cell, [Outcome("a", r, res) for r, res in enumerate(results)])
                      for cell, results in cells.items()}

    def run(self, _suite, cell):
        return self.cells[cell]

    def environment(self, cell):
        return {"device": "cpu"}


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
    assert CHECKS["lossless"](context({SEQ: [ok([1])]}, SEQ)) is None


def test_lossless_under_seeded_sampling_fails_only_where_the_logits_are_identical():
    spec = SEQ.reference(spec="draft-simple")
    sampled = suite(temperature=0.7, seed=42, repeat_penalty=1.5)
    reference = ok([1, 2, 3], logits=rows("a", "b", "c"))
    proven = verdict(context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "b", "c"))]}, spec, sampled),
                     "lossless")
    assert not proven.passed and "bit-identical" in proven.message and "at token 1" in proven.message
    numerics = verdict(context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "B", "c"))]}, spec, sampled),
                       "lossless")
    assert numerics.passed and numerics.evidence["reported_only"] and numerics.evidence["matching"] == 0
    # under a grammar the sampler state also depends on earlier logits (re-samples): every row must match
    grammar = suite(temperature=0.7, seed=42, grammar='root ::= "x"')
    earlier = ok([1, 9, 3], logits=rows("A", "b", "c"))
    assert verdict(context({SEQ: [reference], spec: [earlier]}, spec, grammar), "lossless").passed
    assert not verdict(context({SEQ: [reference], spec: [earlier]}, spec, sampled), "lossless").passed
    unseeded = suite(temperature=0.7, seed=-1)
    assert CHECKS["lossless"](context({SEQ: [reference], spec: [ok([5])]}, spec, unseeded)) is None
    greedy = suite(temperature=0, repeat_penalty=1.5)  # greedy with penalties always fails on a divergence
    assert not verdict(context({SEQ: [reference], spec: [ok([1, 9, 3], logits=rows("a", "B", "c"))]}, spec, greedy),
                       "lossless").passed


def test_mode_invariant_fails_for_no_kv_unified_and_only_reports_par():
    split, par = SEQ.reference(mode="no-kv-unified"), SEQ.reference(mode="par")
    cells = {SEQ: [ok([1, 2])], split: [ok([1, 5])], par: [ok([1, 5])]}
    assert not verdict(context(cells, split), "mode-invariant").passed
    reported = verdict(context(cells, par), "mode-invariant")
    assert reported.passed and reported.evidence["matching"] == 0 and reported.evidence["reported_only"]


def test_baseline(tmp_path):
    store = BaselineStore(tmp_path)
    missing = verdict(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), "baseline")
    assert not missing.passed and "--update-baselines" in missing.message
    BaselineStore(tmp_path, update=True).check(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store))
    assert verdict(context({SEQ: [ok([4, 5])]}, SEQ, baselines=store), "baseline").passed
    failed = verdict(context({SEQ: [ok([4, 6])]}, SEQ, baselines=store), "baseline")
    assert not failed.passed and "at token 1" in failed.message


def test_spec_ran():
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=2)]}, spec), "spec-ran").passed
    assert not verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=0)]}, spec), "spec-ran").passed
    assert not verdict(context({spec: [ok([1])]}, spec), "spec-ran").passed
    reject = SEQ.reference(spec="scripted-reject")
    assert verdict(context({reject: [ok([1], draft_n=4, draft_n_accepted=0)]}, reject), "spec-ran").passed
    grammar_case = suite(expect_accepts=False)  # a drafter that does not see the grammar: drafts suffice
    assert verdict(context({spec: [ok([1], draft_n=4, draft_n_accepted=0)]}, spec, grammar_case), "spec-ran").passed
    assert not verdict(context({spec: [ok([1])]}, spec, grammar_case), "spec-ran").passed


def test_spec_ran_counts_per_case_not_per_cell():
    spec = SEQ.reference(spec="draft-simple")
    two = Suite(name="demo", path=None, cases=[Case("a", Sampling(), prompt="x"), Case("b", Sampling(), prompt="y")],
                matrix={}, checks=list(CHECKS))
    run = CellRun(two, spec, [Outcome("a", 0, ok([1], draft_n=8, draft_n_accepted=3)), Outcome("b", 0, ok([1]))])
    runs = Runs(two, {})
    runs.cells[spec] = run
    check = lambda case: CHECKS["spec-ran"](CheckContext(run, case, runs, None, str, "repro"))
    assert check("a").passed
    failed = check("b")
    assert not failed.passed and "no drafts at all for the case" in failed.message


def test_grammar_valid():
    s = suite(schema=SCHEMA)
    assert verdict(context({SEQ: [ok([1], text='{"n": 3}')]}, SEQ, s), "grammar-valid").passed
    assert not verdict(context({SEQ: [ok([1], text='{"n": "x"}')]}, SEQ, s), "grammar-valid").passed
    assert not verdict(context({SEQ: [ok([1], text='{"n": 3')]}, SEQ, s), "grammar-valid").passed


def test_a_cell_that_could_not_be_served_fails_no_crash_only():
    ctx = context({SEQ: []}, SEQ)
    ctx.run.error = "model file not found: x.gguf"
    results = evaluate(ctx, list(CHECKS))
    assert [(r.name, r.passed) for r in results] == [("no-crash", False)] and "x.gguf" in results[0].message


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_every_check_is_documented(name):
    assert CHECKS[name].__doc__


def scan(healthy, duplicates=()):
    dups = [{"part": "kv", "stream": 0, "seq_id": 0, "pos": p, "count": 2} for p in duplicates]
    totals = {"duplicate_cells": len(dups), "orphans": 0, "missing_positions": 0}
    return {"healthy": healthy, "totals": totals, "duplicates": dups, "orphans": [], "holes": []}


def test_kv_healthy_reports_the_duplicate_positions():
    clean = ok([1]); clean.kv_scan = scan(True)
    assert verdict(context({SEQ: [clean]}, SEQ), "kv-healthy").passed
    dirty = ok([1]); dirty.kv_scan = scan(False, duplicates=(22, 23))
    failed = verdict(context({SEQ: [dirty]}, SEQ), "kv-healthy")
    assert not failed.passed and "(seq 0, pos 22)" in failed.message and failed.evidence["duplicate_cells"] == 2
    assert CHECKS["kv-healthy"](context({SEQ: [ok([1])]}, SEQ)) is None


def test_logits_close():
    import numpy as np

    from harness.logits import capture

    rows = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    ref = ok([1, 2, 3]); ref.logits = [capture(r, 10) for r in rows]
    near = ok([1, 2, 3]); near.logits = [capture(r + 1e-4, 10) for r in rows]
    far = ok([1, 2, 3]); far.logits = [capture(r * 1.5, 10) for r in rows]
    spec = SEQ.reference(spec="draft-simple")
    assert verdict(context({SEQ: [ref], spec: [near]}, spec), "logits-close").passed
    failed = verdict(context({SEQ: [ref], spec: [far]}, spec), "logits-close")
    assert not failed.passed and "max_abs" in failed.message
