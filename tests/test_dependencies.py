"""Every third-party module the package imports is a declared dependency (pyproject.toml `[project] dependencies`):
the README's Quickstart installs only those (`pip install -e '.[real]'`), so a module that merely happens to be on
the developer's or CI's machine breaks a fresh venv at import. Found 2026-12-02: scipy (harness/checks/seeded.py)
was imported but not declared, and `specharness run` failed in a fresh venv with ModuleNotFoundError."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter installs tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _imported_top_level_modules() -> set[str]:
    found = set()
    for path in (ROOT / "harness").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"harness", "__future__"}


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_of_the_package_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_normalized(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in project["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(_imported_top_level_modules()):
        dists = {_normalized(d) for d in providers.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(dists)
    assert not missing, f"imported by harness/ but not in pyproject.toml's dependencies: {missing}"
