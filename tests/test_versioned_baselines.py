"""Baselines kept per llama.cpp version range: `<case>--<model>--<backend>--<device>@<range>.json` beside the
version-free file holds what legitimately changed in those versions (tokens, acceptance, work); a run reads the
narrowest kept range that covers its llama.cpp, else the version-free file, says which in run.json, and `diff`
tells when two runs compared with different ones."""

import json
import shutil

import pytest

from harness.cli import main
from harness.report.diff import properties
from harness.report.files import RunDir
from harness.verdict.baselines import BaselineStore

SUITE = """\
suite: versioned
matrix: {backends: [inproc], modes: [seq], specs: [none], models: [tiny-dense]}
sampling: {n_predict: 8, temperature: 0}
checks: [no-crash, baseline]
cases:
  - {name: hello, prompt: "Hello there"}
"""


def _run(tmp_path, out: str, *extra: str) -> tuple[int, dict]:
    argv = ["run", "--suite", str(tmp_path / "versioned.yaml"), "--baselines-dir", str(tmp_path / "b")]
    status = main([*argv, "--out", str(tmp_path / out), *extra])
    return status, json.loads((tmp_path / out / "run.json").read_text())


def test_a_run_reads_the_baseline_kept_for_its_version_and_diff_says_so(tmp_path, tiny_models):
    (tmp_path / "versioned.yaml").write_text(SUITE)
    assert _run(tmp_path, "record", "--update-baselines")[0] == 0
    plain = tmp_path / "b" / "versioned" / "hello--tiny-dense--inproc--cpu.json"
    data = json.loads(plain.read_text())
    assert _run(tmp_path, "plain")[1]["versioned_baselines"] == []

    # the engine's llama.cpp is 0c1e570 (llama-cpp-python 0.3.36): a file kept for another version is not read
    changed = dict(data, tokens=data["tokens"][:-1] + [data["tokens"][-1] + 1])
    newer = plain.with_name(plain.stem + "@b11400..b11434.json")
    newer.write_text(json.dumps(changed))
    status, meta = _run(tmp_path, "other")
    assert status == 0 and meta["versioned_baselines"] == []

    # one kept for a range that covers it is read (here it disagrees with the output: the verdict fails on it)
    covering = plain.with_name(plain.stem + "@b11311..b11434.json")
    covering.write_text(json.dumps(changed))
    status, meta = _run(tmp_path, "covered")
    assert status == 1 and meta["versioned_baselines"] == [str(covering)]
    failed = [c for c in json.loads((tmp_path / "covered" / "checks.json").read_text()) if not c["passed"]]
    assert [c["check"] for c in failed] == ["baseline"] and "@b11311..b11434.json" in failed[0]["message"]
    # ... and the narrowest of those that cover it wins
    shutil.copy(plain, plain.with_name(plain.stem + "@0c1e570.json"))
    status, meta = _run(tmp_path, "narrowest")
    assert status == 0 and meta["versioned_baselines"] == [str(plain.with_name(plain.stem + "@0c1e570.json"))]

    a, b = RunDir.load(tmp_path / "plain"), RunDir.load(tmp_path / "narrowest")
    key = "baselines kept for its llama.cpp version"
    assert properties(a)[key] == "none" and properties(b)[key].endswith("@0c1e570.json")


def test_update_with_a_range_writes_the_file_kept_for_it(tmp_path, tiny_models):
    (tmp_path / "versioned.yaml").write_text(SUITE)
    assert _run(tmp_path, "record", "--update-baselines", "--baselines-range", "b11311..b11320")[0] == 0
    kept = tmp_path / "b" / "versioned" / "hello--tiny-dense--inproc--cpu@b11311..b11320.json"
    assert kept.is_file() and not kept.with_name("hello--tiny-dense--inproc--cpu.json").exists()
    with pytest.raises(SystemExit) as usage:  # not a version: argparse's usage error, exit 2
        main(["run", "--suite", "x", "--baselines-range", "latest"])
    assert usage.value.code == 2


def test_a_kept_range_that_is_not_a_version_is_never_read(tmp_path):
    plain = tmp_path / "c--m--server--cpu.json"
    plain.write_text("{}")
    plain.with_name("c--m--server--cpu@whatever.json").write_text("{}")
    from harness.backends.build.versions import tag_version

    assert BaselineStore(tmp_path).versioned(plain, tag_version("b11434")) == plain
