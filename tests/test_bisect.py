"""`specharness bisect` on a real llama.cpp history: real builds, a real llama-server, real git.

The history (tests/bisect_history.py) is twelve commits on the vendored llama.cpp: #4 does not compile,
#6 drops the seq_rm after a speculative checkpoint restore (a real llama-server bug class), #9 aborts every
request past its 8th token (#10 reverts it), #11 aborts llama-server while it loads the model. The first
run builds each visited commit incrementally in one persistent tree (a few minutes with a warm
compiler cache); later runs find every build in the cache and only judge.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bisect_history import (
    BROKEN,
    MID_REQUEST_CRASH,
    REGRESSION,
    REGRESSION_TIP,
    STARTUP_ABORT,
    commits,
    fixture_lock,
    history_repo,
)
from interrupts import interrupt, left_behind, spawn, wait_for_phase

from harness.backends.build import build_tree_dir, cmake_options
from harness.backends.build.cmake import TREE_MARKER
from harness.bisect.judge import BAD, GOOD, SKIP, verdict_of
from harness.bisect.plan import from_run, from_suite
from harness.bisect.releases import release_range
from harness.bisect.step import CURRENT, read_log
from harness.checks.base import CheckResult
from harness.errors import HarnessError
from harness.paths import cache_dir

pytestmark = [
    pytest.mark.xdist_group("bisect-history"),  # one fixture repository: its tests run on one worker
    pytest.mark.stress,
]

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "data" / "bisect-quicksort.yaml"
CRASH_SUITE = ROOT / "tests" / "data" / "bisect-crash.yaml"
CELLS_SUITE = ROOT / "tests" / "data" / "bisect-cells.yaml"
SAMPLED_SUITE = ROOT / "tests" / "data" / "bisect-sampled.yaml"


def specharness(*args: str, **kw) -> subprocess.Popen:
    """`python -m harness.cli ...` of this checkout as a process of its own (real signals, real exit status)."""
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def finish(proc: subprocess.Popen, timeout: float = 1800) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def assert_restored(repo: Path) -> None:
    """On main again, nothing modified, no bisect left behind."""
    assert git(repo, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert git(repo, "status", "--porcelain") == ""
    assert not (repo / ".git" / "BISECT_START").exists()


@pytest.fixture
def history():
    """The fixture repository, one test at a time (a bisect checks out commits in it)."""
    with fixture_lock():  # before history_repo(), which resets a bisect left behind
        repo = history_repo()
        yield repo
    assert_restored(repo)


def bisect_args(repo: Path, out: Path, good: int = 1) -> list[str]:
    """Bisect from commit #`good` (1 = the imported tree) to the last commit before the crash commits (#9 on:
    the regression's history as it was, so the bisect visits the commit that does not build)."""
    return [
        "bisect",
        "--source",
        str(repo),
        "--good",
        commits(repo)[good - 1],
        "--bad",
        commits(repo)[REGRESSION_TIP - 1],
        "--suite",
        str(SUITE),
        "--out",
        str(out),
    ]


def check_outcome(repo: Path, out: Path, stdout: str, good: int = 1) -> None:
    shas = commits(repo)
    regression, broken = shas[REGRESSION - 1], shas[BROKEN - 1]
    assert f"first bad commit: {regression}" in stdout
    log = read_log(out)
    by_commit = {e["commit"]: e for e in log}
    if good < BROKEN:
        assert by_commit[broken]["verdict"] == "skip" and by_commit[broken]["build_attempts"] == 2
        assert "does not build" in by_commit[broken]["reason"]
    assert by_commit[shas[good - 1]]["role"] == "verify-good" and by_commit[shas[good - 1]]["verdict"] == "good"
    tip = shas[REGRESSION_TIP - 1]
    assert by_commit[tip]["role"] == "verify-bad" and by_commit[tip]["verdict"] == "bad"
    assert by_commit[regression]["verdict"] == "bad" and by_commit[shas[REGRESSION - 2]]["verdict"] == "good"
    failed = [c for c in by_commit[regression]["checks"] if not c["passed"]]
    assert failed, "the first bad commit must fail a check"
    assert all(e["verdict"] in ("good", "bad", "skip") and "build_seconds" in e for e in log)
    result = json.loads((out / "bisect.json").read_text())
    assert result["first_bad"]["commit"] == regression and result["parent"]["entry"]["verdict"] == "good"
    html = (out / "bisect.html").read_text()
    assert regression in html and "drop the seq_rm" in html and failed[0]["check"] in html


@pytest.mark.workflows
def test_bisect_finds_the_regression_and_skips_the_commit_that_does_not_build(history, tmp_path):
    status, out, err = finish(specharness(*bisect_args(history, tmp_path / "run")))
    assert status == 0, err[-3000:]
    check_outcome(history, tmp_path / "run", out)


