"""`metrics-agree` (issue 48 item 6): llama-server's /metrics counters moved over each batch by exactly what the
batch's answers report. The rule on constructed batches (fast), then a llama-server whose slots above 0 never add
their accepted drafts to /metrics (a one-edit patch of the vendored server-context.cpp, `metrics_on_prediction`):
categories' tiny-hybrid draft-simple cells fail `metrics-agree` in par and no-kv-unified only, while seq (slot 0
alone) and every other check pass. The unpatched build passes it in every server cell of the default suites (the
suite items of `pytest`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from seeded import seeded_tree

from harness.backends.build import BuildInfo, ensure_server
from harness.backends.client import parse_metrics
from harness.checks.base import CheckContext
from harness.checks.metrics import metrics_agree
from harness.matrix import Cell
from harness.result import Result, Timings
from harness.result.cellrun import CellRun, Outcome
from harness.suites import load_suite

ROOT = Path(__file__).resolve().parents[1]
METRICS = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 96
llamacpp:spec_decode_num_draft_tokens_total 40
llamacpp:spec_decode_num_accepted_tokens_total 25
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 15
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 10
"""


def test_the_prometheus_text_is_read_by_name_with_labelled_series_summed():
    m = parse_metrics(METRICS)
    assert m["tokens_predicted_total"] == 96 and m["spec_decode_num_accepted_tokens_per_pos_total"] == 25


def answer(predicted: int, drafted: int, accepted: int, batch: dict | None, ok: bool = True) -> Result:
    return Result(
        tokens=[1] * predicted,
        stop_reason="limit" if ok else "crashed",
        error=None if ok else "crashed",
        timings=Timings(predicted_n=predicted),
        spec_stats={"draft_n": drafted, "draft_n_accepted": accepted},
        metrics=batch,
    )


def context(results: list[tuple[str, Result]], backend: str = "server") -> CheckContext:
    suite = load_suite("quicksort")
    run = CellRun(suite, Cell(backend, "par", "draft-simple", "tiny-dense"))
    run.outcomes = [Outcome(case, 0, r) for case, r in results]
    return CheckContext(run, "C", None, None, str, "specharness run ...")


def delta(predicted: int, drafted: int, accepted: int, per_pos: int | None = None) -> dict:
    out = {
        "tokens_predicted_total": predicted,
        "spec_decode_num_draft_tokens_total": drafted,
        "spec_decode_num_accepted_tokens_total": accepted,
        "spec_decode_num_accepted_tokens_per_pos_total": accepted if per_pos is None else per_pos,
    }
    return {"batch": 7, "requests": 2, "delta": out}


def test_a_batch_whose_counters_add_up_passes_and_one_that_lost_a_slots_accepted_drafts_fails():
    batch = delta(96 + 64, 40 + 30, 25 + 20)
    ok = metrics_agree(context([("C", answer(96, 40, 25, batch)), ("Java", answer(64, 30, 20, batch))]))
    assert ok.passed and ok.is_verdict and ok.evidence["batches_compared"] == 1
    lost = delta(96 + 64, 40 + 30, 25)  # the second slot's 20 accepted never reached /metrics
    bad = metrics_agree(context([("C", answer(96, 40, 25, lost)), ("Java", answer(64, 30, 20, lost))]))
    assert not bad.passed
    assert "spec_decode_num_accepted_tokens_total moved by 25, the answers' draft_n_accepted add up to 45" in (
        bad.message
    )
    assert "C round 0, Java round 0" in bad.message
    per_pos = delta(160, 70, 45, per_pos=44)  # the per-position series short of the total
    assert not metrics_agree(
        context([("C", answer(96, 40, 25, per_pos)), ("Java", answer(64, 30, 20, per_pos))])
    ).passed


def test_a_batch_with_a_request_that_did_not_complete_or_was_not_measured_is_not_compared():
    batch = delta(10, 0, 0)
    crashed = metrics_agree(context([("C", answer(96, 40, 25, batch)), ("Java", answer(0, 0, 0, batch, ok=False))]))
    assert crashed.not_run and "did not complete" in crashed.not_run
    unmeasured = {"batch": 8, "requests": 1, "unmeasured": "llama-server was restarted during the batch"}
    restarted = metrics_agree(context([("C", answer(96, 40, 25, unmeasured))]))
    assert restarted.not_run and "restarted" in restarted.not_run


def test_in_process_cells_are_not_run_with_the_reason():
    result = metrics_agree(context([("C", answer(96, 40, 25, None))], backend="inproc"))
    assert result.not_run and "no /metrics" in result.not_run


LOST_ACCEPTED = {
    "        metrics.n_draft_accepted    += slot.stats.n_draft_accepted;\n": (
        "        if (slot.id == 0) { // seeded bug: slots above 0 never add their accepted drafts\n"
        "            metrics.n_draft_accepted += slot.stats.n_draft_accepted;\n"
        "        }\n"
    ),
}
"""The edit: server-context.cpp's `metrics_on_prediction` adds a released slot's accepted drafts to /metrics for
slot 0 only. Tokens, drafts, the timings and every other counter stay as they are."""


@pytest.mark.long  # one llama-server variant (server-context.cpp recompiled) and categories' 3 cells on it
def test_a_server_whose_metrics_lose_the_accepted_drafts_of_slots_above_0_fails_metrics_agree_outside_seq(
    tmp_path, tiny_models
):
    build: BuildInfo = ensure_server(
        source=seeded_tree(LOST_ACCEPTED, "seeded-metrics-lost-accepted", "tests/test_metrics_agree.py")
    )
    out = tmp_path / "run"
    argv = ["run", "--suite", "categories", "--backend", "server", "--model", "tiny-hybrid", "--spec", "draft-simple"]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *argv, "--server-bin", str(build.server_bin), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-3000:]
    checks = json.loads((out / "checks.json").read_text())
    failed = [c for c in checks if not c["passed"] and c.get("not_run") is None]
    assert failed and {c["check"] for c in failed} == {"metrics-agree"}, [(c["check"], c["message"]) for c in failed]
    assert {c["mode"] for c in failed} == {"par", "no-kv-unified"}  # seq serves slot 0 only: its counters add up
    assert all("spec_decode_num_accepted_tokens_total" in c["message"] for c in failed)
    seq = [c for c in checks if c["check"] == "metrics-agree" and c["mode"] == "seq"]
    assert seq and all(c["passed"] and c.get("not_run") is None for c in seq)
