"""What the harness itself costs (`specharness bench costs`, and the parts `bench scan` / `overhead`).

- `overhead`: per generated token, the time the in-process engine spends outside `llama_decode`;
- `logit_logging`: the cost of logging one position's top-k logits (digest, log-normaliser) against
  the cost of a generated token;
- `scan_per_step`: the cost per generated token of scanning the KV state after every speculative step;
- `scan`: the KV scanner on a real state of N cells (default 32,768) from a tiny model;
- `state_copies`: the share of a checkpoint-mode run's wall time spent copying sequence state;
- `suite_wall`: the wall time of a whole suite run against the inference time of its requests.
"""

import contextlib
import statistics
import time
from typing import Optional

import numpy as np

from harness.backends.base import ServeConfig
from harness.backends.inproc import context_params, spec_config
from harness.engine import ContextParams, Engine
from harness.engine.context import Context
from harness.engine.model import Model
from harness.kv.scan import layout_from_model, scan_bytes
from harness.models import draft_for, resolve
from harness.suites.request import Request, Sampling

PROMPT = "Write a quicksort demo in C. Please, write just code. Do not write any extra comments."


def bench_scan(model_name: str, n_cells: int, repeats: int) -> dict:
    """Fill one sequence with `n_cells` positions, then time dumping and scanning its state."""
    info = resolve(model_name)
    model = Model(info.path)
    ctx = Context(model, ContextParams(n_ctx=n_cells, n_batch=2048, n_ubatch=512, threads=1))
    batch = ctx.new_batch()
    tokens = np.random.default_rng(0).integers(100, model.n_vocab, n_cells)
    for start in range(0, n_cells, batch.capacity):
        batch.clear()
        for pos in range(start, min(start + batch.capacity, n_cells)):
            batch.add(int(tokens[pos]), pos, 0, False)
        if ctx.decode(batch):
            raise RuntimeError("decode failed while filling the cache")
    t0 = time.perf_counter()
    blob = ctx.state_seq(0, 0)
    dump_ms = 1000 * (time.perf_counter() - t0)
    layout = layout_from_model(info.path)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = scan_bytes(blob, "seq", layout, {0: n_cells})
        times.append(1000 * (time.perf_counter() - t0))
    batch.free()
    ctx.close()
    model.close()
    return {
        "model": model_name,
        "cells": report.totals["cells"],
        "blob_mb": round(len(blob) / 2**20, 1),
        "dump_ms": round(dump_ms, 1),
        "scan_ms_median": round(statistics.median(times), 2),
        "scan_ms_max": round(max(times), 2),
        "healthy": report.healthy,
    }


