"""docs/ci.md's recipe, end to end: `harness/data/fork-ci.sh` runs a suite sharded over two jobs against a base and
a head llama-server (the bisect fixture's clean commit and the commit that brings back a checkpoint-restore bug),
merges the shards, diffs base vs head and fails on the regression; the same shards as both sides pass."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bisect_history import REGRESSION, builds_at

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "harness" / "data" / "fork-ci.sh"
SELECTION = f"--suite {ROOT / 'tests/data/bisect-quicksort.yaml'} --mode seq --spec none,draft-simple"

pytestmark = pytest.mark.xdist_group("bisect-history")  # the fixture's builds: with the bisect tests


def fork_ci(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, SPECHARNESS_CI_ARGS=SELECTION, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    )
    return subprocess.run([str(SCRIPT), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.workflows
def test_the_fork_ci_script_fails_on_a_regression_and_passes_without_one(tmp_path):
    clean, regression = builds_at(REGRESSION - 1, REGRESSION)
    out = tmp_path / "ci"
    proc = fork_ci("all", clean.server_bin, regression.server_bin, 2, out, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "REGRESSED: 1 newly failing" in proc.stdout
    for side, build in (("base", clean), ("head", regression)):
        meta = json.loads((out / side / "run.json").read_text())
        assert [s["shard"] for s in meta["shards"]] == ["1/2", "2/2"] and meta["missing_shards"] == []
        assert build.commit.startswith(meta["backends"]["server"]["llama_cpp_commit"])
        assert (out / side / "index.html").is_file()
    assert "kv-healthy" in (out / "head" / "diff.html").read_text()

    same = tmp_path / "same"  # the base's shards on both sides: nothing regressed
    for i in (1, 2):
        shutil.copytree(out / f"base-{i}", same / f"base-{i}")
        shutil.copytree(out / f"base-{i}", same / f"head-{i}")
    proc = fork_ci("report", 2, same, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (same / "head" / "diff.html").is_file()
    assert fork_ci("shard", clean.server_bin, cwd=tmp_path).returncode == 2  # bad usage: the usage text, exit 2
