"""`specharness mutate`: mutants of llama.cpp's speculative code made by universalmutator, written one at a time into
the cache's copy of the tree and always taken out again, and the score with its exact interval.

The quick tests here use a small stand-in tree (a CMakeLists.txt and one C++ file) and the vendored tree's own files;
the campaign end to end (real builds of mutants, the default job's llama-server cells, Ctrl-C) is a `workflows` test
at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.backends.build import vendored_source
from harness.cli import main
from harness.errors import HarnessError
from harness.mutate.battery import server_cells
from harness.mutate.campaign import KILLED, STILLBORN, SURVIVED
from harness.mutate.generate import Mutant, mutants_of, pool, sample
from harness.mutate.score import load_judgements, score
from harness.mutate.targets import DEFAULT_TARGETS, Target, function_lines, log_only_lines, parse_target
from harness.mutate.tree import JOURNAL, MutationTree

ROOT = Path(__file__).resolve().parents[1]

CPP = """\
#include "x.h"
// a comment
static int add(int a, int b) {
    if (a > b) {
        LOG_INF("%s: a = %d, b = %d\\n",
                __func__, a, b);
    }
    return a + b;
}

int unrelated(int a) {
    return a * 2;
}
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "llama.cpp"
    (src / "common").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    (src / "common" / "x.cpp").write_text(CPP)
    return src


def test_log_only_statements_comments_and_includes_are_never_mutated(tree):
    text = CPP.splitlines()
    assert log_only_lines(text) == {5, 6}
    assert log_only_lines(['    SPC_DBG("%d",', "            n);", "    n++;"]) == {1, 2}  # speculative.cpp's own
    lines = Target("common/x.cpp").lines(tree)
    assert 1 not in lines and 2 not in lines and 5 not in lines and 6 not in lines
    assert {3, 4, 8, 12} <= set(lines)
    assert {m.line for m in mutants_of(tree, Target("common/x.cpp"))} <= set(lines)


def test_a_compile_time_assertion_is_never_mutated(tree):
    """A mutant of a static_assert does not compile or emits the same code (campaign vendored-400-seed1's
    2fbbed56f4b1, `== 11` made `>= 11`, was served by every cell of every suite for 15 minutes to survive)."""
    (tree / "common" / "x.cpp").write_text(CPP + 'static_assert(N == 11,\n              "msg");\nint k = 1;\n')
    lines = Target("common/x.cpp").lines(tree)
    n = len(CPP.splitlines())
    assert n + 1 not in lines and n + 2 not in lines and n + 3 in lines


def test_a_function_target_is_its_body_only(tree):
    assert function_lines(CPP.splitlines(), "add") == [4, 5, 6, 7, 8]
    assert {m.line for m in mutants_of(tree, Target("common/x.cpp", "functions:unrelated"))} == {12}
    with pytest.raises(HarnessError, match="defines no function nothere"):
        function_lines(CPP.splitlines(), "nothere", "common/x.cpp")


@pytest.mark.parametrize(
    "text, error",
    [("/abs/x.cpp", "relative"), ("../x.cpp", "relative"), ("common/x.cpp:9-3", "1 <= A <= B"), ("a.cpp:x", "A-B")],
)
def test_a_bad_target_is_one_line_naming_it(text, error):
    with pytest.raises(HarnessError, match=error):
        parse_target(text)


def test_the_default_targets_are_the_speculative_path_of_the_vendored_tree():
    source = vendored_source()
    counts = {t.file: len(t.lines(source)) for t in DEFAULT_TARGETS}
    assert counts["common/speculative.cpp"] > 1000
    assert 50 < counts["common/sampling.cpp"] < 300  # five functions' bodies, not the file
    assert 100 < counts["tools/server/server-context.cpp"] < 400  # its speculative lines, not its 5,559
    assert parse_target("common/sampling.cpp:678-720").lines(source)[0] >= 678


