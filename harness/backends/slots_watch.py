"""Progress of a llama-server's slots while requests are in flight: a server that stops producing tokens is
found within the stall window (StallMeter), not at the end of a request's deadline.

The /completion requests stay non-streamed: at 0c1e570 a streamed /completion leaves out the id of every
token that ends in an incomplete UTF-8 sequence (server-context.cpp `process_token` sends no chunk for it
and the final chunk's `tokens` is empty), so a streamed Result would lose tokens. Instead a thread polls
GET /slots (on by default; answered by the server's main loop between two decode steps) and watches each
slot's prompt tokens read and tokens generated (`n_prompt_tokens`, `n_decoded`): when none of them moves,
or /slots does not answer, for the stall window, the session is told the server stalled. A server that
answers /slots with another status than 200 or 503 (a build without the endpoint) is left to the deadlines.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import requests

from harness.backends.base import StallMeter

POLL_S = 0.25
"""Seconds between two looks at /slots."""
ANSWER_WAIT_S = 60.0
"""The longest one look waits for /slots (the window may be longer, or infinite: another look follows)."""


def progress(slots: list[dict]) -> tuple:
    """What moves while llama-server works: each slot's task, prompt tokens read and tokens generated."""
    return tuple(
        (
            s.get("id"),
            s.get("id_task"),
            s.get("is_processing"),
            s.get("n_prompt_tokens"),
            s.get("n_prompt_tokens_processed"),
            (s.get("next_token") or [{}])[0].get("n_decoded"),
        )
        for s in slots
    )


def reading_prompts(slots: list[dict], in_flight: int) -> bool:
    """Whether a request in flight may still be before its second token (reading its prompt, or waiting for a
    slot): the prompt lengths then count towards the window."""
    busy = [s for s in slots if s.get("is_processing")]
    return len(busy) < in_flight or any((s.get("next_token") or [{}])[0].get("n_decoded", 0) < 2 for s in busy)


class SlotsWatch:
    """Watches the server `current()` returns while requests are `tracking()`; calls `on_stall(server, why)`
    once per server that makes no progress for the stall window of `meter`."""

    def __init__(self, current: Callable[[], object], meter: StallMeter, on_stall: Callable[[object, str], None]):
        self.current = current
        self.meter = meter
        self.on_stall = on_stall
        self._prompts: dict[object, int] = {}
        """Requests in flight → their prompt length (0 until known)."""
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def tracking(self) -> Iterator[Callable[[int], None]]:
        """Watch while one request is in flight; yields the function that tells its prompt length."""
        key = object()

        def prompt(n_tokens: int) -> None:
            with self._cond:
                self._prompts[key] = n_tokens

        with self._cond:
            self._prompts[key] = 0
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="llama-server-watch")
                self._thread.start()
            self._cond.notify_all()
        try:
            yield prompt
        finally:
            with self._cond:
                del self._prompts[key]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        done = None  # the server last given up on (stalled, gone, or without /slots)
        while True:
            with self._cond:
                if self._closed:
                    return
                server = self.current()
                if not self._prompts or server is done:
                    self._cond.wait(None if not self._prompts else POLL_S)
                    continue
            if self._watch(server):
                done = server

    def _watch(self, server) -> bool:
        """Poll `server` while requests are in flight on it; returns when none are or it was replaced (False),
        or when it stalled (reported), is unreachable or has no /slots (True: watch it no more)."""
        last, seen, slots = time.monotonic(), None, []
        while True:
            with self._cond:
                if not self._prompts or self._closed or server is not self.current():
                    return False
                prompt_tokens = sum(self._prompts.values()) if reading_prompts(slots, len(self._prompts)) else 0
            window = self.meter.window(prompt_tokens)
            left = last + window - time.monotonic()
            if left <= 0:
                self.on_stall(
                    server, f"got no token for {time.monotonic() - last:.1f} s ({self.meter.explain(prompt_tokens)})"
                )
                return True
            try:
                answer = requests.get(f"{server.url}/slots", timeout=min(left, ANSWER_WAIT_S))
                if answer.status_code == 200:
                    slots = answer.json()
                    if progress(slots) != seen:
                        last, seen = time.monotonic(), progress(slots)
            except requests.Timeout:
                continue
            except (requests.RequestException, ValueError):  # the process is gone: the requests in flight say so
                return True
            if answer.status_code not in (200, 503):  # no /slots endpoint: the deadlines alone apply
                return True
            with self._cond:
                self._cond.wait(POLL_S)
