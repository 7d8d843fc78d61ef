"""The `acceptance` check compares like with like: the same options, the same round (modulo the rounds
stored, `--repeat`), the same output, the baseline's own counts; what it cannot compare is `not run` with the
reason, never a failure or a pass; and the one-token rule does not excuse a collapse."""

import json
from pathlib import Path

import pytest
from test_checks import SEQ, Runs, ok, spec_ok, suite

from harness.checks import CHECKS
from harness.checks.acceptance import Acceptance, fall, options_key
from harness.checks.base import CheckContext
from harness.execute import ExecOptions
from harness.matrix import Cell
from harness.verdict import noise
from harness.verdict.baselines import BaselineStore

REPO = Path(__file__).resolve().parents[1]
SPEC = SEQ.reference(spec="draft-simple")
TOKENS = list(range(40))


def ctx(cells, cell, s, store, options=None):
    runs = Runs(s, cells)
    if options is not None:
        runs.options = options
    return CheckContext(runs.run(s, cell), "a", runs, store, lambda t: " ".join(map(str, t)), "repro")


def acceptance(cells, cell, s, store, options=None):
    return CHECKS["acceptance"](ctx(cells, cell, s, store, options))


def record(tmp_path, cells, cell, s, options=None) -> BaselineStore:
    """Record the tokens and the acceptance rows as `--update-baselines` does; the store that reads them."""
    writer = BaselineStore(tmp_path, update=True)
    writer.recorded(ctx(cells, cell, s, writer, options))
    updated = acceptance(cells, cell, s, writer, options)
    assert updated.status == "not run" and "baselines updated in this run" in updated.not_run
    return BaselineStore(tmp_path)


# --- the one-token rule, bounded -------------------------------------------------------------------------


def test_a_collapse_of_a_request_with_two_drafts_fails():
    """Before: one token given back to 0 of 2 made it 1 of 1 (100 %), so the rate's collapse 2 of 2 → 0 of 2
    always passed, and the share of 64 generated tokens moves less than a calibrated tolerance (Gemma's 0.146)."""
    why = fall(Acceptance(2, 2, 64), Acceptance(2, 0, 64), 0.146)
    assert why is not None and "acceptance 100.0 % (2/2 drafted) -> 0.0 % (0/2 drafted)" in why
    assert fall(Acceptance(2, 2, 8), Acceptance(2, 0, 8), 0.0) is not None
    assert fall(Acceptance(2, 1, 8), Acceptance(2, 0, 8), 0.0) is None  # one token: no finding
    assert fall(Acceptance(1, 1, 8), Acceptance(2, 0, 8), 0.0) is None  # rejected, so drafted once more


def test_gemmas_23_to_15_accepted_of_92_drafted_fails_at_its_committed_tolerance():
    """Gemma 3 270M on llama-server, w1 iterative.turn1, seq/draft-simple: 23 of 92 drafted accepted (48 tokens
    generated). 15 is 8 tokens fewer; the calibrated noise of this cell is 1 to 3 tokens (the committed
    measurement: 23, 22, 21, 21 accepted across modes and the micro-batch split)."""
    data = json.loads((REPO / "fixtures/calibration/gemma3-270m--server--cpu.json").read_text())
    tolerance = data["acceptance"]["draft-simple"]["tolerance"]
    assert tolerance == pytest.approx(0.146)
    why = fall(Acceptance(92, 23, 48), Acceptance(92, 15, 48), tolerance)
    assert why is not None and "accepted tokens 23 -> 15 of 48 generated" in why
    # the committed measurement's own spread passes: every equivalent run against seq, at the modes tolerance
    measured = data["measured"]
    seq = measured["seq/draft-simple"]["acceptance"]
    for variant in ("par/draft-simple", "no-kv-unified/draft-simple", "seq/draft-simple/n_ubatch=7"):
        for case, counts in measured[variant]["acceptance"].items():
            modes = data["acceptance"]["draft-simple"]["tolerance_modes"]
            assert fall(Acceptance(*seq[case]), Acceptance(*counts), modes) is None, (variant, case)


# --- rows keyed by round and options ---------------------------------------------------------------------