def test_a_mutant_is_one_line_with_a_stable_id_a_diff_git_applies_and_a_seeded_sample(tree):
    made = pool(tree, (Target("common/x.cpp"),))
    assert len({m.id for m in made}) == len(made) > 10
    m = made[0]
    assert Mutant.from_json(m.to_json()) == m and m.to_json()["id"] == m.id
    mutated = m.apply(CPP)
    assert sum(a != b for a, b in zip(CPP.splitlines(), mutated.splitlines(), strict=True)) == 1
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    patch = tree / "m.diff"
    patch.write_text(m.diff(CPP))
    subprocess.run(["git", "-C", str(tree), "apply", "m.diff"], check=True)
    assert (tree / m.file).read_text() == mutated
    assert sample(made, 3, 7) == sample(made, 3, 7) != sample(made, 3, 8)
    assert sorted(sample(made, None, 1), key=lambda x: x.id) == sorted(made, key=lambda x: x.id)
    with pytest.raises(HarnessError, match="is not the line mutant"):
        m.apply(CPP.replace(m.original, "changed\n"))


def test_the_tree_is_a_copy_that_a_mutant_leaves_clean_whatever_happens(tree):
    m = pool(tree, (Target("common/x.cpp"),))[0]
    mt = MutationTree(tree)
    with mt.held():
        assert mt.path != tree and mt.is_clean(["common/x.cpp"])
        with pytest.raises(RuntimeError), mt.applied(m):
            assert (mt.path / m.file).read_text() == m.apply(CPP) and (mt.path / JOURNAL).exists()
            raise RuntimeError("a build failed")
        assert mt.is_clean(["common/x.cpp"])
        with pytest.raises(KeyboardInterrupt), mt.applied(m):
            raise KeyboardInterrupt
        assert mt.is_clean(["common/x.cpp"])
    assert (tree / "common" / "x.cpp").read_text() == CPP  # the user's tree is never written


def test_a_mutant_left_by_a_killed_process_is_taken_out_before_anything_else(tree):
    m = pool(tree, (Target("common/x.cpp"),))[0]
    mt = MutationTree(tree)
    with mt.held():
        pass
    (mt.path / m.file).write_text(m.apply(CPP))  # as a SIGKILL inside `applied` leaves it
    (mt.path / JOURNAL).write_text(json.dumps({"id": m.id, "file": m.file}))
    with mt.held():
        assert mt.is_clean(["common/x.cpp"])


def test_one_campaign_at_a_time_holds_a_tree(tree):
    first, second = MutationTree(tree), MutationTree(tree)
    with first.held(), pytest.raises(HarnessError, match="another campaign"), second.held():
        pass


def test_only_a_mutant_on_an_executable_line_no_run_executes_is_unreached():
    from harness.mutate.campaign import Judge

    judge = Judge.__new__(Judge)  # the coverage lookup alone: no build
    judge._reach = {"ours": {"f.cpp": {"executable": [1, 2, 3], "covered": [1, 3]}}, "peers": {}}

    def at(line: int, file: str = "f.cpp") -> Mutant:
        return Mutant(file, line, "a\n", "b\n", "rule")

    assert not judge.reached(at(2))  # executable, never executed
    assert judge.reached(at(1)) and judge.reached(at(3))
    assert judge.reached(at(7))  # gcov lists no code there (a declaration, a statement's continuation): served
    assert judge.reached(at(2, "other.cpp"))  # a file the coverage build did not measure: served


