"""What every backend offers: serve one model in one mode and turn Requests into Results."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness import MODES
from harness.errors import HarnessError
from harness.llama.defaults import AMX_DEFECT as AMX_DEFECT
from harness.llama.defaults import INVALID_BATCH as INVALID_BATCH
from harness.llama.defaults import cpu_flags as cpu_flags
from harness.llama.defaults import default_repack as default_repack
from harness.llama.defaults import default_threads as default_threads
from harness.llama.defaults import invalid_batch as invalid_batch
from harness.result import Result
from harness.suites.request import Request

KV_SCAN = ("off", "request", "step")

DEADLINE_FLOOR_S = 30.0
"""Seconds every request gets on top of its expected time: start-up, prompt processing and a busy machine."""
DEADLINE_SLACK = 4.0
"""How many times slower than the slowest request measured so far a request may be before it counts as hung."""
ASSUMED_TOKENS_PER_S = 5.0
"""The speed assumed before a session has measured one (a small model on a busy 2-core machine does more)."""


def request_deadline(
    request: Request, n_ctx: int, tokens_per_second: float | None = None, prompt_token_s: float | None = None
) -> float:
    """Seconds a request may take before it ends as `stop_reason: timeout`: the request's (suite's)
    `deadline_s` when set, else DEADLINE_FLOOR_S + DEADLINE_SLACK × (n_predict / the measured speed + the prompt's
    tokens × the slowest measured seconds per prompt token) (`n_predict: -1` counts as the context size `n_ctx`,
    which bounds it; the prompt counts as its bytes, at most `n_ctx`: no token is shorter than a byte).
    The prompt term is what a 16k-token prompt needs (long-context): on a loaded 2-core machine reading it took
    longer than the floor alone (2026-11-27, tiny-long with a draft model, 55.6 s budget overrun)."""
    if request.deadline_s is not None:
        return request.deadline_s
    n = request.sampling.n_predict
    n = n_ctx if n < 0 or n > n_ctx else n
    speed = tokens_per_second if tokens_per_second and tokens_per_second > 0 else ASSUMED_TOKENS_PER_S
    per_prompt_token = prompt_token_s if prompt_token_s and prompt_token_s > 0 else 1.0 / ASSUMED_PROMPT_TOKENS_PER_S
    return DEADLINE_FLOOR_S + DEADLINE_SLACK * (n / speed + prompt_tokens_bound(request, n_ctx) * per_prompt_token)


def prompt_tokens_bound(request: Request, n_ctx: int) -> int:
    """At most how many tokens the request's prompt is: its token ids, or its text's bytes, at most `n_ctx`."""
    if isinstance(request.prompt, list):
        return min(len(request.prompt), n_ctx)
    if isinstance(request.prompt, str):
        texts = [request.prompt]
    else:
        texts = [str(m.get("content", "")) for m in request.messages or ()]
    return min(sum(len(t.encode()) for t in texts), n_ctx)


class SpeedMeter:
    """The slowest whole-request speed (generated tokens per wall-clock second) a session has seen,
    for `request_deadline`; thread-safe enough (one float assignment per record)."""

    MIN_TOKENS = 8
    """Shorter outputs say more about the prompt than about the speed."""

    def __init__(self) -> None:
        self.slowest: float | None = None

    def record(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= self.MIN_TOKENS and seconds > 0:
            speed = n_tokens / seconds
            self.slowest = speed if self.slowest is None else min(self.slowest, speed)


STALL_FLOOR_S = 5.0
"""The shortest stall window: seconds without a token before a request counts as hung. The slowest generation
step measured on the 2-core box was 0.54 s (gemma3-270m, draft-simple, 4 slots, in-process; 0.38 s on
llama-server; tiny models 0.5-25 ms) and 2.0 s with three CPU-bound processes beside it; the floor also
covers a session's first requests, before its steps are measured (docs/internals/backends.md, "Deadlines")."""
STALL_FACTOR = 10.0
"""How many times the slowest measured step (and prompt time) a step may take before it counts as hung: the
slowest single step was at most 2.7 × the mean step of its request (gemma3-270m, ngram-mod; 1.0-2.0 ×
elsewhere, both backends), and three CPU-bound processes beside it made steps 3.7 × slower."""
ASSUMED_PROMPT_TOKENS_PER_S = 100.0
"""The prompt speed assumed before a session has measured one (gemma3-270m reads 230-300 tok/s on one core
of the 2-core box, 105-160 with its draft model reading the prompt too; tiny models thousands)."""
MIN_PROMPT_TOKENS = 64
"""Shorter prompts say more about the per-step overhead than about the prompt speed."""


