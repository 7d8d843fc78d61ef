"""`specharness repro --upstream ID` writes a report of a known llama.cpp defect ready to post upstream (issue 63,
item 4): the entry's cells served on the build under test, its first failure bundled (repro.sh: llama-server and
curl), repro.sh run once against that build, and UPSTREAM.md with the cause, the measurements, what the reproducer
printed and the proposed patch (docs/upstream-reports/patches/<ID>.diff)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_rejection_patches import RNG_FIX_EDITS, SAMPLING_CPP
from test_stale_checkpoint import ERASE_FROM_RESTART

from harness.repro.upstream import patches_dir

ROOT = Path(__file__).resolve().parents[1]


def _repro(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "repro", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900
    )


@pytest.mark.workflows
def test_an_upstream_report_of_a_known_llama_server_defect_reproduces_it_standalone(tmp_path, tiny_models):
    proc = _repro("--upstream", "server-stale-context-checkpoint", "--out", str(tmp_path / "up"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    bundle = tmp_path / "up" / "bundle"
    report = (bundle / "UPSTREAM.md").read_text()
    assert report.startswith("# server-stale-context-checkpoint: ")
    assert "## What happens, and why" in report and "pos_max > pos_next" in report
    assert "stale context checkpoint (n_tokens 101" in report  # this build's failure line
    assert "(exit 1)" in report and "REPRODUCED: the rounds differ" in report  # repro.sh, run against this build
    assert "+                                    if (std::max(cur.pos_min + 1, cur.pos_max) > pos_next) {" in report
    assert (bundle / "repro.sh").is_file() and any((bundle / "requests").glob("*.json"))


def test_the_kept_patch_is_the_fix_the_patched_build_was_tested_with():
    diff = (patches_dir() / "server-stale-context-checkpoint.diff").read_text().splitlines()
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    [(old, new)] = ERASE_FROM_RESTART.items()
    assert removed == old.splitlines()[1:] and added == new.splitlines()[1:]


@pytest.mark.workflows
def test_an_entry_without_a_standalone_reproducer_or_an_unknown_id_is_one_line():
    inproc = _repro("--upstream", "split-equal-keep-tail-exceeds-ubatch")
    assert inproc.returncode == 2 and "no standalone upstream report" in inproc.stderr, inproc.stderr
    assert len(inproc.stderr.strip().splitlines()) == 1
    statistical = _repro("--upstream", "server-rejection-rng-rewound-on-checkpoint-restore")  # suites/statistical's
    assert statistical.returncode == 2 and len(statistical.stderr.strip().splitlines()) == 1, statistical.stderr
    assert "fails `distribution`, which only specharness can judge" in statistical.stderr
    assert "docs/upstream-reports/server-rejection-rng-rewound-on-checkpoint-restore.md" in statistical.stderr
    assert (ROOT / "docs/upstream-reports/server-rejection-rng-rewound-on-checkpoint-restore.md").is_file()
    unknown = _repro("--upstream", "no-such-defect")
    assert unknown.returncode == 2 and "no known failure no-such-defect" in unknown.stderr, unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
    neither = _repro("some[case]")
    assert neither.returncode == 2 and "--from-run" in neither.stderr and "--upstream" in neither.stderr


def test_the_kept_rng_patch_is_the_one_built_here():
    diff = (patches_dir() / "server-rejection-rng-rewound-on-checkpoint-restore.diff").read_text()
    lines = diff.splitlines()
    assert lines[0] == f"--- a/{SAMPLING_CPP}" and lines[1] == f"+++ b/{SAMPLING_CPP}"
    removed = [line[1:] + "\n" for line in lines[2:] if line.startswith("-")]
    added = [line[1:] + "\n" for line in lines[2:] if line.startswith("+")]
    assert (removed, added) == (list(RNG_FIX_EDITS), list(RNG_FIX_EDITS.values()))
