"""Progress means tokens returned (issue 28, item 9): a llama-server slot that works without returning a token
is stalled within the stall window, whatever its other /slots counters do.

A llama-server whose rollback leaves the sampler unrestored spins on penalised requests: every verification
appends the draft to the slot's tokens and every checkpoint restore cuts them again, so `/slots` shows
`n_prompt_tokens` moving at every look while `n_decoded` (the tokens returned) stands still. The watch took
any counter's move for progress, and the 24 spinning requests of the `sampling` suite ended at their 55.6 s
deadline. Here an HTTP endpoint answers /slots exactly as such a server does; the real spinning llama-server is
tests/test_stall_spin.py's.

And a slot that returns tokens is not stalled while its batch mate reads a long prompt (issue 48): recorded
/slots answers, and a real llama-server in par."""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import requests
from skips import require_model

from harness.backends.base import ServeConfig, StallMeter
from harness.backends.server_backend import ServerBackend
from harness.backends.slots_watch import SlotsWatch, n_decoded
from harness.suites.request import Request, Sampling


def slot(
    id_: int, task: int, n_tokens: int, decoded: int, processing: bool = True, processed: int = 33, cached: int = 0
) -> dict:
    """One entry of GET /slots as llama-server 0c1e570 writes it (server_slot::to_json)."""
    return {
        "id": id_,
        "n_ctx": 4096,
        "speculative": True,
        "is_processing": processing,
        "id_task": task,
        "n_prompt_tokens": n_tokens,
        "n_prompt_tokens_processed": processed,
        "n_prompt_tokens_cache": cached,
        "next_token": [{"has_next_token": True, "has_new_line": False, "n_remain": 64 - decoded, "n_decoded": decoded}],
    }


class FakeSlots:
    """An HTTP server answering GET /slots with `answer(look)` for the look-th request."""

    def __init__(self, answer):
        looks = itertools.count()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = json.dumps(answer(next(looks))).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def watch_for(answer, seconds: float, in_flight: int = 1, prompts: list[int] | None = None, meter=None):
    """Watch a fake server for `seconds` with `in_flight` requests of 33 prompt tokens (or requests of `prompts`
    tokens) under `meter` (a 1 s floor, nothing measured): (stalled slot, why, seconds until the stall) or None."""
    fake = FakeSlots(answer)
    server = SimpleNamespace(url=fake.url)
    stalls = []
    watch = SlotsWatch(
        lambda: server, meter or StallMeter(1.0), lambda s, why, slot: stalls.append((slot, why, time.monotonic()))
    )
    started = time.monotonic()
    try:
        with _tracking(watch, prompts or [33] * in_flight):
            while not stalls and time.monotonic() < started + seconds:
                time.sleep(0.05)
    finally:
        watch.close()
        fake.close()
    return (stalls[0][0], stalls[0][1], stalls[0][2] - started) if stalls else None


class _tracking:
    def __init__(self, watch, prompts):
        self.prompts = prompts
        self.contexts = [watch.tracking() for _ in prompts]

    def __enter__(self):
        for context, n_tokens in zip(self.contexts, self.prompts, strict=True):
            context.__enter__()(n_tokens)

    def __exit__(self, *exc):
        for context in self.contexts:
            context.__exit__(*exc)


def test_a_slot_that_spins_without_returning_tokens_is_stalled_within_the_window():
    # the draft of 4 appended, then cut by the checkpoint restore: n_prompt_tokens moves at every look
    stalled = watch_for(lambda look: [slot(0, 5, 40 + 4 * (look % 2), 7)], seconds=10)
    assert stalled is not None, "the spinning slot was taken for progress"
    which, why, after = stalled
    assert after <= 10 and "got no token for" in why and "stall window" in why
    assert which in (0, None)


def test_a_slot_returning_tokens_is_not_stalled():
    assert watch_for(lambda look: [slot(0, 5, 40 + look, 2 + look)], seconds=4) is None


def test_the_spinning_slot_is_named_while_another_returns_tokens():
    stalled = watch_for(
        lambda look: [slot(0, 5, 40 + look, 2 + look), slot(1, 6, 50 + 4 * (look % 2), 9)], seconds=10, in_flight=2
    )
    assert stalled is not None and stalled[0] == 1 and "slot 1 returned none" in stalled[1]


@pytest.mark.parametrize("decoded", [0, 1])
def test_a_slot_still_reading_its_prompt_gets_the_prompt_term(decoded):
    """Before its first tokens a slot may be reading its prompt: the window then has the prompt term (33 tokens
    at the assumed 100 tokens/s: 10 × (0.2 + 0.33) = 5.3 s), so the stall comes later than the 2 s window."""
    stalled = watch_for(lambda look: [slot(0, 5, 33, decoded)], seconds=10)
    assert stalled is not None and stalled[2] >= 5.0 and "33 prompt tokens" in stalled[1]


def measured(step_s: float, prompt_token_s: float) -> StallMeter:
    """A meter with a 1 s floor that measured `step_s` per step and `prompt_token_s` per prompt token."""
    meter = StallMeter(1.0)
    meter.step_s, meter.prompt_token_s = step_s, prompt_token_s
    return meter


