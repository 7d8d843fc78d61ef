"""Hung requests: a request that stops producing tokens becomes a `timeout` result naming its case once no
token came for the stall window (or, as a backstop, past its deadline); the server or the engine's worker
is restarted, the run goes on, and nothing hangs. Driven with a real llama-server and a real engine worker
stopped by SIGSTOP."""

import json
import os
import signal
import threading
import time

import pytest
import requests
from helpers import quicksort

from harness.backends import server as server_module
from harness.backends.base import (
    ASSUMED_PROMPT_TOKENS_PER_S,
    ASSUMED_TOKENS_PER_S,
    DEADLINE_FLOOR_S,
    DEADLINE_SLACK,
    STALL_FACTOR,
    STALL_FLOOR_S,
    ServeConfig,
    SpeedMeter,
    StallMeter,
    prompt_tokens_bound,
    request_deadline,
)
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server import LlamaServer
from harness.cli import main
from harness.engine.worker import STEPS
from harness.errors import HarnessError
from harness.result import Result, Timings
from harness.suites import load_suite
from harness.suites.request import Request, Sampling

STALL_SUITE = """\
suite: stall
matrix: {{backends: [server], modes: [seq], specs: [none], models: [tiny-dense]}}
sampling: {{n_predict: -1, ignore_eos: true}}
deadline_s: {deadline_s}
serve: {{stall_s: {stall_s}}}
run_order: [seq]
checks: [no-crash]
cases:
  - {{name: stalled, prompt: "Write a quicksort demo in C."}}
  - {{name: after_restart, prompt: "Write a quicksort demo in Java.", sampling: {{n_predict: 16}}}}
"""


def test_a_long_prompt_adds_its_reading_time_at_the_slowest_measured_prompt_speed_to_the_deadline():
    long = Request(prompt="one two three four five six seven eight nine ten " * 1636, sampling=Sampling(n_predict=8))
    short = Request(prompt="x", sampling=Sampling(n_predict=8))
    # 81,800 bytes, bounded by the context: 16,384 tokens at 2 ms each, DEADLINE_SLACK times
    extra = request_deadline(long, 16384, 50.0, 0.002) - request_deadline(short, 16384, 50.0, 0.002)
    assert extra == pytest.approx(DEADLINE_SLACK * (16384 - 1) * 0.002)
    tokens = Request(prompt=list(range(300)), sampling=Sampling(n_predict=8))
    assert request_deadline(tokens, 16384, 50.0, 0.002) - request_deadline(short, 16384, 50.0, 0.002) == pytest.approx(
        DEADLINE_SLACK * 299 * 0.002
    )
    chat = Request(messages=[{"role": "user", "content": "abc"}], sampling=Sampling(n_predict=8))
    assert prompt_tokens_bound(chat, 4096) == 3


def test_deadline_is_the_override_or_n_predict_over_the_slowest_measured_speed():
    request = Request(prompt="x", sampling=Sampling(n_predict=100))
    assert request_deadline(Request(prompt="x", deadline_s=2.5), 4096, 1000.0) == 2.5
    one_byte = DEADLINE_SLACK * 1 / ASSUMED_PROMPT_TOKENS_PER_S  # the prompt "x": at most one token
    assert request_deadline(request, 4096, 50.0) == pytest.approx(
        DEADLINE_FLOOR_S + DEADLINE_SLACK * 100 / 50.0 + one_byte
    )
    unlimited = Request(prompt="x", sampling=Sampling(n_predict=-1))
    assert request_deadline(unlimited, 512, 50.0) == pytest.approx(
        DEADLINE_FLOOR_S + DEADLINE_SLACK * 512 / 50.0 + one_byte
    )
    assert request_deadline(request, 4096, None) > request_deadline(request, 4096, 50.0)  # unmeasured: assume slow
    meter = SpeedMeter()
    meter.record(100, 1.0)
    meter.record(100, 4.0)
    meter.record(2, 10.0)  # too short to say anything about the speed
    assert meter.slowest == 25.0


