"""Speed is judged by what one run measures side by side: acceptance against the baselines and the speed-up
over no speculation in the same run. A diff of two clean runs, the second made while busy loops took every
core, flags nothing; a diff against a run whose draft context goes stale flags exactly its speculative
cells, by their acceptance (and the draft context's scan); a speed-up lost beyond both runs' noise bands is
flagged, a machine that is
slower for everything is not."""

import contextlib
import json
import multiprocessing
import os
import shutil

import pytest
from report_helpers import inside, make_checkout

from harness.cli import main
from harness.report.diff import compare
from harness.report.files import RunDir, speedups

pytestmark = pytest.mark.xdist_group("speed-verdicts")  # the module's runs are made once, on one worker

NARROW = ["--suite", "quicksort", "--model", "tiny-dense", "--mode", "seq", "--spec", "none,draft-simple"]


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_cores():
    """A busy loop on every core for the duration."""
    loops = [
        multiprocessing.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 2)
    ]
    for p in loops:
        p.start()
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.join()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models):
    """`idle`: a clean run; `busy`: the same while every core runs a busy loop; `stale`: with the draft
    context never rolled back (outputs unchanged, drafts worse)."""
    root = make_checkout(tmp_path_factory.mktemp("checkout"))
    with inside(root):
        assert main(["run", *NARROW, "--out", "idle"]) == 0
        with busy_cores():
            assert main(["run", *NARROW, "--out", "busy"]) == 0
        assert main(["run", *NARROW, "--fault", "stale-draft-context", "--out", "stale"]) == 1
    return root


def test_every_speculative_cell_records_its_speed_up_over_no_speculation_in_the_same_run(runs):
    speed = speedups(RunDir.load(runs / "idle").records)
    assert set(speed) == {"quicksort seq-draft-simple-tiny-dense-inproc"}
    s = speed["quicksort seq-draft-simple-tiny-dense-inproc"]
    assert s["pairs"] == 9 and 0 < s["low"] <= s["speedup"] <= s["high"]


def test_diff_of_a_clean_run_and_one_made_on_busy_cores_flags_nothing(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs / "idle"), str(runs / "busy")]) == 0
    out = capsys.readouterr().out
    diff = compare(RunDir.load(runs / "idle"), RunDir.load(runs / "busy"))
    assert not [p["cell"] for p in diff.performance if p["flagged"]], out
    assert "no regression" in out


def test_diff_against_a_stale_draft_context_flags_only_the_speculative_cells_by_acceptance(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs / "idle"), str(runs / "stale")]) == 1
    diff = compare(RunDir.load(runs / "idle"), RunDir.load(runs / "stale"))
    flagged = {p["cell"]: p for p in diff.performance if p["flagged"]}
    assert set(flagged) == {"quicksort seq-draft-simple-tiny-dense-inproc"}
    cell = flagged["quicksort seq-draft-simple-tiny-dense-inproc"]
    assert cell["acceptance_regressed"] and cell["b_acceptance"] < cell["a_acceptance"] - 0.1
    # the draft context's scan finds the rejected drafts it kept; the fallen acceptance restates that finding, and
    # so does `work`: worse drafts reject more, so the target decodes more per generated token (a true consequence)
    assert {v["check"] for v in diff.newly_failing} == {"acceptance", "kv-healthy", "work"}
    # only the speculative cells: a cell without speculation drafts nothing, decodes no more, fails nothing
    assert all("-seq-draft-simple-tiny-dense-inproc" in v["item"] for v in diff.newly_failing), diff.newly_failing
    assert [s["signature"] for s in diff.signatures] == ["kv-healthy: orphans in the draft context"]
    assert {v["check"] for v in diff.newly_failing if v["restates"]} == {"acceptance", "work"}
    html = (runs / "stale" / "diff.html").read_text()
    assert "acceptance" in html and "machine-dependent" in html


def test_a_lost_speed_up_is_flagged_and_a_slower_machine_is_not(runs, tmp_path):
    def edited(name: str, factor: dict) -> RunDir:
        target = tmp_path / name
        shutil.copytree(runs / "idle", target)
        rows = json.loads((target / "results.json").read_text())
        for r in rows:
            r["timings"]["predicted_ms"] *= factor[r["spec"]]
        (target / "results.json").write_text(json.dumps(rows))
        return RunDir.load(target)

    idle = RunDir.load(runs / "idle")
    slower_machine = compare(idle, edited("machine", {"none": 3.0, "draft-simple": 3.0}))
    assert not slower_machine.slower and not any(p["flagged"] for p in slower_machine.performance)
    # a loss beyond the noise band the idle run measured (its pairs' max / min, wide when the cores were busy)
    band = speedups(idle.records)["quicksort seq-draft-simple-tiny-dense-inproc"]
    loss = 1.5 * band["high"] / band["low"]
    worse = compare(idle, edited("speedup", {"none": 1.0, "draft-simple": loss}))
    assert [p["cell"] for p in worse.slower] == ["quicksort seq-draft-simple-tiny-dense-inproc"]
    assert worse.slower[0]["speed_regressed"] and worse.slower[0]["ratio"] == pytest.approx(1 / loss, rel=0.01)
    within = compare(idle, edited("within", {"none": 1.0, "draft-simple": 0.9 * band["high"] / band["low"]}))
    assert not within.slower  # inside both bands: noise, not a regression
