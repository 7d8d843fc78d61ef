"""A model the project does not ship: `no baseline yet` (exit 0, counted apart), baselines recorded outside the
package with `--baselines-dir`, compared on the next run, and known by content, not by the file's path."""

import json
import shutil
import xml.etree.ElementTree as ET

import pytest

from harness.cli import main
from harness.models import model_key, resolve

ARGV = [
    "run",
    "--suite",
    "quicksort",
    "--backend",
    "inproc",
    "--mode",
    "seq",
    "--spec",
    "none,ngram-mod",
    "--no-auto-calibrate",
]
"""Judged by the default floor (not measured once and cached: tests/test_calibration_cache.py)."""


def verdicts(out, check):
    return [c for c in json.loads((out / "checks.json").read_text()) if c["check"] == check]


@pytest.mark.workflows
@pytest.mark.long
def test_a_new_model_runs_with_no_baseline_yet_then_records_and_compares(tmp_path, capsys):
    model = tmp_path / "models" / "my-model.gguf"  # a generated model under a path the project does not know
    model.parent.mkdir()
    shutil.copyfile(resolve("tiny-dense-loop").path, model)
    key = model_key(str(model))
    assert key.startswith("gguf-") and key == model_key(str(shutil.copyfile(model, tmp_path / "other-name.gguf")))

    assert main([*ARGV, "--model", str(model), "--out", str(tmp_path / "r1")]) == 0
    baseline = verdicts(tmp_path / "r1", "baseline")
    assert len(baseline) == 6 and all(v["passed"] and v["evidence"]["no_baseline"] for v in baseline)
    speculative = [v for v in verdicts(tmp_path / "r1", "acceptance") if v.get("not_run") is None]
    assert len(speculative) == 3 and all(v["evidence"].get("no_baseline") for v in speculative)
    assert f"no baseline yet for {key} (quicksort, inproc, cpu)" in baseline[0]["message"]
    assert "--update-baselines" in baseline[0]["message"]
    out, err = capsys.readouterr()
    assert "no baseline yet" in out  # the summary table counts them apart
    assert "uncalibrated: " in err and f"specharness calibrate --model {model} --backend inproc --write" in err
    junit = ET.parse(tmp_path / "r1" / "junit.xml").getroot()
    assert (
        len(junit.findall(".//skipped[@type='no-baseline']")) == 9
    )  # 6 baseline verdicts, 3 of acceptance (ngram-mod)
    html = (tmp_path / "r1" / "index.html").read_text()
    assert "9 of them with no baseline yet" in html and "uncalibrated: " in html

    recorded = tmp_path / "my-baselines"
    assert (
        main(
            [
                *ARGV,
                "--model",
                str(model),
                "--update-baselines",
                "--baselines-dir",
                str(recorded),
                "--out",
                str(tmp_path / "r2"),
            ]
        )
        == 0
    )
    files = sorted(p.name for p in (recorded / "quicksort").glob("*.json"))
    assert files == [f"{case}--{key}--inproc--cpu.json" for case in ("C", "Java", "Python")]
    assert "seq/ngram-mod" in json.loads((recorded / "quicksort" / files[0]).read_text())["acceptance"]

    moved = tmp_path / "elsewhere" / "renamed.gguf"  # moving or renaming the file keeps its baselines
    moved.parent.mkdir()
    model.rename(moved)
    assert main([*ARGV, "--model", str(moved), "--baselines-dir", str(recorded), "--out", str(tmp_path / "r3")]) == 0
    baseline = verdicts(tmp_path / "r3", "baseline")
    assert len(baseline) == 6 and all(v["passed"] and "no_baseline" not in v["evidence"] for v in baseline)
    assert all(str(recorded) in v["evidence"]["baseline"] for v in baseline)

    edited = recorded / "quicksort" / files[0]  # and they are compared: an edited token fails that case
    data = json.loads(edited.read_text())
    data["tokens"][5] += 1
    edited.write_text(json.dumps(data))
    assert main([*ARGV, "--model", str(moved), "--baselines-dir", str(recorded), "--out", str(tmp_path / "r4")]) == 1
    failed = [v for v in verdicts(tmp_path / "r4", "baseline") if not v["passed"]]
    assert {v["case"] for v in failed} == {"C"} and "at token 5" in failed[0]["message"]


def test_a_model_of_your_own_runs_the_generic_blocks_only():
    """quicksort's blocks made for one model's gifts (tiny-hybrid-mtp's MTP and heads, the -loop model's n-gram
    types) are not asked of a model no block names; the tiny models' block is."""
    from harness.matrix import cells
    from harness.suites import load_suite

    suite = load_suite("quicksort")
    mine = cells(suite.matrix, {"models": ["/models/mine.gguf"]})
    assert {(c.spec, c.backend) for c in mine} == {("none", "inproc"), ("draft-simple", "inproc")}
    assert {c.mode for c in mine} == {"seq", "par", "no-kv-unified"}
    loop = cells(suite.matrix, {"models": ["tiny-dense-loop"]})
    assert {c.spec for c in loop} == {"none", "ngram-simple", "ngram-map-k", "ngram-map-k4v"}  # its own block


def test_a_cell_the_model_cannot_serve_is_not_run_with_the_reason(tmp_path, capsys):
    """No draft model for draft-simple, no MTP block for draft-mtp: the cell is not served and each of its checks
    is `not run` with what would make it run (exit 0), not a harness error (exit 3)."""
    model = tmp_path / "mine.gguf"
    shutil.copyfile(resolve("tiny-dense-loop").path, model)
    argv = ["run", "--suite", "quicksort", "--backend", "inproc", "--mode", "seq"]
    assert main([*argv, "--model", str(model), "--out", str(tmp_path / "own")]) == 0
    out = "".join(capsys.readouterr())
    assert f"NOT RUN quicksort[seq-draft-simple-{model}-inproc]: draft-simple needs a draft model" in out
    skipped = [c for c in json.loads((tmp_path / "own" / "checks.json").read_text()) if c["spec"] == "draft-simple"]
    assert skipped and all(c["not_run"] and "--draft-model" in c["not_run"] for c in skipped)
    mtp = ["--model", "tiny-hybrid", "--spec", "none,draft-mtp", "--out", str(tmp_path / "mtp")]
    assert main([*argv, *mtp]) == 0
    out = "".join(capsys.readouterr())
    assert "draft-mtp needs a model with an MTP (nextn) block: tiny-hybrid has none" in out