@pytest.mark.workflows
def test_interrupted_bisect_leaves_the_checkout_clean_and_resume_finishes_it(history, tmp_path):
    run_dir, phases = tmp_path / "run", tmp_path / "phases"
    # held in the build of the first `git bisect run` step (cached after the first run of this test): the
    # steps judging the good and the bad end built first; the skip is the test above's
    proc = spawn(bisect_args(history, run_dir, good=BROKEN + 1), phases, hold="building:3")
    wait_for_phase(proc, phases, "building", 3)
    current = json.loads((run_dir / CURRENT).read_text())
    assert (current["role"], current["phase"]) == ("step", "build")
    status, err = interrupt(proc)
    assert status == 130, err[-3000:]
    assert f"--resume {run_dir}" in err
    assert_restored(history)
    assert left_behind(run_dir) == []
    with pytest.raises(ProcessLookupError):
        os.kill(current["pid"], 0)  # the step process is gone, with its build or server
    # this checkout's build tree went back to its place; the shared work path may hold another build's by now
    # (another xdist worker, another job on the machine), never this one's
    own = build_tree_dir(history, "cpu", cmake_options("cpu"))
    assert own.is_dir() and (own / TREE_MARKER).read_text().strip() == own.name, own
    mounted = cache_dir() / "work" / "src"
    assert not (mounted.is_symlink() and mounted.resolve() == history.resolve())
    logged = len(read_log(run_dir))
    status, out, err = finish(specharness("bisect", "--resume", str(run_dir)))
    assert status == 0, err[-3000:]
    check_outcome(history, run_dir, out, good=BROKEN + 1)
    roles = [e["role"] for e in read_log(run_dir)]
    assert roles.count("verify-good") == roles.count("verify-bad") == 1  # not judged again
    assert len(read_log(run_dir)) > logged


@pytest.mark.workflows
def test_sigterm_between_bisect_steps_keeps_the_log_and_the_checkout(history, tmp_path):
    run_dir, phases = tmp_path / "run", tmp_path / "phases"
    # held as the first `git bisect run` step starts: both ends judged and logged, nothing of the step done
    proc = spawn(bisect_args(history, run_dir, good=BROKEN + 1), phases, hold="bisect-step")
    wait_for_phase(proc, phases, "bisect-step")
    status, err = interrupt(proc, signal.SIGTERM)
    assert status == 143, err[-3000:]
    assert f"--resume {run_dir}" in err
    assert_restored(history)
    assert left_behind(run_dir) == []
    assert [e["role"] for e in read_log(run_dir)] == ["verify-bad", "verify-good"]  # the failing end pins first
    assert not (run_dir / CURRENT).exists()


@pytest.mark.workflows
@pytest.mark.parametrize(
    "good, bad, culprit, reason",
    [
        (MID_REQUEST_CRASH - 2, MID_REQUEST_CRASH, MID_REQUEST_CRASH, "fixture: a request past its 8th token"),
        (STARTUP_ABORT - 1, STARTUP_ABORT + 1, STARTUP_ABORT, "fixture: abort while loading the model"),
    ],
    ids=["mid-request-crash", "start-up-abort"],
)
def test_bisect_with_a_pinned_comparison_check_names_the_commit_that_crashes(
    history, tmp_path, good, bad, culprit, reason
):
    """Pinned on `lossless` only (as --from-run pins the check that failed): a build whose every request crashes
    leaves lossless nothing to compare, and one that aborts at start-up serves nothing; `no-crash`, always judged,
    makes both bad (they were good and skip)."""
    shas = commits(history)
    out = tmp_path / "run"
    argv = ["bisect", "--source", str(history), "--good", shas[good - 1], "--bad", shas[bad - 1]]
    argv += ["--suite", str(CRASH_SUITE), "--check", "lossless", "--out", str(out)]
    status, stdout, err = finish(specharness(*argv))
    assert status == 0, err[-3000:]
    assert f"first bad commit: {shas[culprit - 1]}" in stdout
    entry = next(e for e in read_log(out) if e["commit"] == shas[culprit - 1])
    assert entry["verdict"] == "bad" and entry["reason"].startswith("no-crash failed")
    assert "GGML_ASSERT(" in entry["reason"] and reason in entry["reason"]
    assert [c["check"] for c in entry["checks"]] == ["no-crash", "lossless"]
    lossless = entry["checks"][1]
    assert lossless["status"] == "not run" and not lossless["passed"]