def _result(predicted_n: int, predicted_ms: float, prompt_n: int, prompt_ms: float, accepted: int = 0) -> Result:
    return Result(
        tokens=[1] * predicted_n,
        spec_stats={"draft_n": accepted, "draft_n_accepted": accepted},
        timings=Timings(prompt_n=prompt_n, prompt_ms=prompt_ms, predicted_n=predicted_n, predicted_ms=predicted_ms),
    )


def test_stall_window_is_the_floor_or_the_factor_times_the_slowest_step_and_prompt():
    meter = StallMeter()
    assumed_step, assumed_prompt = 1 / ASSUMED_TOKENS_PER_S, 1 / ASSUMED_PROMPT_TOKENS_PER_S
    assert meter.window() == max(STALL_FLOOR_S, STALL_FACTOR * assumed_step)
    assert meter.window(1000) == pytest.approx(STALL_FACTOR * (assumed_step + 1000 * assumed_prompt))
    meter.record(_result(40, 2000.0, 200, 400.0, accepted=20))  # 20 steps of 0.1 s, 2 ms per prompt token
    assert (meter.step_s, meter.prompt_token_s) == (pytest.approx(0.1), pytest.approx(0.002))
    meter.record(_result(40, 400.0, 200, 100.0))  # faster: the slowest stays
    meter.record(_result(4, 4000.0, 8, 800.0))  # too short to say anything about steps or prompt speed
    assert (meter.step_s, meter.prompt_token_s) == (pytest.approx(0.1), pytest.approx(0.002))
    assert meter.window() == STALL_FLOOR_S  # 10 × 0.1 s is below the floor
    assert meter.window(2000) == pytest.approx(STALL_FACTOR * (0.1 + 2000 * 0.002))
    meter.record(_result(16, 16000.0, 64, 64.0))  # one second per step
    assert meter.window() == pytest.approx(STALL_FACTOR * 1.0)
    explained = meter.explain(2000)
    assert explained.startswith(f"stall window {meter.window(2000):.1f} s = max(floor {STALL_FLOOR_S:g} s, ")
    assert "1000.0 ms per step + 2000 prompt tokens × 2.00 ms" in explained and "assumed" not in explained
    override = StallMeter(floor_s=600.0)
    assert override.window(100) == 600.0 and "floor 600 s" in override.explain()
    with pytest.raises(HarnessError, match="stall_s must be a positive number"):
        ServeConfig(model="m.gguf", stall_s=0)


def test_suite_stall_s_must_be_positive(tmp_path):
    suite = tmp_path / "stall.yaml"
    suite.write_text(STALL_SUITE.format(deadline_s=1, stall_s=0))
    with pytest.raises(HarnessError, match="stall_s"):
        load_suite(str(suite))
    suite.write_text(STALL_SUITE.format(deadline_s=1, stall_s=2.5))
    assert load_suite(str(suite)).serve == {"stall_s": 2.5}


class _Stopper(threading.Thread):
    """SIGSTOPs the first llama-server this process starts as soon as one of its slots is processing."""

    def __init__(self):
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.server = None
        self.stopped_at = None

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
            if self.stopped_at is not None:
                return
            time.sleep(0.01)

    def release(self):
        """Never leave a stopped process behind, whatever happened."""
        self.done.set()
        if self.server is not None and self.server.process.poll() is None:
            os.kill(self.server.process.pid, signal.SIGCONT)


