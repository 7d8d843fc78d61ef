"""The suites against a real llama-server built from the vendored llama.cpp: the same checks pass, and
the recorded llama.cpp defect shows as a known failure instead of a red run."""

import json

import pytest

from harness.cli import main

ATTENTION = ["--model", "tiny-dense", "--model", "tiny-hybrid"]
"""The tiny models with attention KV (rolled back by seq_rm and by checkpoint). tiny-recurrent's greedy server cells
are forced-rejection's (none, synth-reject, draft-p-min-0.2: draft-simple's path) and sampling's; kv-fill's
tiny-hybrid-mtp cells are suite items on both backends; Gemma's server cells are quicksort's and w1's."""


@pytest.mark.long
def test_quicksort_and_kv_fill_on_llama_server(tmp_path, tiny_models):
    # quicksort's generic block on the server in seq and par (no-kv-unified on llama-server is the sampling suite's)
    runs = {
        "quicksort": ["--suite", "quicksort", *ATTENTION, "--mode", "seq,par"],
        "kv-fill": ["--suite", "kv-fill", *ATTENTION],
    }
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
    assert {r["model"] for r in records} == {"tiny-dense", "tiny-hybrid"}
    crashes = [r for r in records if r["stop_reason"] == "crashed"]
    assert not crashes, crashes[:1]
    scans = [r["kv_scan"] for r in records if r["kv_scan"] is not None]
    judged = [scan for scan in scans if scan.get("judged", True)]  # a par scan may be not judged: another slot's state
    assert judged and all(scan["healthy"] for scan in judged)
    assert all(scan["reason"] for scan in scans if not scan.get("judged", True))
