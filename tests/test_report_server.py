"""Reports of llama-server runs: an interrupted run still reports (SIGINT once a multi-cell run is under way), and
a model the server cannot load is a per-cell error in the report, not a crash of the run."""

import json
import xml.etree.ElementTree as ET

import pytest
from interrupts import interrupt, left_behind, spawn, wait_for_phase

pytestmark = pytest.mark.stress


def test_sigint_during_a_server_run_reports_what_finished_and_stops_the_servers(tmp_path, tiny_models):
    out, phases = tmp_path / "run", tmp_path / "phases"
    # the cells of one mode (none and draft-simple) run side by side, each with its own llama-server: held as the
    # second mode's servers are up, the first mode's cells finished
    proc = spawn(["run", "--backend", "server", "--model", "tiny-dense", "--out", str(out)], phases, hold="serving:2")
    wait_for_phase(proc, phases, "serving", 2)
    status, output = interrupt(proc)
    assert status == 130, output[-2000:]
    assert left_behind(out) == []
    meta = json.loads((out / "run.json").read_text())
    statuses = {c["id"]: c["status"] for c in meta["cells"]}
    done = {cid for cid, s in statuses.items() if s == "done"}
    not_run = {cid for cid, s in statuses.items() if s == "not run"}
    assert meta["interrupted"] is True and done and not_run and len(statuses) == 6
    records = json.loads((out / "results.json").read_text())
    produced = {f"{r['mode']}-{r['spec']}-{r['model']}-{r['backend']}" for r in records}
    assert done <= produced and all(r["error"] is None for r in records)
    checks = json.loads((out / "checks.json").read_text())
    assert {f"{v['mode']}-{v['spec']}-{v['model']}-{v['backend']}" for v in checks} == done
    html = (out / "index.html").read_text()
    assert 'id="interrupted"' in html and all(f"quicksort {cid}" in html for cid in not_run)
    skipped = [
        c
        for c in ET.parse(out / "junit.xml").getroot().iter("testcase")
        if c.find("skipped") is not None and c.find("skipped").get("type") == "cell-not-run"
    ]
    assert len(skipped) == len(not_run)
    assert f"interrupted: {len(not_run)} of 6 cells did not run" in output and f"report: {out / 'index.html'}" in output


def test_a_model_the_server_cannot_load_is_a_per_cell_error_and_the_run_goes_on(tmp_path, tiny_models, capsys):
    from harness.cli import main

    data = bytearray(tiny_models["tiny-dense"].path.read_bytes())
    key = data.index(b"general.architecture")
    at = data.index(b"llama", key + len("general.architecture"))
    data[at : at + 5] = b"llamz"  # an architecture this llama.cpp does not know, as a newer model is to an older build
    unknown = tmp_path / "future-arch.gguf"
    unknown.write_bytes(bytes(data))
    out = tmp_path / "run"
    argv = [
        "run",
        "--backend",
        "server",
        "--mode",
        "seq",
        "--spec",
        "none",
        "--model",
        str(unknown),
        "--model",
        "tiny-dense",
        "--out",
        str(out),
    ]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "could not load model" in err and "llamz" in err
    meta = json.loads((out / "run.json").read_text())
    status = {c["model"]: c["status"] for c in meta["cells"]}
    assert status == {str(unknown): "error", "tiny-dense": "done"}
    checks = json.loads((out / "checks.json").read_text())
    assert all(v["passed"] for v in checks if v["model"] == "tiny-dense")
    html = (out / "index.html").read_text()
    assert 'id="cell-errors"' in html and "llamz" in html
    errors = [c for c in ET.parse(out / "junit.xml").getroot().iter("testcase") if c.find("error") is not None]
    assert errors and all("future-arch" in c.get("name") for c in errors)
