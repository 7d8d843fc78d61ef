"""HTTP client for one llama-server: /completion, /tokenize, /apply-template → `Result` records.

Every request has a timeout. A dropped connection (the process died) raises `ConnectionLost`, a
timeout raises `RequestTimedOut`, and an HTTP 5xx answer raises `ServerError` (llama-server sends
5xx for fatal decode errors and then terminates): whoever owns the process decides what they mean.
A 4xx answer (a request the server refuses) becomes a Result with `stop_reason="error"`.
"""

from __future__ import annotations

from typing import Any, Optional

import requests

from harness.logits import from_server_probs
from harness.request import Request
from harness.result import Result, Timings

CONNECT_TIMEOUT_S = 10.0
COMPLETION_FIELDS = frozenset({"cache_prompt", "id_slot", "samplers"})
"""Extra /completion fields a caller may add to every request (see `LlamaClient.complete`)."""


class ConnectionLost(Exception):
    """The server closed or refused the connection (usually: the process is gone)."""


class RequestTimedOut(Exception):
    """The server did not answer within the request timeout."""


class ServerError(Exception):
    """An HTTP error answer from the server (`{"error": {"code", "message", "type"}}`); a prompt that does not
    fit the slot (`exceed_context_size_error`) reads `context_full: ...`, as in the in-process engine."""

    def __init__(self, status: int, message: str, kind: str = ""):
        prefix = "context_full: " if kind == "exceed_context_size_error" else ""
        super().__init__(f"{prefix}HTTP {status}: {message}")
        self.status = status


class LlamaClient:
    """Requests to the llama-server at `base_url`, each bounded by `timeout` seconds."""

    def __init__(self, base_url: str, timeout: float = 300.0):
        self.base_url = base_url
        self.timeout = timeout

    def _post(self, path: str, payload: dict) -> dict:
        try:
            resp = requests.post(self.base_url + path, json=payload, timeout=(CONNECT_TIMEOUT_S, self.timeout))
        except requests.Timeout:
            raise RequestTimedOut(f"{path} got no answer within {self.timeout:.0f} s") from None
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

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` exactly as /completion would evaluate it (special tokens added and parsed)."""
        return self._post("/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]

    def apply_template(self, messages: list[dict]) -> str:
        """The prompt text the model's chat template renders for `messages` (with the generation prompt)."""
        return self._post("/apply-template", {"messages": messages})["prompt"]

    def save_slot(self, slot_id: int, filename: str) -> dict:
        """POST /slots/{id}?action=save: the slot's state into the server's --slot-save-path directory."""
        return self._post(f"/slots/{slot_id}?action=save", {"filename": filename})

    def completion(self, payload: dict) -> dict:
        """POST /completion (non-streaming) and return the final response object."""
        return self._post("/completion", payload)

    def complete(self, request: Request, n_probs: int = 0, fields: Optional[dict[str, Any]] = None) -> Result:
        """Serve one Request through /completion and fill a Result with prompt and output token ids.

        Chats are rendered with /apply-template (the same template code /v1/chat/completions runs),
        tokenized, and sent to /completion: /v1/chat/completions returns no token ids at all (only
        `logprobs` entries, without the prompt's ids), while this path yields both id lists. The
        prompt is always sent as token ids, so `prompt_tokens` is exactly what the server evaluated.
        `n_probs` > 0 fills `Result.logits` with the top-`n_probs` log-probabilities per token.
        `fields` adds /completion fields from COMPLETION_FIELDS (e.g. `cache_prompt`, `id_slot`).
        """
        prompt_tokens: list[int] = []
        try:
            if isinstance(request.prompt, list):
                prompt_tokens = list(request.prompt)
            else:
                text = request.prompt if request.messages is None else self.apply_template(request.messages)
                prompt_tokens = self.tokenize(text)
            data = self.completion({"prompt": prompt_tokens, **_sampling_fields(request), "n_probs": n_probs,
                                    "return_tokens": True, **(fields or {})})
        except ServerError as err:
            if err.status >= 500:
                raise
            return Result(prompt_tokens=prompt_tokens, stop_reason="error", error=str(err))
        return _result(prompt_tokens, data)


def _sampling_fields(request: Request) -> dict[str, Any]:
    """/completion fields of a Request's Sampling; unset seed/grammar/schema are left to the server."""
    s = request.sampling
    out = {"n_predict": s.n_predict, "temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
           "min_p": s.min_p, "stop": s.stop}
    optional = {"seed": s.seed, "grammar": s.grammar, "json_schema": s.json_schema}
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def _result(prompt_tokens: list[int], data: dict) -> Result:
    """A Result from a final /completion response object."""
    timings = data.get("timings", {})
    spec_stats: dict[str, Any] = {"draft_n": 0, "draft_n_accepted": 0}  # the server omits them when nothing was drafted
    spec_stats.update({k: v for k, v in timings.items() if k.startswith("draft_")})
    spec_stats["types"] = data.get("generation_settings", {}).get("speculative.types", "")
    return Result(
        prompt_tokens=prompt_tokens,
        tokens=list(data.get("tokens", [])),
        text=data.get("content", ""),
        stop_reason=data.get("stop_type", "none"),
        slot_id=data.get("id_slot", -1),
        timings=Timings(
            prompt_n=timings.get("prompt_n", 0), prompt_ms=timings.get("prompt_ms", 0.0),
            predicted_n=timings.get("predicted_n", 0), predicted_ms=timings.get("predicted_ms", 0.0),
        ),
        spec_stats=spec_stats,
        logits=from_server_probs(data.get("completion_probabilities", [])),
    )
