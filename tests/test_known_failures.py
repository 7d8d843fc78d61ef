"""The known-failures file: entries are validated, and they explain exactly the failures they describe."""

import shutil
from pathlib import Path

import pytest

from harness.checks.base import CheckResult
from harness.errors import HarnessError
from harness.matrix import Cell
from harness.verdict.known_failures import NEW_SUITE, load, tag

REPO = Path(__file__).resolve().parents[1]
ENTRY = """\
- id: demo-defect
  suites: [kv-fill]
  backend: server
  modes: [par]
  specs: [draft-simple, draft-mtp]
  models: [tiny-dense, tiny-hybrid, tiny-hybrid-mtp]
  check: no-crash
  evidence: 'batch index \\d+ is not inside'
  versions: [0c1e570]
  upstream: ggml-org/llama.cpp#24840
  reason: a demo
  measured: ['round 0: HTTP 500: speculative batch index 12 is not inside the current sub-batch [0, 8)']
  wider: ['round 0: HTTP 500: batch index 12 is not inside the current sub-batch [0, 8)']
"""
SHIPPED = load(REPO / "suites" / "known-failures.yaml") + load(REPO / "suites" / "statistical" / "known-failures.yaml")
"""The entries of the default suites and of the statistical suites (suites/statistical, their own CI job)."""


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
        (("suites: [kv-fill]", "suites: [kv-fil]"), "unknown suite 'kv-fil'"),
        (("suites: [kv-fill]", "suite: kv-fill"), "'suite' is now 'suites'"),
        (("  measured: [", "  measurd: ["), "('measurd' was unexpected)"),
        (
            ("  reason: a demo\n", "  reason: a demo\n  limits: [{value: tokens - lost, max: 4}]\n"),
            "names 'tokens', which the evidence pattern does not capture",
        ),
        (("check: no-crash", "check: no-crash2"), "unknown check 'no-crash2'"),
        (("modes: [par]", "modes: [parallel]"), "unknown mode 'parallel'"),
        (("backend: server", "backend: cuda"), "unknown backend 'cuda'"),
        (("  reason: a demo\n", ""), "'reason' is a required property"),
        # recognised only where it was measured: every entry lists its modes, specs and models
        (("  models: [tiny-dense, tiny-hybrid, tiny-hybrid-mtp]\n", ""), "'models' is a required property"),
        (("specs: [draft-simple, draft-mtp]", "specs: []"), "should be non-empty"),
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


def test_a_defect_that_killed_requests_explains_exercised_only_when_the_requests_it_spared_completed_enough(suites):
    """Measured on tiny-hybrid (kv-fill, server, par): the defect killed the lists and hashes chats (their later
    turns not sent), 2 of the 6 spared requests completed and 4 ended context_full: 2 of 12 is short of 25%,
    but only because the defect took 6; a cell whose spared requests complete too few stays a failure."""
    from harness.checks import exercised
    from harness.checks.base import CheckContext
    from harness.execute import CellRun, Outcome
    from harness.result import Result
    from harness.suites import load_suite

    (suites / "known-failures.yaml").write_text(ENTRY.replace("check: no-crash", "check: [no-crash, exercised]"))
    [entry] = load(suites / "known-failures.yaml")
    suite = load_suite(str(suites / "kv-fill.yaml"))
    par = Cell("server", "par", "draft-simple", "tiny-hybrid")
    http500 = "HTTP 500: got exception: speculative batch index 9 is not inside the current sub-batch [0, 8)"
    killed = [http500, f"{http500} (so lists.turn2 was not sent)", f"{http500} (so lists.turn3 was not sent)"] * 2

    def verdict(others: list[str | None], stats: dict | None = None):
        errors = killed + others
        outcomes = [
            Outcome(f"c{i}", 0, Result(stop_reason="error" if e else "limit", error=e, spec_stats=stats or {}))
            for i, e in enumerate(errors)
        ]
        return exercised(CheckContext(CellRun(suite, par, outcomes), suite.first_key, None, None, str, ""))

    measured = verdict([None, None] + ["context_full"] * 4)
    assert not measured.passed and measured.evidence["completed"] == 2 and len(measured.failures) == 10
    assert entry.explained(measured) == (6, 10)
    assert tag([entry], "kv-fill", par, [measured]) == [] and measured.evidence["known_failure"] == "demo-defect"
    assert measured.evidence["known_failure_shortfall"] == (
        "demo-defect killed 6 of 12 requests; of the 6 it spared 2 completed (33%, expected at least 25%), "
        "the others ended context_full ×4"
    )
    for short in (
        verdict([None] + ["context_full"] * 5),  # 1 of the 6 spared: kv-fill itself completes too little
        verdict(["context_full"] * 5 + ["llama-server was killed by SIGSEGV"]),
        verdict([None, None] + ["context_full"] * 4, {"draft_dropped": 0}),  # a counter short: not the defect's
    ):
        assert not short.passed and tag([entry], "kv-fill", par, [short]) == [short], short.message
        assert "known_failure" not in short.evidence
    no_crash = CheckResult("no-crash", False, "x", {"requests": 12, "completed": 2, "completed_min": 0.25})
    no_crash.failures = [f"c0 round 0 did not complete: {http500}", "c1 round 0 did not complete: context_full"]
    assert not entry.explains(no_crash)  # the shortfall reading is `exercised`'s alone


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


