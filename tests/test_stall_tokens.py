"""Progress means tokens returned (issue 28, item 9): a llama-server slot that works without returning a token
is stalled within the stall window, whatever its other /slots counters do.

A llama-server whose rollback leaves the sampler unrestored spins on penalised requests: every verification
appends the draft to the slot's tokens and every checkpoint restore cuts them again, so `/slots` shows
`n_prompt_tokens` moving at every look while `n_decoded` (the tokens returned) stands still. The watch took
any counter's move for progress, and the 24 spinning requests of the `sampling` suite ended at their 55.6 s
deadline. Here an HTTP endpoint answers /slots exactly as such a server does; the real spinning llama-server is
tests/test_stall_spin.py's."""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from harness.backends.base import StallMeter
from harness.backends.slots_watch import SlotsWatch


def slot(id_: int, task: int, n_tokens: int, decoded: int, processing: bool = True) -> dict:
    """One entry of GET /slots as llama-server 0c1e570 writes it (server_slot::to_json)."""
    return {
        "id": id_,
        "n_ctx": 4096,
        "speculative": True,
        "is_processing": processing,
        "id_task": task,
        "n_prompt_tokens": n_tokens,
        "n_prompt_tokens_processed": 33,
        "n_prompt_tokens_cache": 0,
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


def watch_for(answer, seconds: float, in_flight: int = 1):
    """Watch a fake server for `seconds` with `in_flight` requests of 33 prompt tokens: (stalled slot, why,
    seconds until the stall) or None."""
    fake = FakeSlots(answer)
    server = SimpleNamespace(url=fake.url)
    stalls = []
    watch = SlotsWatch(
        lambda: server, StallMeter(1.0), lambda s, why, slot: stalls.append((slot, why, time.monotonic()))
    )
    started = time.monotonic()
    try:
        with _tracking(watch, in_flight):
            while not stalls and time.monotonic() < started + seconds:
                time.sleep(0.05)
    finally:
        watch.close()
        fake.close()
    return (stalls[0][0], stalls[0][1], stalls[0][2] - started) if stalls else None


class _tracking:
    def __init__(self, watch, n):
        self.contexts = [watch.tracking() for _ in range(n)]

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()(33)

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