@pytest.mark.workflows
@pytest.mark.parametrize(
    "suite, mode, not_applying",
    [
        (CELLS_SUITE, "seq", {"repeat-identical", "mode-invariant"}),
        (CELLS_SUITE, "par", {"repeat-identical"}),
        (SAMPLED_SUITE, "seq", {"repeat-identical", "mode-invariant"}),
    ],
    ids=["seq", "par", "sampled"],
)
def test_bisect_of_any_cell_names_the_regression_and_requires_no_check_that_does_not_apply_to_it(
    history, tmp_path, suite, mode, not_applying
):
    """The history as the issue had it (a tree that builds, the commit dropping the seq_rm, two more that change
    comments and docs): checks that do not apply to the cell are not run at every commit and make none of them
    unjudgeable; the failure the bad end pins (the KV scan's duplicate cells) decides good and bad."""
    shas = commits(history)
    out = tmp_path / "run"
    argv = ["bisect", "--source", str(history), "--good", shas[BROKEN], "--bad", shas[REGRESSION_TIP - 1]]
    argv += ["--suite", str(suite), "--mode", mode, "--out", str(out)]
    status, stdout, err = finish(specharness(*argv))
    assert status == 0, err[-3000:]
    assert f"first bad commit: {shas[REGRESSION - 1]}" in stdout
    assert_restored(history)
    log = read_log(out)
    assert [e["role"] for e in log[:2]] == ["verify-bad", "verify-good"]
    assert "kv-healthy: duplicate cells" in json.loads((out / "plan.json").read_text())["signatures"]
    by_commit = {e["commit"]: e for e in log}
    for n, verdict in ((BROKEN + 1, "good"), (REGRESSION, "bad"), (REGRESSION_TIP, "bad")):
        entry = by_commit[shas[n - 1]]
        assert entry["verdict"] == verdict, (n, entry["reason"])
        assert {c["check"] for c in entry["checks"] if c["status"] == "not run"} == not_applying, n
    assert by_commit[shas[REGRESSION - 1]]["reason"].startswith("kv-healthy failed: ")
    assert all(e["verdict"] in ("good", "bad") for e in log), [(e["commit"][:10], e["reason"]) for e in log]


def test_the_fixture_repository_recovers_from_the_locks_a_killed_git_leaves():
    """A test killed while its bisect's git ran leaves `.git/index.lock` (and a bisect): the next test's
    `history_repo()` removes them instead of failing with `git checkout` exit 128."""
    with fixture_lock():
        repo = history_repo()
        (repo / ".git" / "index.lock").write_text("")
        (repo / ".git" / "HEAD.lock").write_text("")
        repo = history_repo()
        assert not list((repo / ".git").rglob("*.lock"))
        assert_restored(repo)


STEP_CMD = (
    f'{sys.executable} -m harness.cli build --source . --json | {sys.executable} -c "import json, shutil, sys, os; '
    "os.makedirs('build-step-cmd', exist_ok=True); "
    "shutil.copy(json.load(sys.stdin)['server_bin'], 'build-step-cmd/llama-server')\""
)
"""A bring-your-own build: any command that leaves a llama-server in the checkout (here: specharness's own
build, copied to an ignored directory)."""


@pytest.mark.workflows
def test_step_cmd_replaces_the_built_in_build(history, tmp_path):
    shas = commits(history)
    regression = shas[REGRESSION - 1]
    out = tmp_path / "run"
    try:
        status, stdout, err = finish(
            specharness(
                "bisect",
                "--source",
                str(history),
                "--good",
                shas[REGRESSION - 2],
                "--bad",
                shas[REGRESSION],
                "--suite",
                str(SUITE),
                "--step-cmd",
                STEP_CMD,
                "--server-bin-pattern",
                "build-step-cmd/llama-*",
                "--out",
                str(out),
            )
        )
    finally:
        shutil.rmtree(history / "build-step-cmd", ignore_errors=True)
    assert status == 0, err[-3000:]
    assert f"first bad commit: {regression}" in stdout
    log = read_log(out)
    assert all(e["server"]["server_bin"].endswith("build-step-cmd/llama-server") for e in log)
    assert (out / f"step-cmd-{regression[:12]}.log").is_file()


# ------------------------------------------------------------------------------ bad input, one line


@pytest.fixture
def small_repo(tmp_path) -> Path:
    repo = tmp_path / "llama.cpp"
    repo.mkdir()
    (repo / "CMakeLists.txt").write_text("project(x)\n")
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one"],
    ):
        git(repo, *args)
    return repo


def _one_line_error(args: list[str]) -> str:
    status, out, err = finish(specharness(*args), timeout=120)
    assert status == 2 and err.count("\n") == 1 and err.startswith("specharness: error: "), (status, out, err)
    return err