def _verdict(entry, line: str) -> CheckResult:
    return CheckResult(entry.check[0], False, line, failures=[line])


def _home_cell(entry) -> Cell:
    return Cell(
        entry.backend,
        (entry.modes or ("seq",))[0],
        (entry.specs or ("draft-simple",))[0],
        (entry.models or ("tiny-dense",))[0],
    )


@pytest.mark.parametrize("entry", SHIPPED, ids=[e.id for e in SHIPPED])
def test_each_entry_explains_its_measured_evidence_and_no_wider_variant_of_it(entry):
    """An entry is as wide as its defect: it explains every failure line measured for it (in its home suite
    and cells) and none of its `wider` variants (more positions past the returned tokens than the defect
    leaves, more tokens lost than it loses, another abort)."""
    assert entry.measured and entry.wider
    cell = _home_cell(entry)
    assert entry.covers(entry.suite, cell) or entry.missing_cpu_flags
    for line in entry.measured:
        assert entry.explains(_verdict(entry, line)), f"{entry.id} does not explain its measured {line!r}"
    for line in entry.wider:
        assert not entry.explains(_verdict(entry, line)), f"{entry.id} explains the wider {line!r}"


def test_the_eog_entries_accept_exactly_one_position_the_eog_tokens():
    eog = {e.id: e for e in SHIPPED}
    line = (
        "round 0: {n} position{s} past the returned tokens: the slot keeps positions {a}..{b} after 8 prompt + "
        "29 returned tokens (stop: eos)"
    )
    for kid in ("server-spec-keeps-eog", "server-spec-keeps-eog-sampled"):
        entry = eog[kid]
        assert entry.explains(_verdict(entry, line.format(n=1, s="", a=37, b=37)))
        assert not entry.explains(_verdict(entry, line.format(n=2, s="s", a=37, b=38)))
        assert not entry.explains(_verdict(entry, line.format(n=1, s="", a=36, b=36)))


def test_the_context_end_entry_accepts_at_most_four_lost_tokens():
    entry = next(e for e in SHIPPED if e.id == "server-spec-context-end-early-stop")
    line = "round 0: unexplained at token {k} (the output ended there, stop: limit; the reference has 60 tokens)"
    assert [entry.explains(_verdict(entry, line.format(k=k))) for k in (60, 59, 56, 55, 40)] == [
        False,  # nothing lost: no early stop
        True,
        True,  # 4 lost: the most the defect loses
        False,  # 5 lost: wider than the defect
        False,
    ]


def test_a_known_defect_in_a_suite_its_entry_does_not_list_is_that_defect_seen_in_a_new_suite(suites):
    """The grammar-json case of issue 28: a known signature in a suite the entry does not list is reported as the
    known defect (it does not fail the run), and the message says it was seen in a new suite."""
    shutil.copy(REPO / "suites" / "eog.yaml", suites / "eog.yaml")
    (suites / "known-failures.yaml").write_text(ENTRY)
    [entry] = load(suites / "known-failures.yaml")
    par = Cell("server", "par", "draft-simple", "tiny-hybrid")
    http500 = "round 0: HTTP 500: speculative batch index 12 is not inside the current sub-batch [0, 8)"
    elsewhere = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[http500])
    assert tag([entry], "eog", par, [elsewhere]) == []
    assert elsewhere.evidence["known_failure"] == "demo-defect" and elsewhere.evidence[NEW_SUITE] == "eog"
    assert "known defect demo-defect, seen in a new suite: eog" in elsewhere.message
    assert "does not fail the run" in elsewhere.message
    home = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[http500])
    assert tag([entry], "kv-fill", par, [home]) == [] and NEW_SUITE not in home.evidence
    seq = Cell("server", "seq", "draft-simple", "tiny-hybrid")  # the defect's conditions still hold everywhere
    other_mode = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[http500])
    assert tag([entry], "eog", seq, [other_mode]) == [other_mode]
    (suites / "known-failures.yaml").write_text(ENTRY + "  anywhere: false\n")
    [listed_only] = load(suites / "known-failures.yaml")
    again = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[http500])
    assert tag([listed_only], "eog", par, [again]) == [again]


