"""One request's result, what every backend returns: `Result` (tokens, text, stop reason, draft counters, top-k
logits, KV scan, work) and its `Timings`."""

from dataclasses import dataclass, field
from typing import Any

from harness.result.logits import PositionLogits
from harness.result.work import Work


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
    metrics: dict | None = None
    """llama-server's /metrics around the batch this request was served in (one request in `seq`; a round's
    requests, sent together, elsewhere): `{"batch": id, "requests": n, "delta": {counter: moved by}}`, or
    `{"batch", "requests", "unmeasured": why}`; None where not measured (the in-process engine). `metrics-agree`
    compares the deltas with the batch's answers."""
    work: Work = field(default_factory=Work)
    """The work the request's steps did (WORK_COUNTERS; None where not counted)."""
    logits: list[PositionLogits] = field(default_factory=list)
    """One entry per generated token when logit logging is on (`logit_top_k` > 0), else empty."""
    split_rollbacks: list[dict] | None = None
    """The steps that rolled drafts back by `seq_rm` after verifying them in a micro-batch ahead of another of the
    same decode (harness.llama.ubatch.split_rollback): llama-server's read from its log
    (harness.backends.server_batches), the in-process engine's from its own batches (harness.engine.speculative);
    None where not known (no recurrent snapshots to roll back into, a log without the lines)."""

    stale_checkpoint: str | None = None
    """llama-server only: the request's prompt went on from a context checkpoint made from other tokens than its own
    (harness.backends.server_checkpoints), in words; None where none was seen."""
    probs_absent: list[int] = field(default_factory=list)
    """llama-server only: the generated tokens that have no `completion_probabilities` entry at all (not an empty
    list: no entry; harness.result.logits.matched_entries), in order; empty elsewhere."""

    def split_rollback_before(self, index: int) -> str:
        """`; after a partial rollback in micro-batch ...`: the last such step whose rolled-back state made token
        `index` or one before it, as a failure line ends with it; "" where there is none."""
        before = [r for r in self.split_rollbacks or () if r["token"] <= index]
        if not before:
            return ""
        r = before[-1]
        batch = ", ".join(f"slot {s}: {n}" for s, n in r["batch"])
        return (
            f"; after slot {r['slot']}'s partial rollback to snapshot plane {r['plane']} in micro-batch {r['ubatch']} "
            f"of {r['ubatches']} of a decode (step {r['step']}: {r['accepted']} of {r['n_draft']} drafts kept; tokens "
            f"per slot: {batch}) from token {r['token']}"
        )

    @property
    def ok(self) -> bool:
        return self.error is None