def test_a_reached_mutant_meets_only_the_cells_that_execute_its_line_and_those_that_compare_with_them(monkeypatch):
    from types import SimpleNamespace

    from harness.matrix import Cell
    from harness.mutate import campaign as campaign_module
    from harness.mutate.campaign import Judge
    from harness.mutate.coverage import union

    suite_cells = [Cell("server", mode, spec, "m") for mode in ("seq", "par") for spec in ("none", "draft-simple")]
    ids = [c.id for c in suite_cells]
    seq_none, seq_draft, par_none, par_draft = ids
    monkeypatch.setattr(campaign_module, "server_cells", lambda suite: suite_cells)
    judge = Judge.__new__(Judge)
    judge.campaign = SimpleNamespace(coverage=True)
    per_cell = {  # the counters each cell's llama-server wrote: line -> cells
        seq_none: {"f.cpp": [1]},
        seq_draft: {"f.cpp": [1, 4]},
        par_none: {"f.cpp": [1]},
        par_draft: {"f.cpp": [1, 3, 4]},
    }
    judge._reach = {
        "ours": union([{"f.cpp": {"executable": [1, 2, 3, 4], "covered": [1, 3, 4]}}]),
        "peers": {},
        "cells": {"quick": per_cell, "part": {seq_none: {"f.cpp": [1]}}},  # part: one cell wrote no counters
    }

    def at(line: int, file: str = "f.cpp") -> Mutant:
        return Mutant(file, line, "a\n", "b\n", "rule")

    assert judge.cells_to_serve(at(3), "quick") == [par_draft]  # no other cell compares with it
    assert judge.cells_to_serve(at(4), "quick") == [seq_draft, par_draft]
    assert judge.cells_to_serve(at(1), "quick") is None  # every cell (seq-none is everyone's reference)
    assert judge.cells_to_serve(at(2), "quick") == []  # executable, no cell executes it: the suite is not run
    assert judge.cells_to_serve(at(3), "part") == [seq_draft, par_none, par_draft]  # unmeasured cells are served
    assert judge.cells_to_serve(at(3), "other") is None  # a suite not measured: every cell
    assert judge.cells_to_serve(at(7), "quick") is None  # not an executable line: every cell
    assert judge.cells_to_serve(at(3, "other.cpp"), "quick") is None  # a file not measured: every cell
    judge.campaign.coverage = False
    assert judge.cells_to_serve(at(3), "quick") is None


def test_a_campaign_names_no_path_of_this_machine_and_finds_its_tree_again_by_identity(tree, tmp_path, monkeypatch):
    from harness.backends.build import source_identity
    from harness.mutate import campaign as campaign_module
    from harness.mutate.campaign import VENDORED, Campaign, _compile_error, portable

    monkeypatch.setattr(campaign_module, "vendored_source", lambda: tree)  # the vendored tree, wherever it lies
    plan = Campaign(VENDORED, str(source_identity(tree)), ["common/x.cpp"], 1, 1, 9, [], ["quicksort"], [])
    out = tmp_path / "campaign"
    out.mkdir()
    plan.save(out)
    assert str(tree) not in (out / "campaign.json").read_text()
    assert Campaign.load(out).tree_source() == tree
    (tree / "common" / "x.cpp").write_text(CPP + "// changed\n")
    with pytest.raises(HarnessError, match="is not the one it sampled"):
        Campaign.load(out).tree_source()
    from harness.backends.build import work_dir
    from harness.paths import cache_dir

    for where in (tree, work_dir() / "src"):  # the tree, or the work path the build links it at
        error = f"llama.cpp build failed (log)\n{where}/common/x.cpp:3:1: error: expected ';'\n"
        record = {
            "status": "stillborn",
            "reason": _compile_error(error),
            "runs": [{"message": f"log {out}/runs/a.log"}],
            "note": f"full log: {cache_dir()}/builds/x.failed.log",
        }
        assert portable(record, tree, out) == {
            "status": "stillborn",
            "reason": "common/x.cpp:3:1: error: expected ';'",
            "runs": [{"message": "log runs/a.log"}],
            "note": "full log: <cache>/builds/x.failed.log",
        }


def record(status: str, id_: str) -> dict:
    return {"id": id_, "status": status}


