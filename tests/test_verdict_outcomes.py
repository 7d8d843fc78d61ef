"""Every check gets exactly one of passed / failed / not run (with the reason) / harness error, through the one
evaluation (harness.checks.evaluate_cell), and every report shows which: index.html, junit.xml, diff."""

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from report_helpers import parse_html
from rich.console import Console
from test_checks import SEQ, Runs, context, ok, rows, suite, verdict

from harness.bisect.judge import BAD, GOOD, SKIP, judged_checks, verdict_of
from harness.bisect.plan import Plan
from harness.checks import CHECKS, evaluate, evaluate_cell
from harness.checks.base import CheckContext, CheckResult, harness_fault, not_run
from harness.cli import main
from harness.commands.run import print_verdicts, summary_table
from harness.matrix import Cell
from harness.report.diff import compare
from harness.report.files import RunDir, check_records
from harness.result import Result
from harness.verdict.baselines import BaselineStore
from harness.verdict.known_failures import tag

SPEC = SEQ.reference(spec="draft-simple")


# --- the evaluation ---------------------------------------------------------------------------------------------


def test_every_check_named_gets_one_result_and_one_that_does_not_apply_is_not_run_with_its_reason(tmp_path):
    results = evaluate(context({SEQ: [ok([1, 2])]}, SEQ, baselines=BaselineStore(tmp_path)), list(CHECKS))
    assert [r.name for r in results] == list(CHECKS)  # none vanishes
    by_name = {r.name: r for r in results}
    assert by_name["no-crash"].status == "passed"
    assert by_name["lossless"].status == "not run" and by_name["lossless"].not_run == "the cell does not speculate"
    assert "KV scan of the 1 completed requests" in by_name["kv-healthy"].not_run
    assert by_name["grammar-valid"].not_run == "the case has no json_schema"
    for r in results:
        assert r.status in ("passed", "not run"), (r.name, r.status)
        assert r.not_run is None or (r.message == f"not run: {r.not_run}" and not r.is_verdict)


def test_a_harness_fault_in_the_reference_cell_is_a_harness_error_of_the_comparison_not_a_failure():
    s = suite()
    runs = Runs(s, {SEQ: [], SPEC: [ok([1, 2], draft_n=2, draft_n_accepted=1)]})
    runs.cells[SEQ].error = "draft-simple needs --draft-model: m has no registered draft"
    results = [r for _, r in evaluate_cell(runs.cells[SPEC], runs, None, ["no-crash", "lossless"], "repro")]
    crash, lossless = results
    assert crash.status == "passed"
    assert lossless.status == "harness error" and lossless.passed and not lossless.is_verdict
    assert "the reference cell seq-none-m-inproc had a harness error: draft-simple needs" in lossless.harness_error
    assert tag([], "demo", SPEC, results) == []  # nothing to excuse: a harness error is never a failure


def test_a_check_that_raises_is_a_harness_error_with_its_traceback(monkeypatch):
    def broken(ctx):
        raise KeyError("a bug of ours")

    monkeypatch.setitem(CHECKS, "no-crash", broken)
    (result,) = evaluate(context({SEQ: [ok([1])]}, SEQ), ["no-crash"])
    assert result.status == "harness error" and "KeyError: 'a bug of ours'" in result.message
    assert "Traceback" in result.harness_error


def test_a_llama_cpp_crash_is_a_verdict_and_what_it_left_unjudged_is_not_run(tmp_path):
    crashed = Result(stop_reason="crashed", error="llama-server was killed by SIGABRT: GGML_ASSERT(x) failed")
    ctx = context({SPEC: [crashed], SEQ: [ok([1])]}, SPEC, baselines=BaselineStore(tmp_path))
    results = {r.name: r for r in evaluate(ctx, list(CHECKS))}
    assert results["no-crash"].status == "failed" and "GGML_ASSERT(x) failed" in results["no-crash"].message
    assert results["lossless"].not_run == "no request of the case completed (no-crash says why)"
    assert not any(r.harness_error for r in results.values())


# --- reports ----------------------------------------------------------------------------------------------------


def stored_run(path: Path, results: list[CheckResult], cell: Cell = SPEC) -> Path:
    """A run directory whose checks.json holds `results` for case `a` of `cell`, written by the run's writer."""
    path.mkdir()
    (path / "checks.json").write_text(json.dumps(check_records([("demo", "a", cell, r) for r in results])))
    (path / "results.json").write_text("[]")
    return path


