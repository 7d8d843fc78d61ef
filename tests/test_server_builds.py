"""Any llama.cpp build: the llama-server of an older llama-cpp-python release's vendored llama.cpp runs the suites,
its `--version` and commit are in the run header, a flag it lacks is one line naming the flag, the setting and
the build, and a renamed flag gets the older spelling."""

import json

import pytest

from harness.backends.build import load_build
from harness.backends.flags import RENAMED, fit_to_build, server_flags, server_version
from harness.backends.server import LlamaServer
from harness.cli import main
from harness.errors import HarnessError
from harness.paths import cache_dir

OLD_RELEASE = "0.3.30"
OLD_COMMIT = "e3a74b299085cd00013804f7fca2e03441b2da20"
"""llama-cpp-python 0.3.30's vendored llama.cpp: it has no `--spec-synth-len` (the `synth-reject` config)."""


pytestmark = pytest.mark.tag_builds
"""The tag-builds job's (.ci/tag-builds builds OLD_RELEASE's llama-server, cached, and runs these; the default
pytest deselects them): building it is a full compile (463 s measured on two shared cores, a third of the whole test
suite's budget)."""


@pytest.fixture(scope="module")
def old_build():
    """The cached llama-server of OLD_RELEASE (skipped, saying how to build it, when absent: `.ci/tag-builds` builds
    it before it runs this module)."""
    found = [
        b
        for p in (cache_dir() / "builds").glob(f"cpu-{OLD_COMMIT[:8]}-*/build-info.json")
        if (b := load_build(p.parent)) is not None
    ]
    if not found:
        pytest.skip(
            f"no cached llama-server of llama-cpp-python {OLD_RELEASE} (llama.cpp {OLD_COMMIT[:10]}); build it "
            f"once (4 to 25 min on 2 cores; .ci/run does when it has the time) with: "
            f"specharness build --release {OLD_RELEASE}"
        )
    return found[0]


def test_an_older_release_runs_with_its_commit_in_the_header_and_a_missing_flag_is_one_line(
    old_build, tmp_path, capsys
):
    out = tmp_path / "run"
    argv = [
        "run",
        "--suite",
        "quicksort",
        "--backend",
        "server",
        "--server-bin",
        str(old_build.server_bin),
        "--model",
        "tiny-dense",
        "--mode",
        "seq",
        "--spec",
        "none,synth-reject",
        "--out",
        str(out),
    ]
    # the synth-reject cell is not run (this build predates its option): never a harness error (exit 3); on Java
    # this llama.cpp answers HTTP 500 (below), which may fail the run
    assert main(argv) in (0, 1)
    meta = json.loads((out / "run.json").read_text())
    server = meta["backends"]["server"]
    assert server["llama_cpp_commit"] == OLD_COMMIT and server["version"] == server_version(old_build.server_bin)
    assert OLD_COMMIT[:12] in (out / "index.html").read_text()
    cells = {c["spec"]: c for c in meta["cells"]}
    assert cells["none"]["status"] == "done"
    reason = (
        f"llama-server {server['version']} (llama-server) has no --spec-synth-len, which the speculative option "
        "spec-synth-len = 1 needs"
    )
    synth = [c for c in json.loads((out / "checks.json").read_text()) if c["spec"] == "synth-reject"]
    assert synth and all(c.get("not_run", "").startswith(reason) for c in synth)
    err = capsys.readouterr().err
    assert f"NOT RUN quicksort[seq-synth-reject-tiny-dense-server]: {reason}" in err
    # the cell without the missing flag runs and is judged (on Java this llama.cpp answers HTTP 500 "The model
    # produced output that does not match the expected Content-only format": a finding on that build) ...
    records = [c for c in json.loads((out / "checks.json").read_text()) if c["spec"] == "none" and c["case"] != "Java"]
    checks = [c for c in records if c.get("not_run") is None]
    assert {c["check"] for c in checks} >= {"no-crash", "baseline"} and all(c["passed"] for c in checks)
    # ... but its slot files are an older format: said once, and kv-healthy is recorded as not run, with that reason
    assert err.count("no KV scan on llama-server") == 1 and "ggsq version 2; this scanner reads versions 3 and 4" in err
    assert "kv-healthy" not in {c["check"] for c in checks}
    assert {c["check"] for c in records if c.get("not_run") is not None} >= {"kv-healthy"}


def test_a_renamed_flag_takes_the_older_spelling(old_build, tmp_path):
    """A build from before the speculative options were renamed: the older build's real flags with the new
    spellings taken out and the old ones put in."""
    pre_rename = (server_flags(old_build.server_bin) - set(RENAMED)) | set(RENAMED.values())
    server = LlamaServer(
        server_bin=old_build.server_bin,
        model=tmp_path / "m.gguf",
        port=1,
        spec={"spec-type": "draft-simple", "spec-draft-n-max": 4, "spec-draft-p-min": 0.2},
    )
    cmd = fit_to_build(server.command(), pre_rename, "0.0.1 (build 1, commit abc1234)")
    assert cmd[cmd.index("--draft-max") + 1] == "4" and cmd[cmd.index("--draft-p-min") + 1] == "0.2"
    assert "--spec-draft-n-max" not in cmd and "--spec-type" in cmd
    with pytest.raises(
        HarnessError,
        match=r"^llama-server 0.0.1 \(build 1, commit abc1234\) \(llama-server\) has no "
        r"--spec-draft-n-max \(nor its older spelling --draft-max\), which the "
        r"speculative option spec-draft-n-max = 4 needs",
    ):
        fit_to_build(server.command(), pre_rename - {"--draft-max"}, "0.0.1 (build 1, commit abc1234)")
