"""`specharness run` end to end on the in-process engine: suites, checks, baselines and exit codes."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from harness.backends.choose import backend_factories
from harness.cli import main
from harness.execute import ExecOptions, Executor
from harness.matrix import Cell
from harness.suites import load_suite

REPO = Path(__file__).resolve().parents[1]
RECORD_KEYS = {
    "suite",
    "case",
    "model",
    "backend",
    "mode",
    "spec",
    "repeat",
    "tokens",
    "text",
    "stop_reason",
    "error",
    "timings",
    "spec_stats",
}


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A scratch copy of the suites and baselines, as the working directory (the real ones stay untouched)."""
    shutil.copytree(REPO / "suites", tmp_path / "suites")
    shutil.copytree(REPO / "fixtures", tmp_path / "fixtures")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.long
def test_run_writes_every_language_and_spec_of_a_tiny_model(tmp_path, tiny_models, capsys):
    """The default job through the command line, one model and mode (quicksort's suite items serve every cell of it
    in this session; the modes through `main` cost 31 s more of a warm pytest, 2026-12-07)."""
    out = tmp_path / "run"
    assert main(["run", "--model", "tiny-dense", "--mode", "seq", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())
    cells = {(r["model"], r["mode"], r["spec"]) for r in records}
    assert cells == {("tiny-dense", "seq", spec) for spec in ("none", "draft-simple")}
    assert {r["case"] for r in records} == {"C", "Java", "Python"}
    assert len(records) == len(cells) * 3 * 3  # three rounds: seq, seq, par
    for r in records:
        assert RECORD_KEYS <= set(r) and r["error"] is None and len(r["tokens"]) == 128
        assert set(r["timings"]) >= {"prompt_ms", "predicted_ms", "predicted_per_second"}
    assert len(pd.read_parquet(out / "results.parquet")) == len(records)
    checks = json.loads((out / "checks.json").read_text())
    assert checks and all(c["passed"] for c in checks)
    assert {"lossless", "baseline", "repeat-identical", "spec-ran"} <= {c["check"] for c in checks}
    assert "specharness run" in capsys.readouterr().out


def test_hand_edited_baseline_fails_exactly_that_case_and_update_restores_it(checkout, capsys):
    edited = checkout / "fixtures/baselines/quicksort/Java--tiny-dense--inproc--cpu.json"
    data = json.loads(edited.read_text())
    data["tokens"][17] += 1
    edited.write_text(json.dumps(data))
    before = {p: p.read_bytes() for p in (checkout / "fixtures/baselines").rglob("*.json") if p != edited}
    argv = ["run", "--suite", "quicksort", "--model", "tiny-dense", "--mode", "seq", "--spec", "none"]
    assert main(argv + ["--out", "r1"]) == 1
    failures = [c for c in json.loads((checkout / "r1/checks.json").read_text()) if not c["passed"]]
    assert {(c["case"], c["check"]) for c in failures} == {("Java", "baseline")}
    assert "at token 17" in failures[0]["message"]
    assert main(argv + ["--update-baselines", "--out", "r2"]) == 0
    assert json.loads(edited.read_text())["tokens"][17] == data["tokens"][17] - 1
    assert all(p.read_bytes() == content for p, content in before.items())


def test_a_run_that_updates_the_baselines_judges_nothing_against_what_it_wrote(checkout):
    """Issue 28: `--update-baselines` compared the cells with the rows it had just written and reported "passed".
    In the run that writes them, `baseline`, `acceptance` and `work` are not run, with that reason, for every case;
    the next run compares with them."""
    edited = checkout / "fixtures/baselines/quicksort/Java--tiny-dense--inproc--cpu.json"
    data = json.loads(edited.read_text())
    data["tokens"][17] += 1  # a difference the update run must not judge either way
    edited.write_text(json.dumps(data))
    argv = ["run", "--suite", "quicksort", "--model", "tiny-dense", "--mode", "seq", "--spec", "draft-simple"]
    assert main(argv + ["--update-baselines", "--out", "r1"]) == 0
    records = json.loads((checkout / "r1/checks.json").read_text())
    judged = {(c["case"], c["check"]): c for c in records if c["check"] in ("baseline", "acceptance", "work")}
    assert set(judged) == {
        (case, check) for case in ("C", "Java", "Python") for check in ("baseline", "acceptance", "work")
    }
    for c in judged.values():
        assert "baselines updated in this run" in c.get("not_run", ""), c
    assert main(argv + ["--out", "r2"]) == 0
    again = [c for c in json.loads((checkout / "r2/checks.json").read_text()) if c["check"] in ("baseline", "work")]
    assert again and not [c for c in again if c.get("not_run")], again  # compared now


def test_missing_baseline_says_how_to_create_it(checkout):
    (checkout / "fixtures/baselines/quicksort/C--tiny-dense--inproc--cpu.json").unlink()
    assert main(["run", "--model", "tiny-dense", "--mode", "seq", "--spec", "none", "--out", "r"]) == 1
    failure = next(c for c in json.loads((checkout / "r/checks.json").read_text()) if not c["passed"])
    assert "create it with: specharness run --suite quicksort" in failure["message"]
    assert failure["message"].split("\n")[0].endswith("--model tiny-dense --update-baselines")


def test_corrupt_baseline_is_a_harness_error_and_is_not_replaced(checkout):
    """A baseline file the harness cannot read is its own fault, not the build's: exit 3, no failed verdict."""
    corrupt = checkout / "fixtures/baselines/quicksort/C--tiny-dense--inproc--cpu.json"
    corrupt.write_text("{not json")
    argv = ["run", "--model", "tiny-dense", "--mode", "seq", "--spec", "none", "--update-baselines", "--out", "r"]
    assert main(argv) == 3
    records = json.loads((checkout / "r/checks.json").read_text())
    assert not [c for c in records if not c["passed"]]  # no verdict on the software under test
    errors = [c for c in records if c.get("harness_error")]
    assert {(c["case"], c["check"]) for c in errors} == {("C", "baseline"), ("C", "work")}
    for c in errors:
        assert c["harness_error"].startswith(
            "corrupt baseline file fixtures/baselines/quicksort/C--tiny-dense--inproc--cpu.json"
        )
        assert c["harness_error"].endswith("(fix or delete it; it is never replaced silently)")
    assert corrupt.read_text() == "{not json"


def test_missing_model_gives_error_results_while_other_cells_run(tmp_path, tiny_models):
    missing = str(tmp_path / "nowhere.gguf")
    suite = load_suite("quicksort")
    executor = Executor(ExecOptions(backends=backend_factories()))
    bad = executor.run(suite, Cell("inproc", "seq", "none", missing))
    good = executor.run(suite, Cell("inproc", "seq", "none", "tiny-dense"))
    assert bad.error and "not found" in bad.error
    assert len(bad.outcomes) == 9 and all(o.result.stop_reason == "error" for o in bad.outcomes)
    assert len(good.outcomes) == 9 and all(o.result.ok and o.result.tokens for o in good.outcomes)


def test_missing_model_on_the_command_line_is_bad_input(tmp_path, capsys):
    missing = str(tmp_path / "nowhere.gguf")
    assert main(["run", "--model", missing, "--model", "tiny-dense", "--out", str(tmp_path / "run")]) == 2
    assert "model file not found" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_existing_results_are_never_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text("[]\n")
    assert main(["run", "--model", "tiny-dense", "--mode", "seq", "--out", str(out)]) == 2
    assert (out / "results.json").read_text() == "[]\n"
    assert "already exists" in capsys.readouterr().err


def test_out_that_is_a_file_is_refused_before_running(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("keep me")
    assert main(["run", "--model", "tiny-dense", "--mode", "seq", "--out", str(target)]) == 2
    assert "cannot write the run directory" in capsys.readouterr().err and target.read_text() == "keep me"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--mode", "sequential"], "unknown mode 'sequential'"),
        (["run", "--suite", "nope"], "unknown suite 'nope'"),
        (["run", "--spec", "magic"], "unknown spec config 'magic'"),
        (["run", "--backend", "gpu"], "unknown backend 'gpu'"),
        (["run", "--cell", "seq-magic-tiny-dense-server"], "--cell seq-magic-tiny-dense-server: no such cell"),
        (["run", "--cell", "par-none-tiny-dense-server", "--mode", "seq"], "no such cell in quicksort"),
        (["run", "--suite", "forced-rejection", "--backend", "inproc", "--spec", "synth-reject"], "nothing to run"),
        (["run", "--suite", "grammar-json", "--backend", "server", "--spec", "scripted-reject"], "nothing to run"),
    ],
)
def test_bad_options_are_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_cell_runs_only_the_cells_it_names_and_judges_them_against_their_references(tmp_path, tiny_models):
    out = tmp_path / "run"
    cell = "par-draft-simple-tiny-dense-inproc"
    assert main(["run", "--cell", cell, "--out", str(out)]) == 0
    checks = json.loads((out / "checks.json").read_text())
    judged = {"-".join(c[k] for k in ("mode", "spec", "model", "backend")) for c in checks}
    assert judged == {cell}
    assert {"lossless", "mode-invariant"} <= {c["check"] for c in checks if c["passed"]}  # against none and seq


