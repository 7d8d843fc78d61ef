"""Repository-wide pytest setup: the suite plugin (`pytest suites/`), the tiny-model fixtures, and `--stress N`
(N busy loops beside the session: the suite on a busy machine)."""

import os
import subprocess
import sys

import llama_cpp
import pytest

from harness.engine.logging import set_llama_verbose
from harness.models import DEFAULT_MODELS, resolve
from harness.paths import cache_dir

pytest_plugins = ["harness.pytest_plugin", "pytester"]
os.environ.setdefault("SPECHARNESS_AUTO_CALIBRATE", "0")  # no test measures a calibration unless it asks for it


@pytest.fixture(scope="session", autouse=True)
def quiet_llama_cpp():
    """llama.cpp's own log stays silent in tests (`specharness --verbose` shows it)."""
    set_llama_verbose(False)
    llama_cpp.llama_backend_init()


@pytest.fixture(scope="session")
def tiny_models():
    """name → ModelInfo for tiny-dense, tiny-hybrid and tiny-recurrent (generated on first use)."""
    return {name: resolve(name) for name in DEFAULT_MODELS}


BYTECODE = pytest.StashKey[str]()


def _cache_bytecode() -> str | None:
    """Where bytecode goes when the environment asks for none (`PYTHONDONTWRITEBYTECODE`, which some images set):
    the specharness cache (`PYTHONPYCACHEPREFIX`, or the one already set), never the checkout. A run starts several
    hundred Python processes (pytest-xdist workers, `specharness` and inner pytest subprocesses, engine fork
    servers); without a cache each compiles the harness again and each pytest process rewrites the assertions of
    tests/ again: a warm `pytest` in a fresh clone on a 2-core machine took 934 s without bytecode and 864 s with it
    written here, its first run included (docs/benchmarks.md, session 17). Python then reads bytecode only under the
    prefix, so the first run compiles the installed packages into it once. For this process and every process it
    starts; None when bytecode was not switched off."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return None
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or str(cache_dir() / "pycache")
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.dont_write_bytecode = False
    sys.pycache_prefix = prefix
    return prefix


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
    prefix = _cache_bytecode()  # before pytest-xdist starts its workers (pytest_sessionstart)
    if prefix is not None:
        config.stash[BYTECODE] = prefix
    config.addinivalue_line(
        "markers",
        "stress: a test of signals, servers, bisect or reports, run under load in CI (`pytest -m stress --stress N`)",
    )
    config.addinivalue_line(
        "markers",
        "long: a test of a minute or more on 2 cores, outside any xdist group: started before the other such tests",
    )
    config.addinivalue_line(
        "markers",
        f"tag_builds: a test of llama-server built at upstream tags (b11311, b11434) or an older release (0.3.30): "
        f"the tag-builds CI job's "
        f"(.ci/tag-builds builds them, cached, and sets {TAG_BUILDS}=1); the default pytest deselects it",
    )
    config.addinivalue_line(
        "markers",
        f"statistical: a test of a large sample, a libllama variant or a seeded race: the statistical CI job's "
        f"(.ci/statistical sets {STATISTICAL}=1); the default pytest deselects it",
    )
    config.addinivalue_line(
        "markers",
        f"workflows: a maintainer's workflow end to end (bisect, shrink, the repro bundles and upstream reports, the "
        f"nightly and fork-CI recipes, sharded runs merged, a new model's first baselines and calibration, a small "
        f"mutation campaign, the installed wheel): "
        f".ci/run's workflows phase (it sets {WORKFLOWS}=1); the default pytest deselects it",
    )
    if config.getoption("--stress") > 0 and not hasattr(config, "workerinput"):  # the controller only, once
        config.stash[BUSY] = [
            subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(config.getoption("--stress"))
        ]


TAG_BUILDS = "SPECHARNESS_TAG_BUILDS"
"""Set to 1 by .ci/tag-builds: the `tag_builds` tests are collected (elsewhere deselected, not skipped: they are that
job's tests, run where their builds are made)."""
STATISTICAL = "SPECHARNESS_STATISTICAL"
"""Set to 1 by .ci/statistical: the `statistical` tests are collected (elsewhere deselected, not skipped)."""
WORKFLOWS = "SPECHARNESS_WORKFLOWS"
"""Set to 1 by .ci/run's workflows phase (`--stress N` implies it, for the bisects of the stress pass): the
`workflows` tests are collected. They are the
tests of the maintainers' recipes end to end, which build llama.cpp histories and run whole commands (about 950 s
of the 4,410 s of test time of a warm `pytest` on 2 cores, 2026-12-07): CI runs them right after the README's
`pytest`, which stays within its 20 minutes without them (docs/guide/ci.md)."""
STRESS = "SPECHARNESS_STRESS"
"""Set to 1, or give `--stress N` with N > 0 as .ci/run's stress pass does: the `stress` tests (signals, servers,
bisect and reports) are collected. That pass runs them under a busy loop per core; the default `pytest` leaves them
to it rather than run them twice (about 460 s of its 4,410 s of test time on 2 cores, 2026-12-07)."""
OTHER_JOBS = {"tag_builds": TAG_BUILDS, "statistical": STATISTICAL, "workflows": WORKFLOWS, "stress": STRESS}
"""marker -> the variable its CI job sets to 1: a test with the marker is that job's, deselected elsewhere."""


def deselect_other_jobs(config: pytest.Config, items: list) -> None:
    """The tests of another CI job or phase (OTHER_JOBS: the tag-builds job's, the statistical job's, .ci/run's
    workflows phase's and stress pass's) are deselected, not
    skipped: the default pytest reports no skip for want of a build or a sample that job makes."""
    present = {marker for marker, variable in OTHER_JOBS.items() if os.environ.get(variable) == "1"}
    if config.getoption("--stress") > 0:  # a run under load: the stress pass (its bisects are workflows too)
        present |= {"stress", "workflows"}
    absent = [marker for marker in OTHER_JOBS if marker not in present]
    other = [i for i in items if any(i.get_closest_marker(m) for m in absent)]
    if other:
        config.hook.pytest_deselected(items=other)
        moved = set(other)
        items[:] = [i for i in items if i not in moved]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """The `long` tests first. pytest-xdist hands out its groups biggest first and then the single tests in this
    order, two or three at a time: a long single test collected late (the calibration's re-measurement, 620 s of
    the stress pass on 2 cores) started when the others were done and ran alone at the end. Only tests outside an
    xdist group move (a group keeps its order, e.g. the selftest's clean row first); after every deselection
    (trylast), so `-m`, `-k` and `--shard` choose as before. Another CI job's tests go first (`deselect_other_jobs`)."""
    deselect_other_jobs(config, items)
    first = [i for i in items if i.get_closest_marker("long") and not i.get_closest_marker("xdist_group")]
    if first:
        moved = set(first)
        items[:] = first + [i for i in items if i not in moved]


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in config.stash.get(BUSY, []):
        proc.kill()
        proc.wait()


def pytest_report_header(config: pytest.Config) -> list[str]:
    n = config.getoption("--stress")
    lines = [f"stress: {n} busy loops on {os.cpu_count()} cores"] if n > 0 else []
    if BYTECODE in config.stash:
        lines.append(f"bytecode: PYTHONDONTWRITEBYTECODE was set; written under {config.stash[BYTECODE]} instead")
    return lines