def test_repeat_compares_round_r_with_stored_round_r_modulo_the_rounds_stored(tmp_path):
    once = suite(rounds=("seq", "seq", "par"))
    clean = {SEQ: [ok(TOKENS)] * 3, SPEC: [spec_ok(TOKENS, 40, 24)] * 3}
    store = record(tmp_path, clean, SPEC, once)
    thrice = suite(rounds=("seq", "seq", "par") * 3)  # `--repeat 3`
    repeated = {SEQ: [ok(TOKENS)] * 9, SPEC: [spec_ok(TOKENS, 40, 24)] * 9}
    result = acceptance(repeated, SPEC, thrice, store)
    assert result.status == "passed" and result.evidence["compared"] == 9, result.message
    worse = {SEQ: [ok(TOKENS)] * 9, SPEC: [spec_ok(TOKENS, 40, 24)] * 7 + [spec_ok(TOKENS, 40, 6)] * 2}
    failed = acceptance(worse, SPEC, thrice, store)  # round 7 against stored round 1
    assert failed.status == "failed" and failed.failures[0].startswith("round 7 (seq) against baseline")


def test_repeat_does_not_compare_a_drafter_that_learns_with_rounds_it_never_had(tmp_path):
    ngram = SEQ.reference(spec="ngram-mod")
    once = suite(rounds=("seq",))
    store = record(tmp_path, {SEQ: [ok(TOKENS)], ngram: [spec_ok(TOKENS, 40, 24)]}, ngram, once)
    twice = {SEQ: [ok(TOKENS)] * 2, ngram: [spec_ok(TOKENS, 40, 24), spec_ok(TOKENS, 40, 3)]}
    result = acceptance(twice, ngram, suite(rounds=("seq", "seq")), store)
    assert result.status == "passed" and result.evidence["compared"] == 1
    assert "round 1 follows 1 earlier rounds" in result.evidence["not_compared"][0]


def test_spec_overrides_are_compared_only_with_rows_recorded_under_them(tmp_path):
    s = suite()
    store = record(tmp_path, {SEQ: [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 40, 30)]}, SPEC, s)
    n_max_4 = ExecOptions(backends={}, spec_overrides={"spec-draft-n-max": 4})
    smaller = {SEQ: [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 16, 8)]}  # shorter drafts: fewer tokens accepted
    result = acceptance(smaller, SPEC, s, store, n_max_4)  # `no baseline yet`, as a missing token baseline
    assert result.passed and result.evidence["no_baseline"] and result.evidence["compared"] == 0, result.message
    assert "no acceptance baseline for these options (seq/draft-simple [spec-draft-n-max=4])" in result.message
    assert acceptance(smaller, SPEC, s, store, ExecOptions(backends={})).status == "failed"  # the defaults' rows
    record(tmp_path, smaller, SPEC, s, n_max_4)
    assert acceptance(smaller, SPEC, s, store, n_max_4).status == "passed"
    stored = json.loads(next(tmp_path.rglob("*.json")).read_text())["acceptance"]
    assert sorted(stored) == ["seq/draft-simple", "seq/draft-simple [spec-draft-n-max=4]"]
    assert stored["seq/draft-simple"][0]["draft_n_accepted"] == 30  # the defaults' rows are left as they were


def test_the_options_key_names_what_shapes_drafts_and_nothing_else():
    s = suite()
    c = ctx({SPEC: [ok(TOKENS)]}, SPEC, s, None, ExecOptions(backends={}))
    assert options_key(c) == "seq/draft-simple"
    slots = ExecOptions(backends={}, parallel=2, engine={"fault": "skip-rollback"})
    assert options_key(ctx({SPEC: [ok(TOKENS)]}, SPEC, s, None, slots)) == "seq/draft-simple [parallel=2]"
    s.serve = {"parallel": 1}  # the suite sets the slots: --parallel changes nothing
    assert options_key(ctx({SPEC: [ok(TOKENS)]}, SPEC, s, None, slots)) == "seq/draft-simple"


