"""A session given no run directory logs into a temp dir of its own and removes it when it closes, unless a message
cited a file in it (a crash's log, a failed start's): shared CI machines keep only what somebody was pointed to.
Before LogDir every such session left its dir behind (sessions 12-14's test runs left 7108 of them, 1.1 GB)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import kill_when_busy, quicksort

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.process import LogDir
from harness.backends.server import LlamaServer
from harness.backends.server_backend import ServerBackend
from harness.engine.worker import STEPS
from harness.errors import HarnessError

KILL_WAIT_S = 120.0
"""How long a killer thread waits for the state it kills in (a step done, a slot processing): a deadline, not a
phase it assumes."""


def _cited_logs(text: str) -> list[Path]:
    """The log files a message names."""
    return [Path(p) for p in re.findall(r"(/\S+\.log)\b", text)]


def test_log_dir_removes_its_own_temp_dir_unless_cited_and_never_a_given_one(tmp_path):
    given = LogDir(tmp_path / "run", "specharness-test-")
    given.path.mkdir()
    given.close()
    own, cited = LogDir(None, "specharness-test-"), LogDir(None, "specharness-test-")
    (own.path / "a.log").write_text("x")
    assert cited.cite(cited.path / "b.log") == cited.path / "b.log"
    own.close(), cited.close(), own.close()
    assert given.path.is_dir() and not own.path.exists() and cited.path.is_dir()
    cited.path.rmdir()


def test_an_engine_session_without_a_run_dir_removes_its_logs_on_a_clean_close(tiny_models):
    session = InprocBackend().open(ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq"))
    try:
        assert session.run([quicksort("C", n_predict=4)])[0].ok
        assert session.log_path.is_file()
    finally:
        session.close()
    assert not session.logs.path.exists()


def test_a_crashed_engine_session_keeps_the_log_its_error_cites(tiny_models):
    session = InprocBackend().open(ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq"))
    worker = session.process

    def kill_once_stepping() -> None:
        deadline = time.monotonic() + KILL_WAIT_S
        while session.progress[STEPS] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(worker.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_once_stepping)
    killer.start()
    try:
        [crashed] = session.run([quicksort("C", n_predict=100_000)])
    finally:
        killer.join()
        session.close()
    assert crashed.stop_reason == "crashed", crashed.error
    [log] = _cited_logs(crashed.error)
    assert log.parent == session.logs.path and log.is_file()
    shutil.rmtree(log.parent)


def test_a_server_session_without_a_run_dir_removes_its_dir_when_clean_and_keeps_a_cited_crash_log(tiny_models):
    build = ensure_server(None, "cpu", [], jobs=None)
    config = ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq")
    with ServerBackend(build).open(config) as clean:
        assert clean.run([quicksort("C", n_predict=4)])[0].ok
    assert not clean.run_dir.exists()

    with ServerBackend(build).open(config) as session:
        done = threading.Event()
        killer = threading.Thread(target=kill_when_busy, args=(session.server, signal.SIGKILL, done, KILL_WAIT_S))
        killer.start()
        try:
            [crashed] = session.run([quicksort("C", n_predict=4000)])
        finally:
            done.set()
            killer.join()
    assert crashed.stop_reason == "crashed", crashed.error
    [log] = _cited_logs(crashed.error)
    assert log.parent == session.run_dir and log.is_file()
    shutil.rmtree(log.parent)


def test_a_lone_llama_server_removes_its_temp_log_on_stop_and_keeps_the_one_a_failed_start_names(tiny_models, tmp_path):
    build = ensure_server(None, "cpu", [], jobs=None)
    with LlamaServer(server_bin=build.server_bin, model=tiny_models["tiny-dense"].path) as server:
        assert server.log_path.is_file()
    assert not server.log_path.parent.exists()

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(256))
    refused = LlamaServer(server_bin=build.server_bin, model=bad)
    with pytest.raises(HarnessError, match="could not load model") as excinfo:
        refused.start()
    [log] = _cited_logs(str(excinfo.value))
    assert log == refused.log_path and log.is_file()
    shutil.rmtree(log.parent)
