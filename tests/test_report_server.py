"""Reports of llama-server runs: an interrupted run still reports (SIGINT once a multi-cell run is under way), and
a model the server cannot load is a per-cell error in the report, not a crash of the run."""

import json
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from report_helpers import REPO


def processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        line = " ".join(a.decode(errors="replace") for a in args)
        if text in line and "llama-server" in line:
            found.append(line)
    return found


def test_sigint_during_a_server_run_reports_what_finished_and_stops_the_servers(tmp_path, tiny_models):
    from harness.backends.build import ensure_server

    ensure_server()  # the build (cached) is not part of the 20 s
    out = tmp_path / "run"
    # --repeat 3: every round three times, so each mode's cells take long enough to interrupt in the middle
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--backend", "server", "--model", "tiny-dense",
                             "--repeat", "3", "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # wait for the state, not for a time: the cells of one mode (none and draft-simple) run side by side, each
    # with its own llama-server, so a third server log means the first mode's cells finished and the next began
    deadline = time.monotonic() + 300
    while (len(list((out / "server-logs").glob("llama-server-*.log"))) < 3 and proc.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output[-2000:]
    assert processes_mentioning(str(out)) == []
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
    skipped = [c for c in ET.parse(out / "junit.xml").getroot().iter("testcase")
               if c.find("skipped") is not None and c.find("skipped").get("type") == "not-run"]
    assert len(skipped) == len(not_run)
    assert f"interrupted: {len(not_run)} of 6 cells did not run" in output and f"report: {out / 'index.html'}" in output


def test_a_model_the_server_cannot_load_is_a_per_cell_error_and_the_run_goes_on(tmp_path, tiny_models, capsys):
    from harness.cli import main

    data = bytearray(tiny_models["tiny-dense"].path.read_bytes())
    key = data.index(b"general.architecture")
    at = data.index(b"llama", key + len("general.architecture"))
    data[at:at + 5] = b"llamz"  # an architecture this llama.cpp does not know, as a newer model is to an older build
    unknown = tmp_path / "future-arch.gguf"
    unknown.write_bytes(bytes(data))
    out = tmp_path / "run"
    argv = ["run", "--backend", "server", "--mode", "seq", "--spec", "none", "--model", str(unknown),
            "--model", "tiny-dense", "--out", str(out)]
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
