"""Failure signatures and patterns on real runs of the tiny models: a real llama.cpp abort (in-process), an
engine fault and a llama-server with a seeded defect each show as one signature whose pattern matches
checks.json, two defects in one run as exactly two, in index.html, junit.xml, the console and `diff`; a
check that only restates a crash is its consequence, not another failure."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from report_helpers import inside, make_checkout, parse_html

from harness.backends.base import INVALID_BATCH, invalid_batch
from harness.backends.process import invalid_batch_in_log
from harness.cli import main
from harness.signatures import classify, signature_of

ABORT = "crash: GGML_ASSERT(n_ubatch > n_keep_tail) failed"
DUPLICATES = "kv-healthy: duplicate cells"
RUNS = {
    # a real abort inside llama.cpp (split_equal, recurrent snapshots): the hybrid model with a drafter only
    "abort": ["--suite", "small-ubatch", "--model", "tiny-hybrid"],
    # the engine fault: only a checkpoint restore (hybrid) after a rejection (scripted drafts) leaves cells; its
    # lossless, baseline, logits and acceptance failures are consequences of the damaged cache
    "fault": [
        "--suite",
        "quicksort",
        "--model",
        "tiny-hybrid",
        "--model",
        "tiny-dense",
        "--mode",
        "seq",
        "--spec",
        "none,scripted-wrong-at-2",
        "--fault",
        "skip-seq-rm-after-restore",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_models):
    """The two runs (with no known-failure entries: the abort fails) and their merge; the console of each."""
    root = make_checkout(tmp_path_factory.mktemp("signatures"))
    (root / "suites" / "known-failures.yaml").write_text("[]\n")
    console = {}
    with inside(root):
        for name, args in RUNS.items():
            with contextlib.redirect_stderr(io.StringIO()) as err:
                assert main(["run", *args, "--out", name]) == 1
            console[name] = err.getvalue()
        assert main(["report", "--merge", "abort", "fault", "--out", "both"]) == 0
    return root, console


@pytest.fixture(scope="module")
def seeded(runs):
    """The same bug class in a real llama-server: the bisect fixture's regression commit (no seq_rm after a
    checkpoint restore), built once (cached; the bisect tests build it too); merged with the abort run."""
    from bisect_history import REGRESSION, builds_at

    (build,) = builds_at(REGRESSION)
    root, console = runs
    with inside(root):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert (
                main(
                    [
                        "run",
                        "--suite",
                        "quicksort",
                        "--backend",
                        "server",
                        "--model",
                        "tiny-hybrid",
                        "--model",
                        "tiny-dense",
                        "--mode",
                        "seq",
                        "--spec",
                        "none,draft-simple",
                        "--server-bin",
                        str(build.server_bin),
                        "--out",
                        "server",
                    ]
                )
                == 1
            )
        console["server"] = err.getvalue()
        assert main(["report", "--merge", "abort", "server", "--out", "abort+server"]) == 0
    return root


def load(path: Path):
    return json.loads(path.read_text())


def expected_grid(run: Path) -> dict[tuple[str, str], str]:
    """From checks.json and run.json alone: ("mode · drafter", "kind · backend") → failed / passed."""
    kinds = {name: m["kind"] for name, m in load(run / "run.json")["models"].items()}
    grid: dict[tuple[str, str], str] = {}
    for v in load(run / "checks.json"):
        spot = (f"{v['mode']} · {v['spec']}", f"{kinds[v['model']]} · {v['backend']}")
        failed = not v["passed"] and "known_failure" not in v["evidence"]
        grid[spot] = "failed" if failed or grid.get(spot) == "failed" else "passed"
    return grid


@pytest.mark.parametrize(
    "name, signature, reading",
    [
        ("abort", ABORT, "only draft-simple; none clean"),
        ("fault", DUPLICATES, "only scripted-wrong-at-2, only hybrid; none clean, dense clean"),
        ("server", DUPLICATES, "only draft-simple, only hybrid; none clean, dense clean"),
    ],
)
def test_one_defect_is_one_signature_whose_pattern_matches_checks_json(runs, request, name, signature, reading):
    root, console = runs
    if name == "server":
        request.getfixturevalue("seeded")
    run = root / name
    doc = parse_html((run / "index.html").read_text())
    found = doc.find_all("div", class_="signature")
    assert [a.attrs["data-signature"] for a in found] == [signature]
    assert doc.find(id="distinct-failures").text.startswith("1 distinct failure")
    assert found[0].find("p", class_="reading").text.startswith(reading)
    shown = {
        (td.attrs["data-row"], td.attrs["data-col"]): td.attrs["data-state"]
        for td in found[0].find_all("td", class_="spot")
    }
    assert shown == expected_grid(run)
    failing = [v for v in load(run / "checks.json") if not v["passed"]]
    cases = {(v["suite"], v["case"], v["mode"], v["spec"], v["model"], v["backend"]) for v in failing}
    assert int(found[0].attrs["data-cases"]) == len(cases)
    types = {f.get("type") for f in ET.parse(run / "junit.xml").getroot().iter("failure")}
    assert types == {signature}
    lines = console[name].splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("1 distinct failure"))) + 1] == f"1. {signature}"
    assert f"   {reading}" in console[name]


def test_two_defects_in_one_run_are_exactly_two_signatures_and_diff_groups_by_them(runs, capsys):
    root, _ = runs
    doc = parse_html((root / "both" / "index.html").read_text())
    assert [a.attrs["data-signature"] for a in doc.find_all("div", class_="signature")] == [ABORT, DUPLICATES]
    assert doc.find(id="distinct-failures").text.startswith("2 distinct failures")
    rows = doc.find(id="failing").find_all("tr", data_status="failed")
    assert [r.attrs["data-signature"] for r in rows] == sorted(
        (r.attrs["data-signature"] for r in rows), key=[ABORT, DUPLICATES].index
    )  # grouped
    assert main(["diff", str(root / "fault"), str(root / "both")]) == 1
    out = capsys.readouterr().out
    assert f"1 distinct failure newly failing: {ABORT} (" in out
    table = out[out.index("newly failing (") :]
    assert "signature" in table.splitlines()[2] and "GGML_ASSERT" in table  # the newly failing table's column
    listed = parse_html((root / "both" / "diff.html").read_text()).find(id="newly-failing-signatures").find_all("li")
    assert [li.attrs["data-signature"] for li in listed] == [ABORT] and listed[0].attrs["data-in-a"] == "0"


def test_a_seeded_llama_server_and_an_engine_abort_in_one_run_are_two_signatures(seeded):
    doc = parse_html((seeded / "abort+server" / "index.html").read_text())
    found = {d.attrs["data-signature"]: d for d in doc.find_all("div", class_="signature")}
    assert list(found) == [ABORT, DUPLICATES]
    columns = {th.text for th in found[DUPLICATES].find_all("th") if "data-col" in th.attrs}
    assert columns == {"hybrid · inproc", "hybrid · server", "dense · server"}
    failed = {
        (td.attrs["data-row"], td.attrs["data-col"]) for td in found[DUPLICATES].find_all("td", data_state="failed")
    }
    assert failed == {("seq · draft-simple", "hybrid · server")}


def test_a_check_of_a_crashed_request_is_a_consequence_not_another_failure(runs, tmp_path):
    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "abort", run)
    checks = load(run / "checks.json")
    crash = next(v for v in checks if not v["passed"])
    error = next(r["error"] for r in load(run / "results.json") if r["stop_reason"] == "crashed")
    restating = [  # what spec-ran and lossless say of a case whose request (or reference) crashed
        {**crash, "check": "spec-ran", "message": "no drafts at all for the case (1 requests)", "evidence": {}},
        {
            **crash,
            "mode": "seq",
            "check": "lossless",
            "message": f"non-speculative output reference failed: {error}",
            "evidence": {},
        },
    ]
    (run / "checks.json").write_text(json.dumps(checks + restating))
    assert main(["report", str(run)]) == 0
    doc = parse_html((run / "index.html").read_text())
    block = doc.find("div", class_="signature")
    assert len(doc.find_all("div", class_="signature")) == 1
    assert block.attrs["data-signature"] == ABORT and block.attrs["data-consequences"] == "2"
    rows = doc.find(id="failing").find_all("tr", data_consequence="1")
    assert {r.find_all("td")[2].text for r in rows} == {"spec-ran", "lossless"}
    restates = [
        p.get("value") for p in ET.parse(run / "junit.xml").getroot().iter("property") if p.get("name") == "restates"
    ]
    assert restates == [ABORT, ABORT]


def test_signatures_drop_paths_numbers_and_the_backend_but_keep_the_assert():
    server = (
        "llama-server was killed by SIGABRT: /home/ci/llama.cpp/src/llama-batch.cpp:412: "
        "GGML_ASSERT(n_ubatch > 0 && ubatch.n_seqs <= 4) failed; log /tmp/r/server-3.log ends with:\n..."
    )
    engine = (
        "the in-process engine's worker was killed by SIGABRT: /opt/src/llama-batch.cpp:415: "
        "GGML_ASSERT(n_ubatch > 0 && ubatch.n_seqs <= 4) failed; log /tmp/q/engine-1.log ends with:\n..."
    )
    crash = {"check": "no-crash", "passed": False, "evidence": {}}
    assert (
        signature_of({**crash, "message": f"1 of 2 requests failed; C round 0: {server}"})
        == signature_of({**crash, "message": f"2 of 2 requests failed; Java round 1: {engine}"})
        == "crash: GGML_ASSERT(n_ubatch > 0 && ubatch.n_seqs <= 4) failed"
    )
    startup = (
        "llama-server was killed by SIGABRT during start-up: /ci/src/llama-context.cpp:2273: "
        "GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed (log: /tmp/r/server-logs/llama-server-par-1.log)"
    )
    in_engine = (
        "the in-process engine's worker was killed by SIGABRT: /opt/src/llama-context.cpp:2273: "
        "GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed; log /tmp/q/engine-1.log ends with:\n..."
    )
    assert (
        signature_of({**crash, "message": f"C round 0: {startup}"})
        == signature_of({**crash, "message": f"C round 0: {in_engine}"})
        == "crash: GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max) failed"
    )  # a warm-up abort reads the same
    thrown = (
        "llama-server was killed by SIGABRT; log /x/y.log ends with:\nterminate called after\n"
        "  what():  failed to remove sequence 7"
    )
    assert (
        signature_of({**crash, "message": "x"}, [{"error": thrown, "stop_reason": "crashed"}])
        == "crash: failed to remove sequence N"
    )
    spec_ran = classify(
        {"check": "spec-ran", "passed": False, "message": "no drafts at all for the case (2 requests)"},
        [{"error": thrown, "stop_reason": "crashed"}],
        [{**crash, "message": "1 of 2 requests failed"}],
    )
    assert (spec_ran.text, spec_ran.consequence) == ("crash: failed to remove sequence N", True)


def test_what_a_known_llama_cpp_defect_explains_is_grouped_by_signature_too(tmp_path, tiny_models):
    """The same abort with its known-failure entry in place: the run passes, and the console and the report's
    known-defects table say what the entry explained, by signature (a second signature would show there)."""
    root = make_checkout(tmp_path)
    with inside(root):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert main(["run", "--suite", "small-ubatch", "--model", "tiny-hybrid", "--out", "known"]) == 0
    line = next(x for x in err.getvalue().splitlines() if x.startswith("known llama.cpp defect "))
    assert line.startswith(f"known llama.cpp defect split-equal-keep-tail-exceeds-ubatch: 1 signature: {ABORT} (")
    row = parse_html((root / "known" / "index.html").read_text()).find(
        "tr", data_known="split-equal-keep-tail-exceeds-ubatch"
    )
    assert [c.text for c in row.find_all("code", class_="known-signature")] == [ABORT]


def test_a_batch_llama_cpp_refuses_is_the_kv_damage_it_would_make_from_either_backend(tmp_path):
    """A batch that starts a sequence at a position the KV cache already holds is the damage the scan finds as
    duplicate cells (where llama.cpp's check does not look); one that skips positions, holes. llama-server
    says only `Invalid input batch.`: its log's reason is added, as the engine words it."""
    crash = {"check": "no-crash", "passed": False, "evidence": {}}
    assert signature_of({**crash, "message": f"C round 0: {invalid_batch(0, 41, 41)}"}) == "kv-healthy: duplicate cells"
    assert signature_of({**crash, "message": f"C round 0: {invalid_batch(2, 41, 45)}"}) == "kv-healthy: holes"
    assert signature_of({**crash, "message": f"C round 0: {INVALID_BATCH}"}) == f"error: {INVALID_BATCH}"
    log = tmp_path / "server.log"
    log.write_text(
        "init: the tokens of sequence 3 in the input batch have inconsistent sequence positions:\n"
        " - the last position stored in the memory module of the context (i.e. the KV cache) for sequence 3 is X = 57\n"
        " - the tokens for sequence 3 in the input batch have a starting position of Y = 56\n"
        " it is required that the sequence positions remain consecutive: Y = X + 1\n"
        "decode: failed to initialize batch\nsrv  update_slots: Invalid input batch. off = 0, n_batch = 2048, "
        "ret = -1\n"
    )
    assert invalid_batch_in_log(log) == invalid_batch(3, 57, 56)
    assert (
        signature_of({**crash, "message": f"C round 0: HTTP 500: Invalid input batch. {invalid_batch_in_log(log)}"})
        == "kv-healthy: duplicate cells"
    )
    log.write_text("srv  update_slots: Compute error.\n")
    assert invalid_batch_in_log(log) is None


def test_reports_read_stored_runs_without_importing_the_engine():
    code = (
        "import sys, harness.report, harness.report.diff, harness.report.cli, harness.report.history, "
        "harness.report.merge; print(sorted(m for m in sys.modules if m.startswith(('harness.engine', "
        "'harness.engine.detok', 'harness.execute'))))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


# ------------------------------------------------------------------ signatures keyed within their pattern (issue 28)


def _verdict(check: str, mode: str, spec: str, model: str, **more) -> dict:
    return {
        "suite": "s",
        "case": more.pop("case", "c"),
        "mode": mode,
        "spec": spec,
        "model": model,
        "backend": "server",
        "check": check,
        "passed": False,
        "message": more.pop("message", "x"),
        "evidence": more.pop("evidence", {}),
        **more,
    }


HARD = {"first_divergence": {"kind": "hard"}}


def test_the_same_text_in_cells_that_share_no_axis_is_two_signatures_until_a_cell_links_them():
    from harness.signatures import group

    a = _verdict("lossless", "seq", "ngram-mod", "tiny-dense", evidence=HARD)
    b = _verdict("lossless", "par", "draft-simple", "tiny-hybrid", evidence=HARD)
    kinds = {"tiny-dense": "dense", "tiny-hybrid": "hybrid", "tiny-recurrent": "recurrent"}
    apart = group([a, b], [], lambda v: True, kinds)
    assert sorted(f.signature for f in apart) == [
        "lossless: hard divergence [par · draft-simple · hybrid]",
        "lossless: hard divergence [seq · ngram-mod · dense]",
    ]
    link = _verdict("lossless", "seq", "draft-simple", "tiny-recurrent", evidence=HARD)  # shares a mode and a drafter
    [joined] = group([a, b, link], [], lambda v: True, kinds)
    assert joined.signature == "lossless: hard divergence" and len(joined.verdicts) == 3
    [same_kind] = group([a, _verdict("lossless", "par", "draft-simple", "tiny-dense", evidence=HARD)], [], bool)
    assert same_kind.signature == "lossless: hard divergence"  # one model kind: one pattern


def test_an_abort_line_joins_cells_that_share_no_axis_a_bare_signal_does_not():
    from harness.signatures import group

    abort = "1 of 1 requests failed; c round 0: llama-server was killed by SIGABRT: x.cpp:1: GGML_ASSERT(a > b) failed"
    a = _verdict("no-crash", "seq", "ngram-mod", "tiny-dense", message=abort)
    b = _verdict("no-crash", "par", "draft-simple", "tiny-hybrid", message=abort)
    assert [f.signature for f in group([a, b], [], bool)] == ["crash: GGML_ASSERT(a > b) failed"]
    segv = "1 of 1 requests failed; c round 0: llama-server was killed by SIGSEGV"
    found = group([{**a, "message": segv}, {**b, "message": segv}], [], bool)
    assert len(found) == 2 and all(f.signature.startswith("crash: killed by SIGSEGV [") for f in found)


def test_a_kv_finding_folds_only_under_a_crash_of_the_same_request():
    from harness.signatures import classify, group

    crash = _verdict(
        "no-crash",
        "par",
        "draft-simple",
        "tiny-hybrid",
        message="1 of 2 requests failed; c round 1: llama-server was killed by SIGABRT: x.cpp:1: GGML_ASSERT(a) failed",
        failures=["round 1: llama-server was killed by SIGABRT: x.cpp:1: GGML_ASSERT(a) failed"],
    )
    kv = _verdict(
        "kv-healthy",
        "par",
        "draft-simple",
        "tiny-hybrid",
        evidence={"duplicate_cells": 2},
        failures=["round 0: 2 duplicate cells"],
    )
    own = classify(kv, [], [crash, kv])
    assert (own.text, own.consequence) == ("kv-healthy: duplicate cells", False)  # round 0 completed: evidence
    assert sorted(f.signature for f in group([crash, kv], [], bool)) == [
        "crash: GGML_ASSERT(a) failed",
        "kv-healthy: duplicate cells",
    ]
    same = {**kv, "failures": ["round 1: 2 duplicate cells"]}
    assert classify(same, [], [crash, same]).consequence
    unknown = {k: v for k, v in kv.items() if k != "failures"}  # a verdict that does not say: as before
    assert classify(unknown, [], [crash, unknown]).consequence
    records = [{"repeat": 0, "error": None}, {"repeat": 1, "error": "killed"}]
    bare_crash = {k: v for k, v in crash.items() if k != "failures"}  # its rounds from results.json
    assert not classify(kv, records, [bare_crash, kv]).consequence


def test_a_timeout_and_what_it_cut_off_are_one_signature_whatever_the_case():
    from harness.signatures import of_error

    timeout = "timeout: case code_python did not finish within its deadline of 55.6 s"
    other = "timeout: case sorts.turn2 did not finish within its deadline of 12.0 s"
    assert (
        of_error(timeout).text
        == of_error(other).text
        == "timeout: the request did not finish within its deadline of N s"
    )
    cut = of_error(f"cut off: llama-server was restarted because {timeout}")
    assert (cut.text, cut.kind, cut.consequence) == (of_error(other).text, "timeout", True)
    assert "code_c" not in of_error("HTTP 500: case code_c failed").text


def test_a_refused_batch_folds_under_kv_damage_only_on_evidence_of_its_slot_and_the_earlier_request():
    """Issue 63: two seeded defects in one llama-server build (rejected draft cells left in the KV cache, grammar
    state not advanced). The scan of case a finds 4 leaked positions (21..24 past its 21 prompt + returned
    tokens); case b's request, the next on the same slot, fails with `Invalid input batch.`, llama.cpp's log saying
    the cache's last position of sequence 0 is X = 25 where the batch starts it at Y = 21. With that evidence (the
    slot, X and Y, the earlier request and its damage) it folds under a's KV-damage signature as a consequence
    (with what restates it), so the two defects are exactly two failures, and the failure says why. Without it
    (another slot, an earlier request whose scan was healthy, the slot unknown, or the damage in another cell) it
    stands as its own KV damage; Y = X + 1 is no evidence of damage."""
    from harness.signatures import group, headline

    cell = ("seq", "draft-simple", "tiny-dense")
    scan = _verdict(
        "kv-healthy",
        *cell,
        case="a",
        message="1 of 1 requests left an unhealthy KV cache (0 duplicate cells, 0 orphans, 4 positions past the "
        "returned tokens in all); first: round 0: 4 positions past the returned tokens",
        evidence={"scanned": 1, "unhealthy": 1, "duplicate_cells": 0, "orphans": 0, "past_returned": 4},
        failures=["round 0: 4 positions past the returned tokens"],
    )
    grammar = _verdict("grammar-valid", *cell, case="json", message="1 of 1 outputs invalid", failures=["round 0: x"])
    refused = f"HTTP 500: Invalid input batch. {invalid_batch(0, 25, 21)}"
    batch = _verdict(
        "no-crash",
        *cell,
        case="b",
        message=f"1 of 1 requests failed; b round 0: {refused}",
        failures=[f"round 0: {refused}"],
    )
    unsent = _verdict("spec-ran", *cell, case="b", message="no drafts at all for the case (1 requests)")
    where = {k: batch[k] for k in ("suite", "mode", "spec", "model", "backend")}

    def records(slot_a: int = 0, slot_b: int = 0, pos_max: int = 24) -> list[dict]:
        scan_a = {"healthy": True, "pos_max": {"0": pos_max}}
        a = {**where, "case": "a", "repeat": 0, "slot_id": slot_a, "prompt_n": 13, "tokens": list(range(8)),
             "error": None, "stop_reason": "limit", "kv_scan": scan_a}  # fmt: skip
        b = {**where, "case": "b", "repeat": 0, "slot_id": slot_b, "prompt_n": 0, "tokens": [], "error": refused,
             "stop_reason": "error", "kv_scan": None}  # fmt: skip
        return [a, b]

    two = ["grammar-valid: invalid output", "kv-healthy: positions past the returned tokens"]
    found = group([scan, grammar, batch, unsent], records(), bool)
    assert [f.signature for f in found] == two, headline(found)
    kv = found[1]
    assert kv.verdicts == [scan] and kv.consequences == [batch, unsent]
    assert kv.folds == [
        "b round 0 on slot 0: llama.cpp refused its batch (X = 25, Y = 21) after a round 0 on the same slot left "
        "positions 21..24 past its 21 prompt + returned tokens"
    ], kv.folds
    own = [
        "grammar-valid: invalid output",
        "kv-healthy: duplicate cells",
        "kv-healthy: positions past the returned tokens",
    ]
    for evidence_missing in (records(slot_b=1), records(pos_max=20), records(slot_b=-1), []):
        found = group([scan, grammar, batch, unsent], evidence_missing, bool)
        assert sorted(f.signature for f in found) == own, headline(found)
        alone = next(f for f in found if f.signature == "kv-healthy: duplicate cells")
        assert (alone.verdicts, alone.consequences, alone.folds) == ([batch], [unsent], [])
    far = {**batch, "mode": "par", "spec": "ngram-mod", "model": "tiny-hybrid"}  # another cell: not a's slot
    found = group([scan, grammar, far], records(), bool)
    assert sorted(f.signature for f in found) == own, headline(found)
    [alone] = group([batch, unsent], [], bool)  # no KV-damage root in the run
    assert (alone.signature, alone.verdicts, alone.consequences) == ("kv-healthy: duplicate cells", [batch], [unsent])
    skip = f"HTTP 500: Invalid input batch. {invalid_batch(0, 25, 29)}"
    assert signature_of({**batch, "message": f"1 of 1 requests failed; b round 0: {skip}"}) == "kv-healthy: holes"
    follows = f"HTTP 500: Invalid input batch. {invalid_batch(0, 25, 26)}"
    assert signature_of({**batch, "message": f"1 of 1 requests failed; b round 0: {follows}"}).startswith("error: ")
