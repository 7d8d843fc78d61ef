"""One place evaluates a cell's checks (issue 28, item 3): `harness.checks.evaluate_cell`. `run`, the pytest
plugin, bisect and shrink call it; nothing else in the package calls a check or `evaluate`, so a harness error, the
detokenizer and known failures are read one way whatever the command. Calibration judges no check: it reads a
cell's end (a harness fault, a llama.cpp crash) from the same Run fields `evaluate_cell` reads, and refuses to
measure either (tests/test_verdicts.py). Before 996bd37, running.py, the plugin, bisect/judge.py and shrink/trial.py
imported `evaluate` and each ran its own loop over a cell's cases: the first test fails there."""

import ast
from pathlib import Path

import harness.checks

PACKAGE = Path(harness.checks.__file__).resolve().parents[1]
USERS = {
    "running.py": "specharness run",
    "pytest_plugin.py": "the pytest plugin",
    "bisect/judge.py": "bisect",
    "shrink/trial.py": "shrink",
}
SEEDED_COUNTING = {
    "harness.checks.seeded.draws",
    "harness.checks.seeded.seeded_keys",
    "harness.checks.seeded.noise_bound",
}
"""The seeded check's counting, which calibration measures a device's noise rate with (harness/calibration/seeded.py:
the distinct draws of a seeded group and the upper bound of a count): readings, no verdict, kept in one place."""
MAY_IMPORT = {
    "evaluate_cell",
    "harness_errors",
    "CHECKS",
    "DID_NOT_COMPLETE",
    "kv_problems",
    "harness.checks.base.CheckResult",
    "harness.checks.acceptance.Acceptance",
    "seeded",  # bench seeded counts draws with the check's own counting (harness.checks.seeded.draws): one place
    *SEEDED_COUNTING,
    "exact_law",  # the exact fixed-prefix test's statistics: no check of a run's cells; bench exact is its one caller
}
"""What a module outside harness/checks/ may take from it: the one evaluation, its harness errors, the check names
(CHECKS: the selftest's columns, docgen's table), the verdict's type, and readings that are no verdict (a request
that did not complete; the KV findings a repro bundle names; a request's acceptance arithmetic, which calibration
measures its spread with; the seeded check's counting, SEEDED_COUNTING; the exact fixed-prefix test's statistics,
which `bench exact` applies to samples no suite run makes)."""


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith("checks/"):
            yield rel, ast.parse(path.read_text(), filename=str(path))


def _taken_from_checks(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.checks"):
            names |= {f"{node.module}.{a.name}" if node.module != "harness.checks" else a.name for a in node.names}
        if isinstance(node, ast.Import) and any(a.name.startswith("harness.checks") for a in node.names):
            names.add("import harness.checks")
    return names


def test_nothing_outside_harness_checks_calls_a_check_or_evaluate():
    wrong = {}
    for rel, tree in _modules():
        extra = _taken_from_checks(tree) - MAY_IMPORT
        calls = [
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Subscript)
            and getattr(n.func.value, "id", "") == "CHECKS"
        ]
        if extra or calls:
            wrong[rel] = (sorted(extra), calls)
    assert not wrong, f"modules evaluating checks outside harness.checks.evaluate_cell: {wrong}"


def test_run_the_plugin_bisect_and_shrink_evaluate_through_evaluate_cell():
    trees = dict(_modules())
    for rel, who in USERS.items():
        calls = [
            n for n in ast.walk(trees[rel]) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "evaluate_cell"
        ]
        assert calls, f"{who} ({rel}) no longer evaluates through evaluate_cell"


def test_calibration_calls_no_check_and_reads_a_cells_end_as_evaluate_cell_does():
    source = "\n".join(p.read_text() for p in sorted((PACKAGE / "calibration").glob("*.py")))
    source += (PACKAGE / "commands/calibrate.py").read_text()
    assert _taken_from_checks(ast.parse(source)) == {"harness.checks.acceptance.Acceptance", *SEEDED_COUNTING}
    assert "run.fault or run.crash" in source and "reference.fault or reference.crash" in source
    assert "run.fault" in (PACKAGE / "checks/registry.py").read_text()