class StallMeter:
    """The stall window of a session: no token (or prompt progress) for `window(...)` seconds ends a request
    as `timeout`. Learns the slowest mean generation step (predicted_ms over the steps: tokens less
    accepted drafts) and prompt speed from the session's finished Results; `floor_s` replaces
    STALL_FLOOR_S (ServeConfig.stall_s)."""

    def __init__(self, floor_s: float | None = None) -> None:
        self.floor_s = STALL_FLOOR_S if floor_s is None else floor_s
        self.step_s: float | None = None
        self.prompt_token_s: float | None = None

    def record(self, result: Result) -> None:
        """Learn from a finished request (ignored when too short to tell)."""
        timings = result.timings
        steps = timings.predicted_n - result.spec_stats.get("draft_n_accepted", 0)
        if timings.predicted_n >= SpeedMeter.MIN_TOKENS and steps > 0 and timings.predicted_ms > 0:
            self.step_s = max(self.step_s or 0.0, timings.predicted_ms / 1000.0 / steps)
        if timings.prompt_n >= MIN_PROMPT_TOKENS and timings.prompt_ms > 0:
            self.prompt_token_s = max(self.prompt_token_s or 0.0, timings.prompt_ms / 1000.0 / timings.prompt_n)

    def window(self, prompt_tokens: int = 0) -> float:
        """Seconds the next token may take when `prompt_tokens` prompt tokens may have to be read first:
        max(floor, STALL_FACTOR × (slowest step + prompt_tokens × slowest prompt time per token))."""
        return max(self.floor_s, STALL_FACTOR * self._step_s(prompt_tokens))

    def explain(self, prompt_tokens: int = 0) -> str:
        """How `window(prompt_tokens)` came about, for an error message."""
        what = f"{1000 * self._step_s(0):.1f} ms per step" + ("" if self.step_s else " (assumed)")
        if prompt_tokens:
            per = 1000 * (self.prompt_token_s or 1.0 / ASSUMED_PROMPT_TOKENS_PER_S)
            what = (
                f"({what} + {prompt_tokens} prompt tokens × {per:.2f} ms"
                + ("" if self.prompt_token_s else " (assumed)")
                + ")"
            )
        return (
            f"stall window {self.window(prompt_tokens):.1f} s = max(floor {self.floor_s:g} s, "
            f"{STALL_FACTOR:g} × {what})"
        )

    def _step_s(self, prompt_tokens: int) -> float:
        step_s = self.step_s or 1.0 / ASSUMED_TOKENS_PER_S
        return step_s + prompt_tokens * (self.prompt_token_s or 1.0 / ASSUMED_PROMPT_TOKENS_PER_S)


SERVER_ONLY = {
    "ctx_checkpoints": "--ctx-checkpoints",
    "checkpoint_min_step": "--checkpoint-min-step",
    "cache_ram": "--cache-ram",
}
"""ServeConfig fields that are llama-server flags with no in-process counterpart → the flag."""