def test_not_run_and_harness_errors_show_in_index_html_and_junit_with_their_reasons(tmp_path):
    run = stored_run(
        tmp_path / "run",
        [
            CheckResult("no-crash", True),
            not_run("kv-healthy", "no KV scan of the 3 completed requests"),
            harness_fault("lossless", "the reference cell seq-none-m-inproc had a harness error: start-up timeout"),
        ],
    )
    assert main(["report", str(run)]) == 0
    doc = parse_html((run / "index.html").read_text())
    rows = doc.find(id="not-run-checks").find_all("tr", class_="not-run")
    assert [(r.attrs["data-check"], r.find("td", class_="reason").text) for r in rows] == [
        ("kv-healthy", "no KV scan of the 3 completed requests")
    ]
    assert "1 checks not judged: harness error" in doc.find(id="harness-errors").text
    assert doc.find(id="run-status").text == "HARNESS-ERROR"
    cases = {c.get("name"): c for c in ET.parse(run / "junit.xml").getroot().iter("testcase")}
    skipped = cases["demo[a-seq-draft-simple-m-inproc]::kv-healthy"].find("skipped")
    assert (
        skipped.get("type") == "not-run" and skipped.get("message") == "not run: no KV scan of the 3 completed requests"
    )
    error = cases["demo[a-seq-draft-simple-m-inproc]::lossless"].find("error")
    assert error.get("type") == "harness-error" and "start-up timeout" in error.get("message")
    assert cases["demo[a-seq-draft-simple-m-inproc]::no-crash"].find("skipped") is None


def test_every_check_can_be_not_run_with_a_reason_shown_in_index_html_and_junit(tmp_path):
    """A speculative `par` cell whose case sent nothing (a suite with one round, no schema, no n_probs, no
    `expect:`): every check of the check list is not run, each with its reason, and both reports show each."""
    par = Cell("inproc", "par", "draft-simple", "m")
    runs = Runs(suite(), {par: [], SEQ: [], SEQ.reference(spec="draft-simple"): [], par.reference(spec="none"): []})
    results = [r for _, r in evaluate_cell(runs.cells[par], runs, BaselineStore(tmp_path), list(CHECKS), "repro")]
    assert [r.name for r in results] == list(CHECKS)
    assert all(r.status == "not run" and r.not_run for r in results), [(r.name, r.status) for r in results]
    run = stored_run(tmp_path / "run", results, par)
    assert main(["report", str(run)]) == 0
    shown = {
        r.attrs["data-check"]: r.find("td", class_="reason").text
        for r in parse_html((run / "index.html").read_text()).find(id="not-run-checks").find_all("tr")
        if "data-check" in r.attrs
    }
    assert shown == {r.name: r.not_run for r in results}
    skipped = {
        c.get("name").split("::")[1]: c.find("skipped").get("message")
        for c in ET.parse(run / "junit.xml").getroot().iter("testcase")
    }
    assert skipped == {r.name: f"not run: {r.not_run}" for r in results}


def test_diff_flags_a_check_that_ran_before_and_does_not_run_now(tmp_path, capsys):
    before = stored_run(
        tmp_path / "a",
        [CheckResult("no-crash", True), CheckResult("kv-healthy", True), CheckResult("lossless", True)],
    )
    after = stored_run(
        tmp_path / "b",
        [CheckResult("no-crash", True), not_run("kv-healthy", "the slot file could not be scanned")],
    )
    diff = compare(RunDir.load(before), RunDir.load(after))
    flagged = {(e["check"], e["a"], e["b"], e["message"]) for e in diff.no_longer_judged}
    assert flagged == {
        ("kv-healthy", "passed", "not-run", "the slot file could not be scanned"),
        ("lossless", "passed", "missing", "no lossless record in the case"),
    }
    assert diff.regressed and not diff.other_changes
    page = tmp_path / "diff.html"
    assert main(["diff", str(before), str(after), "--out", str(page)]) == 1
    out = capsys.readouterr().out
    assert "no longer judged" in out and "REGRESSED: 0 newly failing, 2 no longer judged" in out
    rows = parse_html(page.read_text()).find(id="no-longer-judged").find_all("tr")
    assert sorted(r.attrs["data-name"] + " " + r.find_all("td")[1].text for r in rows if "data-name" in r.attrs) == [
        "demo[a-seq-draft-simple-m-inproc] kv-healthy",
        "demo[a-seq-draft-simple-m-inproc] lossless",
    ]


