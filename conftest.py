"""Repository-wide pytest setup: the suite plugin (`pytest suites/`), the tiny-model fixtures, and `--stress N`
(N busy loops beside the session: the suite on a busy machine)."""

import os
import subprocess
import sys

import llama_cpp
import pytest

from harness.engine.logging import set_llama_verbose
from harness.models import DEFAULT_MODELS, resolve

pytest_plugins = ["harness.pytest_plugin", "pytester"]


@pytest.fixture(scope="session", autouse=True)
def quiet_llama_cpp():
    """llama.cpp's own log stays silent in tests (`specharness --verbose` shows it)."""
    set_llama_verbose(False)
    llama_cpp.llama_backend_init()


@pytest.fixture(scope="session")
def tiny_models():
    """name → ModelInfo for tiny-dense, tiny-hybrid and tiny-recurrent (generated on first use)."""
    return {name: resolve(name) for name in DEFAULT_MODELS}


BUSY = pytest.StashKey[list]()
BUSY_LOOP = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"
"""One core kept busy until the session that started it ends (or dies: the loop then has another parent)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stress",
        type=int,
        default=0,
        metavar="N",
        help="run N busy loops (N CPU-bound processes, e.g. $(nproc)) for the whole session, as on a "
        "busy machine; `-m stress` selects the interrupt, server, bisect and report tests",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "stress: a test of signals, servers, bisect or reports, run under load in CI (`pytest -m stress --stress N`)",
    )
    if config.getoption("--stress") > 0 and not hasattr(config, "workerinput"):  # the controller only, once
        config.stash[BUSY] = [
            subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(config.getoption("--stress"))
        ]


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in config.stash.get(BUSY, []):
        proc.kill()
        proc.wait()


def pytest_report_header(config: pytest.Config) -> list[str]:
    n = config.getoption("--stress")
    return [f"stress: {n} busy loops on {os.cpu_count()} cores"] if n > 0 else []
