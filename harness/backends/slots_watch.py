"""Progress of a llama-server's slots while requests are in flight: a request whose slot returns no token is found
within the stall window (StallMeter), not at the end of its deadline.

The /completion requests stay non-streamed: at 0c1e570 a streamed /completion leaves out the id of every
token that ends in an incomplete UTF-8 sequence (server-context.cpp `process_token` sends no chunk for it
and the final chunk's `tokens` is empty), so a streamed Result would lose tokens. Instead a thread polls
GET /slots (on by default; answered by the server's main loop between two decode steps, and at the vendored
llama.cpp during one too: `decode` yields to the task queue, `yield_to_queue`, with the counters of before it).

Progress means tokens returned. A slot's `next_token[0].n_decoded` is its task's `stats.n_gen`, which
llama-server increments exactly once per token it hands to `process_token` (the token the request returns),
in an ordinary step and for every accepted token of a speculative step; a checkpoint restore (a rejected
draft of a hybrid or recurrent target) returns before it. A slot that spins without returning tokens keeps
other counters moving: `n_prompt_tokens` is the slot's cached token count, which grows by the draft at every
verification and shrinks at every restore (a rollback that leaves the sampler unrestored, the replay loop of
ggml-org/llama.cpp#28060), so a watch that took any change of it for progress never fired on such a server.
So a busy slot is stalled when its task's `n_decoded` has not moved for the stall window (the prompt term
of the window while it has not returned its first tokens), whatever else it reports; a request in flight that
no slot serves yet waits on the server as a whole (a new task, a slot finishing, a token anywhere, or prompt
tokens read); a server whose /slots does not answer for the window is stalled too. A server that answers
/slots with another status than 200 or 503 (a build without the endpoint) is left to the deadlines.

A slot that returns tokens waits on its batch mates' prompts too (issue 48): llama-server decodes a slot's
next token in one batch with up to n_batch prompt tokens of the other slots, so while another slot reads a
prompt the slot returns nothing for the whole batch, and nothing in /slots moves meanwhile (a slot's
`n_prompt_tokens_processed` moves only after each llama_decode call of up to n_batch tokens; its
`n_prompt_tokens` has already taken the whole batch before it). gemma3-270m stood a generating slot still for
5.2 s while another read 2047 tokens of a 4002-token prompt (2026-11-28, default batch of 2048, 2-core box under
load), past the 5 s floor. So while any request in flight may still be before its second token, a slot that
returned its first tokens has the prompt term of the other requests in flight (those of all in flight, less its
own: `n_prompt_tokens_processed` + `n_prompt_tokens_cache`, the tokens its task read or found cached) in its
window; still measured from its last token, so a slot that spins while another reads is stalled once that
window has passed.

A stall says whether the server spun or hung (`log_since`): the watch notes the size of llama-server's log (at
`-lv 5`, lines for every step) whenever a slot returns a token or the server gets on, and a stall quotes what was
logged after that. A line logged LIVELOCK_REPEATS times or more names a livelock (the checkpoint-erase loop of
ggml-org/llama.cpp#28280 logs "erasing old context checkpoint" at one position; the replay loop of #28060 the same
verification); nothing logged is a hang.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import requests

from harness.backends.base import StallMeter
from harness.backends.client import local

POLL_S = 0.25
"""Seconds between two looks at /slots."""
ANSWER_WAIT_S = 60.0
"""The longest one look waits for /slots (the window may be longer, or infinite: another look follows)."""
LIVELOCK_REPEATS = 10
"""A line logged this often since the stalled slot's last token names a livelock: an ordinary step's lines carry
its positions and token counts, so they do not repeat word for word; a loop at one position logs the same."""
TIMESTAMP = re.compile(r"^\d+(?:\.\d+)+ ")
"""The elapsed-time prefix of a llama-server log line (`0.00.201.622 D que ...`)."""
SLOT_LINE = re.compile(r"\bid +\d+ \| task -?\d+ \|")
"""A line a slot logged about its task (`slot create_check: id  0 | task 5 | erasing old context checkpoint ...`)."""
LOG_READ_MAX = 4 << 20
"""The most of the log a stall reads (its last bytes, when more was logged since the last progress)."""


def log_size(path: Path | None) -> int:
    """The size of a log file now (0 when there is none yet)."""
    try:
        return path.stat().st_size if path else 0
    except OSError:
        return 0


def log_since(path: Path | None, offset: int) -> str:
    """What llama-server logged from `offset` on, in a stall's words: the two slot lines (SLOT_LINE, timestamps
    left out) logged most, when LIVELOCK_REPEATS times or more ("spinning: ..., a livelock"); nothing ("hung:
    ..."); or how many lines, no slot's repeated. The server-wide lines of every step (the task queue's,
    "yielding to queue") repeat in any run and name nothing."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as log:
            log.seek(max(offset, log_size(path) - LOG_READ_MAX))
            lines = [TIMESTAMP.sub("", line).strip() for line in log.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [line for line in lines if line]
    if not lines:
        return "hung: llama-server logged nothing since"
    slot_lines = Counter(line for line in lines if SLOT_LINE.search(line))
    looped = [f"`{line}` {n} times" for line, n in slot_lines.most_common(2) if n >= LIVELOCK_REPEATS]
    if looped:
        return f"spinning: llama-server logged {' and '.join(looped)} in {len(lines)} lines since, a livelock"
    return f"llama-server logged {len(lines)} lines since, no slot's line {LIVELOCK_REPEATS} times"


def n_decoded(slot: dict) -> int:
    """The tokens a slot's current (or last) task has returned so far."""
    return (slot.get("next_token") or [{}])[0].get("n_decoded", 0)


def token_progress(slot: dict) -> tuple:
    """What moves when a slot returns a token: its task and that task's returned-token count."""
    return slot.get("id_task"), n_decoded(slot)


def progress(slots: list[dict]) -> tuple:
    """What moves when the server as a whole gets on: a task starting or ending on a slot, a token returned, prompt
    tokens read (never the slot's cached token count, `n_prompt_tokens`, which a spinning slot keeps moving)."""
    return tuple(
        (s.get("id"), s.get("id_task"), s.get("is_processing"), s.get("n_prompt_tokens_processed"), n_decoded(s))
        for s in slots
    )


def reading_prompts(slots: list[dict], in_flight: int) -> bool:
    """Whether a request in flight may still be before its second token (reading its prompt, or waiting for a
    slot): the prompt lengths then count towards the window."""
    busy = [s for s in slots if s.get("is_processing")]
    return len(busy) < in_flight or any(n_decoded(s) < 2 for s in busy)


def prompt_read(slot: dict) -> int:
    """The prompt tokens a slot's task has read or found cached: its whole prompt once it returns tokens."""
    return slot.get("n_prompt_tokens_processed", 0) + slot.get("n_prompt_tokens_cache", 0)


def slot_prompt_term(slot: dict, slots: list[dict], in_flight: int, prompts: int) -> int:
    """The prompt tokens in a busy slot's window, `prompts` being those of all requests in flight: all of them
    before its second token (its own prompt, and others read in the same batches); after it, those of the other
    requests while one of them may still be before its second token (their prompt tokens share the batches that
    carry this slot's next tokens), else none."""
    if n_decoded(slot) < 2:
        return prompts
    if reading_prompts(slots, in_flight):
        return max(0, prompts - prompt_read(slot))
    return 0


class Stall:
    """Per busy slot, since when its task has returned no token; and since when the server as a whole got on."""

    def __init__(self, now: float, log_at: int = 0) -> None:
        self.server_since = now
        self.server_log_at = log_at
        self.seen: tuple | None = None
        self.slots: dict[object, tuple[tuple, float]] = {}
        self.log_at: dict[object, int] = {}
        """Per busy slot, the log's size when it last returned a token."""

    def update(self, slots: list[dict], now: float, log_at: int = 0) -> None:
        """Learn from an answer of /slots at time `now`, the server's log being `log_at` bytes long."""
        if progress(slots) != self.seen:
            self.seen, self.server_since, self.server_log_at = progress(slots), now, log_at
        busy, at = {}, {}
        for slot in slots:
            if slot.get("is_processing"):
                key, id_ = token_progress(slot), slot.get("id")
                before = self.slots.get(id_)
                same = before is not None and before[0] == key
                busy[id_] = before if same else (key, now)
                at[id_] = self.log_at.get(id_, log_at) if same else log_at
        self.slots, self.log_at = busy, at

    def log_from(self, slot) -> int:
        """The log's size when `slot` (None: the server as a whole) last got on."""
        return self.server_log_at if slot is None else self.log_at.get(slot, self.server_log_at)

    def overdue(
        self, slots: list[dict], in_flight: int, prompts: int, window: Callable[[int], float], now: float
    ) -> tuple[object, float, int] | None:
        """(slot id or None for the server as a whole, seconds without progress, prompt tokens of the window) when
        the server made no progress, or a busy slot returned no token, for its window; else None. `prompts`: the
        prompt tokens of the requests in flight; `window(n)`: the stall window when `n` prompt tokens may have to
        be read first."""
        tokens = prompts if reading_prompts(slots, in_flight) else 0
        if now - self.server_since >= window(tokens):
            return None, now - self.server_since, tokens
        for slot in slots:
            if slot.get("is_processing"):
                _, since = self.slots.get(slot.get("id"), (None, now))
                tokens = slot_prompt_term(slot, slots, in_flight, prompts)
                if now - since >= window(tokens):
                    return slot.get("id"), now - since, tokens
        return None


class SlotsWatch:
    """Watches the server `current()` returns while requests are `tracking()`; calls `on_stall(server, why, slot)`
    once per server on which a busy slot returned no token (`slot`: its id), or which as a whole made no progress
    or did not answer (`slot` None), for the stall window of `meter`."""

    def __init__(
        self, current: Callable[[], object], meter: StallMeter, on_stall: Callable[[object, str, int | None], None]
    ):
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
        log = getattr(server, "log_path", None)
        stall, slots = Stall(time.monotonic(), log_size(log)), []
        while True:
            with self._cond:
                if not self._prompts or self._closed or server is not self.current():
                    return False
                in_flight, prompt_tokens = len(self._prompts), sum(self._prompts.values())
            now = time.monotonic()
            late = stall.overdue(slots, in_flight, prompt_tokens, self.meter.window, now)
            if late is not None:
                slot, waited, tokens = late
                where = f"slot {slot} returned none" if slot is not None else "llama-server made no progress"
                spun = log_since(log, stall.log_from(slot))
                why = f"got no token for {waited:.1f} s ({where}; {self.meter.explain(tokens)})"
                self.on_stall(server, why + (f"; {spun}" if spun else ""), slot)
                return True
            # a look at /slots waits no longer than the server's window can end (a server that does not answer)
            reading = prompt_tokens if reading_prompts(slots, in_flight) else 0
            left = stall.server_since + self.meter.window(reading) - now
            try:
                answer = local("GET", f"{server.url}/slots", timeout=max(0.05, min(left, ANSWER_WAIT_S)))
                if answer.status_code == 200:
                    slots = answer.json()
                    stall.update(slots, time.monotonic(), log_size(log))
            except requests.Timeout:
                continue
            except (requests.RequestException, ValueError):  # the process is gone: the requests in flight say so
                return True
            if answer.status_code not in (200, 503):  # no /slots endpoint: the deadlines alone apply
                return True
            with self._cond:
                self._cond.wait(POLL_S)
