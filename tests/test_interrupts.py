"""Ctrl-C (exit 130) and SIGTERM (exit 143) in every phase of every command: each test holds the process at the
start of one phase (SPECHARNESS_HOLD_PHASE), waits until the phase file says it is there, signals, and checks
the exit status, what was kept, and that no llama-server or engine worker is left. Tiny cells: seconds each.
The interrupts of a bisect are in tests/test_bisect.py (they need its fixture repository)."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
from interrupts import REPO, entered, interrupt, left_behind, spawn, wait_for_phase

pytestmark = pytest.mark.stress

SUITE = REPO / "tests" / "data" / "interrupt.yaml"
SERVER = ["--backend", "server", "--mode", "seq,par", "--spec", "none"]
"""Two cells, each with its own llama-server: seq, then par (checks compare par with seq)."""
INPROC = ["--backend", "inproc", "--mode", "seq,par", "--spec", "none"]
CASES = 2
"""Cases in the suite: `checking` is entered once per case of a cell."""


def run(tmp_path, *options: str, hold: str, sig: int = signal.SIGINT) -> tuple[int, str]:
    """`specharness run` of the interrupt suite into tmp_path/run, held at `hold`, then sent `sig`."""
    phases = tmp_path / "phases"
    proc = spawn(
        ["run", "--suite", str(SUITE), "--out", str(tmp_path / "run"), *options],
        phases,
        hold,
        env={"TMPDIR": str(tmp_path)},
    )
    name, _, n = hold.partition(":")
    wait_for_phase(proc, phases, name, int(n or 1))
    status, output = interrupt(proc, sig)
    assert left_behind(tmp_path) == [], output[-2000:]
    return status, output


def statuses(out) -> dict[str, str]:
    meta = json.loads((out / "run.json").read_text())
    assert meta["interrupted"] is True
    return {c["id"]: c["status"] for c in meta["cells"]}


def produced(out, name: str = "results.json") -> set[str]:
    """The cells with records (results.json) or verdicts (checks.json)."""
    return {f"{r['mode']}-{r['spec']}-{r['model']}-{r['backend']}" for r in json.loads((out / name).read_text())}


SEQ, PAR = "seq-none-tiny-dense-{}", "par-none-tiny-dense-{}"


@pytest.fixture(scope="module", autouse=True)
def built_and_made(tiny_models):
    """The tiny models and the cached llama-server build, before any test holds a phase."""
    from harness.backends.build import ensure_server

    ensure_server()


def test_ctrl_c_while_planning_exits_130_and_writes_nothing(tmp_path):
    status, output = run(tmp_path, *SERVER, hold="planning")
    assert status == 130, output[-2000:]
    assert not (tmp_path / "run" / "results.json").exists() and "interrupted" in output


def test_ctrl_c_while_building_llama_server_reports_every_cell_not_run(tmp_path):
    status, output = run(tmp_path, *SERVER, hold="building")
    assert status == 130, output[-2000:]
    assert set(statuses(tmp_path / "run").values()) == {"not run"}
    assert "interrupted: 2 of 2 cells did not run" in output


def test_ctrl_c_while_serving_keeps_the_finished_cell_and_stops_the_servers(tmp_path):
    status, output = run(tmp_path, *SERVER, hold="serving:2")  # seq finished; par's server is up
    out = tmp_path / "run"
    assert status == 130, output[-2000:]
    assert statuses(out) == {SEQ.format("server"): "done", PAR.format("server"): "not run"}
    assert produced(out) == produced(out, "checks.json") == {SEQ.format("server")}
    assert 'id="interrupted"' in (out / "index.html").read_text()


def test_sigterm_while_serving_in_process_exits_143_and_stops_the_engine_workers(tmp_path):
    status, output = run(tmp_path, *INPROC, hold="serving:2", sig=signal.SIGTERM)
    out = tmp_path / "run"
    assert status == 143, output[-2000:]
    assert statuses(out) == {SEQ.format("inproc"): "done", PAR.format("inproc"): "not run"}
    assert produced(out) == {SEQ.format("inproc")}


def test_ctrl_c_while_checking_keeps_what_was_served_and_checked(tmp_path):
    status, output = run(tmp_path, *INPROC, hold=f"checking:{CASES + 1}")  # par served, its checks begun
    out = tmp_path / "run"
    assert status == 130, output[-2000:]
    assert statuses(out) == {SEQ.format("inproc"): "done", PAR.format("inproc"): "not run"}
    assert produced(out) == {SEQ.format("inproc"), PAR.format("inproc")}
    assert produced(out, "checks.json") == {SEQ.format("inproc")}


def test_ctrl_c_while_triaging_a_divergence(tmp_path):
    # a fault of the in-process engine makes the scripted cell diverge; its checks triage the divergence
    status, output = run(
        tmp_path,
        "--backend",
        "inproc",
        "--mode",
        "seq",
        "--model",
        "tiny-hybrid",
        "--fault",
        "partial-checkpoint-only",
        hold="triage",
    )
    out = tmp_path / "run"
    assert status == 130, output[-2000:]
    assert statuses(out) == {
        "seq-none-tiny-hybrid-inproc": "done",
        "seq-scripted-wrong-at-2-tiny-hybrid-inproc": "not run",
    }
    assert "seq-scripted-wrong-at-2-tiny-hybrid-inproc" in produced(out)


@pytest.mark.parametrize("phase", ["writing", "report"])
def test_ctrl_c_while_writing_finishes_the_files(tmp_path, phase):
    status, output = run(tmp_path, *SERVER, hold=phase)
    out = tmp_path / "run"
    assert status == 130, output[-2000:]
    meta = json.loads((out / "run.json").read_text())
    assert {c["status"] for c in meta["cells"]} == {"done"}
    assert meta["interrupted"] is (phase == "writing")  # held before run.json was written, or after
    assert produced(out) == produced(out, "checks.json") == {SEQ.format("server"), PAR.format("server")}
    assert (out / "index.html").is_file() and (out / "junit.xml").is_file()
    assert "interrupted: every cell had finished" in output


def test_ctrl_c_while_the_finished_run_exits_is_not_lost(tmp_path):
    status, output = run(tmp_path, *SERVER, hold="exit")  # everything written, the servers stopped
    out = tmp_path / "run"
    assert status == 130, output[-2000:]
    assert json.loads((out / "run.json").read_text())["interrupted"] is False
    assert produced(out, "checks.json") == {SEQ.format("server"), PAR.format("server")}
    assert f"report: {out / 'index.html'}" in output


def test_ctrl_c_during_shrink_writes_the_smallest_case_found(tmp_path):
    failing, phases = tmp_path / "failing", tmp_path / "phases"
    made = spawn(
        [
            "run",
            "--suite",
            str(SUITE),
            "--backend",
            "inproc",
            "--mode",
            "seq",
            "--model",
            "tiny-hybrid",
            "--fault",
            "partial-checkpoint-only",
            "--out",
            str(failing),
        ],
        tmp_path / "run-phases",
    )
    output = made.communicate(timeout=300)[0]
    assert made.returncode == 1, output[-2000:]
    out = tmp_path / "bundle"
    proc = spawn(
        ["shrink", "--from-run", str(failing), "--case", "C", "--check", "lossless", "--tries", "1", "--out", str(out)],
        phases,
        "serving:10",
        env={"TMPDIR": str(tmp_path)},
    )
    wait_for_phase(proc, phases, "serving", 10)  # a few trials in (each serves the reference and the failing cell)
    status, output = interrupt(proc)
    assert status == 130, output[-2000:]
    assert left_behind(tmp_path) == []
    assert json.loads((out / "shrink.json").read_text())["stopped"] == "interrupted"
    assert (out / "case.json").is_file() and (out / "repro.py").is_file()


def pytest_session(tmp_path, hold: str, sig: int = signal.SIGINT, workers: int = 0) -> tuple[int, str]:
    """`pytest suites/ --report tmp_path/report` on a copy of the interrupt suite, held at `hold`, sent `sig`
    (with xdist `workers`: to the process group, as Ctrl-C in a terminal)."""
    suites = tmp_path / "suites"
    suites.mkdir()
    shutil.copy(SUITE, suites)
    phases = tmp_path / "phases"
    xdist = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    proc = spawn(
        [
            "-p",
            "harness.pytest_plugin",
            "-p",
            "no:cacheprovider",
            *xdist,
            "suites",
            "--report",
            str(tmp_path / "report"),
            *SERVER,
        ],
        phases,
        hold,
        env={"TMPDIR": str(tmp_path)},
        module="pytest",
        cwd=tmp_path,
        start_new_session=bool(workers),
    )
    name, _, n = hold.partition(":")
    wait_for_phase(proc, phases, name, int(n or 1))
    status, output = interrupt(proc, sig, group=bool(workers))
    assert left_behind(tmp_path) == [], output[-2000:]
    return status, output


def test_ctrl_c_in_a_pytest_session_reports_what_finished(tmp_path):
    status, output = pytest_session(tmp_path, "serving:2")
    out = tmp_path / "report"
    assert status == 130, output[-2000:]
    assert statuses(out) == {SEQ.format("server"): "done", PAR.format("server"): "not run"}
    assert produced(out, "checks.json") == {SEQ.format("server")}


def test_ctrl_c_in_a_pytest_xdist_session_merges_what_the_workers_finished(tmp_path):
    # both cells go to one worker (one xdist group), in an order of its choosing: one checked, the other served
    status, output = pytest_session(tmp_path, f"checking:{CASES + 1}", workers=2)
    out = tmp_path / "report"
    assert status == 130, output[-2000:]
    cells = statuses(out)
    done = {cell for cell, status in cells.items() if status == "done"}
    errors = [c.get("error") for c in json.loads((out / "run.json").read_text())["cells"] if c["status"] == "error"]
    assert sorted(cells.values()) == ["done", "not run"], (errors, output[-6000:], entered(tmp_path / "phases"))
    assert produced(out, "checks.json") == done
    assert not (out / ".workers").exists()


def test_sigterm_while_pytest_collects_the_suites_exits_143(tmp_path):
    status, output = pytest_session(tmp_path, "planning", signal.SIGTERM)
    assert status == 143, output[-2000:]
    assert not (tmp_path / "report").exists()


def test_ctrl_c_during_selftest_shows_the_rows_that_finished(tmp_path):
    phases = tmp_path / "phases"
    proc = spawn(
        ["selftest", "--fault", "no-penalty-restore", "--clean-runs", "0"],
        phases,
        "serving",
        env={"TMPDIR": str(tmp_path)},
    )
    wait_for_phase(proc, phases, "serving")
    status, output = interrupt(proc)
    assert status == 130, output[-2000:]
    assert left_behind(tmp_path) == []
    assert "interrupted: 0 of 2 rows ran" in output


def test_ctrl_c_during_calibrate_stops_its_workers(tmp_path):
    phases = tmp_path / "phases"
    proc = spawn(
        [
            "calibrate",
            "--model",
            "tiny-dense",
            "--backend",
            "inproc",
            "--repeats",
            "1",
            "--write",
            "--calibration-dir",
            str(tmp_path / "calibration"),
        ],
        phases,
        "serving",
        env={"TMPDIR": str(tmp_path)},
    )
    wait_for_phase(proc, phases, "serving")
    status, output = interrupt(proc)
    assert status == 130, output[-2000:]
    assert left_behind(tmp_path) == []
    assert not (tmp_path / "calibration").exists()  # nothing half-measured is written


def test_ctrl_c_during_bench_keeps_the_models_measured(tmp_path):
    phases, out = tmp_path / "phases", tmp_path / "bench"
    proc = spawn(
        [
            "bench",
            "--model",
            "tiny-dense,tiny-hybrid",
            "--engine",
            "inproc",
            "--spec",
            "none",
            "--workload",
            "quicksort.C",
            "--repeat",
            "1",
            "--n-predict",
            "8",
            "--no-costs",
            "--out",
            str(out),
        ],
        phases,
        "serving:2",
        env={"TMPDIR": str(tmp_path)},
    )
    wait_for_phase(proc, phases, "serving", 2)  # tiny-dense measured, tiny-hybrid's sessions open
    status, output = interrupt(proc)
    assert status == 130, output[-2000:]
    assert left_behind(tmp_path) == []
    data = json.loads((out / "bench.json").read_text())
    assert data["interrupted"] is True and {r["model"] for r in data["rows"]} == {"tiny-dense"}


def test_a_phase_file_records_a_whole_run_in_order(tmp_path):
    phases = tmp_path / "phases"
    proc = spawn(["run", "--suite", str(SUITE), "--out", str(tmp_path / "run"), *SERVER], phases)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-2000:]
    assert entered(phases) == [
        "planning",
        "building",
        "serving",
        *["checking"] * CASES,
        "serving",
        *["checking"] * CASES,
        "writing",
        "report",
        "exit",
    ]