class _Timed:
    """Sums the wall time spent in some functions of `owner` (a class or a module) while active."""

    def __init__(self, owner, *names: str):
        self.owner, self.names, self.seconds, self.calls, self.originals = owner, names, 0.0, 0, {}

    def __enter__(self) -> "_Timed":
        for name in self.names:
            original = self.originals[name] = getattr(self.owner, name)

            def timed(*args, _original=original, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
                    self.calls += 1

            setattr(self.owner, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(self.owner, name, original)


def _engine(model_name: str, spec: str = "none", logit_top_k: int = 0, kv_scan: str = "off") -> Engine:
    """An engine in this process for `model_name` with a speculative preset of the suites."""
    from harness.matrix import spec_preset

    options = spec_preset(spec).options
    draft = resolve(draft_for(model_name)).path if "draft-simple" in options.get("spec-type", "") else None
    config = ServeConfig(model=resolve(model_name).path, mode="seq", spec=dict(options), draft_model=draft)
    return Engine(config.model, context_params(config), spec_config(config) if options else None, logit_top_k, kv_scan)


def _generate(engine: Engine, n_predict: int, timer: Optional["_Timed"] = None) -> tuple[float, int]:
    """Seconds and tokens of one greedy request of `PROMPT` after a short warm-up; `timer` (if given) times
    the request only."""
    engine.run([Request(prompt=PROMPT, sampling=Sampling(n_predict=8))])
    with timer or contextlib.nullcontext():
        t0 = time.perf_counter()
        result = engine.run([Request(prompt=PROMPT, sampling=Sampling(n_predict=n_predict))])[0]
        seconds = time.perf_counter() - t0
    return seconds, len(result.tokens)


def bench_overhead(model_name: str, n_predict: int) -> dict:
    """Greedy generation in `seq` mode: the share of each token's time spent outside llama_decode."""
    with _engine(model_name) as engine:
        decode = _Timed(Context, "decode")
        total, n = _generate(engine, n_predict, decode)
    n += 1
    outside = total - decode.seconds
    return {
        "model": model_name,
        "tokens": n - 1,
        "ms_per_token": round(1000 * total / n, 3),
        "outside_decode_ms_per_token": round(1000 * outside / n, 4),
        "outside_share_pct": round(100 * outside / total, 2),
    }


def _alternating(engines: dict, n_predict: int, repeats: int) -> dict:
    """key → median ms per generated token over `repeats` rounds that run every engine in turn; the
    engines are closed afterwards."""
    per_token: dict = {key: [] for key in engines}
    try:
        for _ in range(repeats):
            for key, engine in engines.items():
                seconds, n = _generate(engine, n_predict)
                per_token[key].append(1000 * seconds / max(n, 1))
    finally:
        for engine in engines.values():
            engine.close()
    return {key: statistics.median(values) for key, values in per_token.items()}


def logit_logging(model_name: str, k: int = 10, n_predict: int = 128, repeats: int = 3) -> dict:
    """What logging the top-k logits of every generated token costs: ms per token with logging on against
    off (medians of `repeats` alternating runs; the capture itself runs on a background thread while the
    next decode runs), and the time `capture` holds the generating thread per call."""
    from harness.engine import slot

    engines = {top_k: _engine(model_name, logit_top_k=top_k) for top_k in (0, k)}
    with _Timed(slot, "capture") as captures:
        ms = _alternating(engines, n_predict, repeats)
    off, on = ms[0], ms[k]
    return {
        "model": model_name,
        "k": k,
        "tokens": n_predict,
        "ms_per_token_off": round(off, 3),
        "ms_per_token_on": round(on, 3),
        "share_pct": round(100 * (on - off) / off, 2),
        "capture_ms_in_thread": round(1000 * captures.seconds / max(captures.calls, 1), 3),
    }


def scan_per_step(model_name: str, spec: str = "ngram-mod", n_predict: int = 128, repeats: int = 3) -> dict:
    """ms per generated token with the KV state scanned after every speculative step, against none (medians
    over `repeats` alternating runs)."""
    ms = _alternating({mode: _engine(model_name, spec, kv_scan=mode) for mode in ("off", "step")}, n_predict, repeats)
    off, step = ms["off"], ms["step"]
    return {
        "model": model_name,
        "spec": spec,
        "ms_per_token_off": round(off, 3),
        "ms_per_token_step": round(step, 3),
        "scan_ms_per_token": round(step - off, 3),
        "share_pct": round(100 * (step - off) / step, 2),
    }


def state_copies(model_name: str = "tiny-hybrid", spec: str = "draft-simple", n_predict: int = 128) -> dict:
    """A checkpoint-mode speculative run: the share of its wall time spent in sequence-state copies
    (`Context.state_seq` and `Context.set_state_seq`, llama.cpp's serialization included)."""
    with _engine(model_name, spec) as engine:
        copies = _Timed(Context, "state_seq", "set_state_seq")
        wall, n = _generate(engine, n_predict, copies)
    return {
        "model": model_name,
        "spec": spec,
        "tokens": n,
        "wall_ms": round(1000 * wall, 1),
        "copy_ms": round(1000 * copies.seconds, 2),
        "copies": copies.calls,
        "share_pct": round(100 * copies.seconds / wall, 2),
    }


def suite_wall(suite_name: str = "quicksort", model: str = "tiny-dense", backend: str = "inproc") -> dict:
    """A whole suite run as `specharness run` does it (logit logging and per-request KV scans on):
    its wall time against the sum of its requests' prompt and generation times."""
    from harness.backends.choose import backend_factories
    from harness.execute import ExecOptions, Executor
    from harness.matrix import cells, narrowing
    from harness.suites import load_suite

    suite = load_suite(suite_name)
    executor = Executor(ExecOptions(backends=backend_factories()))
    chosen = cells(suite.matrix, narrowing(backends=[backend], models=[model]))
    t0 = time.perf_counter()
    runs = [executor.run(suite, cell) for cell in chosen]
    wall = time.perf_counter() - t0
    results = [o.result for run in runs for o in run.outcomes]
    inference = sum(r.timings.prompt_ms + r.timings.predicted_ms for r in results) / 1000
    return {
        "suite": suite_name,
        "model": model,
        "backend": backend,
        "cells": len(chosen),
        "requests": len(results),
        "tokens": sum(len(r.tokens) for r in results),
        "wall_s": round(wall, 2),
        "inference_s": round(inference, 2),
        "inference_share_pct": round(100 * inference / wall, 1),
    }


def forward_times(model_name: str = "gemma3-270m", sizes: tuple[int, ...] = (1, 2, 4, 8, 9), repeats: int = 20) -> dict:
    """ms of one target forward (`llama_decode`) of a batch of `sizes` tokens after a 128-token prefix, logits
    for every row (a speculative verification): the physical floor a speculative step cannot go below."""
    info = resolve(model_name)
    model = Model(info.path)
    ctx = Context(model, ContextParams(n_ctx=1024))
    batch = ctx.new_batch()
    try:
        prefix = [int(t) for t in np.random.default_rng(0).integers(100, min(model.n_vocab, 30000), 128)]
        batch.clear()
        for pos, token in enumerate(prefix):
            batch.add(token, pos, 0, pos == len(prefix) - 1)
        if ctx.decode(batch):
            raise RuntimeError("decode failed on the prefix")
        out = {"model": model_name}
        for size in sizes:
            times = []
            for _ in range(repeats):
                batch.clear()
                for i in range(size):
                    batch.add(prefix[i], len(prefix) + i, 0, True)
                t0 = time.perf_counter()
                if ctx.decode(batch):
                    raise RuntimeError(f"decode failed on a batch of {size}")
                times.append(1000 * (time.perf_counter() - t0))
                ctx.seq_rm(0, len(prefix), -1)
            out[f"batch_{size}_ms"] = round(statistics.median(times), 3)
        return out
    finally:
        batch.free()
        ctx.close()
        model.close()
