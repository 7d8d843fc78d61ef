"""The suites against a real llama-server built from the vendored llama.cpp: the same checks pass, and
the recorded llama.cpp defect shows as a known failure instead of a red run."""

import json

from harness.cli import main


def test_quicksort_and_kv_fill_on_llama_server(tmp_path, tiny_models):
    # the tiny models' quicksort block on the server (Gemma's server cells are suite items already), in seq and par:
    # no-kv-unified on llama-server is the sampling suite's (the tiny models, none and draft-simple, both backends)
    models = [arg for name in tiny_models for arg in ("--model", name)]
    runs = {"quicksort": ["--suite", "quicksort", *models, "--mode", "seq,par"], "kv-fill": ["--suite", "kv-fill"]}
    checks, records = [], []
    for name, args in runs.items():
        out = tmp_path / name
        status = main(["run", *args, "--backend", "server", "--out", str(out)])
        verdicts = json.loads((out / "checks.json").read_text())
        unexpected = [c for c in verdicts if not c["passed"] and "known_failure" not in c["evidence"]]
        assert status == 0 and not unexpected, unexpected[:3]
        checks += verdicts
        records += json.loads((out / "results.json").read_text())
    assert {c["check"] for c in checks if c["suite"] == "quicksort"} >= {"baseline", "lossless", "kv-healthy"}
    assert set(tiny_models) <= {r["model"] for r in records}  # kv-fill adds tiny-hybrid-mtp (draft-mtp)
    crashes = [r for r in records if r["stop_reason"] == "crashed"]
    assert not crashes, crashes[:1]
    scans = [r["kv_scan"] for r in records if r["kv_scan"] is not None]
    judged = [scan for scan in scans if scan.get("judged", True)]  # a par scan may be not judged: another slot's state
    assert judged and all(scan["healthy"] for scan in judged)
    assert all(scan["reason"] for scan in scans if not scan.get("judged", True))