def test_a_cell_outside_the_recorded_matrix_is_not_run_no_baseline_yet(tmp_path):
    s = suite()
    store = record(tmp_path, {SEQ: [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 40, 24)]}, SPEC, s)
    par = SPEC.reference(mode="par")  # e.g. Gemma quicksort with `--mode seq,par`: par/draft-simple never recorded
    cells = {SEQ: [ok(TOKENS)], SEQ.reference(mode="par"): [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 40, 24)]}
    cells[par] = [spec_ok(TOKENS, 40, 24)]
    result = acceptance(cells, par, s, store)
    assert result.status == "passed" and "no baseline yet" in result.message  # compared with seq only
    assert result.evidence["compared"] == 1 and "seq" in result.evidence and "baseline" not in result.evidence
    assert "no_baseline" not in result.evidence
    alone = acceptance(
        {SEQ: [ok(TOKENS)], SPEC.reference(spec="ngram-mod"): [spec_ok(TOKENS, 40, 24)]},
        SPEC.reference(spec="ngram-mod"),
        s,
        store,
    )
    assert alone.passed and alone.evidence["no_baseline"]
    assert alone.message.startswith("no baseline yet: no acceptance baseline for seq/ngram-mod")


# --- the same output, the baseline's own counts ----------------------------------------------------------


def test_acceptance_after_a_near_tie_flip_is_not_compared(tmp_path):
    """par diverged from seq at token 5 (a flip mode-invariant excuses as a near-tie): its drafts were made on
    another text, so its acceptance says nothing about the drafter."""
    s = suite()
    par, seq = SPEC.reference(mode="par"), SPEC
    flipped = TOKENS[:5] + [99] + TOKENS[6:]
    cells = {SEQ: [ok(TOKENS)], SEQ.reference(mode="par"): [ok(flipped)], seq: [spec_ok(TOKENS, 40, 30)]}
    cells[par] = [spec_ok(flipped, 40, 10)]
    result = acceptance(cells, par, s, BaselineStore(tmp_path))
    assert result.status == "not run", result.message
    assert "its output differs from seq's at token 5" in result.not_run


def test_the_baselines_share_uses_its_own_generated_count_and_output(tmp_path):
    s = suite()
    store = record(tmp_path, {SEQ: [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 40, 24)]}, SPEC, s)
    rows, _ = store.acceptance(ctx({SEQ: [ok(TOKENS)], SPEC: [spec_ok(TOKENS, 40, 24)]}, SPEC, s, store))
    assert rows[0]["generated"] == 40 and len(rows[0]["output"]) == 16
    path = next(tmp_path.rglob("*.json"))
    data = json.loads(path.read_text())
    for row in data["acceptance"]["seq/draft-simple"]:  # a row recorded before the counts were kept
        del row["generated"], row["output"]
    path.write_text(json.dumps(data))
    shorter = TOKENS[:20]  # this run stopped early: another output, whose counts are not comparable
    rows, _ = store.acceptance(ctx({SEQ: [ok(TOKENS)], SPEC: [spec_ok(shorter, 20, 6)]}, SPEC, s, store))
    assert rows[0]["generated"] == 40  # the baseline's own output, not this run's 20 tokens
    result = acceptance({SEQ: [ok(TOKENS)], SPEC: [spec_ok(shorter, 20, 6)]}, SPEC, s, store)
    assert result.status == "not run" and "its output differs from the one the baseline" in result.not_run


def test_a_refused_tolerance_is_not_judged(tmp_path, monkeypatch):
    """llama-server ngram-mod with the requests sent at once on tiny-dense: tolerance_concurrent 2.0 ≥ 1."""
    data = json.loads((REPO / "fixtures/calibration/tiny-dense--server--cpu.json").read_text())
    floor = noise.from_data(data, "calibrated (tiny-dense--server--cpu.json)")
    monkeypatch.setattr(noise, "load", lambda *a, **k: floor)
    ngram = Cell("server", "seq", "ngram-mod", "m")
    plain = ngram.reference(spec="none")
    s = suite(rounds=("par",))
    store = record(tmp_path, {plain: [ok(TOKENS)], ngram: [spec_ok(TOKENS, 40, 24)]}, ngram, s)
    result = acceptance({plain: [ok(TOKENS)], ngram: [spec_ok(TOKENS, 40, 2)]}, ngram, s, store)
    assert result.status == "not run" and "not judged: noise exceeds the range" in result.not_run
    assert "tolerance_concurrent 2 ≥ 1" in result.not_run