# --- seeded sampled divergences reported only: passed, and shown everywhere a verdict is ----------------------


def sampled_lossless(*outputs: list[int]) -> CheckResult:
    """`lossless` of a seeded sampled case whose rounds gave `outputs`, against no speculation's [1, 2, 3]; the logit
    rows at token 1 differ, so a divergence there is reported only (harness.checks.lossless)."""
    s = suite(rounds=("seq",) * len(outputs), temperature=0.7, seed=42)
    mine = [ok(tokens, logits=rows("a", "B", "c")) for tokens in outputs]
    return verdict(context({SEQ: [ok([1, 2, 3], logits=rows("a", "b", "c"))], SPEC: mine}, SPEC, s), "lossless")


def sampled_verdicts() -> list[tuple]:
    """Case `a`: round 1 of 2 diverged at token 1 (reported only); case `b`: both rounds matched."""
    reported, matching = sampled_lossless([1, 2, 3], [1, 9, 3]), sampled_lossless([1, 2, 3], [1, 2, 3])
    assert reported.passed and reported.evidence["reported_only"] and matching.passed
    return [
        ("demo", "a", SPEC, CheckResult("no-crash", True)),
        ("demo", "a", SPEC, reported),
        ("demo", "b", SPEC, matching),
    ]


HEADLINE = (
    "sampled divergences reported only: 1 of 4 seeded sampled speculative requests (lossless; the logits at the "
    "divergence are not proven bit-identical (llama-server gives no logit digests), and the count of such divergences "
    "is within the measured noise rate: harness/checks/seeded.py)"
)


def test_a_sampled_divergence_reported_only_is_counted_on_the_console_after_the_verdict_lines():
    verdicts = sampled_verdicts()
    console = Console(file=io.StringIO(), soft_wrap=True)  # as `specharness run` prints
    print_verdicts(console, [], verdicts, [], [])
    message = verdicts[1][3].message
    assert "round 1: First divergence at token 1" in message and message.endswith("reported only)")
    assert console.file.getvalue().splitlines() == [
        HEADLINE,
        f"SAMPLED demo[a-seq-draft-simple-m-inproc] [lossless] {message}",
    ]
    runs = Runs(suite(rounds=("seq", "seq")), {SPEC: [ok([1, 2, 3]), ok([1, 9, 3])]})
    table = Console(file=io.StringIO(), width=400)
    table.print(summary_table([runs.cells[SPEC]], verdicts))
    assert "3 passed, 1 with a sampled divergence reported only" in table.file.getvalue()


