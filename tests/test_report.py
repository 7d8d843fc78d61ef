"""Reports of real runs on the tiny models (in-process engine): index.html, junit.xml, re-rendering,
the re-run command, diff, history and a real headless browser."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from report_helpers import REPO, browser_or_skip, inside, make_checkout, parse_html

from harness.cli import main
from harness.report.files import item_name, status
from harness.report.html import anchor

pytestmark = pytest.mark.stress

FAILING = "quicksort[Java-seq-none-tiny-dense-inproc]"
NARROW = ["--suite", "quicksort", "--model", "tiny-dense", "--mode", "seq", "--spec", "none"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models):
    """A clean run r0, then r1 with the Java baseline hand-edited at token 17: exactly one failing case."""
    root = make_checkout(tmp_path_factory.mktemp("checkout"))
    with inside(root):
        assert main(["run", *NARROW, "--out", "r0"]) == 0
        edited = root / "fixtures/baselines/quicksort/Java--tiny-dense--inproc--cpu.json"
        data = json.loads(edited.read_text())
        data["tokens"][17] += 1
        edited.write_text(json.dumps(data))
        assert main(["run", *NARROW, "--out", "r1"]) == 1
    return root


def load(path: Path):
    return json.loads(path.read_text())


def test_first_screen_of_the_report_is_the_failure_and_counts_match_checks_json(runs):
    doc = parse_html((runs / "r1/index.html").read_text())
    sections = [n.attrs["id"] for n in doc.find_all("section")]
    assert sections[0] == "failures"
    assert doc.find(id="run-status").text == "FAILED"
    rows = doc.find(id="failing").find_all("tr", data_status="failed")
    assert [r.attrs["data-name"] for r in rows] == [FAILING]
    assert "at token 17" in rows[0].text and "baseline" in rows[0].text
    checks = load(runs / "r1/checks.json")
    for table in doc.find_all("table", class_="counts"):
        axis = table.attrs["data-axis"]
        expected = Counter((v[axis], status(v)) for v in checks)
        for row in table.find_all("tr"):
            if "data-key" not in row.attrs:
                continue
            for cell in row.find_all("td"):
                if cell.attrs.get("data-status") in ("failed", "known", "near-tie", "passed"):
                    assert int(cell.text) == expected[(row.attrs["data-key"], cell.attrs["data-status"])], (
                        axis,
                        row.attrs,
                    )
    banner = doc.find("section", id="failures").find("div", class_="banner").text
    verdicts = [v for v in checks if status(v) not in ("not-run", "harness-error")]
    assert "1 failed" in banner and f"of {len(verdicts)} check verdicts" in banner
    assert f"{len(checks) - len(verdicts)} checks not run" in banner  # recorded, shown, never counted as a pass


def test_token_diff_highlights_the_first_divergent_token(runs):
    doc = parse_html((runs / "r1/index.html").read_text())
    case = doc.find("article", id=anchor(FAILING))
    ref, other = case.find_all("mark", class_="first-divergence")
    baseline = load(runs / "fixtures/baselines/quicksort/Java--tiny-dense--inproc--cpu.json")["tokens"]
    produced = next(r["tokens"] for r in load(runs / "r1/results.json") if item_name(r) == FAILING and r["repeat"] == 0)
    assert ref.attrs["data-index"] == other.attrs["data-index"] == "17"
    assert int(ref.attrs["data-token"]) == baseline[17] and int(other.attrs["data-token"]) == produced[17]
    assert baseline[:17] == produced[:17] and baseline[17] != produced[17]
    vocab = load(runs / "r1/vocab.json")["tiny-dense"]
    assert other.text == vocab[str(produced[17])].replace("\n", "↵\n")
    assert len(doc.find_all("article")) == 1  # passing cases are counted, not rendered


def test_rerun_command_from_the_report_reproduces_exactly_that_case(runs):
    doc = parse_html((runs / "r1/index.html").read_text())
    command = doc.find("pre", class_="rerun-command").text
    argv = shlex.split(command)
    assert argv[:2] == ["pytest", f"suites/quicksort.yaml::{FAILING}"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", *argv, "-p", "no:cacheprovider"],
        cwd=runs,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout[-2000:]
    assert f"FAILED suites/quicksort.yaml::{FAILING}" in done.stdout
    assert "1 failed" in done.stdout and "passed" not in done.stdout.splitlines()[-1]
    assert "First divergence at token 17" in done.stdout


def test_junit_xml_has_one_testcase_per_verdict_named_like_the_pytest_items(runs):
    import xml.etree.ElementTree as ET

    root = ET.parse(runs / "r1/junit.xml").getroot()
    cases = root.findall(".//testcase")
    checks = load(runs / "r1/checks.json")
    assert len(cases) == len(checks)
    assert {c.get("name") for c in cases} == {f"{item_name(v)}::{v['check']}" for v in checks}
    failed = [c for c in cases if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == [f"{FAILING}::baseline"]
    assert failed[0].get("classname") == "suites.quicksort.yaml"
    assert "token 17" in failed[0].find("failure").get("message")
    assert root.find("testsuite").get("failures") == "1"


def test_report_rerenders_identically_from_the_stored_files(runs, capsys):
    before = (runs / "r1/index.html").read_bytes()
    (runs / "r1/index.html").unlink()
    assert main(["report", str(runs / "r1")]) == 0
    assert (runs / "r1/index.html").read_bytes() == before
    assert f"report: {runs / 'r1/index.html'}" in capsys.readouterr().out


def test_run_names_the_report_and_records_how_it_ran(runs):
    meta = load(runs / "r1/run.json")
    assert meta["command"] == "specharness run " + shlex.join([*NARROW, "--out", "r1"])
    assert meta["backends"]["inproc"]["llama_cpp_python"] and meta["backends"]["inproc"]["system_info"]
    assert len(meta["models"]["tiny-dense"]["sha256"]) == 64
    assert [c["status"] for c in meta["cells"]] == ["done"] and meta["interrupted"] is False


def test_report_in_headless_chromium_shows_the_failure_on_the_first_screen(runs):
    browser_or_skip()
    from harness.report.browser import open_report

    index = runs / "r1/index.html"
    with open_report(index, width=1280, height=800) as loaded:
        page = loaded.page
        row = page.locator(f'#failing tr[data-name="{FAILING}"]')
        assert row.is_visible()
        box = row.bounding_box()
        assert box["y"] + box["height"] <= 800, "the failing case is below the first screen"
        page.screenshot(path=str(runs / "r1/screenshot.png"))
        row.locator("a").click()
        mark = page.locator('article[data-status="failed"] mark.first-divergence').first
        assert mark.is_visible() and mark.get_attribute("data-index") == "17"
        assert loaded.console_errors == []
    png = (runs / "r1/screenshot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    for other in ("r0/index.html",):
        with open_report(runs / other) as loaded:
            assert loaded.console_errors == [] and loaded.page.locator("#all-passed").is_visible()


def test_diff_lists_exactly_the_changed_case_and_exits_1(runs, capsys):
    capsys.readouterr()
    assert main(["diff", str(runs / "r0"), str(runs / "r1"), "--speed-threshold", "1"]) == 1
    out = capsys.readouterr().out
    listed = {name for name in ("C", "Java", "Python") if f"quicksort[{name}-seq-none-tiny-dense-inproc]" in out}
    assert listed == {"Java"}
    assert "newly failing (1)" in out and "REGRESSED" in out
    doc = parse_html((runs / "r1/diff.html").read_text())
    assert [r.attrs["data-name"] for r in doc.find(id="newly-failing").find_all("tr") if "data-name" in r.attrs] == [
        FAILING
    ]
    assert not doc.find_all(id="changed") and doc.find(id="diff-status").text == "REGRESSED"
    assert (
        main(["diff", str(runs / "r1"), str(runs / "r0"), "--speed-threshold", "1", "--out", str(runs / "back.html")])
        == 0
    )
    assert "newly passing (1)" in capsys.readouterr().out


def test_diff_shows_a_changed_output_with_its_triage_and_never_judges_a_slower_machine(runs, tmp_path, capsys):
    slow = tmp_path / "slow"
    shutil.copytree(runs / "r0", slow)
    rows = load(slow / "results.json")
    for r in rows:  # a busier machine: every request at half the speed (test_speed_verdicts judges speed-ups)
        r["timings"]["predicted_ms"] *= 2
    changed = next(r for r in rows if r["case"] == "Python" and r["repeat"] == 0)
    changed["tokens"][40] += 1
    (slow / "results.json").write_text(json.dumps(rows))
    assert main(["diff", str(runs / "r0"), str(slow)]) == 0
    out = capsys.readouterr().out
    assert "changed output (1)" in out and "0 speculative cells with less acceptance or speed-up" in out
    assert "quicksort[Python-seq-none-tiny-dense-inproc]" in out and "token 40" in out
    doc = parse_html((slow / "diff.html").read_text())
    article = doc.find("article", id=anchor("changed-quicksort[Python-seq-none-tiny-dense-inproc]"))
    assert article.find("mark", class_="first-divergence").attrs["data-index"] == "40"
    assert article.find("svg", class_="chart")  # r0's logits give the margins


def test_history_marks_new_failures_fixed_flaky_and_stable(runs, tmp_path, capsys):
    flaky = tmp_path / "flaky"
    shutil.copytree(runs / "r0", flaky)
    rows = load(flaky / "results.json")
    next(r for r in rows if r["case"] == "C")["tokens"][5] += 1
    (flaky / "results.json").write_text(json.dumps(rows))
    assert (
        main(["report", "--history", str(runs / "r0"), str(flaky), str(runs / "r1"), "--out", str(tmp_path / "h.html")])
        == 1
    )
    doc = parse_html((tmp_path / "h.html").read_text())
    category = {
        r.attrs["data-name"]: r.attrs["data-status"]
        for r in doc.find(id="all-items").find_all("tr")
        if "data-name" in r.attrs
    }
    assert category == {
        FAILING: "new failure",
        "quicksort[C-seq-none-tiny-dense-inproc]": "flaky",
        "quicksort[Python-seq-none-tiny-dense-inproc]": "stable",
    }
    assert main(["report", "--history", str(runs / "r1"), str(runs / "r0"), "--out", str(tmp_path / "h2.html")]) == 0
    assert "1 fixed" in capsys.readouterr().out


def test_report_of_records_without_the_new_fields_says_not_recorded(tmp_path):
    run = tmp_path / "old"
    run.mkdir()
    verdict = {
        "suite": "s",
        "case": "c",
        "model": "m",
        "backend": "inproc",
        "mode": "par",
        "spec": "none",
        "check": "mode-invariant",
        "passed": False,
        "message": "differs",
        "evidence": {"first_divergence": {"round": 0, "index": 3, "kind": "hard"}},
    }
    (run / "checks.json").write_text(json.dumps([verdict]))
    (run / "results.json").write_text("[]")
    assert main(["report", str(run)]) == 0
    doc = parse_html((run / "index.html").read_text())
    article = doc.find("article")
    assert "token streams: not recorded" in article.text and "reference margins: not recorded" in article.text
    assert "Margin there: not recorded" in article.text
    assert doc.find(id="command").text == "not recorded"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "nowhere"], "nowhere: no such run directory"),
        (["report"], "report takes one of"),
        (["report", "--merge", "a", "b"], "--merge needs --out"),
        (["diff", "nowhere", "also-nowhere"], "nowhere: no such run directory"),
    ],
)
def test_report_commands_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_lossless_failure_shows_the_margin_chart_and_a_specharness_rerun(tmp_path, tiny_models):
    out = tmp_path / "fault"
    argv = [
        "run",
        "--suite",
        "quicksort",
        "--model",
        "tiny-hybrid",
        "--mode",
        "seq",
        "--spec",
        "none,scripted-wrong-at-2",
        "--fault",
        "skip-seq-rm-after-restore",
        "--out",
        str(out),
    ]
    assert main(argv) == 1
    lossless = [v for v in load(out / "checks.json") if v["check"] == "lossless" and not v["passed"]]
    assert lossless
    first = lossless[0]["evidence"]["first_divergence"]
    assert first["reference"] == "non-speculative output" and len(first["reference_margins"]) == len(
        first["reference_tokens"]
    )
    doc = parse_html((out / "index.html").read_text())
    block = next(
        d
        for d in doc.find_all("div", class_="divergence")
        if d.attrs["data-check"] == "lossless" and item_name(lossless[0]) in d.parent.find("h3").text
    )
    assert block.find("mark", class_="first-divergence").attrs["data-index"] == str(first["index"])
    chart = block.find("svg", class_="chart")
    assert chart.find("line", class_="divergence") and "divergence @ " + str(first["index"]) in chart.text
    command = block.parent.find("pre", class_="rerun-command").text
    assert command.startswith(
        "specharness run --suite quicksort --backend inproc --mode seq --spec scripted-wrong-at-2 "
        "--model tiny-hybrid --fault skip-seq-rm-after-restore"
    )


def test_known_defects_near_ties_and_unserved_cells_in_html_and_junit(tmp_path):
    import xml.etree.ElementTree as ET

    run = tmp_path / "synthetic"
    run.mkdir()
    base = {"suite": "kv-fill", "model": "tiny-dense", "backend": "server", "spec": "draft-simple", "message": ""}
    checks = [
        {
            **base,
            "case": "chat1.turn1",
            "mode": "par",
            "check": "no-crash",
            "passed": False,
            "message": "HTTP 500: speculative batch index 3 is not inside the current sub-batch [0, 2)",
            "evidence": {"known_failure": "server-spec-batch-split-on-kv-full"},
        },
        {
            **base,
            "case": "chat1.turn1",
            "mode": "no-kv-unified",
            "check": "mode-invariant",
            "passed": True,
            "evidence": {"near_ties": 2},
        },
        {
            **base,
            "case": "chat1.turn1",
            "mode": "seq",
            "check": "no-crash",
            "passed": False,
            "message": "the cell could not be served: llama-server could not load model tiny-dense",
            "evidence": {},
        },
    ]
    meta = {
        "cells": [
            {
                "suite": "kv-fill",
                "id": "seq-draft-simple-tiny-dense-server",
                "status": "error",
                "error": "llama-server could not load model tiny-dense: unknown architecture",
            }
        ],
        "known_failures": [
            {
                "id": "server-spec-batch-split-on-kv-full",
                "reason": "the batch split",
                "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
                "upstream": "https://github.com/ggml-org/llama.cpp/issues/24840",
            }
        ],
    }
    for name, data in (("checks.json", checks), ("results.json", []), ("run.json", meta)):
        (run / name).write_text(json.dumps(data))
    assert main(["report", str(run)]) == 0
    doc = parse_html((run / "index.html").read_text())
    known = doc.find("section", id="known")
    assert known.find("a").attrs["href"] == "https://github.com/ggml-org/llama.cpp/issues/24840"
    assert "kv-fill[chat1.turn1-par-draft-simple-tiny-dense-server]" in known.text
    assert "unknown architecture" in doc.find(id="cell-errors").text
    per_check = {
        r.attrs["data-key"]: {c.attrs["data-status"]: c.text for c in r.find_all("td") if "data-status" in c.attrs}
        for r in doc.find("table", data_axis="check").find_all("tr")
        if "data-key" in r.attrs
    }
    assert per_check["no-crash"]["known"] == "1" and per_check["no-crash"]["failed"] == "1"
    assert per_check["mode-invariant"]["near-tie"] == "1"
    cases = {c.get("name"): c for c in ET.parse(run / "junit.xml").getroot().iter("testcase")}
    skipped = cases["kv-fill[chat1.turn1-par-draft-simple-tiny-dense-server]::no-crash"].find("skipped")
    assert skipped.get("type") == "known-failure" and "issues/24840" in skipped.get("message")
    assert cases["kv-fill[chat1.turn1-seq-draft-simple-tiny-dense-server]::no-crash"].find("error") is not None
    near = cases["kv-fill[chat1.turn1-no-kv-unified-draft-simple-tiny-dense-server]::mode-invariant"]
    assert near.find("failure") is None and near.find("properties/property").get("value") == "2"


def test_diff_triages_a_changed_output_with_the_floor_and_sampling_of_its_cell(tmp_path):
    """`diff` classes a changed output as the run's checks do: the calibrated floor of its model, backend and mode
    (not the uncalibrated default) and greedy only where its case picked the argmax (a sampled flip is no
    near-tie on margins)."""
    from harness.report.diff import triage_context
    from harness.report.files import RunDir
    from harness.verdict import noise

    run = RunDir(tmp_path, [], [], {"backends": {"server": {"device": "cpu"}}, "suites": {}})
    greedy = {"suite": "quicksort", "case": "C", "model": "tiny-dense", "backend": "server", "mode": "seq"}
    floor, picks_argmax = triage_context(run, greedy)
    assert picks_argmax and floor.calibrated
    assert floor.near_tie == noise.load("tiny-dense", "server", "cpu").for_mode("seq").near_tie
    assert floor.near_tie != noise.DEFAULT.near_tie
    sampled = {**greedy, "suite": "sampling", "case": "quicksort_penalties"}
    assert triage_context(run, sampled)[1] is False
    gone = {**greedy, "suite": "a-suite-no-longer-here"}
    assert triage_context(run, gone)[1] is False
