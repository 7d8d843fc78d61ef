"""The layers as contracts: the import contracts of pyproject.toml (`[tool.importlinter]`, stated in
docs/architecture.md) hold for harness/, and each kind of contract catches the break it names.

`.ci/run` runs `lint-imports` too; this test makes a plain `pytest` catch a broken layer as well."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CONTRACTS = {
    "engine-no-backends",
    "server-no-engine",
    "checks-no-executor",
    "reports-read-stored-runs",
    "commands-on-top",
    "docs-and-cli-on-top",
    "stages",
    "verdict-policy",
    "no-circles",
}
"""The contracts docs/architecture.md states (by their ids in pyproject.toml)."""

LINT = (
    "import sys; from importlinter.cli import lint_imports; "
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"
)


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the `harness` package in `root` (the working directory comes first on sys.path)."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, capture_output=True, text=True, timeout=300)


def test_every_stated_contract_is_configured_and_none_is_excepted():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = config["contracts"]
    assert {c["id"] for c in contracts} == CONTRACTS
    assert not [c["id"] for c in contracts if c.get("ignore_imports")], "mend the import, do not except it"


def test_the_import_contracts_hold():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count(" KEPT") == len(CONTRACTS)


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the package and its contracts, to break on purpose."""
    shutil.copytree(ROOT / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("harness/engine/batch.py", "import harness.backends.base", "the engine imports no backend"),
        ("harness/backends/client.py", "import harness.engine.model", "llama-server code never imports the engine"),
        ("harness/checks/budget.py", "import harness.execute", "checks never import the executor"),
        ("harness/report/charts.py", "import harness.backends.flags", "reports read stored runs"),
        ("harness/shrink/driver.py", "import harness.commands.run", "commands sit on top"),
        ("harness/running.py", "import harness.docgen", "docs generation and the CLI sit on top"),
        ("harness/suites/request.py", "import harness.execute", "the stages in order"),  # a stage reaching up
        ("harness/verdict/noise.py", "import harness.report.files", "one judge"),  # the policy reading a report
        ("harness/errors.py", "import harness.matrix", "no import circles"),  # matrix imports errors
        ("harness/suites/__init__.py", "import harness.checks.base", "no import circles"),  # a circle between packages
    ],
)
def test_a_planted_break_fails_its_contract(copy, module, line, contract):
    path = copy / module
    path.write_text(path.read_text() + f"\n{line}  # planted by tests/test_layers.py\n")
    proc = lint(copy)
    assert proc.returncode != 0
    broken = [row for row in proc.stdout.splitlines() if row.endswith(" BROKEN")]
    assert any(row.startswith(contract) for row in broken), proc.stdout[-3000:]
