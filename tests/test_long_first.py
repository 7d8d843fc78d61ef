"""The collection order pytest-xdist schedules by: the `long` tests outside any xdist group first (conftest.py),
every other test in its place, a group's tests in their own order."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def collected(*args: str, env: dict | None = None) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-n", "0", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_the_stress_pass_collects_its_long_single_tests_first_and_keeps_the_groups_order():
    """The statistical job's stress pass (its calibration re-measurement is `statistical`: the default job's stress
    pass deselects it)."""
    files = ["tests/test_bisect.py", "tests/test_clean_runs.py", "tests/test_verdicts.py"]
    plain = collected(
        "-m",
        "stress",
        *files,
        env={"SPECHARNESS_STATISTICAL": "1", "SPECHARNESS_WORKFLOWS": "1", "SPECHARNESS_STRESS": "1"},
    )
    ordered = [n for n in plain if "test_consecutive_clean_runs" in n or "test_a_re_measurement" in n]
    assert len(ordered) == 2 and plain[:2] == ordered, plain[:4]
    rest = [n for n in plain if n not in ordered]
    bisect = [n for n in rest if n.startswith("tests/test_bisect.py")]
    assert bisect and rest[: len(bisect)] == bisect  # the bisect-history group in its collection order


def test_only_long_tests_outside_an_xdist_group_move_first(pytester):
    """The repository's conftest.py as a plugin of a scratch project: `long` tests outside a group go first, in
    their order; a `long` test inside a group, and every other test, keep their places."""
    pytester.makepyfile(rootconftest=(REPO / "conftest.py").read_text())
    pytester.syspathinsert()
    pytester.makepyfile(
        test_a="""
        import pytest

        def test_short(): pass

        @pytest.mark.xdist_group("g")
        def test_grouped_first(): pass

        @pytest.mark.long
        @pytest.mark.xdist_group("g")
        def test_grouped_long(): pass

        @pytest.mark.long
        def test_long_one(): pass

        def test_short_two(): pass

        @pytest.mark.long
        def test_long_two(): pass
        """
    )
    result = pytester.runpytest("-p", "rootconftest", "-p", "no:xdist", "--co", "-q")
    names = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert names == [
        "test_long_one",
        "test_long_two",
        "test_short",
        "test_grouped_first",
        "test_grouped_long",
        "test_short_two",
    ], result.outlines


def test_the_default_stress_pass_leaves_the_statistical_jobs_re_measurement_out():
    files = ["tests/test_verdicts.py", "tests/test_clean_runs.py"]
    default = collected("-m", "stress", *files, env={"SPECHARNESS_STATISTICAL": "", "SPECHARNESS_STRESS": "1"})
    assert not [n for n in default if "test_a_re_measurement" in n]
    assert default[0].startswith("tests/test_clean_runs.py")  # the long test first