@pytest.mark.workflows
def test_dirty_checkout_is_refused_in_one_line(small_repo, tmp_path):
    (small_repo / "CMakeLists.txt").write_text("project(y)\n")
    err = _one_line_error(
        [
            "bisect",
            "--source",
            str(small_repo),
            "--good",
            "main",
            "--bad",
            "main",
            "--suite",
            str(SUITE),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert "uncommitted changes" in err and "CMakeLists.txt" in err


@pytest.mark.workflows
def test_unknown_revision_and_non_checkout_are_one_line_errors(small_repo, tmp_path):
    err = _one_line_error(
        [
            "bisect",
            "--source",
            str(small_repo),
            "--good",
            "v9.9",
            "--bad",
            "main",
            "--suite",
            str(SUITE),
            "--out",
            str(tmp_path / "a"),
        ]
    )
    assert "unknown revision 'v9.9'" in err
    plain = tmp_path / "plain"
    plain.mkdir()
    err = _one_line_error(
        [
            "bisect",
            "--source",
            str(plain),
            "--good",
            "a",
            "--bad",
            "b",
            "--suite",
            str(SUITE),
            "--out",
            str(tmp_path / "b"),
        ]
    )
    assert "not the top of a git checkout" in err


def test_every_dimension_of_the_cell_is_pinned():
    with pytest.raises(HarnessError, match="several cases .*pin one with --case"):
        from_suite("quicksort")
    with pytest.raises(HarnessError, match="several values of mode .*--mode"):
        from_suite("quicksort", case="C")
    plan = from_suite(str(SUITE))
    assert (plan.case, plan.mode, plan.spec, plan.model) == ("C", "seq", "draft-simple", "tiny-hybrid")
    assert plan.checks == ["no-crash", "lossless", "kv-healthy"] and plan.cell.backend == "server"


def _checks_json(run_dir: Path, records: list[dict]) -> Path:
    run_dir.mkdir()
    base = {"suite": "quicksort", "message": "", "evidence": {}}
    (run_dir / "checks.json").write_text(json.dumps([dict(base, **r) for r in records]))
    return run_dir


def test_from_run_pins_the_failing_cell_and_names_what_is_wrong(tmp_path):
    cell = {"backend": "server", "mode": "par", "spec": "draft-simple", "model": "tiny-hybrid"}
    run = _checks_json(
        tmp_path / "run",
        [
            dict(cell, case="C", check="lossless", passed=False),
            dict(cell, case="C", check="no-crash", passed=True),
            dict(cell, case="Java", check="lossless", passed=True),
            dict(cell, backend="inproc", case="Python", check="lossless", passed=False),
        ],
    )
    plan = from_run(run, "C")
    assert (plan.case, plan.mode, plan.spec, plan.model, plan.checks) == (
        "C",
        "par",
        "draft-simple",
        "tiny-hybrid",
        ["lossless"],
    )
    with pytest.raises(HarnessError, match="did not fail"):
        from_run(run, "Java")
    with pytest.raises(HarnessError, match="no case 'Rust'"):
        from_run(run, "Rust")
    with pytest.raises(HarnessError, match="only on the inproc backend"):
        from_run(run, "Python")
    with pytest.raises(HarnessError, match="not a run directory"):
        from_run(tmp_path, "C")


def test_a_step_judges_as_run_does_and_is_bad_only_with_the_pinned_signature():
    """The checks' own policy decides (a near-tie in seq on a model calibrated bit-exact is a failed verdict there,
    and bisect does not excuse it again); a failure is bad only with the pinned failure's signature, another
    failure at a step is a skip naming both; --strict counts a comparison that excused proven near-ties as bad."""
    near = CheckResult(
        "lossless",
        False,
        "1 of 1 outputs differ from the seq reference; round 0: near-tie at token 3",
        {"first_divergence": {"kind": "near-tie", "index": 3}},
        failures=["round 0: near-tie at token 3"],
    )
    assert verdict_of([near], strict=False)["verdict"] == BAD  # the check failed it: not excused again
    pinned = verdict_of([near], strict=False)["signatures"]
    assert verdict_of([near], strict=False, pinned=pinned)["verdict"] == BAD
    crash = CheckResult(
        "no-crash", False, "1 of 1 requests failed", failures=["round 0: llama-server was killed by SIGSEGV"]
    )
    other = verdict_of([crash], strict=False, pinned=pinned)
    assert other["verdict"] == SKIP and "another failure than the pinned one" in other["reason"], other
    assert pinned[0] in other["reason"]
    excused = CheckResult("lossless", True, "1 of 1 outputs differ at proven near-ties", {"near_ties": 1})
    assert verdict_of([excused], strict=False)["verdict"] == GOOD
    assert verdict_of([excused], strict=True)["verdict"] == BAD


def test_release_ranges_are_validated():
    available = ["0.3.29", "0.3.30", "0.3.31", "0.3.32", "0.3.33"]
    assert release_range("0.3.30..0.3.32", available) == ["0.3.30", "0.3.31", "0.3.32"]
    for bad, message in (
        ("0.3.32..0.3.30", "not older"),
        ("latest", "OLD..NEW"),
        ("0.3.30..0.3.99", "not on the package index"),
    ):
        with pytest.raises(HarnessError, match=message):
            release_range(bad, available)