def test_the_eog_defect_in_grammar_json_is_known():
    """The 9 grammar-json cases of issue 28 (tiny-hybrid and tiny-recurrent, draft-simple, every mode)."""
    line = (
        "round 0: 1 position past the returned tokens: the slot keeps positions 40..40 after 12 prompt + 28 "
        "returned tokens (stop: eos)"
    )
    for mode in ("seq", "par", "no-kv-unified"):
        for model in ("tiny-hybrid", "tiny-recurrent"):
            r = CheckResult("kv-healthy", False, line, failures=[line])
            assert tag(SHIPPED, "grammar-json", Cell("server", mode, "draft-simple", model), [r]) == []
            assert r.evidence["known_failure"] == "server-spec-keeps-eog"


def test_the_console_says_which_known_defect_showed_in_a_new_suite_and_that_it_does_not_fail_the_run(suites):
    from harness.signatures import group
    from harness.signatures.text import known_lines

    shutil.copy(REPO / "suites" / "eog.yaml", suites / "eog.yaml")
    (suites / "known-failures.yaml").write_text(ENTRY)
    [entry] = load(suites / "known-failures.yaml")
    par = Cell("server", "par", "draft-simple", "tiny-hybrid")
    http500 = "round 0: HTTP 500: speculative batch index 12 is not inside the current sub-batch [0, 8)"
    r = CheckResult("no-crash", False, f"1 of 1 requests failed; c {http500}", failures=[http500])
    assert tag([entry], "eog", par, [r]) == []
    record = {"suite": "eog", "case": "c", **{k: getattr(par, k) for k in ("mode", "spec", "model", "backend")}}
    record |= {"check": r.name, "passed": False, "message": r.message, "evidence": r.evidence, "failures": r.failures}
    [line] = known_lines({"demo-defect": group([record], [], lambda v: True)})
    assert line.startswith("known llama.cpp defect demo-defect: 1 signature: ")
    assert "seen in a new suite: eog (known defect, not failing the run" in line


def test_a_run_without_an_intermittent_known_failure_says_so_and_does_not_fail_on_it(suites):
    """`specharness run`: a deterministic entry whose cells ran without it is `FIXED?` (the run fails); one with
    `tries` (intermittent) only says it did not show this time: one run without it proves nothing."""
    import io

    from rich.console import Console

    from harness.commands.run import print_verdicts

    (suites / "known-failures.yaml").write_text(ENTRY + ENTRY.replace("demo-defect", "rare-defect") + "  tries: 3\n")
    deterministic, intermittent = load(suites / "known-failures.yaml")
    out = io.StringIO()
    done = [("kv-fill", Cell("server", "par", "draft-simple", "tiny-dense"))]
    assert print_verdicts(Console(file=out), [], [], done, [deterministic, intermittent]) == [deterministic]
    text = out.getvalue()
    assert "FIXED? known failure demo-defect did not reproduce" in text
    assert "not reproduced this run: known failure rare-defect (intermittent" in text
    assert "FIXED? known failure rare-defect" not in text


def test_a_known_failure_whose_cells_ran_with_other_spec_options_is_not_judged_fixed(suites):
    """A run whose `--spec-*` options changed the entry's cells (e.g. `--spec-draft-sampling probabilistic` over a
    defect measured under sample-and-match) cannot say the defect is gone: `not judged`, not `FIXED?`."""
    import io

    from rich.console import Console

    from harness.commands.run import print_verdicts
    from harness.result.cellrun import CellRun
    from harness.suites import load_suite

    (suites / "known-failures.yaml").write_text(ENTRY)
    [entry] = load(suites / "known-failures.yaml")
    cell = Cell("server", "par", "draft-simple", "tiny-dense")
    run = CellRun(load_suite("kv-fill"), cell)
    run.spec = {"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-sampling": "probabilistic"}
    out = io.StringIO()
    assert print_verdicts(Console(file=out, width=200), [run], [], [("kv-fill", cell)], [entry]) == []
    text = out.getvalue()
    assert "not judged: known failure demo-defect did not show" in text and "FIXED?" not in text
    run.spec = {"spec-type": "draft-simple", "spec-draft-n-max": 4}  # as measured: FIXED? again
    assert print_verdicts(Console(file=io.StringIO()), [run], [], [("kv-fill", cell)], [entry]) == [entry]


def test_an_entry_whose_strict_cell_is_not_in_its_home_suite_is_an_error_of_the_registry(suites):
    """Its strict expected failure would never run, so it could never show as fixed while it still excuses
    failures wherever its signature shows."""
    (suites / "known-failures.yaml").write_text(
        ENTRY.replace("models: [tiny-dense, tiny-hybrid, tiny-hybrid-mtp]", "models: [gemma3-270m]")
    )
    with pytest.raises(HarnessError, match=r"entry 0 \(demo-defect\): no cell of its home suite kv-fill's default"):
        load(suites / "known-failures.yaml")


