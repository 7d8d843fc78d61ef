"""`--shard I/N` and `specharness report --merge`: three shards merged give the unsharded run's verdicts."""

import json
import subprocess
import sys

import pytest
from report_helpers import REPO

from harness.cli import main
from harness.matrix import Shard, cells, estimated_cost, shard
from harness.report.files import item_name, status
from harness.suites import load_suite

SMALL = "--suite grammar-json --model tiny-dense --mode seq,no-kv-unified --spec none,draft-simple".split()
"""Four cells, some compared with cells of another shard: grammar-json's two short cases in one round (quicksort's
three cases in three rounds of 128 tokens made this test 32 s of a warm pytest)."""


def verdicts(run) -> set:
    return {(item_name(v), v["check"], status(v), v["message"]) for v in json.loads((run / "checks.json").read_text())}


def outputs(run) -> dict:
    return {(item_name(r), r["repeat"]): r["tokens"] for r in json.loads((run / "results.json").read_text())}


@pytest.mark.workflows
@pytest.mark.long
def test_three_shards_merged_give_the_unsharded_verdicts(tmp_path, tiny_models, capsys):
    assert main(["run", *SMALL, "--out", str(tmp_path / "all")]) == 0
    parts = [tmp_path / f"shard{i}" for i in (1, 2, 3)]
    for i, part in enumerate(parts, 1):
        assert main(["run", *SMALL, "--shard", f"{i}/3", "--out", str(part)]) == 0
    owned = [[c["id"] for c in json.loads((p / "run.json").read_text())["cells"]] for p in parts]
    assert sorted(sum(owned, [])) == sorted(
        c["id"] for c in json.loads((tmp_path / "all/run.json").read_text())["cells"]
    )
    assert all(owned), "every shard got work"
    ran = sum(len(json.loads((p / "results.json").read_text())) for p in parts)
    assert ran > len(outputs(tmp_path / "all")), "some shard ran reference cells it does not own"
    capsys.readouterr()
    assert main(["report", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
    assert f"report: {tmp_path / 'merged/index.html'}" in capsys.readouterr().out
    assert verdicts(tmp_path / "merged") == verdicts(tmp_path / "all")
    assert outputs(tmp_path / "merged") == outputs(tmp_path / "all")
    meta = json.loads((tmp_path / "merged/run.json").read_text())
    assert meta["missing_shards"] == [] and meta["merge_conflicts"] == [] and len(meta["shards"]) == 3
    assert (tmp_path / "merged/junit.xml").exists()

    other = tmp_path / "other"
    other.mkdir()
    for name in ("results.json", "checks.json"):
        (other / name).write_text((parts[0] / name).read_text())
    data = json.loads((parts[0] / "run.json").read_text())
    data["harness_version"] = "0.0.1"
    (other / "run.json").write_text(json.dumps(data))
    assert main(["report", "--merge", str(other), str(parts[1]), "--out", str(tmp_path / "bad")]) == 2
    assert "cannot merge" in capsys.readouterr().err and not (tmp_path / "bad/results.json").exists()
    data["harness_version"] = meta["harness_version"]
    data["backends"]["inproc"]["llama_cpp_python"] = "0.3.35"
    (other / "run.json").write_text(json.dumps(data))
    assert main(["report", "--merge", str(other), str(parts[1]), "--out", str(tmp_path / "bad")]) == 2
    assert "inproc llama.cpp 0.3.35" in capsys.readouterr().err


def test_shards_are_a_deterministic_balanced_partition_of_the_default_matrix():
    suites = [load_suite(name) for name in ("quicksort", "w1", "categories")]
    jobs = [(s, c) for s in suites for c in cells(s.matrix)]
    parts = [shard(jobs, Shard(i, 4)) for i in range(1, 5)]
    key = lambda j: (j[0].name, j[1])  # noqa: E731
    assert sorted(key(j) for p in parts for j in p) == sorted(key(j) for j in jobs)
    assert [list(map(key, p)) for p in parts] == [
        list(map(key, shard(list(reversed(jobs)), Shard(i, 4))))[::-1] for i in range(1, 5)
    ]

    def executed(part):  # a shard runs its cells and, on demand, the cells they compare with
        ran = {
            (s.name, ref): s
            for s, c in part
            for ref in (c, c.reference(spec="none"), c.reference(mode="seq"), c.reference(mode="seq", spec="none"))
        }
        return sum(estimated_cost(s, c) for (_, c), s in ran.items())

    loads = [executed(p) for p in parts]
    assert max(loads) <= 1.2 * min(loads), loads


@pytest.mark.parametrize("text", ["0/3", "4/3", "1", "a/b", "2/0"])
def test_bad_shard_is_a_one_line_error(text, capsys):
    assert main(["run", "--shard", text]) == 2
    assert f"--shard takes I/N with 1 <= I <= N (e.g. 2/3), not '{text}'" in capsys.readouterr().err


@pytest.mark.workflows
@pytest.mark.long
def test_pytest_shards_split_the_suite_items_without_overlap():
    def collected(*extra):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "suites/quicksort.yaml",
                "suites/w1.yaml",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                "-n",
                "0",
                "-p",
                "no:hypothesispytest",  # half of each collection's start-up; no suite item uses it
                "-p",
                "no:benchmark",
                *extra,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return {line for line in done.stdout.splitlines() if "::" in line}

    everything = collected()
    parts = [collected("--shard", f"{i}/3") for i in (1, 2, 3)]
    assert set().union(*parts) == everything
    assert sum(map(len, parts)) == len(everything) and all(parts)
