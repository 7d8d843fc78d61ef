"""The `Result` record: one per request, filled the same way by every backend."""

from dataclasses import dataclass, field
from typing import Any

from harness.logits import PositionLogits


@dataclass
class Timings:
    """Per-request timings in llama-server's field names."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    cache_n: int = 0
    """Prompt tokens reused from the slot's cache, not decoded again (llama-server's `cache_n`; the in-process
    engine clears a slot's sequence after every request and decodes each prompt whole: always 0)."""
    predicted_n: int = 0
    predicted_ms: float = 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "cache_n": self.cache_n,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_second": round(self.predicted_per_second, 2),
        }


@dataclass
class Result:
    """What one request produced.

    `stop_reason` uses llama-server's `stop_type` words: `eos`, `word` (a stop string), `limit`
    (n_predict or context end), or `error` / `crashed` / `timeout` (past its deadline) when `error`
    says why.
    """

    prompt_tokens: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "none"
    truncated: bool = False
    """llama-server's `truncated`: the generation reached the end of the context (stopped there, or shifted
    the context and went on)."""
    error: str | None = None
    slot_id: int = -1
    timings: Timings = field(default_factory=Timings)
    spec_stats: dict[str, Any] = field(default_factory=dict)
    kv_scan: dict | None = None
    """The KV scanner's brief verdict on this request's sequence (None when not scanned)."""
    logits: list[PositionLogits] = field(default_factory=list)
    """One entry per generated token when logit logging is on (`logit_top_k` > 0), else empty."""

    @property
    def ok(self) -> bool:
        return self.error is None
