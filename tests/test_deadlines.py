"""Request deadlines: a request that never ends becomes a `timeout` result naming its case, the server is
restarted, the run goes on, and nothing hangs. Driven with a real llama-server stopped by SIGSTOP."""

import json
import os
import signal
import threading
import time

import pytest
import requests

from harness.backends import server as server_module
from harness.backends.base import DEADLINE_FLOOR_S, DEADLINE_SLACK, SpeedMeter, request_deadline
from harness.cli import main
from harness.request import Request, Sampling

DEADLINE_S = 4.0
STALL_SUITE = f"""\
suite: stall
matrix: {{backends: [server], modes: [seq], specs: [none], models: [tiny-dense]}}
sampling: {{n_predict: -1, ignore_eos: true}}
deadline_s: {DEADLINE_S}
run_order: [seq]
checks: [no-crash]
cases:
  - {{name: stalled, prompt: "Write a quicksort demo in C."}}
  - {{name: after_restart, prompt: "Write a quicksort demo in Java.", sampling: {{n_predict: 16}}}}
"""


def test_deadline_is_the_override_or_n_predict_over_the_slowest_measured_speed():
    request = Request(prompt="x", sampling=Sampling(n_predict=100))
    assert request_deadline(Request(prompt="x", deadline_s=2.5), 4096, 1000.0) == 2.5
    assert request_deadline(request, 4096, 50.0) == pytest.approx(DEADLINE_FLOOR_S + DEADLINE_SLACK * 100 / 50.0)
    unlimited = Request(prompt="x", sampling=Sampling(n_predict=-1))
    assert request_deadline(unlimited, 512, 50.0) == pytest.approx(DEADLINE_FLOOR_S + DEADLINE_SLACK * 512 / 50.0)
    assert request_deadline(request, 4096, None) > request_deadline(request, 4096, 50.0)  # unmeasured: assume slow
    meter = SpeedMeter()
    meter.record(100, 1.0)
    meter.record(100, 4.0)
    meter.record(2, 10.0)  # too short to say anything about the speed
    assert meter.slowest == 25.0


class _Stopper(threading.Thread):
    """SIGSTOPs the first llama-server this process starts as soon as one of its slots is processing."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.server = None
        self.stopped_at = None
        self.gone_at = None

    def run(self):
        limit = time.monotonic() + 120
        while not self.done.is_set() and time.monotonic() < limit:
            server = self.server or next(iter(server_module._RUNNING), None)
            if server is not None and self.server is None and server.process is not None:
                self.server = server
            if self.server is not None and self.stopped_at is None:
                try:
                    answer = requests.get(f"{self.server.url}/slots", timeout=2)
                    slots = answer.json() if answer.status_code == 200 else []  # 503 while loading
                    if any(slot["is_processing"] for slot in slots):
                        os.kill(self.server.process.pid, signal.SIGSTOP)
                        self.stopped_at = time.monotonic()
                except requests.RequestException:
                    pass
            if self.stopped_at is not None and self.server.process.poll() is not None:
                self.gone_at = time.monotonic()
                return
            time.sleep(0.01)

    def release(self):
        """Never leave a stopped process behind, whatever happened."""
        self.done.set()
        if self.server is not None and self.server.process.poll() is None:
            os.kill(self.server.process.pid, signal.SIGCONT)


def test_server_stopped_mid_request_times_out_the_case_restarts_and_the_run_goes_on(tmp_path, tiny_models):
    suite = tmp_path / "stall.yaml"
    suite.write_text(STALL_SUITE)
    out = tmp_path / "run"
    stopper = _Stopper()
    stopper.start()
    started = time.monotonic()
    try:
        status = main(["run", "--suite", str(suite), "--out", str(out)])
    finally:
        stopper.release()
    elapsed = time.monotonic() - started
    assert stopper.stopped_at is not None, "the server was never caught processing"
    assert stopper.gone_at is not None and stopper.gone_at - stopper.stopped_at <= DEADLINE_S + 1.0
    assert status == 1
    records = {r["case"]: r for r in json.loads((out / "results.json").read_text())}
    assert records["stalled"]["stop_reason"] == "timeout"
    assert "case stalled" in records["stalled"]["error"] and "restarted" in records["stalled"]["error"]
    assert records["after_restart"]["stop_reason"] == "limit" and len(records["after_restart"]["tokens"]) == 16
    checks = {(c["case"], c["check"]): c for c in json.loads((out / "checks.json").read_text())}
    stalled = checks[("stalled", "no-crash")]
    assert not stalled["passed"] and "case stalled" in stalled["message"] and stalled["evidence"]["timeouts"] == 1
    assert checks[("after_restart", "no-crash")]["passed"]
    assert elapsed < 120
