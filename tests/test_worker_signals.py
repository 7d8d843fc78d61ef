"""The in-process engine's worker leaves SIGINT, SIGTERM and SIGHUP to the parent: a signal sent to the whole
process group (`kill -TERM -- -PGID`, a closed terminal) must not kill the worker before the parent decides,
or the requests in flight read as `crashed ... SIGTERM`, a verdict on llama.cpp that it never earned."""

import os
import signal
import time

import pytest

from harness.backends.inproc import _context, _start_without_main
from harness.engine.worker import serve


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_the_worker_outlives_a_signal_to_its_process_group(tmp_path, sig):
    ctx = _context()
    conn, child = ctx.Pipe()
    progress = ctx.RawArray("q", 2)
    process = ctx.Process(target=serve, args=(child, str(tmp_path / "engine.log"), False, progress), daemon=True)
    _start_without_main(process)
    child.close()
    try:
        conn.send(("run", []))  # no engine yet: the worker answers (a harness bug report), so it is in its loop
        assert conn.poll(60), "the worker did not answer"
        assert conn.recv()[0] == "bug"
        os.kill(process.pid, sig)
        time.sleep(0.5)
        assert process.is_alive(), f"the worker died of {sig.name} (exit code {process.exitcode})"
        conn.send(("close",))
        process.join(10)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)