def test_the_score_is_killed_over_compiled_non_equivalent_with_scipy_s_exact_interval(tmp_path):
    records = [record(KILLED, f"k{i}") for i in range(9)] + [record(SURVIVED, "s1"), record(SURVIVED, "s2")]
    records += [record(STILLBORN, "b1"), record("error", "e1")]
    s = score(records, {"s2": {"verdict": "equivalent", "reason": "log only"}})
    assert (s.killed, s.survived, s.equivalent, s.stillborn, s.errors, s.denominator) == (9, 2, 1, 1, 1, 10)
    from scipy.stats import binomtest

    ci = binomtest(9, 10).proportion_ci(0.95, "exact")
    assert (s.low, s.high) == (ci.low, ci.high)
    assert "score 9/10 = 90.0 % (95 % CI 55.5-99.7 %" in s.line()
    assert score([record(STILLBORN, "b")], {}).value is None
    peered = [dict(r, peers={"killed": i < 3}) for i, r in enumerate(records[:10])]  # 9 killed, s1, s2 equivalent
    s = score(peered, {"s2": {"verdict": "equivalent", "reason": "log only"}})
    assert (s.peers_killed, s.peers_judged) == (3, 10)  # the equivalent one left out, as from ours
    assert "llama.cpp's own server tests: 3/10 = 30.0 %" in s.line()


