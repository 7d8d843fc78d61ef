"""`repro.sh` of a failing `par` case (two requests sent at once) against the vendored llama-server: it waits for
its own requests only (never for the llama-server it started), so it ends within its timeout whatever the
build does, and it tells apart the same failure (exit 1), a different failure (exit 3) and no failure (exit 0).

The failure is a real llama.cpp abort the vendored build has (known failure server-small-batch-drafts-overflow:
`-b 2 -np 2` with a draft model). "A build without the defect" is the same llama-server given a batch large
enough for the drafts (a wrapper appends `-b 64`: later options win); a different failure is a request timeout
where the run crashed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAILURE = "small-batch[C-par-draft-simple-tiny-dense-server]"
ABORT = 'GGML_ASSERT(add_ok && "batch must be large enough to hold the sampled and draft tokens") failed'


def specharness(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, tiny_models) -> Path:
    tmp = tmp_path_factory.mktemp("repro-sh")
    run = specharness(
        "run",
        "--suite",
        "small-batch",
        "--backend",
        "server",
        "--model",
        "tiny-dense",
        "--spec",
        "draft-simple",
        "--out",
        str(tmp / "run"),
    )
    assert run.returncode == 0, run.stderr[-2000:]  # the abort is a known llama.cpp defect
    done = specharness("repro", FAILURE, "--from-run", str(tmp / "run"), "--out", str(tmp / "bundle"))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "bundle"


def repro(bundle: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """repro.sh on its own (bash, curl and the bundle's files), bounded well below any hang."""
    return subprocess.run(
        ["bash", str(bundle / "repro.sh")],
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _server(bundle: Path) -> str:
    for line in (bundle / "repro.sh").read_text().splitlines():
        if line.startswith('LLAMA_SERVER="${LLAMA_SERVER:-'):
            return line[len('LLAMA_SERVER="${LLAMA_SERVER:-') : -2]
    raise AssertionError("no LLAMA_SERVER default in repro.sh")


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_the_bundle_sends_the_batch_at_once_and_waits_for_its_requests_only(bundle):
    script = (bundle / "repro.sh").read_text()
    assert 'post subject-0-0 & REQS+=($!); post subject-0-1 & REQS+=($!); wait "${REQS[@]}"' in script
    assert "\nwait\n" not in script and " wait\n" not in script  # no bare wait: it would wait for llama-server too
    head = script.split("set -u")[0]
    assert "1 the failure reproduces" in head and "3 a different failure" in head and "0 it does not" in head


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_repro_sh_reproduces_the_abort_on_the_build_with_the_defect(bundle, tmp_path):
    done = repro(bundle, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "REPRODUCED: llama-server stopped answering" in done.stdout and ABORT in done.stdout


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_repro_sh_ends_not_reproduced_where_the_defect_is_absent(bundle, tmp_path):
    """The maintainer's check of a fix: every request completes, the script must end (it hung before)."""
    server = tmp_path / "llama-server"
    server.write_text(f'#!/usr/bin/env bash\nexec "{_server(bundle)}" "$@" -b 64\n')
    server.chmod(0o755)
    # one run (REPRO_RUNS=1) of the N its measured rate asks (3 of 3: N = 11; tests/test_repro_rate.py)
    done = repro(bundle, tmp_path, LLAMA_SERVER=str(server), REPRO_RUNS="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not reproduced: every request completed" in done.stdout


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_a_timeout_where_the_run_crashed_is_a_different_failure(bundle, tmp_path):
    """llama-server keeps running and a request gets no answer in time: not the abort (it used to count as
    "REPRODUCED: llama-server stopped answering")."""
    server = tmp_path / "llama-server"
    server.write_text(f'#!/usr/bin/env bash\nexec "{_server(bundle)}" "$@" -b 64\n')
    server.chmod(0o755)
    done = repro(bundle, tmp_path, LLAMA_SERVER=str(server), REQUEST_TIMEOUT="0.01")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "DIFFERENT FAILURE" in done.stdout and "got no answer within 0.01 s" in done.stdout


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_an_http_error_from_a_live_server_where_the_run_crashed_is_a_different_failure(bundle, tmp_path):
    """llama-server answers the subject requests with an HTTP error and keeps running: not the abort (an HTTP error
    answer used to count as "REPRODUCED: llama-server stopped answering"). Here the error is the refusal of a
    request without the API key llama-server was started with; repro.sh reads every non-200 answer of a live
    llama-server alike."""
    server = tmp_path / "llama-server"
    server.write_text(f'#!/usr/bin/env bash\nexec "{_server(bundle)}" "$@" -b 64 --api-key not-sent\n')
    server.chmod(0o755)
    done = repro(bundle, tmp_path, LLAMA_SERVER=str(server))
    assert done.returncode == 3, done.stdout + done.stderr
    assert "DIFFERENT FAILURE" in done.stdout and re.search(r"subject-0-\d: HTTP [45]\d\d: ", done.stdout), done.stdout


@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_the_issue_says_how_to_get_the_specharness_that_wrote_it(bundle):
    case = json.loads((bundle / "case.json").read_text())
    issue = (bundle / "ISSUE.md").read_text()
    assert "pip install specharness" not in issue
    commit = case["harness"]["commit"]  # the checkout's commit when the bundle was written (HEAD may move since)
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    assert len(commit) == 40 and known.returncode == 0
    assert f"specharness at commit `{commit}`" in issue or f"@{commit}'`" in issue


SEGV_WRAPPER = """#!/usr/bin/env bash
# the run's llama-server with a batch large enough for the drafts, killed by SIGSEGV once a slot is busy
port=""; prev=""
for a in "$@"; do [ "$prev" = --port ] && port="$a"; prev="$a"; done
[ -z "$port" ] && exec "{server}" "$@"
"{server}" "$@" -b 64 &
pid=$!
( while kill -0 $pid 2>/dev/null; do
    if curl -s "http://127.0.0.1:$port/slots" 2>/dev/null | grep -q '"is_processing":true'; then
      kill -SEGV $pid; exit
    fi
    sleep 0.01
  done ) &
wait $pid
"""


@pytest.mark.workflows
@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_specharness_repro_tells_not_reproduced_and_a_different_failure_apart(bundle, tmp_path):
    run = bundle.parent / "run"
    fixed = tmp_path / "fixed"
    fixed.write_text(f'#!/usr/bin/env bash\nexec "{_server(bundle)}" "$@" -b 64\n')
    fixed.chmod(0o755)
    passed = specharness(
        "repro", FAILURE, "--from-run", str(run), "--server-bin", str(fixed), "--out", str(tmp_path / "a")
    )
    assert passed.returncode == 1, passed.stderr[-2000:]
    assert "not reproduced: every one of 3 runs passed" in passed.stderr and not (tmp_path / "a" / "case.json").exists()
    segv = tmp_path / "segv"
    segv.write_text(SEGV_WRAPPER.replace("{server}", _server(bundle)))
    segv.chmod(0o755)
    other = specharness(
        "repro", FAILURE, "--from-run", str(run), "--server-bin", str(segv), "--out", str(tmp_path / "b")
    )
    assert other.returncode == 4, other.stderr[-2000:]
    assert "a different failure: crash: " in other.stderr and "showed in 0 of 3 runs" in other.stderr


def test_repro_py_tells_the_same_failure_a_different_one_and_none_apart():
    """repro.py (the in-process engine) judges as repro.sh does: the run's signature, another failure, none."""
    from harness.repro.replay import DIFFERENT, NOT_REPRODUCED, REPRODUCED, judge
    from harness.result import Result

    abort = "the in-process engine's worker was killed by SIGABRT: x.cpp:1: GGML_ASSERT(a > b) failed; log l ends"
    case = {"judge": "crash", "key": "C", "signature": "crash: GGML_ASSERT(a > b) failed", "legs": []}

    def seen(*results):
        return judge(case, {"subject": {"C": list(results)}})[0]

    ok = Result(tokens=[1, 2], stop_reason="limit")
    assert seen(ok, Result(stop_reason="crashed", error=abort)) == REPRODUCED
    other = abort.replace("a > b", "c != d")
    assert seen(ok, Result(stop_reason="crashed", error=other)) == DIFFERENT
    assert seen(ok, Result(stop_reason="timeout", error="timeout: case C did not finish")) == DIFFERENT
    assert seen(ok, ok) == NOT_REPRODUCED
    kv = {**case, "judge": "kv", "signature": "kv-healthy: duplicate cells"}
    scan = {"healthy": False, "totals": {"duplicate_cells": 0, "orphans": 3, "missing_positions": 0}}
    damaged = Result(tokens=[1], stop_reason="limit", kv_scan=scan)
    assert judge(kv, {"subject": {"C": [damaged]}})[0] == DIFFERENT  # orphans, not the duplicate cells
    scan = {**scan, "totals": {**scan["totals"], "duplicate_cells": 2}}
    assert judge(kv, {"subject": {"C": [Result(tokens=[1], stop_reason="limit", kv_scan=scan)]}})[0] == REPRODUCED


@pytest.mark.workflows
def test_repro_sh_of_a_kv_failure_scans_the_failing_requests_own_slot(tmp_path, tiny_models):
    """eog's `replay` (the known defect server-spec-keeps-eog: the slot keeps the EOG token at P+T): its slot is
    saved right after it, before the suite's next requests take the slot (before, the scan read the last
    request's state against the failing request's counts); the end-of-generation token llama-server lists is not
    a returned token."""
    run = specharness(
        "run",
        "--suite",
        "eog",
        "--backend",
        "server",
        "--spec",
        "draft-simple",
        "--model",
        "tiny-recurrent",
        "--mode",
        "seq",
        "--out",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    failure = "eog[replay-seq-draft-simple-tiny-recurrent-server]"
    done = specharness("repro", failure, "--from-run", str(tmp_path / "run"), "--out", str(tmp_path / "bundle"))
    assert done.returncode == 0, done.stderr[-3000:]
    script = (tmp_path / "bundle" / "repro.sh").read_text()
    assert script.index("post subject-0-1\n") < script.index("action=save") < script.index("post subject-0-2\n")
    work = tmp_path / "work"
    work.mkdir()
    same = repro(tmp_path / "bundle", work)
    assert same.returncode == 1, same.stdout + same.stderr
    assert "REPRODUCED: kv-healthy: positions past the returned tokens" in same.stdout
    assert "positions up to 17 after 8 prompt + 9 returned tokens" in same.stdout
    # a scanner that fails exits 1 like an unhealthy scan, without its report: no verdict, exit 2
    broken = tmp_path / "broken"
    broken.mkdir()
    said = "ModuleNotFoundError: No module named 'harness'"
    (broken / "specharness").write_text(f'#!/bin/sh\necho "{said}" >&2\nexit 1\n')
    (broken / "specharness").chmod(0o755)
    failed = repro(tmp_path / "bundle", work, SPECHARNESS=str(broken / "specharness"))
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "specharness scan could not read the slot file (exit 1): ModuleNotFoundError" in failed.stdout
    assert "not reproduced" not in failed.stdout and "REPRODUCED" not in failed.stdout


@pytest.mark.workflows
def test_repro_sh_of_a_divergence_reproduces_only_where_the_run_diverged(tmp_path, tiny_models):
    """draft-budget's ctx_end_c (known defect server-spec-context-end-early-stop: the output ends 3 tokens early at
    the context end, the first divergence at token 53): judged against the run without drafts, repro.sh
    reproduces it at that token; with drafts of at most 2 tokens the outputs are equal: not reproduced."""
    run = specharness(
        "run",
        "--suite",
        "draft-budget",
        "--backend",
        "server",
        "--spec",
        "draft-simple,none",
        "--model",
        "tiny-dense",
        "--mode",
        "seq",
        "--out",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    failure = "draft-budget[ctx_end_c-seq-draft-simple-tiny-dense-server]"
    done = specharness("repro", failure, "--from-run", str(tmp_path / "run"), "--out", str(tmp_path / "bundle"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RUN_AT=' 53 '" in (tmp_path / "bundle" / "repro.sh").read_text()
    work = tmp_path / "work"
    work.mkdir()
    same = repro(tmp_path / "bundle", work)
    assert same.returncode == 1 and "REPRODUCED: the output first diverges where it did in the run" in same.stdout, (
        same.stdout + same.stderr
    )
    short = tmp_path / "short-drafts"
    short.write_text(f'#!/usr/bin/env bash\nexec "{_server(tmp_path / "bundle")}" "$@" --spec-draft-n-max 2\n')
    short.chmod(0o755)
    equal = repro(tmp_path / "bundle", work, LLAMA_SERVER=str(short), REPRO_RUNS="1")  # one of its N runs
    assert equal.returncode == 0 and "not reproduced: the outputs are equal" in equal.stdout, equal.stdout


@pytest.mark.workflows
@pytest.mark.long
def test_the_reproducers_of_slot_restore_failures_replay_the_saves_and_restores(tmp_path, tiny_models):
    """slot-restore on llama-server (ggml-org/llama.cpp#28619): the bundle replays each restore round's slot steps
    (`POST /slots/0?action=save|erase|restore`, a fresh llama-server for `restore-fresh`, the other conversation
    before `restore-over`'s restore). Known defect slot-restore-drops-draft-context (tiny-dense): repro.sh
    reproduces the run's drafted / accepted counts after each restore (exit 1); repro.py, on the engine that
    restores the draft context too, does not (exit 0). Known defect slot-restore-over-recurrent-draft-aborts
    (tiny-hybrid): repro.sh reproduces the abort of `restore-over`."""
    run = specharness(
        "run",
        "--suite",
        "slot-restore",
        "--backend",
        "server",
        "--spec",
        "draft-simple",
        "--model",
        "tiny-dense",
        "--model",
        "tiny-hybrid",
        "--out",
        str(tmp_path / "run"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    bundles = {}
    for model, check in (("tiny-dense", "restore-identical"), ("tiny-hybrid", "no-crash")):
        failure = f"slot-restore[chat.turn2-seq-draft-simple-{model}-server]"
        bundles[model] = tmp_path / f"bundle-{model}"
        done = specharness(
            "repro", failure, "--check", check, "--tries", "1", "--from-run", str(tmp_path / "run"),
            "--out", str(bundles[model]),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    script = (bundles["tiny-dense"] / "repro.sh").read_text()
    steps = ["slot_action subject 0 save saved-r1-chat.bin", "slot_action subject 0 erase",
             "slot_action subject 0 restore saved-r1-chat.bin", "start_server subject-fresh",
             "slot_action subject 0 restore saved-r2-chat.bin", "use_server main", "-detour",
             "slot_action subject 0 restore saved-r3-chat.bin"]  # fmt: skip
    at = 0
    for step in steps:  # in this order
        assert step in script[at:], f"{step} missing after the earlier steps:\n{script}"
        at = script.index(step, at)
    assert "--slot-save-path" in script
    assert "action=save" in (bundles["tiny-dense"] / "ISSUE.md").read_text()
    work = tmp_path / "work"
    work.mkdir()
    same = repro(bundles["tiny-dense"], work)
    assert same.returncode == 1, same.stdout + same.stderr
    assert "REPRODUCED: a restored turn drafted / accepted other counts, same output" in same.stdout
    assert "uninterrupted: drafted / accepted 69 29" in same.stdout
    assert "round 1 (restore): drafted / accepted 88 24" in same.stdout  # the run's counts (known-failures.yaml)
    engine = subprocess.run(
        [sys.executable, str(bundles["tiny-dense"] / "repro.py")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert "round 3 (restore-over): drafted / accepted (69, 29)" in engine.stdout
    aborted = repro(bundles["tiny-hybrid"], work)
    assert aborted.returncode == 1, aborted.stdout + aborted.stderr
    assert "common.cpp:1539: failed to remove sequence 0 with p0=" in aborted.stdout


@pytest.mark.xdist_group("repro-sh-bundle")  # one bundle fixture for these tests
def test_the_issue_quotes_the_dead_servers_log_tail_not_the_runs_log_path(bundle):
    """The run's log path is not in the bundle (a shrink's is a deleted temporary directory): ISSUE.md quotes the
    lines the error carries from it instead."""
    actual = (bundle / "ISSUE.md").read_text().split("## Actual", 1)[1].split("\n## ", 1)[0]
    assert "the log ended with:" in actual and "ends with:" not in actual, actual
    assert "\n  ```\n" in actual and ABORT in actual, actual