@pytest.mark.parametrize("option", ["--repeat", "--parallel"])
def test_counts_must_be_positive(option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", option, "0"])
    assert exit_.value.code == 2 and "expected an integer >= 1" in capsys.readouterr().err


def test_expected_cells_of_one_mode_run_side_by_side_taking_turns_round_by_round(tiny_models):
    """The speed-up of a speculative cell compares requests made moments apart: with `expect`, the cell
    without speculation and the speculative ones of the same suite, backend, model and mode keep their
    sessions open together and serve round r in turn (A B, then B A); a scripted config runs alone."""
    calls = []
    real = backend_factories()["inproc"]

    class Recording:
        name = "inproc"

        def __init__(self):
            self.backend = real()

        def environment(self):
            return self.backend.environment()

        def open(self, config):
            session, spec = self.backend.open(config), config.spec.get("spec-type", "none")
            calls.append(("open", spec))

            class Session:
                def run(self, requests):
                    calls.append(("run", spec))
                    return session.run(requests)

                def close(self):
                    calls.append(("close", spec))
                    session.close()

            return Session()

    suite = load_suite("quicksort")
    executor = Executor(ExecOptions(backends={"inproc": Recording}, logit_top_k=0, kv_scan="off"))
    cells = [Cell("inproc", "seq", spec, "tiny-dense") for spec in ("draft-simple", "scripted-accept")]
    executor.expect([(suite, c) for c in cells])
    run = executor.run(suite, cells[0])
    assert run.error is None and len(run.outcomes) == 9
    turns = [spec for what, spec in calls if what == "run"]
    assert calls[:2] == [("open", "none"), ("open", "draft-simple")]
    # rounds seq, seq, par: three requests one at a time, again, then all three at once
    assert turns == ["none"] * 3 + ["draft-simple"] * 6 + ["none"] * 3 + ["none", "draft-simple"]
    assert executor.run(suite, cells[0].reference(spec="none")) is executor.runs()[0]  # ran with it, memoized
    calls.clear()
    executor.run(suite, cells[1])  # the script is the reference's output: it runs alone, afterwards
    assert [c for c in calls if c[0] == "open"] == [("open", "none")]
