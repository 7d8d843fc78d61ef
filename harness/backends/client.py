"""HTTP client for one llama-server: /completion, /tokenize, /apply-template → `Result` records.

Every request has a timeout. A dropped connection (the process died) raises `ConnectionLost`, a
timeout raises `RequestTimedOut`, and an HTTP 5xx answer raises `ServerError` (llama-server sends
5xx for fatal decode errors and then terminates): whoever owns the process decides what they mean.
A 4xx answer (a request the server refuses) becomes a Result with `stop_reason="error"`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import requests

from harness.result import Result, Timings
from harness.result.logits import from_server_probs, matched_entries
from harness.suites.request import Request, Sampling

CONNECT_TIMEOUT_S = 10.0
COMPLETION_FIELDS = frozenset({"cache_prompt", "id_slot", "samplers"})
"""Extra /completion fields a caller may add to every request (see `LlamaClient.complete`)."""


def local(method: str, url: str, **kwargs: Any) -> requests.Response:
    """One HTTP request to a llama-server of this machine (`requests.request`, but without the environment's
    proxies and credentials: an HTTP_PROXY without 127.0.0.1 in NO_PROXY would send it through a proxy, and reading
    them took a tenth of the harness's own time per request). A fresh connection each time, as `requests.get`."""
    with requests.Session() as session:
        session.trust_env = False
        return session.request(method, url, **kwargs)


class ConnectionLost(Exception):
    """The server closed or refused the connection (usually: the process is gone)."""


class RequestTimedOut(Exception):
    """The server did not answer within the request timeout."""


KV_FULL_MESSAGE = "Context size has been exceeded."
"""llama-server's error for every slot in progress when even a one-token decode finds no free KV cell
(`update_slots`, decode status 1 at n_batch 1): its form of a full context during generation."""


class ServerError(Exception):
    """An HTTP error answer from the server (`{"error": {"code", "message", "type"}}`); a prompt that does not
    fit the slot (`exceed_context_size_error`) or a KV cache full during generation (`KV_FULL_MESSAGE`)
    reads `context_full: ...`, as in the in-process engine."""

    def __init__(self, status: int, message: str, kind: str = ""):
        full = kind == "exceed_context_size_error" or message.strip() == KV_FULL_MESSAGE
        prefix = "context_full: " if full else ""
        super().__init__(f"{prefix}HTTP {status}: {message}")
        self.status = status


class LlamaClient:
    """Requests to the llama-server at `base_url`, each bounded by `timeout` seconds."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url
        self.timeout = timeout

    def _post(self, path: str, payload: dict, until: float | None = None) -> dict:
        """POST and return the JSON answer within `timeout` seconds, or by `until` (time.monotonic) if given."""
        timeout = self.timeout if until is None else max(0.01, until - time.monotonic())
        try:
            resp = local("POST", self.base_url + path, json=payload, timeout=(min(CONNECT_TIMEOUT_S, timeout), timeout))
        except requests.Timeout:
            raise RequestTimedOut(f"{path} got no answer within {timeout:.1f} s") from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as err:
            raise ConnectionLost(f"{path}: {err}") from None
        if resp.status_code >= 400:
            try:
                error = resp.json()["error"]
                message, kind = error["message"], error.get("type", "")
            except (ValueError, KeyError, TypeError):
                message, kind = resp.text.strip()[:200], ""
            raise ServerError(resp.status_code, message, kind)
        return resp.json()

    def tokenize(self, text: str, until: float | None = None) -> list[int]:
        """Token ids of `text` exactly as /completion would evaluate it (special tokens added and parsed)."""
        return self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True}, until)["tokens"]

    def apply_template(self, messages: list[dict], until: float | None = None) -> str:
        """The prompt text the model's chat template renders for `messages` (with the generation prompt)."""
        return self._post("/apply-template", {"messages": messages}, until)["prompt"]

    def all_idle(self, within: float = 10.0) -> bool:
        """Whether every slot is idle (GET /slots, asked again until they are, for at most `within` seconds): a
        slot is released, and its request's counters added to /metrics, just after its answer is sent."""
        return self._slots_become(lambda slot: not slot.get("is_processing"), within)

    def metrics(self) -> dict[str, float]:
        """llama-server's counters (GET /metrics, Prometheus text; `--metrics`), by name without the `llamacpp:`
        prefix; the labelled `spec_decode_num_accepted_tokens_per_pos_total` summed over its positions."""
        try:
            resp = local(
                "GET", self.base_url + "/metrics", timeout=(min(CONNECT_TIMEOUT_S, self.timeout), self.timeout)
            )
        except requests.Timeout:
            raise RequestTimedOut(f"/metrics got no answer within {self.timeout:.1f} s") from None
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as err:
            raise ConnectionLost(f"/metrics: {err}") from None
        if resp.status_code >= 400:
            raise ServerError(resp.status_code, resp.text.strip()[:200])
        return parse_metrics(resp.text)

    def slot_idle(self, slot_id: int, within: float = 10.0) -> bool:
        """Whether slot `slot_id` is idle (GET /slots, asked again until it is, for at most `within` seconds): a
        request's answer is sent just before its slot is released, and a save posted before the release waits
        among llama-server's deferred tasks, where only another slot's release may pick it up."""
        return self._slots_become(lambda slot: slot.get("id") != slot_id or not slot.get("is_processing"), within)

    def _slots_become(self, idle, within: float) -> bool:
        """Whether `idle(slot)` holds for every slot of GET /slots, asked again until it does, for at most `within`
        seconds (False at once when /slots cannot be read)."""
        until = time.monotonic() + within
        while True:
            try:
                slots = local("GET", self.base_url + "/slots", timeout=max(0.01, until - time.monotonic())).json()
                if all(idle(s) for s in slots):
                    return True
            except (requests.RequestException, ValueError, AttributeError):
                return False
            if time.monotonic() >= until:
                return False
            time.sleep(0.005)

    def save_slot(self, slot_id: int, filename: str) -> dict:
        """POST /slots/{id}?action=save: the slot's state into the server's --slot-save-path directory."""
        return self._post(f"/slots/{slot_id}?action=save", {"filename": filename})

    def restore_slot(self, slot_id: int, filename: str) -> dict:
        """POST /slots/{id}?action=restore: a saved state from the --slot-save-path directory into the slot."""
        return self._post(f"/slots/{slot_id}?action=restore", {"filename": filename})

    def erase_slot(self, slot_id: int) -> dict:
        """POST /slots/{id}?action=erase: the slot's sequence cleared (target and draft contexts) and its tokens."""
        return self._post(f"/slots/{slot_id}?action=erase", {})

    def completion(self, payload: dict, until: float | None = None) -> dict:
        """POST /completion (non-streaming) and return the final response object."""
        return self._post("/completion", payload, until)

    def complete(
        self,
        request: Request,
        n_probs: int = 0,
        fields: dict[str, Any] | None = None,
        deadline_s: float | None = None,
        on_prompt: Callable[[int], None] | None = None,
        pin: Callable[[list[int]], int | None] | None = None,
    ) -> Result:
        """Serve one Request through /completion and fill a Result with prompt and output token ids.

        Chats are rendered with /apply-template (the same template code /v1/chat/completions runs),
        tokenized, and sent to /completion: /v1/chat/completions returns no token ids at all (only
        `logprobs` entries, without the prompt's ids), while this path yields both id lists. The
        prompt is always sent as token ids, so `prompt_tokens` is exactly what the server evaluated.
        `n_probs` > 0 fills `Result.logits` with the top-`n_probs` log-probabilities per token (the
        request's own `n_probs` wins). `fields` adds /completion fields from COMPLETION_FIELDS (e.g.
        `cache_prompt`, `id_slot`). `deadline_s` bounds the whole exchange instead of `timeout`
        (RequestTimedOut past it). `on_prompt(n_tokens)` learns the prompt's length before it is sent.
        `pin(prompt_tokens)` names the slot the request must take (`id_slot`; None: the server chooses), once
        the prompt is known.
        """
        until = None if deadline_s is None else time.monotonic() + deadline_s
        sampling = request.sampling
        prompt_tokens: list[int] = []
        try:
            if isinstance(request.prompt, list):
                prompt_tokens = list(request.prompt)
            else:
                text = request.prompt if request.messages is None else self.apply_template(request.messages, until)
                prompt_tokens = self.tokenize(text, until)
            if on_prompt is not None:
                on_prompt(len(prompt_tokens))
            slot = pin(prompt_tokens) if pin is not None else None
            pinned = dict(fields or {}) | ({"id_slot": slot} if slot is not None else {})
            if not request.cache_prompt:
                pinned["cache_prompt"] = False
            data = self.completion(completion_payload(prompt_tokens, sampling, n_probs, pinned), until)
        except ServerError as err:
            if err.status >= 500:
                raise
            return Result(prompt_tokens=prompt_tokens, stop_reason="error", error=str(err))
        return _result(prompt_tokens, data)


def completion_payload(
    prompt_tokens: list[int], sampling: Sampling, n_probs: int = 0, fields: dict[str, Any] | None = None
) -> dict:
    """The /completion request body for a prompt of token ids: every sampling field as it is, the top-`n_probs`
    probabilities (the request's own `n_probs` wins), the generated token ids (`return_tokens`), `fields`."""
    return {
        "prompt": list(prompt_tokens),
        **sampling.server_fields(),
        "n_probs": n_probs if sampling.n_probs is None else sampling.n_probs,
        "return_tokens": True,
        **(fields or {}),
    }


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text of llama-server's /metrics → {name: value} (`llamacpp:` dropped; a labelled series summed
    under its name)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("llamacpp:"):
            continue
        name, _, value = line[len("llamacpp:") :].rpartition(" ")
        name = name.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _result(prompt_tokens: list[int], data: dict) -> Result:
    """A Result from a final /completion response object."""
    timings = data.get("timings", {})
    tokens = list(data.get("tokens", []))
    entries = matched_entries(data.get("completion_probabilities", []), tokens)
    logits = from_server_probs(entries)
    absent = [i for i, entry in enumerate(entries[: len(tokens)]) if entry is None]
    if data.get("stop_type") == "eos" and tokens:
        # llama-server lists the end-of-generation token it stopped on; Results (as the in-process engine's)
        # hold the generated tokens without it (its text is empty either way)
        tokens.pop()
        logits = logits[: len(tokens)]
        absent = [p for p in absent if p < len(tokens)]
    spec_stats: dict[str, Any] = {"draft_n": 0, "draft_n_accepted": 0}  # the server omits them when nothing was drafted
    spec_stats.update({k: v for k, v in timings.items() if k.startswith("draft_")})
    spec_stats["types"] = data.get("generation_settings", {}).get("speculative.types", "")
    return Result(
        prompt_tokens=prompt_tokens,
        tokens=tokens,
        text=data.get("content", ""),
        stop_reason=data.get("stop_type", "none"),
        truncated=bool(data.get("truncated", False)),
        slot_id=data.get("id_slot", -1),
        timings=Timings(
            prompt_n=timings.get("prompt_n", 0),
            prompt_ms=timings.get("prompt_ms", 0.0),
            cache_n=timings.get("cache_n", 0),
            predicted_n=timings.get("predicted_n", 0),
            predicted_ms=timings.get("predicted_ms", 0.0),
        ),
        spec_stats=spec_stats,
        logits=logits,
        probs_absent=absent,
    )