# Recorded from a real llama-server (0c1e570, gemma3-270m, par, 2 slots, default batch of 2048, 2026-11-28, the
# run of test_a_generating_slot_is_not_stalled_while_its_batch_mate_reads_a_long_prompt without the fix): slot 0
# had returned 44 tokens of a 9-token prompt (5 read, 4 cached) when slot 1 took a 4002-token prompt; the batch
# held slot 0's next token and 2047 of slot 1's prompt tokens, and every look at /slots for the 5.4 s of its
# decode answered the same (n_prompt_tokens_processed moves only after a whole llama_decode call).
GENERATING = slot(0, 88, 53, 44, processed=5, cached=4)
READING = slot(1, 154, 2047, 0, processed=0)


def test_a_generating_slot_waits_out_its_batch_mates_prompt():
    """Issue 48: the old watch gave slot 0 the window of a step (1 s here) and declared it stalled while the
    batch that carried its next token read 2047 of slot 1's prompt tokens. Its window now has the prompt term of
    the other requests in flight (4002 tokens: 10 × (0.01 + 4002 × 0.0005) = 20.1 s)."""
    stalled = watch_for(lambda look: [GENERATING, READING], seconds=3.5, prompts=[9, 4002], meter=measured(0.01, 5e-4))
    assert stalled is None, f"slot {stalled[0]} was declared stalled after {stalled[2]:.1f} s: {stalled[1]}"


def test_a_slot_that_spins_while_its_batch_mate_reads_is_stalled_within_the_mates_prompt_term():
    """The batch mate's prompt term bounds the wait: slot 0 returns nothing while slot 1 reads a 400-token prompt
    (its n_prompt_tokens_processed moving, so the server as a whole gets on); slot 0 is stalled once the window
    with slot 1's 400 tokens (its own 9 already read: not counted) has passed, 10 × (0.01 + 400 × 0.0005) = 2.1 s,
    not after the 1 s of a step, and not never."""

    def answer(look):
        read = min(400, 20 * (look + 1))
        return [GENERATING, slot(1, 154, read, 0, processed=read)]

    stalled = watch_for(answer, seconds=8, prompts=[9, 400], meter=measured(0.01, 5e-4))
    assert stalled is not None, "the spinning slot was never declared stalled"
    which, why, after = stalled
    assert which == 0 and "slot 0 returned none" in why and "400 prompt tokens" in why, why
    assert 2.0 <= after <= 4.0, f"declared after {after:.1f} s: {why}"


def test_a_generating_slot_is_not_stalled_while_its_batch_mate_reads_a_long_prompt(tmp_path):
    """Issue 48 on a real llama-server: in par a request generates on one slot when another request's
    4000-token prompt arrives. llama-server puts the generating slot's next token and the prompt's tokens in one
    batch, so that slot returns nothing until the batch is decoded: with the default batch of 2048, gemma3-270m
    took 5.2 s for 2047 of them under a full test run on the 2-core box (the issue's 5.5 s), past the 5 s floor of
    the window the old watch gave the generating slot, which restarted the server. A batch of 4096 takes all of
    the prompt but its last 4 + n_ubatch tokens (read apart for a checkpoint) and stands the generating slot
    still well past the floor (14.1 s measured, 2026-11-28; the old watch restarted the server after 5.1 s). The
    floor is the default, as in the issue."""
    model = require_model("gemma3-270m")
    config = ServeConfig(model=model.path, mode="par", parallel=2, n_ctx=8192, n_batch=4096)
    words = "one two three four five six seven eight nine ten "
    warm = Request(prompt=words * 50, sampling=Sampling(n_predict=16, ignore_eos=True, temperature=0.0), tag="warm")
    generating = Request(
        prompt="Write a quicksort demo in C.",
        sampling=Sampling(n_predict=64, ignore_eos=True, temperature=0.0),
        tag="generating",
    )
    reading = Request(prompt=words * 400, sampling=Sampling(n_predict=8, temperature=0.0), tag="reading")
    still = {"since": None, "longest": 0.0}  # the generating slot standing still while the other reads: the evidence

    with ServerBackend(run_dir=tmp_path).open(config) as session:
        [warmed] = session.run([warm])  # the session measures a step and the prompt speed, as a suite's cases do
        assert warmed.ok, warmed.error
        results: dict[str, object] = {}
        first = threading.Thread(target=lambda: results.update(generating=session.run([generating])[0]))
        first.start()
        until = time.monotonic() + 60
        while time.monotonic() < until and not any(
            s.get("is_processing") and n_decoded(s) >= 4 for s in _slots(session)
        ):
            time.sleep(0.05)
        second = threading.Thread(target=lambda: results.update(reading=session.run([reading])[0]))
        second.start()
        while second.is_alive():
            slots, now = _slots(session), time.monotonic()
            busy = {s["id"]: n_decoded(s) for s in slots if s.get("is_processing")}
            if len(busy) == 2 and min(busy.values()) == 0 and max(busy.values()) >= 4:
                key = max(busy.values())
                if still["since"] is None or still["since"][0] != key:
                    still["since"] = (key, now)
                still["longest"] = max(still["longest"], now - still["since"][1])
            second.join(0.1)
        first.join(120)
        starts = session.starts
    evidence = f"the generating slot stood still for {still['longest']:.1f} s while the other read its prompt"
    for tag in ("generating", "reading"):
        result = results[tag]
        assert result.stop_reason == "limit", (tag, result.stop_reason, result.error, evidence)
    assert len(results["generating"].tokens) == 64 and len(results["reading"].tokens) == 8
    assert starts == 1, f"llama-server was restarted ({evidence})"


def _slots(session) -> list[dict]:
    try:
        answer = requests.get(f"{session.server.url}/slots", timeout=5)
        return answer.json() if answer.status_code == 200 else []
    except (requests.RequestException, ValueError):
        return []
