"""`specharness bench`: speed numbers measured on this machine (never asserted in tests).

- `scan`: the KV scanner on a real state of N cells (default 32768) from a tiny model.
- `overhead`: per generated token, the time the in-process engine spends outside `llama_decode`.
- `build-step`: the cost of a build in a copy of the vendored llama.cpp (the compiler cache serves a
  different directory holding the same tree) and of an incremental step that changes one `.cpp` file.
"""

import argparse
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from harness.engine import ContextParams, Engine
from harness.engine.context import Context
from harness.engine.model import Model
from harness.kvscan import layout_from_model, scan_bytes
from harness.models import resolve
from harness.request import Request, Sampling


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
    return {"model": model_name, "cells": report.totals["cells"], "blob_mb": round(len(blob) / 2**20, 1),
            "dump_ms": round(dump_ms, 1), "scan_ms_median": round(statistics.median(times), 2),
            "scan_ms_max": round(max(times), 2), "healthy": report.healthy}


def bench_overhead(model_name: str, n_predict: int) -> dict:
    """Greedy generation in `seq` mode: the share of each token's time spent outside llama_decode."""
    spent = {"decode_s": 0.0}
    original = Context.decode

    def timed(self, batch):
        t0 = time.perf_counter()
        status = original(self, batch)
        spent["decode_s"] += time.perf_counter() - t0
        return status

    Context.decode = timed
    try:
        with Engine(resolve(model_name).path, ContextParams()) as engine:
            prompt = Request(prompt="Write a quicksort demo in C.", sampling=Sampling(n_predict=8))
            engine.run([prompt])  # warm-up
            spent["decode_s"] = 0.0
            t0 = time.perf_counter()
            result = engine.run([Request(prompt=prompt.prompt, sampling=Sampling(n_predict=n_predict))])[0]
            total = time.perf_counter() - t0
    finally:
        Context.decode = original
    n = len(result.tokens) + 1
    outside = total - spent["decode_s"]
    return {"model": model_name, "tokens": n - 1, "ms_per_token": round(1000 * total / n, 3),
            "outside_decode_ms_per_token": round(1000 * outside / n, 4),
            "outside_share_pct": round(100 * outside / total, 2)}


def bench_build_step(file: str, jobs: int | None) -> dict:
    """Build a copy of the vendored tree as it is, then twice after a real code change to `file`: the first
    change is built in the copy's own build tree (a fresh one on the first run: configure plus the
    compiler cache), the second is the incremental step of a bisect (one file recompiled, relinked)."""
    from harness.backends.build import SOURCE_MARKER, build_tree_dir, cmake_options, ensure_server, vendored_source
    from harness.paths import cache_dir

    vendored = vendored_source()
    copy = cache_dir() / "bench" / f"{vendored.name}-copy"
    if not (copy / SOURCE_MARKER).is_file():  # copied to a temp name first: the marker means complete
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(vendored, tmp, ignore=lambda d, names: {"models"} & set(names) if Path(d) == vendored else ())
        shutil.rmtree(copy, ignore_errors=True)
        tmp.rename(copy)
    original = (vendored / file).read_text()
    row: dict = {"file": file, "fresh_tree": not build_tree_dir(copy, "cpu", cmake_options("cpu")).exists()}
    for label, stamp in (("copy", None), ("first_edit", 1), ("incremental_edit", 2)):
        edit = f'static const char * bench_stamp = "{time.time_ns()}-{stamp}";\n' if stamp else ""
        (copy / file).write_text(original + edit)
        t0 = time.perf_counter()
        info = ensure_server(copy, "cpu", [], jobs)
        row[f"{label}_seconds"] = round(time.perf_counter() - t0, 1)
        root = info.server_bin.parent.parent
        log = (root / "build.log").read_text(errors="replace") if not info.cached else ""
        row[f"{label}_build"] = "cached" if info.cached else next(
            (line[2:] for line in log.splitlines() if line.startswith("# compiler cache")), "built")
        if stamp:
            shutil.rmtree(root)  # a one-off binary: keep the cache small
    (copy / file).write_text(original)
    return row


def cmd_bench(args: argparse.Namespace) -> int:
    """Print the measurements as a table."""
    console = Console()
    if args.what == "scan":
        row = bench_scan(args.model or "tiny-dense", args.cells, args.repeats)
    elif args.what == "build-step":
        row = bench_build_step(args.file, args.jobs)
    else:
        row = bench_overhead(args.model or "gemma3-270m", args.n_predict)
    for key, value in row.items():
        console.print(f"{key:>28}: {value}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness bench`."""
    p = sub.add_parser("bench", help="measure speed on this machine (KV scan, engine overhead, incremental builds)")
    p.add_argument("what", choices=("scan", "overhead", "build-step"))
    p.add_argument("--model", help="registry name or .gguf (scan: tiny-dense; overhead: gemma3-270m)")
    p.add_argument("--cells", type=int, default=32768, help="cells in the scanned state (scan)")
    p.add_argument("--repeats", type=int, default=20, help="timed scans (scan)")
    p.add_argument("--n-predict", type=int, default=256, help="generated tokens (overhead)")
    p.add_argument("--file", default="tools/server/server-context.cpp",
                   help="source file the incremental step changes (build-step)")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (build-step; default all cores)")
    p.set_defaults(func=cmd_bench)
