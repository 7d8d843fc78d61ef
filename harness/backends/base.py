"""What every backend offers: serve one model in one mode and turn Requests into Results."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Protocol

from harness import MODES
from harness.errors import HarnessError
from harness.request import Request
from harness.result import Result


KV_SCAN = ("off", "request", "step")

DEADLINE_FLOOR_S = 30.0
"""Seconds every request gets on top of its expected time: start-up, prompt processing and a busy machine."""
DEADLINE_SLACK = 4.0
"""How many times slower than the slowest request measured so far a request may be before it counts as hung."""
ASSUMED_TOKENS_PER_S = 5.0
"""The speed assumed before a session has measured one (a small model on a busy 2-core machine does more)."""


def request_deadline(request: Request, n_ctx: int, tokens_per_second: Optional[float] = None) -> float:
    """Seconds a request may take before it ends as `stop_reason: timeout`: the request's (suite's)
    `deadline_s` when set, else DEADLINE_FLOOR_S + DEADLINE_SLACK × n_predict / the measured speed
    (`n_predict: -1` counts as the context size `n_ctx`, which bounds it)."""
    if request.deadline_s is not None:
        return request.deadline_s
    n = request.sampling.n_predict
    n = n_ctx if n < 0 or n > n_ctx else n
    speed = tokens_per_second if tokens_per_second and tokens_per_second > 0 else ASSUMED_TOKENS_PER_S
    return DEADLINE_FLOOR_S + DEADLINE_SLACK * n / speed


class SpeedMeter:
    """The slowest whole-request speed (generated tokens per wall-clock second) a session has seen,
    for `request_deadline`; thread-safe enough (one float assignment per record)."""

    MIN_TOKENS = 8
    """Shorter outputs say more about the prompt than about the speed."""

    def __init__(self) -> None:
        self.slowest: Optional[float] = None

    def record(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= self.MIN_TOKENS and seconds > 0:
            speed = n_tokens / seconds
            self.slowest = speed if self.slowest is None else min(self.slowest, speed)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`/proc/cpuinfo`; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


AMX_DEFECT = "amx_int8"
"""The CPU flag under which llama.cpp's AMX matrix multiplication (weights repacked into the AMX buffer type)
segfaults on Q4_K models: ggml-org/llama.cpp#20824, the `amx-repack-segfault` entry of known-failures.yaml."""


def default_repack() -> bool:
    """llama-server's `--repack` default (on), except on a CPU with AMX, where the repacked weights crash
    llama.cpp (AMX_DEFECT): there the suites serve with `--no-repack`, the run header says so, and the
    `amx-repack` suite keeps the defect itself under test as a known failure."""
    return AMX_DEFECT not in cpu_flags()


def default_threads() -> int:
    """Half the cores (at least one): spin barriers make all-core decoding slow on a busy 2-core box."""
    return max(1, (os.cpu_count() or 2) // 2)


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
    draft_model: Optional[Path] = None
    spec: dict = field(default_factory=dict)
    """Speculative options under llama-server's names without the leading dashes (`spec-type`, ...)."""
    kv_scan: str = "off"
    """Scan the sequence's KV state: `off`, after every `request`, or (in-process only) after every
    speculative `step` too."""
    logit_top_k: int = 0
    """Log the top-k candidates of every generated position (0 = off; llama-server's `n_probs`)."""
    engine: dict = field(default_factory=dict)
    """In-process only: options of the speculative engine llama-server does not have (`rollback`,
    `checkpoint_flags`, `checkpoint_attempts`, `fault`, `drafters`: drafter objects tried first, and
    `script`: {"kind": a scripted preset's script, "outputs": prompt tokens → expected output}, the data the
    in-process backend builds the scripted drafter from)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise HarnessError(f"unknown mode '{self.mode}' (use one of: {', '.join(MODES)})")
        if self.kv_scan not in KV_SCAN:
            raise HarnessError(f"kv_scan must be one of {', '.join(KV_SCAN)}, not '{self.kv_scan}'")
        if self.flash_attn not in ("on", "off", "auto"):
            raise HarnessError(f"flash_attn must be on, off or auto, not '{self.flash_attn}'")

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