def test_a_sampled_divergence_reported_only_shows_on_index_html_first_screen_and_in_junit(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checks.json").write_text(json.dumps(check_records(sampled_verdicts())))
    (run / "results.json").write_text("[]")
    assert main(["report", str(run)]) == 0
    doc = parse_html((run / "index.html").read_text())
    assert doc.find(id="run-status").text == "PASSED"  # a verdict it does not change, shown apart
    assert "1 of them with a sampled divergence reported only" in doc.find(id="all-passed").text
    assert doc.find(id="reported-headline").text == HEADLINE
    (row,) = doc.find(id="reported").find_all("tr", class_="reported")
    case, check, round_, triage, message = (td.text for td in row.find_all("td"))
    assert (case, check, round_) == ("demo[a-seq-draft-simple-m-inproc]", "lossless", "1")
    assert "at token 1" in triage and message.endswith("within the measured noise: reported only)")
    counts = doc.find("table", data_axis="check").find("tr", data_key="lossless")
    assert counts.find("td", data_status="reported").text == "1" and counts.find("td", data_status="passed").text == "1"
    cases = {c.get("name"): c for c in ET.parse(run / "junit.xml").getroot().iter("testcase")}
    reported = cases["demo[a-seq-draft-simple-m-inproc]::lossless"]
    assert reported.find("failure") is None and reported.find("skipped") is None
    assert reported.find("properties/property").attrib == {"name": "reported_only", "value": message}
    assert reported.find("system-out").text == f"reported only: {message}"
    assert cases["demo[b-seq-draft-simple-m-inproc]::lossless"].find("system-out") is None


# --- bisect -----------------------------------------------------------------------------------------------------


def test_bisect_always_judges_no_crash_and_requires_of_a_cell_only_the_checks_that_can_show_the_pinned_failure():
    """A check that does not apply to the cell (mode-invariant in seq) is not required; the pinned signature's own
    check giving no verdict, an unservable cell or a harness error make a skip; a crash is bad."""
    plan = Plan(suite="s.yaml", case="C", checks=["lossless"], mode="seq", spec="draft-simple", model="m")
    assert judged_checks(plan) == ["no-crash", "lossless"]
    crash = CheckResult("no-crash", False, "1 of 1 requests failed; C round 0: llama-server was killed by SIGABRT")
    unjudged = not_run("lossless", "no request of the case completed (no-crash says why)")
    bad = verdict_of([crash, unjudged], strict=False)
    assert bad["verdict"] == BAD and "no-crash failed: 1 of 1 requests failed" in bad["reason"]
    served, healthy = CheckResult("no-crash", True), CheckResult("kv-healthy", True)
    seq_reference = not_run("mode-invariant", "the cell is the seq reference itself")
    kv_damage = ["kv-healthy: duplicate cells"]
    for pinned in (None, kv_damage, ["crash: GGML_ASSERT(x) failed"]):
        assert verdict_of([served, seq_reference, healthy], False, pinned)["verdict"] == GOOD, pinned
    no_scan = not_run("kv-healthy", "no KV scan of the 1 completed requests")
    skip = verdict_of([served, seq_reference, no_scan], False, kv_damage)
    assert skip["verdict"] == SKIP and skip["reason"] == (
        "kv-healthy gave no verdict, so this build cannot show the pinned failure (kv-healthy: duplicate cells): "
        "not run: no KV scan of the 1 completed requests"
    )
    assert verdict_of([served, seq_reference, no_scan], False)["verdict"] == GOOD  # nothing pinned: not required
    # the signature's check is not judged (a kv-corrupt divergence of lossless pinned): a check but no-crash must
    # give a verdict
    assert verdict_of([served, CheckResult("lossless", True), seq_reference], False, kv_damage)["verdict"] == GOOD
    only_unjudged = verdict_of(
        [served, not_run("lossless", "the case samples with a random seed"), seq_reference], False, kv_damage
    )
    assert only_unjudged["verdict"] == SKIP and only_unjudged["reason"].startswith("lossless gave no verdict")
    unservable = verdict_of([not_run(n, "tiny-hybrid has no draft model") for n in ("no-crash", "lossless")], False)
    assert unservable["verdict"] == SKIP and unservable["reason"] == (
        "the cell was not served: not run: tiny-hybrid has no draft model"
    )
    fault = harness_fault("no-crash", "the cell could not be served: llama-server was not ready within 60 s")
    skip = verdict_of([fault, harness_fault("lossless", "the cell could not be served")], strict=False)
    assert skip["verdict"] == SKIP and "not ready within 60 s" in skip["reason"]
    assert verdict_of([CheckResult("no-crash", True), CheckResult("lossless", True)], False)["verdict"] == GOOD


# --- specharness run: a harness fault exits 3 ------------------------------------------------------------------


def test_run_exits_3_when_the_draft_model_cannot_be_made_and_records_no_verdict_for_its_cell(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--suite", "quicksort", "--backend", "inproc", "--model", "tiny-dense", "--mode", "seq"]
    argv += ["--spec", "draft-simple", "--draft-model", str(tmp_path / "nowhere.gguf"), "--out", str(out)]
    assert main(argv) == 3
    records = json.loads((out / "checks.json").read_text())
    draft = [r for r in records if r["spec"] == "draft-simple"]
    assert draft and all(r.get("harness_error") and "nowhere.gguf" in r["harness_error"] for r in draft)
    assert not [r for r in records if r["passed"] is False]  # a harness fault is no failed no-crash
    assert "HARNESS ERROR quicksort[C-seq-draft-simple-tiny-dense-inproc] [no-crash]" in capsys.readouterr().err


@pytest.fixture
def fake_server(tmp_path) -> Path:
    """An executable that is not llama-server: it prints a usage line and exits 1 (no abort)."""
    path = tmp_path / "not-llama-server"
    path.write_text("#!/bin/sh\necho 'usage: not-llama-server [options]'\nexit 1\n")
    path.chmod(0o755)
    return path


def test_run_exits_3_on_a_server_bin_that_is_not_llama_server(tmp_path, fake_server, tiny_models):
    out = tmp_path / "run"
    argv = ["run", "--suite", "quicksort", "--backend", "server", "--model", "tiny-dense", "--mode", "seq"]
    assert main([*argv, "--spec", "none", "--server-bin", str(fake_server), "--out", str(out)]) == 3
    records = json.loads((out / "checks.json").read_text())
    assert records and all(r.get("harness_error") for r in records)


STARTUP_ABORT = """\
suite: startup-abort
matrix: {backends: [server, inproc], modes: [par], specs: [none], models: [tiny-dense]}
serve: {n_ctx: 256, n_batch: 1, n_ubatch: 1, parallel: 2}
sampling: {n_predict: 4, temperature: 0}
checks: [no-crash]
cases:
  - {name: hello, prompt: "Hello"}
"""
"""A logical batch smaller than the sequences (`-b 1 -np 2`): llama.cpp accepts the context, then aborts at its
first decode with GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) (docs/upstream-defects.md): llama-server in
its warm-up, before it serves anything, the engine while loading the model."""


def test_a_llama_cpp_abort_at_start_up_is_a_no_crash_failure_with_its_abort_line_on_both_backends(
    tmp_path, tiny_models, capsys
):
    suites = tmp_path / "suites"
    suites.mkdir()
    (suites / "startup-abort.yaml").write_text(STARTUP_ABORT)
    out = tmp_path / "run"
    assert main(["run", "--suites-dir", str(suites), "--out", str(out)]) == 1  # a finding, not a harness fault (3)
    records = json.loads((out / "checks.json").read_text())
    assert {(r["backend"], r["check"], r["passed"]) for r in records} == {
        ("server", "no-crash", False),
        ("inproc", "no-crash", False),
    }
    for r in records:
        assert "harness_error" not in r and "GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed" in r["message"]
    server = next(r for r in records if r["backend"] == "server")
    assert "llama-server was killed by SIGABRT during start-up" in server["message"]
    run = json.loads((out / "run.json").read_text())
    assert all(c["status"] == "done" for c in run["cells"])  # served (and crashed): no cell error
    # no gdb attached for a backtrace on the abort (GGML_NO_BACKTRACE: seconds where gdb is installed)
    logs = [p for p in out.rglob("*.log") if "GGML_ASSERT" in p.read_text(errors="replace")]
    assert len(logs) == 2 and not [p for p in logs if "gdb" in p.read_text(errors="replace")], logs


class _AbortingRestart:
    """A backend whose session serves the first batch, then (llama-server restarted after a crash) aborts in its
    start-up: how the executor must read a LlamaAbort raised mid-run."""

    name = "inproc"

    def environment(self) -> dict:
        return {"device": "cpu"}

    def open(self, config):
        return self

    def run(self, requests):
        from harness.errors import LlamaAbort

        if getattr(self, "served", False):
            raise LlamaAbort("llama-server was killed by SIGABRT during start-up: x.cpp:1: GGML_ASSERT(y) failed")
        self.served = True
        return [Result(tokens=[1], text="a", stop_reason="limit") for _ in requests]

    def close(self) -> None:
        pass


def test_a_llama_cpp_abort_while_restarting_mid_run_makes_the_unserved_requests_crashes_not_a_harness_fault(
    tiny_models,
):
    from harness.execute import ExecOptions, Executor
    from harness.suites import load_suite

    backend = _AbortingRestart()
    executor = Executor(ExecOptions(backends={"inproc": lambda: backend}))
    cell = Cell("inproc", "seq", "none", "tiny-dense")
    run = executor.run(load_suite("quicksort"), cell)
    assert run.fault is None and "GGML_ASSERT(y) failed" in run.crash
    stops = [o.result.stop_reason for o in run.outcomes]
    assert stops[0] == "limit" and set(stops[1:]) == {"crashed"} and len(stops) == 9  # 3 cases x 3 rounds
    (crash,) = evaluate(CheckContext(run, "Java", executor, None, str, "repro"), ["no-crash"])
    assert crash.status == "failed" and "GGML_ASSERT(y) failed" in crash.message
