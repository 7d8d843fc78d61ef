"""The installable distribution: the wheel carries the suites and fixtures and the pytest plugin, and runs from
any directory; `specharness init` and `--suites-dir` run suites of one's own, with their own baselines."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from venvs import PTH, make_venv

from harness.cli import main

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "harness", "suites", "fixtures")
SELECTION = ["--model", "tiny-dense", "--mode", "seq", "--spec", "none", "--backend", "inproc"]


def run(cmd: list, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.workflows
@pytest.mark.long
def test_the_wheel_runs_the_default_job_and_the_pytest_plugin_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "VIRTUAL_ENV")}
    source = tmp_path / "source"  # a copy: the build leaves build/ and *.egg-info beside the sources
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(REPO / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", source], tmp_path, env)
    wheel = next((tmp_path / "dist").glob("specharness-*.whl"))

    # a fresh venv that sees the llama-cpp-python (and the other dependencies) already installed: no compile
    bin_dir = make_venv(tmp_path / "venv")
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel], tmp_path, env)
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = run([bin_dir / "python", "-c", "import harness; print(harness.__file__)"], work, env).stdout
    assert where.startswith(str(tmp_path / "venv"))

    run([bin_dir / "specharness", "run", *SELECTION, "--out", "r1"], work, env)
    assert (work / "r1" / "index.html").is_file()
    baselines = [c for c in json.loads((work / "r1" / "checks.json").read_text()) if c["check"] == "baseline"]
    assert len(baselines) == 3 and all(c["passed"] and "no_baseline" not in c["evidence"] for c in baselines)
    assert all("harness/bundled/fixtures/baselines/quicksort/" in c["evidence"]["baseline"] for c in baselines)

    proc = run(
        [
            bin_dir / "python",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "harness",
            "-k",
            "quicksort.yaml",
            *SELECTION,
            "--report",
            "r2",
        ],
        work,
        env,
    )
    assert "3 passed" in proc.stdout and (work / "r2" / "index.html").is_file()
    baselines = [c for c in json.loads((work / "r2" / "checks.json").read_text()) if c["check"] == "baseline"]
    assert all("harness/bundled/fixtures/baselines/quicksort/" in c["evidence"]["baseline"] for c in baselines)
    assert len(baselines) == 3


def test_the_test_venv_sees_the_packages_of_a_venv_running_the_tests(tmp_path):
    """Tests run inside a newcomer's virtual environment: the venv the wheel test makes must see that
    environment's packages, not the base interpreter's (`--system-site-packages` did)."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True, timeout=300)
    purelib = subprocess.run(
        [str(outer / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "only_in_the_outer_venv.py").write_text("WHERE = 'outer'\n")
    helper = Path(__file__).with_name("venvs.py")
    subprocess.run([str(outer / "bin" / "python"), str(helper), str(tmp_path / "inner")], check=True, timeout=300)
    probe = [str(tmp_path / "inner" / "bin" / "python"), "-c", "import only_in_the_outer_venv as m; print(m.WHERE)"]
    seen = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert seen.returncode == 0 and seen.stdout.strip() == "outer", seen.stderr
    pth = next((tmp_path / "inner").rglob(PTH)).read_text()
    assert purelib in pth.splitlines()
    old_way = tmp_path / "old"  # what the test did: the base interpreter's packages only
    subprocess.run(
        [str(outer / "bin" / "python"), "-m", "venv", "--without-pip", "--system-site-packages", str(old_way)],
        check=True,
        timeout=300,
    )
    probe[0] = str(old_way / "bin" / "python")
    assert subprocess.run(probe, capture_output=True, text=True, timeout=60).returncode != 0


@pytest.mark.workflows
@pytest.mark.long
def test_init_writes_a_suite_that_runs_and_records_its_own_baselines(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "proj"]) == 0
    assert main(["init", "proj"]) == 0 and "kept (exists)" in capsys.readouterr().out
    argv = ["run", "--suites-dir", "proj/suites", "--mode", "seq"]
    assert main([*argv, "--out", "r1"]) == 0  # nothing recorded yet: `no baseline yet`, not a failure
    assert "--suite proj/suites/starter.yaml" in capsys.readouterr().err
    assert main([*argv, "--update-baselines", "--out", "r2"]) == 0
    assert sorted(p.name for p in (tmp_path / "proj/fixtures/baselines/starter").glob("*.json")) == [
        "greeting--tiny-dense--inproc--cpu.json",
        "list--tiny-dense--inproc--cpu.json",
    ]
    checks = [c for c in json.loads((tmp_path / "r2/checks.json").read_text()) if c["check"] == "baseline"]
    assert checks and all(c["passed"] and "no_baseline" not in c["evidence"] for c in checks)
    assert main(["run", "--suites-dir", "proj/suites", "--suite", "nope", "--out", "r3"]) == 2
    assert "unknown suite 'nope' (known: " in capsys.readouterr().err

    # pytest in the directory: the ini key points the plugin at the suites; an edited baseline fails there
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    pytest = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "harness.pytest_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "--mode",
        "seq",
    ]
    proc = subprocess.run(pytest, cwd=tmp_path / "proj", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-2000:]
    edited = tmp_path / "proj/fixtures/baselines/starter/list--tiny-dense--inproc--cpu.json"
    data = json.loads(edited.read_text())
    data["tokens"][3] += 1
    edited.write_text(json.dumps(data))
    proc = subprocess.run(pytest, cwd=tmp_path / "proj", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "2 failed" in proc.stdout and "at token 3" in proc.stdout, proc.stdout[-2000:]