@pytest.mark.parametrize(
    "path, deadline_s, stall_s, reason",
    [
        ("stall", 60, 2, "case stalled got no token for"),  # the stall window fires long before the deadline
        ("deadline", 3, 600, "case stalled did not finish within its deadline of 3.0 s"),  # the backstop
    ],
    ids=["stall-window", "deadline"],
)
def test_server_stopped_mid_request_times_out_the_case_restarts_and_the_run_goes_on(
    tmp_path, tiny_models, path, deadline_s, stall_s, reason
):
    suite = tmp_path / "stall.yaml"
    suite.write_text(STALL_SUITE.format(deadline_s=deadline_s, stall_s=stall_s))
    out = tmp_path / "run"
    build = ensure_server()
    stopper = _Stopper()
    stopper.start()
    try:  # the built binary passed as --server-bin: the run header still names its llama.cpp commit
        status = main(["run", "--suite", str(suite), "--out", str(out), "--server-bin", str(build.server_bin)])
    finally:
        stopper.release()
    assert stopper.stopped_at is not None, "the server was never caught processing"
    assert status == 1
    records = {r["case"]: r for r in json.loads((out / "results.json").read_text())}
    error = records["stalled"]["error"]
    assert records["stalled"]["stop_reason"] == "timeout" and reason in error and "restarted" in error
    assert ("stall window" in error) == (path == "stall")
    assert records["after_restart"]["stop_reason"] == "limit" and len(records["after_restart"]["tokens"]) == 16
    checks = {(c["case"], c["check"]): c for c in json.loads((out / "checks.json").read_text())}
    stalled = checks[("stalled", "no-crash")]
    assert not stalled["passed"] and "case stalled" in stalled["message"] and stalled["evidence"]["timeouts"] == 1
    assert checks[("after_restart", "no-crash")]["passed"]
    server = json.loads((out / "run.json").read_text())["backends"]["server"]
    assert server["llama_cpp_commit"] == build.commit != "unknown"


def test_engine_worker_stopped_mid_request_times_out_by_its_stall_window(tiny_models):
    session = InprocBackend().open(ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq", stall_s=1.0))
    worker, progress = session.process, session.progress

    def stop_when_generating():
        limit = time.monotonic() + 60
        while progress[STEPS] < 20 and time.monotonic() < limit:  # the prompt read, tokens coming
            time.sleep(0.001)
        os.kill(worker.pid, signal.SIGSTOP)

    stopper = threading.Thread(target=stop_when_generating, daemon=True)
    try:
        stalled = quicksort("C", n_predict=-1, ignore_eos=True)
        stalled.deadline_s, stalled.tag = 60.0, "stalled"  # the stall window fires long before
        stopper.start()
        [late] = session.run([stalled])
        stopper.join()
        assert late.stop_reason == "timeout" and "case stalled got no token for" in late.error
        assert "stall window" in late.error and "worker was killed" in late.error
        again = session.run([quicksort("C", n_predict=8)])[0]
        assert again.ok and len(again.tokens) == 8 and session.starts == 2
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGCONT)
        session.close()


def test_a_streamed_completion_loses_token_ids_so_the_server_side_watches_slots(tiny_models, tmp_path):
    """Why llama-server's requests stay non-streamed (harness.backends.slots_watch): at 0c1e570 a streamed
    /completion sends no chunk for a token that leaves the text with an incomplete UTF-8 sequence (here a
    byte-fallback lead byte of the tiny model, sampled with seed 0), so its id is lost. When a llama.cpp
    update fails this test, streaming became an option."""
    config = ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq")
    with LlamaServer.from_config(config, ensure_server().server_bin, log_path=tmp_path / "server.log") as server:
        prompt = requests.post(
            f"{server.url}/tokenize", json={"content": "Story number 0:", "add_special": True}, timeout=30
        ).json()["tokens"]
        payload = {
            "prompt": prompt,
            "n_predict": 128,
            "temperature": 1.5,
            "top_k": 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": 0,
            "return_tokens": True,
            "cache_prompt": False,
        }
        whole = requests.post(f"{server.url}/completion", json=payload, timeout=60).json()
        answer = requests.post(f"{server.url}/completion", json={**payload, "stream": True}, stream=True, timeout=60)
        chunks = [json.loads(line[len(b"data: ") :]) for line in answer.iter_lines() if line.startswith(b"data: ")]
    streamed = [token for chunk in chunks for token in chunk["tokens"]]
    assert len(whole["tokens"]) == chunks[-1]["tokens_predicted"] == 128 and chunks[-1]["tokens"] == []
    assert "".join(chunk["content"] for chunk in chunks) == whole["content"]  # the text arrives, the ids do not
    lost, rest = [], iter(streamed)
    following = next(rest, None)
    for token in whole["tokens"]:
        if token == following:
            following = next(rest, None)
        else:
            lost.append(token)
    assert following is None and len(lost) == 128 - len(streamed) > 0  # the stream is the tokens less the lost
