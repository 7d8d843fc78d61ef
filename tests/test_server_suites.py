"""The suites against a real llama-server built from the vendored llama.cpp: the same checks pass, and
the recorded llama.cpp defect shows as a known failure instead of a red run."""

import json

from harness.cli import main


def test_quicksort_and_kv_fill_on_llama_server(tmp_path, tiny_models):
    out = tmp_path / "run"
    status = main(["run", "--suite", "quicksort", "--suite", "kv-fill", "--backend", "server", "--out", str(out)])
    checks = json.loads((out / "checks.json").read_text())
    unexpected = [c for c in checks if not c["passed"] and "known_failure" not in c["evidence"]]
    assert status == 0 and not unexpected, unexpected[:3]
    assert {c["check"] for c in checks if c["suite"] == "quicksort"} >= {"baseline", "lossless", "kv-healthy"}
    records = json.loads((out / "results.json").read_text())
    crashes = [r for r in records if r["stop_reason"] == "crashed"]
    assert not crashes, crashes[:1]
    assert all(r["kv_scan"] is None or r["kv_scan"]["healthy"] for r in records)
