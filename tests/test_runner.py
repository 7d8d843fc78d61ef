"""`specharness run` end to end on the in-process engine, and its handling of bad input."""

import json

import pytest

from harness.backends.inproc import InprocBackend
from harness.cli import main
from harness.runner import RunPlan, run_plan
from harness.suites import load_suite

RECORD_KEYS = {"suite", "case", "model", "backend", "mode", "spec", "repeat", "tokens", "text",
               "stop_reason", "error", "timings", "spec_stats"}


def test_default_run_writes_every_language_mode_and_model(tmp_path, tiny_models, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())
    assert len(records) == 3 * 3 * 3
    assert {(r["model"], r["mode"], r["case"]) for r in records} == {
        (m, mode, lang) for m in tiny_models for mode in ("seq", "par", "no-kv-unified")
        for lang in ("C", "Java", "Python")
    }
    for r in records:
        assert RECORD_KEYS <= set(r) and r["error"] is None and len(r["tokens"]) == 128
        assert set(r["timings"]) >= {"prompt_ms", "predicted_ms", "predicted_per_second"}
    assert "specharness run" in capsys.readouterr().out


def test_missing_model_path_gives_error_records_while_other_models_run(tmp_path, tiny_models):
    missing = str(tmp_path / "nowhere.gguf")
    plan = RunPlan(suite=load_suite("quicksort"), models=[missing, "tiny-dense"], modes=["seq"],
                   backend=InprocBackend())
    records = run_plan(plan)
    bad = [r for r in records if r["model"] == missing]
    good = [r for r in records if r["model"] == "tiny-dense"]
    assert len(bad) == 3 and all("not found" in r["error"] and r["stop_reason"] == "error" for r in bad)
    assert len(good) == 3 and all(r["error"] is None and r["tokens"] for r in good)


def test_existing_results_are_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("[]\n")
    assert main(["run", "--model", "tiny-dense", "--mode", "seq", "--out", str(out)]) == 2
    assert (out / "results.json").read_text() == "[]\n"
    assert "already exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["run", "--mode", "sequential"], "unknown mode 'sequential'"),
    (["run", "--suite", "nope"], "unknown suite 'nope'"),
    (["run", "--spec", "magic"], "unknown spec type 'magic'"),
])
def test_bad_options_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
