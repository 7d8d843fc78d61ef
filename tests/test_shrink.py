"""`specharness shrink` and its reproducer bundle on real failures: an in-process fault switch, and a llama-server
built with a seeded defect (the regression commit of the bisect fixture history, whose builds the bisect tests
cache). Each shrink must end with a small prompt that still fails with the run's signature; the bundle's
repro.sh, run on its own with bash and curl, must fail on the seeded build and pass on the clean one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bisect_history import REGRESSION, builds_at

ROOT = Path(__file__).resolve().parents[1]
SEEDED_SUITE = ROOT / "tests" / "data" / "shrink-seeded.yaml"
FAULT_SUITE = ROOT / "tests" / "data" / "shrink-fault.yaml"
CHAT_SUITE = ROOT / "tests" / "data" / "shrink-chat.yaml"


def specharness(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def shrunk(bundle: Path) -> tuple[dict, dict]:
    """(shrink.json, case.json) of a bundle."""
    return json.loads((bundle / "shrink.json").read_text()), json.loads((bundle / "case.json").read_text())


def assert_small(summary: dict, case: dict) -> None:
    """A prompt of at most 16 tokens (the original is 22), with the run's signature, in every request of the case."""
    final = summary["final"]["prompt"]
    assert final is not None and len(final) <= 16, summary["final"]
    assert case["signature"] == summary["signature"]
    target = [
        r
        for leg in case["legs"]
        if leg["role"] == "subject"
        for b in leg["batches"]
        for r in b["requests"]
        if r["key"] == case["key"]
    ]
    assert target and all(r["payload"]["prompt"] == final for r in target)