def test_a_judgement_without_a_reason_or_verdict_is_refused(tmp_path):
    path = tmp_path / "survivors.yaml"
    path.write_text("- {id: abc, verdict: equivalent}\n")
    with pytest.raises(HarnessError, match="without a reason"):
        load_judgements(path)
    path.write_text("- {id: abc, verdict: maybe, reason: x}\n")
    with pytest.raises(HarnessError, match="equivalent or gap"):
        load_judgements(path)
    path.write_text("- {id: abc, verdict: gap, reason: no cell reaches it, closed_by: suites/x.yaml}\n")
    assert load_judgements(path)["abc"]["closed_by"] == "suites/x.yaml"
    assert isinstance(load_judgements(), dict)  # the committed file parses


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["mutate", "--source", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "not a llama.cpp source tree" in capsys.readouterr().err
    assert main(["mutate", "--stage1", "nosuchsuite", "--out", str(tmp_path / "o")]) == 2
    assert "no llama-server suite named nosuchsuite" in capsys.readouterr().err
    assert main(["mutate", "--resume", str(tmp_path)]) == 2
    assert "holds no campaign" in capsys.readouterr().err


# ------------------------------------------------------------------ end to end: real mutant builds, real suites

SMALL = [
    "--target",
    "common/sampling.cpp:678-720",  # common_sampler_sample_and_accept_n: one small translation unit to rebuild
    "--stage1",
    "forced-rejection",  # llama-server cells whose drafts are rejected: what that function decides
    "--stage2",
    "none",
]
"""A small campaign's options (the interrupt test adds --no-peers: llama.cpp's own tests cost 76 s a build)."""


MUTATION_TREE = pytest.mark.xdist_group("mutation-tree")
"""The campaigns below mutate the one copy of the vendored tree, one campaign at a time (its lock): one worker."""


def _tree_is_clean() -> bool:
    tree = MutationTree(vendored_source())
    return not (tree.path / JOURNAL).exists() and tree.is_clean(["common/sampling.cpp"])


@MUTATION_TREE
@pytest.mark.workflows
@pytest.mark.long
def test_a_small_campaign_builds_each_mutant_judges_it_scores_reports_and_leaves_the_tree_clean(tmp_path):
    out = tmp_path / "campaign"
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", "mutate", *SMALL, "--sample", "3", "--seed", "3", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    records = [json.loads(line) for line in (out / "mutants.jsonl").read_text().splitlines()]
    assert len(records) == 3 and {r["status"] for r in records} <= {"stillborn", "killed", "survived"}
    for r in records:
        assert r["diff"].startswith("--- a/common/sampling.cpp") and r["build_s"] > 0
        if r["status"] == "killed":
            assert r["suite"] == "forced-rejection" and r["check"] and r["signature"] and r["stage"] == 1
    assert "mutants judged" in proc.stdout and "report: " in proc.stdout
    html = (out / "mutate.html").read_text()
    assert all(r["id"] in html for r in records)
    assert _tree_is_clean()
    clean = json.loads((out / "campaign.json").read_text())["clean"]
    assert clean["forced-rejection"]["exit"] == 0 and clean["peers"]["passed"]  # llama.cpp's own tests, offline
    for r in records:
        assert ("peers" in r) == (r["status"] != "stillborn")
    assert "llama.cpp's own server tests" in proc.stdout or not any("peers" in r for r in records)
    reach = json.loads((out / "coverage.json").read_text())  # the battery's line coverage, measured first
    for whose in ("ours", "peers"):
        lines = reach[whose]["common/sampling.cpp"]
        assert set(lines["covered"]) <= set(lines["executable"]) and 682 in lines["covered"]
        assert 712 in set(lines["executable"]) - set(lines["covered"])  # the overload without idxs: no caller
    assert set(reach["suites"]) == {"forced-rejection"}  # each suite's lines apart (which suites a mutant meets)
    assert set(reach["suites"]["forced-rejection"]["common/sampling.cpp"]) == set(
        reach["ours"]["common/sampling.cpp"]["covered"]
    )
    per_cell = reach["cells"]["forced-rejection"]  # ... and each cell's (which cells of a suite a mutant meets)
    assert set(per_cell) <= {c.id for c in server_cells("forced-rejection")} | {
        c.reference(spec="none").id for c in server_cells("forced-rejection")
    }
    assert set().union(*(f["common/sampling.cpp"] for f in per_cell.values())) == set(
        reach["ours"]["common/sampling.cpp"]["covered"]
    )
    verifying = {cell for cell, f in per_cell.items() if 682 in f["common/sampling.cpp"]}
    assert verifying and not any("-none-" in cell for cell in verifying)  # only speculative cells verify drafts


@MUTATION_TREE
@pytest.mark.workflows
@pytest.mark.long
def test_ctrl_c_with_a_mutant_in_the_tree_takes_it_out_and_resume_finishes_the_campaign(tmp_path):
    from interrupts import interrupt as send
    from interrupts import spawn, wait_for_phase

    out, phases = tmp_path / "campaign", tmp_path / "phases"
    args = ["mutate", *SMALL, "--no-peers", "--no-coverage", "--sample", "1", "--seed", "5", "--out", str(out)]
    proc = spawn(args, phases, hold="mutating")
    wait_for_phase(proc, phases, "mutating")
    tree = MutationTree(vendored_source())
    assert (tree.path / JOURNAL).exists() and not tree.is_clean(["common/sampling.cpp"])  # held with it written
    status, output = send(proc, signal.SIGINT)
    assert status == 130, output[-2000:]
    assert "the llama.cpp tree is clean" in output and f"--resume {out}" in output
    assert _tree_is_clean() and not (out / "mutants.jsonl").exists()
    started = time.monotonic()
    resumed = subprocess.run(
        [sys.executable, "-m", "harness.cli", "mutate", "--resume", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env={k: v for k, v in os.environ.items() if k != "SPECHARNESS_HOLD_PHASE"},
    )
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert len((out / "mutants.jsonl").read_text().splitlines()) == 1 and _tree_is_clean()
    assert time.monotonic() - started < 3600


def test_the_report_shows_every_mutant_its_judgement_and_the_score(tmp_path):
    from harness.mutate.campaign import Campaign
    from harness.mutate.score import write_report

    m = Mutant("common/x.cpp", 4, "    if (a > b) {\n", "    if (a < b) {\n", "> ==> <  (universal.rules:40)")
    campaign = Campaign("src", "0c1e570", ["common/x.cpp"], 1, 2, 10, [m.to_json()], ["quicksort"], [])
    killed = {
        **m.to_json(),
        "id": "k1",
        "status": KILLED,
        "stage": 1,
        "suite": "quicksort",
        "check": "lossless",
        "cell": None,
        "signature": "lossless: hard divergence",
        "build_s": 3.0,
        "diff": "-a\n+b\n",
    }
    survived = {**m.to_json(), "status": SURVIVED, "build_s": 2.0, "diff": "-a\n+b\n", "peers": {"killed": False}}
    html = write_report(tmp_path, campaign, [killed, survived], {m.id: {"verdict": "equivalent", "reason": "dead"}})
    text = html.read_text()
    assert "k1" in text and m.id in text and "equivalent" in text and "dead" in text and "score 1/1" in text
