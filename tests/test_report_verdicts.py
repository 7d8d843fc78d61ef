"""What the report says of verdicts that are not plain passes or failures (issue 28 items 5 and 6): an acceptance
tolerance refused at calibration is "not judged" with its reason in index.html's list of checks not run, and a
known defect seen in a suite its entry does not list says so in the known-defects table, with the suite, as known
and not failing the run. Stored runs written from records (no model runs)."""

from report_helpers import parse_html

from harness.report.files import RunDir, write_files
from harness.report.html import render_index
from harness.signatures.text import NEW_SUITE

CELL = {"suite": "eog", "model": "tiny-hybrid", "backend": "server", "mode": "par", "spec": "draft-simple"}
REFUSED = "not judged: noise exceeds the range (calibrated spread 1.2 in par, tolerance refused at calibration)"
HTTP500 = "round 0: HTTP 500: speculative batch index 12 is not inside the current sub-batch [0, 8)"
ENTRY = {
    "id": "server-spec-batch-split-on-kv-full",
    "upstream": "https://github.com/ggml-org/llama.cpp/issues/24840",
    "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
    "reason": "the speculative batch split",
}


def stored_run(path):
    record = {
        **CELL,
        "case": "c",
        "repeat": 0,
        "tokens": [1, 2],
        "text": "ab",
        "stop_reason": "limit",
        "error": None,
        "slot_id": 0,
        "prompt_n": 4,
        "timings": {},
        "spec_stats": {"draft_n": 4, "draft_n_accepted": 2},
        "kv_scan": None,
        "work": None,
    }
    known = {
        "check": "no-crash",
        "passed": False,
        "message": f"1 of 1 requests failed; c {HTTP500}",
        "failures": [HTTP500],
        "evidence": {"known_failure": ENTRY["id"], NEW_SUITE: "eog"},
    }
    refused = {"check": "acceptance", "passed": True, "message": f"not run: {REFUSED}", "not_run": REFUSED}
    verdicts = [{**CELL, "case": "c", "evidence": {}} | v for v in (known, refused)]
    meta = {"format": 1, "cells": [], "backends": {}, "models": {}, "known_failures": [ENTRY]}
    write_files(path, [record], verdicts, {}, {}, meta)
    return RunDir.load(path)


def test_a_refused_tolerance_and_a_known_defect_in_a_new_suite_show_in_index_html(tmp_path):
    page = parse_html(render_index(stored_run(tmp_path / "run")))
    row = page.find(id="known").find("tr", data_known=ENTRY["id"])
    assert "seen in a new suite: eog (a known defect, not failing the run" in row.text
    assert "1 failed" not in page.text and "0 failed" in page.text
    assert REFUSED in page.text and "acceptance" in page.text