@pytest.fixture(scope="module")
def fault_bundle(tmp_path_factory) -> Path:
    """A run with an in-process fault (rejected drafts' attention cells kept after a checkpoint restore), shrunk.
    quicksort's C case narrowed (tests/data/shrink-fault.yaml): one case beside it, two rounds, 64 tokens."""
    tmp = tmp_path_factory.mktemp("shrink-fault")
    run = specharness(
        "run",
        "--suite",
        str(FAULT_SUITE),
        "--model",
        "tiny-hybrid",
        "--mode",
        "seq",
        "--spec",
        "scripted-wrong-at-2",
        "--backend",
        "inproc",
        "--fault",
        "skip-seq-rm-after-restore",
        "--out",
        str(tmp / "run"),
    )
    assert run.returncode == 1, run.stderr[-2000:]
    done = specharness("shrink", "--from-run", str(tmp / "run"), "--case", "C", "--out", str(tmp / "bundle"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shrink: trial" in done.stderr  # progress as it goes
    return tmp / "bundle"


@pytest.mark.workflows
@pytest.mark.xdist_group("shrink-fault")  # one fault_bundle for both tests
def test_shrink_of_an_in_process_fault_keeps_its_signature(fault_bundle):
    summary, case = shrunk(fault_bundle)
    assert summary["signature"] == "kv-healthy: duplicate cells" and summary["policy"] == "1 of 1"
    assert summary["original"]["companions"] and len(summary["original"]["rounds"]) > 1  # each pass had work
    assert_small(summary, case)
    assert summary["final"]["n_predict"] < summary["original"]["n_predict"]
    assert summary["final"]["companions"] == [] and len(summary["final"]["rounds"]) == 1
    issue = (fault_bundle / "ISSUE.md").read_text()
    assert (
        "duplicate cells" in issue
        and "specharness models make tiny-hybrid" in issue
        and case["model"]["sha256"] in issue
    )


@pytest.mark.workflows
@pytest.mark.xdist_group("shrink-fault")
def test_repro_py_fails_with_the_fault_and_passes_without(fault_bundle):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    faulty = subprocess.run(
        [sys.executable, "repro.py"], cwd=fault_bundle, env=env, capture_output=True, text=True, timeout=300
    )
    assert faulty.returncode == 1 and "REPRODUCED" in faulty.stdout, faulty.stdout + faulty.stderr
    clean = subprocess.run(
        [sys.executable, "repro.py"],
        cwd=fault_bundle,
        env=dict(env, SPECHARNESS_FAULT="none"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr


@pytest.mark.workflows
@pytest.mark.long
def test_shrink_of_a_failing_chat_turn_drops_the_other_turns_then_shrinks_it_as_a_prompt(tmp_path):
    """A real chat failure: four concurrent chats on a small KV cache (tests/data/shrink-chat.yaml, kv-fill as it
    was) with the draft context not rolled back, the third turn of one judged by kv-healthy. The shrink drops the
    chats in flight beside it, then the earlier turns, then sends the failing turn as one prompt of token ids and
    cuts that, keeping the signature at every step."""
    run = specharness(
        "run",
        "--suite",
        str(CHAT_SUITE),
        "--model",
        "tiny-dense",
        "--backend",
        "inproc",
        "--fault",
        "stale-draft-context",
        "--out",
        str(tmp_path / "run"),
    )
    assert run.returncode == 1, run.stderr[-2000:]
    done = specharness(
        "shrink",
        "--from-run",
        str(tmp_path / "run"),
        "--case",
        "sorts.turn3",
        "--check",
        "kv-healthy",
        "--tries",
        "1",  # deterministic (the fault): the 3 runs of the 4 chats that would tell are the fault test's
        "--out",
        str(tmp_path / "bundle"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary, case = shrunk(tmp_path / "bundle")
    assert summary["signature"] == "kv-healthy: orphans in the draft context"
    assert (
        summary["original"]["turn"] == 2 and summary["original"]["turns"] is None and summary["original"]["companions"]
    )
    steps = [json.loads(line) for line in (tmp_path / "bundle" / "shrink-log.jsonl").read_text().splitlines()]
    held = [s["what"] for s in steps if s["holds"]]
    assert "only the failing turn" in held and any(w.startswith("the failing turn as a prompt of") for w in held)
    assert all(s["seen"] == [summary["signature"]] for s in steps if s["holds"])
    assert summary["final"]["turns"] == [2] and summary["final"]["companions"] == []
    assert_small(summary, case)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """llama-server at the bisect history's regression commit and at its parent, a run of the bisect case on the
    seeded build, and its shrunk bundle (judged by `lossless`: repro.sh compares with the run without drafts)."""
    clean, bad = builds_at(REGRESSION - 1, REGRESSION)
    tmp = tmp_path_factory.mktemp("shrink-seeded")
    run = specharness(
        "run", "--suite", str(SEEDED_SUITE), "--server-bin", str(bad.server_bin), "--out", str(tmp / "run")
    )
    assert run.returncode == 1, run.stderr[-2000:]
    done = specharness(
        "shrink",
        "--from-run",
        str(tmp / "run"),
        "--case",
        "Python",
        "--check",
        "lossless",
        "--tries",
        "1",  # a deterministic defect (greedy, seq): no runs of the original case to tell it
        "--out",
        str(tmp / "bundle"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return clean, bad, tmp / "bundle"


@pytest.mark.workflows
@pytest.mark.xdist_group("bisect-history")  # the fixture repository's builds
def test_shrink_of_a_seeded_llama_server_defect(seeded):
    _, _, bundle = seeded
    summary, case = shrunk(bundle)
    # the divergence is triaged kv-corrupt: the lossless verdict restates the KV scan's signature
    assert summary["signature"] == "kv-healthy: duplicate cells" and case["judge"] == "differs"
    assert_small(summary, case)
    assert (bundle / "repro.sh").is_file() and (bundle / "requests").is_dir()


@pytest.mark.workflows
@pytest.mark.xdist_group("bisect-history")  # the fixture repository's builds
def test_repro_sh_alone_fails_on_the_seeded_build_and_passes_on_the_clean_one(seeded, tmp_path):
    clean, bad, bundle = seeded
    alone = tmp_path / "bundle"
    shutil.copytree(bundle, alone)  # nothing of the checkout: bash, curl and the files of the bundle
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    failing = subprocess.run(
        ["bash", str(alone / "repro.sh")],
        env=dict(env, LLAMA_SERVER=str(bad.server_bin)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failing.returncode == 1 and "REPRODUCED" in failing.stdout, failing.stdout + failing.stderr
    assert "expected (" in failing.stdout and "actual" in failing.stdout
    passing = subprocess.run(
        ["bash", str(alone / "repro.sh")],
        env=dict(env, LLAMA_SERVER=str(clean.server_bin)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert passing.returncode == 0, passing.stdout + passing.stderr


@pytest.mark.workflows
def test_a_smaller_case_of_an_acceptance_failure_is_judged_against_a_baseline_recorded_for_it(tmp_path):
    """`acceptance` compares with the baseline stored for the original case. Judged that way, a one-token case
    that drafts nothing 'falls' too: the signature for the wrong reason. Judged against a baseline the reference
    configuration (no --fault) records for it, it passes, while the original case still fails."""
    from argparse import Namespace

    from harness.models import resolve
    from harness.repro.legs import tokenize
    from harness.shrink.candidate import initial
    from harness.shrink.cli import Origin
    from harness.shrink.trial import Policy, Runner

    run = specharness(
        "run",
        "--suite",
        "quicksort",
        "--model",
        "tiny-dense-loop",
        "--mode",
        "par",
        "--spec",
        "ngram-map-k",
        "--backend",
        "inproc",
        "--fault",
        "shared-drafter-state",
        "--out",
        str(tmp_path / "run"),
    )
    assert run.returncode == 1, run.stderr[-2000:]
    args = Namespace(
        from_run=str(tmp_path / "run"),
        case="Python",  # the C case keeps its acceptance at 64 tokens
        check="acceptance",
        mode=None,
        spec=None,
        model=None,
        backend=None,
        server_bin=None,
        source=None,
    )
    origin = Origin(args, "shrink")
    assert origin.signature == "acceptance: fell against baseline"
    start = initial(origin.suite, "Python", origin.check, origin.cell)
    tiny = start.with_(prompt=tuple(tokenize(resolve("tiny-dense-loop").path, "Write")), n_predict=1, companions=())
    runner = Runner(origin.options, None, None, origin.signature, Policy(), tmp_path / "logs", origin=start)
    assert runner.attempt(start).shows(origin.signature)
    assert runner.attempt(tiny).signatures == []
    stored = Runner(origin.options, None, None, origin.signature, Policy(), tmp_path / "logs2", origin=tiny)
    # judged against C's baseline (what the shrink kept before): C's rows were measured on another output, so the
    # one-token case is not compared with them (acceptance: not run), rather than 'falling' for the wrong reason
    assert stored.attempt(tiny).signatures == []


def test_a_baseline_relative_failure_without_a_reference_configuration_is_refused_in_one_line():
    from argparse import Namespace

    from harness.errors import HarnessError
    from harness.shrink.driver import require_shrinkable
    from harness.shrink.trial import reference_of

    assert reference_of(Namespace(fault="stale-draft-context"), None, None, "inproc") == "without --fault"
    assert reference_of(Namespace(fault=None), Path("llama-server"), None, "server") == "the vendored llama-server"
    assert reference_of(Namespace(fault=None), None, None, "inproc") is None
    require_shrinkable("acceptance", "without --fault")
    require_shrinkable("lossless", None)
    for check in ("acceptance", "baseline"):
        with pytest.raises(
            HarnessError, match=f"a `{check}` failure compares with the baseline stored for the original case"
        ):
            require_shrinkable(check, None)
