"""The peers on the same mutants: llama.cpp's own server tests of speculation, run offline against each mutant build.

`PEER_TESTS` at the tree's own commit (tools/server/tests/unit/): test_speculative.py, test_slot_save.py,
test_ctx_shift.py. They download their models from Hugging Face; here a pytest plugin of ours (`PLUGIN`, loaded
with `-p`) gives every preset the generated tiny models instead (the main model tiny-dense, the draft model
tiny-dense-draft), stubs the downloads, and the tests run as they are, with llama-server at LLAMA_SERVER_BIN_PATH.
A test that fails on the unmutated build too (a model-specific expectation, a multimodal preset with no offline
model) does not count: a mutant is killed by the peers when a test that passes on the unmutated build fails on it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from harness.models import resolve

PEER_TESTS = ("unit/test_speculative.py", "unit/test_slot_save.py", "unit/test_ctx_shift.py")
PEER_TIMEOUT_MIN_S = 300
PLUGIN_NAME = "specharness_offline_presets"
PLUGIN = '''"""specharness: llama.cpp's server tests offline, on the generated tiny models (harness/mutate/peers.py)."""
import json
import os
import sys
import types

sys.modules.setdefault("wget", types.ModuleType("wget"))  # utils imports it for downloads, which are stubbed
import utils  # noqa: E402

_MODELS = json.loads(os.environ["SPECHARNESS_PEER_MODELS"])


def _offline(make):
    def preset():
        server = make()
        server.model_hf_repo = server.model_hf_file = None
        server.model_file = _MODELS["main"]
        server.offline = True
        return server

    return staticmethod(preset)


for _name, _make in list(vars(utils.ServerPreset).items()):
    if isinstance(_make, staticmethod) and _name != "load_all":
        setattr(utils.ServerPreset, _name, _offline(_make.__func__))
utils.ServerPreset.load_all = staticmethod(lambda: None)
utils.download_file = lambda url, output_file_path=None: _MODELS["draft"]
'''


def stage(tree: Path, run_dir: Path) -> Path:
    """The tree's tools/server/tests copied into the campaign (once), with the offline plugin beside them."""
    target = run_dir / "peers" / "tests"
    if not target.is_dir():
        source = tree / "tools" / "server" / "tests"
        shutil.copytree(source, target.with_name("tests.tmp"), dirs_exist_ok=True)
        (target.with_name("tests.tmp") / f"{PLUGIN_NAME}.py").write_text(PLUGIN)
        target.with_name("tests.tmp").rename(target)
    return target


def run_peers(tests: Path, server_bin: Path, out: Path, timeout_s: float | None, extra: dict | None = None) -> dict:
    """PEER_TESTS against `server_bin`: {"passed": [...], "failed": [...], "seconds", "exit"} (test ids)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    junit = out.with_suffix(".xml")
    junit.unlink(missing_ok=True)
    models = {"main": str(resolve("tiny-dense").path), "draft": str(resolve("tiny-dense-draft").path)}
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(server_bin),
        "SPECHARNESS_PEER_MODELS": json.dumps(models),
        "PYTHONPATH": str(tests),
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # their session as theirs: no plugin of this environment (ours included)
        **(extra or {}),
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN_NAME, "-o", "addopts="]
    cmd += [f"--junitxml={junit}", *PEER_TESTS]
    started = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        try:
            code: int | str = subprocess.run(
                cmd, cwd=tests, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    passed, failed = _outcomes(junit)
    return {"exit": code, "passed": passed, "failed": failed, "seconds": round(time.monotonic() - started, 1)}


def _outcomes(junit: Path) -> tuple[list[str], list[str]]:
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return [], []
    passed, failed = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("skipped") is not None:
            continue
        (failed if case.find("failure") is not None or case.find("error") is not None else passed).append(name)
    return passed, failed


def peer_kill(clean: dict, mutant: dict) -> list[str]:
    """The tests that pass on the unmutated build and not on the mutant (all of them after a timeout)."""
    if mutant["exit"] == "timeout":
        return list(clean["passed"])
    return [t for t in clean["passed"] if t not in mutant["passed"]]


def timeout_for(clean: dict) -> float:
    return max(PEER_TIMEOUT_MIN_S, 4 * clean["seconds"])