@dataclass
class ServeConfig:
    """How to serve a model; fields use llama.cpp's parameter names (n_ctx is llama-server's `-c`, ...)."""

    model: Path
    mode: str = "seq"
    parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: str = "off"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    threads: int = field(default_factory=default_threads)
    seed: int = 42
    repack: bool = field(default_factory=default_repack)
    """llama-server's `--repack` / `--no-repack`: weights repacked into the CPU's extra buffer types."""
    context_shift: bool = False
    """llama-server's `--context-shift` / `--no-context-shift`: a slot that reaches the context end discards
    `n_discard` tokens after the first `n_keep` (request fields) and generates on, instead of stopping there.
    Off by default, as in llama-server; a model whose memory cannot shift (llama_memory_can_shift false:
    M-RoPE models such as the qwen35 hybrids) has it switched off at start-up by both backends."""
    ctx_checkpoints: int | None = None
    """llama-server's `--ctx-checkpoints` (context checkpoints per slot of a recurrent, hybrid or SWA target; 0 = none)
    and, below, `--checkpoint-min-step` (the fewest tokens between two of them) and `--cache-ram` (MiB of host-RAM
    prompt cache; 0 = off, -1 = unlimited). None: llama-server's default. llama-server only: the in-process engine
    has no prompt cache across requests, so a cell that sets one is not served there (Unservable)."""
    checkpoint_min_step: int | None = None
    cache_ram: int | None = None
    draft_model: Path | None = None
    spec: dict = field(default_factory=dict)
    """Speculative options under llama-server's names without the leading dashes (`spec-type`, ...)."""
    kv_scan: str = "off"
    """Scan the sequence's KV state: `off`, after every `request`, or (in-process only) after every
    speculative `step` too."""
    logit_top_k: int = 0
    """Log the top-k candidates of every generated position (0 = off; llama-server's `n_probs`)."""
    stall_s: float | None = None
    """The floor of the stall window in seconds (None: STALL_FLOOR_S; see StallMeter)."""
    engine: dict = field(default_factory=dict)
    """In-process only: options of the speculative engine llama-server does not have (`rollback`,
    `checkpoint_flags`, `checkpoint_attempts`, `fault`, `drafters`: drafter objects tried first, and
    `script`: {"kind": a scripted preset's script, "outputs": prompt tokens → expected output}, the data the
    in-process backend builds the scripted drafter from)."""
    env: dict = field(default_factory=dict)
    """llama-server only: variables added to its process's environment (e.g. GCOV_PREFIX: where a `--coverage`
    build writes the cell's line counters, `harness.execute.executor.CELL_COUNTERS`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HarnessError(f"unknown mode '{self.mode}' (use one of: {', '.join(MODES)})")
        if self.kv_scan not in KV_SCAN:
            raise HarnessError(f"kv_scan must be one of {', '.join(KV_SCAN)}, not '{self.kv_scan}'")
        if self.flash_attn not in ("on", "off", "auto"):
            raise HarnessError(f"flash_attn must be on, off or auto, not '{self.flash_attn}'")
        if self.stall_s is not None and self.stall_s <= 0:
            raise HarnessError(f"stall_s must be a positive number of seconds, not {self.stall_s}")

    @property
    def server_only(self) -> dict:
        """The settings set here that only llama-server has (SERVER_ONLY), by their flag."""
        return {flag: getattr(self, name) for name, flag in SERVER_ONLY.items() if getattr(self, name) is not None}

    @property
    def n_slots(self) -> int:
        """`seq` serves one slot; `par` and `no-kv-unified` serve `parallel` slots."""
        return 1 if self.mode == "seq" else self.parallel

    @property
    def kv_unified(self) -> bool:
        """`par` shares one KV stream between slots; `no-kv-unified` gives each slot its own."""
        return self.mode == "par"


class Session(Protocol):
    """A model being served in one mode."""

    def run(self, requests: list[Request]) -> list[Result]:
        """Serve `requests` (one after another in `seq`, concurrently otherwise); one Result each, in order."""

    def close(self) -> None:
        """Free the model / stop the process."""


class Backend(Protocol):
    """A named way of serving models (`inproc`, `server`)."""

    name: str

    def open(self, config: ServeConfig) -> Session:
        """Start serving `config.model`; raises HarnessError with a one-line reason when that fails."""

    def environment(self) -> dict:
        """Facts about what produces the outputs; `device` (cpu, cuda, metal, gpu) is part of baseline keys."""