def test_an_entry_goes_by_what_a_cell_was_served_with_not_by_its_presets_name():
    """`--spec-draft-sampling greedy` turns a `draft-simple-probabilistic` cell into sample-and-match draft-simple:
    the defect measured on draft-simple (#28049) is that cell's too, and only under that override; a cell served
    otherwise than any listed spec would be under the run's options (rejection sampling) is not the entry's. Two
    cells served alike are judged alike."""
    entry = next(e for e in SHIPPED if e.id == "server-spec-keeps-eog-sampled")
    cell = Cell("server", "seq", "draft-simple-probabilistic", "tiny-recurrent")
    line = entry.measured[0]

    def verdict():
        return CheckResult("kv-healthy", False, line, failures=[line])

    greedy, probabilistic = {"spec-draft-sampling": "greedy"}, {"spec-draft-sampling": "probabilistic"}
    served_greedy = verdict()
    assert tag([entry], "sampling", cell, [served_greedy], greedy) == []
    assert served_greedy.evidence["known_failure"] == entry.id
    assert tag([entry], "sampling", cell, [verdict()]) != []  # as the preset serves it: rejection sampling
    # under --spec-draft-sampling probabilistic the listed draft-simple is served as the cell is: alike
    listed = Cell("server", "seq", "draft-simple", "tiny-recurrent")
    assert tag([entry], "sampling", listed, [verdict()], probabilistic) == []
    assert tag([entry], "sampling", cell, [verdict()], probabilistic) == []
    assert tag([entry], "sampling", listed, [verdict()], {"spec-draft-n-max": 2}) == []
    assert tag([entry], "sampling", cell, [verdict()], {"spec-draft-n-max": 2}) != []


def test_an_option_set_to_llama_servers_default_serves_as_the_preset_measured():
    """`--spec-draft-sampling greedy` is what llama-server does without the flag: a cell it overrides is served as
    measured (FIXED? stays possible), and the preset keeps its entries."""
    from harness.matrix import served_as

    assert served_as("ngram-mod", {"spec-draft-sampling": "greedy"}) == served_as("ngram-mod", {})
    assert served_as("ngram-mod", {"spec-draft-sampling": "probabilistic"}) != served_as("ngram-mod", {})


def test_a_cell_the_override_makes_an_entrys_spec_cannot_show_the_defect_gone():
    """Under `--spec-draft-sampling probabilistic` the eog-sampled entry's draft-simple is served by rejection
    sampling, as `draft-simple-probabilistic` is: the entry covers both cells, but neither is served as the defect
    was measured (sample-and-match), so a run where it does not show says nothing of a fix (no FIXED?)."""
    import io

    from rich.console import Console

    from harness.commands.run import print_verdicts
    from harness.result.cellrun import CellRun
    from harness.suites import load_suite

    entry = next(e for e in SHIPPED if e.id == "server-spec-keeps-eog-sampled")
    suite = load_suite("sampling")
    probabilistic = {"spec-draft-sampling": "probabilistic"}
    runs, done = [], []
    for spec in ("draft-simple", "draft-simple-probabilistic"):
        cell = Cell("server", "seq", spec, "tiny-recurrent")
        run = CellRun(suite, cell)
        run.spec = {"spec-type": "draft-simple", "spec-draft-n-max": 4, **probabilistic}
        runs.append(run)
        done.append(("sampling", cell))
    out = io.StringIO()
    assert print_verdicts(Console(file=out, width=200), runs, [], done, [entry], probabilistic) == []
    assert "FIXED?" not in out.getvalue()
    greedy = {"spec-draft-sampling": "greedy"}  # sample-and-match, as measured: a run without it says FIXED?
    for run in runs:
        run.spec = {"spec-type": "draft-simple", "spec-draft-n-max": 4, **greedy}
    assert print_verdicts(Console(file=io.StringIO()), runs, [], done, [entry], greedy) == [entry]


def test_an_entry_measured_not_to_show_on_a_cpu_with_a_flag_does_not_apply_there(suites):
    from harness.backends.base import cpu_flags

    have = sorted(cpu_flags())[0] if cpu_flags() else None
    if have is None:
        pytest.skip("no CPU flags readable here")
    (suites / "known-failures.yaml").write_text(ENTRY + f"  without_cpu_flags: [{have}]\n")
    [entry] = load(suites / "known-failures.yaml")
    assert entry.missing_cpu_flags == [f"no {have}"]
    par = Cell("server", "par", "draft-simple", "tiny-dense")
    assert not entry.covers("kv-fill", par)
