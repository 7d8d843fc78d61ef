"""An image that sets PYTHONDONTWRITEBYTECODE does not make every process of a test run compile the harness again:
the root conftest.py sends bytecode to the specharness cache instead, for the processes the run starts too."""

import os
import subprocess
import sys

import conftest

PROBE = "import sys; print(sys.flags.dont_write_bytecode, sys.pycache_prefix)"


def test_with_bytecode_switched_off_a_run_and_its_subprocesses_cache_it_under_the_specharness_cache(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    prefix = conftest._cache_bytecode()
    assert prefix == str(tmp_path / "cache" / "pycache")
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ and os.environ["PYTHONPYCACHEPREFIX"] == prefix
    assert (sys.dont_write_bytecode, sys.pycache_prefix) == (False, prefix)
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    assert child.stdout.split() == ["0", prefix]


def test_a_prefix_already_set_is_kept_and_a_run_with_bytecode_on_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "mine"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert conftest._cache_bytecode() == str(tmp_path / "mine")
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "unchanged")
    assert conftest._cache_bytecode() is None
    assert os.environ["PYTHONPYCACHEPREFIX"] == "unchanged"
