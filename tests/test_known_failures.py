"""The known-failures file: entries are validated, and they explain exactly the failures they describe."""

import shutil
from pathlib import Path

import pytest

from harness.checks.base import CheckResult
from harness.errors import HarnessError
from harness.known_failures import load, tag
from harness.matrix import Cell

REPO = Path(__file__).resolve().parents[1]
ENTRY = """\
- id: demo-defect
  suite: kv-fill
  backend: server
  modes: [par]
  check: no-crash
  evidence: 'batch index \\d+ is not inside'
  llama_cpp_commit: 0c1e570
  upstream: ggml-org/llama.cpp#24840
  reason: a demo
"""


@pytest.fixture
def suites(tmp_path):
    shutil.copy(REPO / "suites" / "kv-fill.yaml", tmp_path / "kv-fill.yaml")
    return tmp_path


def test_the_shipped_file_loads():
    assert [e.id for e in load(REPO / "suites" / "known-failures.yaml")]


def test_an_entry_explains_only_its_cells_check_and_evidence(suites):
    (suites / "known-failures.yaml").write_text(ENTRY)
    [entry] = load(suites / "known-failures.yaml")
    par, seq = Cell("server", "par", "draft-simple", "tiny-dense"), Cell("server", "seq", "draft-simple", "tiny-dense")
    crash = CheckResult("no-crash", False, "HTTP 500: speculative batch index 12 is not inside the current sub-batch")
    other = CheckResult("no-crash", False, "killed by SIGABRT")
    assert tag([entry], "kv-fill", par, [crash, other]) == [other]
    assert crash.evidence["known_failure"] == "demo-defect"
    fresh = CheckResult("no-crash", False, crash.message)
    assert tag([entry], "kv-fill", seq, [fresh]) == [fresh]


def test_an_entry_must_explain_every_failing_request_of_a_verdict(suites):
    (suites / "known-failures.yaml").write_text(ENTRY)
    [entry] = load(suites / "known-failures.yaml")
    par = Cell("server", "par", "draft-simple", "tiny-dense")
    http500 = "round 0: HTTP 500: speculative batch index 12 is not inside the current sub-batch [0, 8)"
    explained = CheckResult("no-crash", False, "2 of 3 requests failed", failures=[http500, http500])
    assert tag([entry], "kv-fill", par, [explained]) == []
    assert explained.evidence["known_failure"] == "demo-defect"
    mixed = CheckResult(
        "no-crash", False, "2 of 3 requests failed", failures=[http500, "round 1: llama-server was killed by SIGSEGV"]
    )
    assert tag([entry], "kv-fill", par, [mixed]) == [mixed]
    assert "known_failure" not in mixed.evidence
    assert "demo-defect explains 1 of 2 failing requests; the other 1 stay failures" in mixed.message


@pytest.mark.parametrize(
    "change, message",
    [
        (("evidence: 'batch index \\d+ is not inside'", "evidence: '(index)?'"), "matches an empty string"),
        (("  upstream: ggml-org/llama.cpp#24840\n", ""), "'upstream' is a required property"),
        (("suite: kv-fill", "suite: kv-fil"), "unknown suite 'kv-fil'"),
        (("check: no-crash", "check: no-crash2"), "unknown check 'no-crash2'"),
        (("modes: [par]", "modes: [parallel]"), "unknown mode 'parallel'"),
        (("backend: server", "backend: cuda"), "unknown backend 'cuda'"),
        (("  reason: a demo\n", ""), "'reason' is a required property"),
    ],
)
def test_bad_entries_are_one_line_errors_naming_file_and_entry(suites, change, message):
    path = suites / "known-failures.yaml"
    path.write_text(ENTRY.replace(*change))
    with pytest.raises(HarnessError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: entry 0: ") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_an_entry_naming_exercised_explains_completions_its_defect_took_and_nothing_else(suites):
    from harness.checks import exercised
    from harness.checks.base import CheckContext
    from harness.execute import CellRun, Outcome
    from harness.result import Result
    from harness.suites import load_suite

    (suites / "known-failures.yaml").write_text(ENTRY.replace("check: no-crash", "check: [no-crash, exercised]"))
    [entry] = load(suites / "known-failures.yaml")
    assert entry.check == ("no-crash", "exercised")
    suite = load_suite(str(suites / "kv-fill.yaml"))
    par = Cell("server", "par", "draft-simple", "tiny-dense")
    http500 = "HTTP 500: got exception: speculative batch index 11 is not inside the current sub-batch [0, 4)"

    def verdict(errors: list[str | None]):
        run = CellRun(
            suite,
            par,
            [Outcome(f"c{i}", 0, Result(stop_reason="error" if e else "limit", error=e)) for i, e in enumerate(errors)],
        )
        return exercised(CheckContext(run, suite.first_key, None, None, str, ""))

    all_killed = verdict([http500] * 12)  # the defect took every request: no completion was possible
    assert not all_killed.passed and len(all_killed.failures) == 12
    assert tag([entry], "kv-fill", par, [all_killed]) == [] and all_killed.evidence["known_failure"] == "demo-defect"
    other = verdict([http500] * 10 + ["context_full", "llama-server was killed by SIGSEGV"])
    assert tag([entry], "kv-fill", par, [other]) == [other]  # two missing completions are something else
    assert verdict([None] * 4 + [http500] * 8).passed  # a third completed: exercised as expected


def test_an_entry_for_a_cpu_feature_applies_only_on_a_cpu_that_has_it(suites):
    from harness.backends.base import cpu_flags

    have = sorted(cpu_flags())[0] if cpu_flags() else None
    (suites / "known-failures.yaml").write_text(ENTRY + "  cpu_flags: [no-cpu-has-this-flag]\n")
    [absent] = load(suites / "known-failures.yaml")
    par = Cell("server", "par", "draft-simple", "tiny-dense")
    crash = CheckResult("no-crash", False, "HTTP 500: speculative batch index 12 is not inside the current sub-batch")
    assert absent.missing_cpu_flags == ["no-cpu-has-this-flag"] and not absent.covers("kv-fill", par)
    assert tag([absent], "kv-fill", par, [crash]) == [crash]  # elsewhere the failure stays a failure
    if have is not None:
        (suites / "known-failures.yaml").write_text(ENTRY + f"  cpu_flags: [{have}]\n")
        [present] = load(suites / "known-failures.yaml")
        assert present.missing_cpu_flags == [] and present.covers("kv-fill", par)
