"""`specharness bench`: speed numbers measured on this machine (never asserted in tests).

- `scan`: the KV scanner on a real state of N cells (default 32768) from a tiny model.
- `overhead`: per generated token, the time the in-process engine spends outside `llama_decode`.
- `build-step`: the cost of a build in a copy of the vendored llama.cpp (the compiler cache serves a
  different directory holding the same tree) and of an incremental step that changes one `.cpp` file.
- `report`: size, render time and browser load time of an `index.html` of N check verdicts (default
  2,000), generated with the shapes of real records and evidence.
"""

import argparse
import random
import shutil
import statistics
import tempfile
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


REPORT_CHECKS = ("no-crash", "repeat-identical", "lossless", "mode-invariant", "baseline", "spec-ran", "kv-healthy",
                 "logits-close")
COMPARISONS = ("lossless", "mode-invariant", "baseline", "repeat-identical")


def synthetic_run(out: Path, n_verdicts: int, fail_rate: float = 0.1, n_predict: int = 128, seed: int = 0) -> Path:
    """A run directory of `n_verdicts` check verdicts shaped like a real run's: quicksort-like cases over
    cells of 3 models × 3 modes × 4 spec configs × 2 backends, three rounds per case, top-k logits, KV-scan
    verdicts; a `fail_rate` share of the comparison verdicts fail with full first-divergence evidence
    (tokens, margins). Token texts come from tiny-dense's vocabulary when it is available."""
    from harness.report.files import write_files

    rng = random.Random(seed)
    try:
        from harness.detok import detokenizer

        detok = detokenizer(resolve("tiny-dense").path)
        pieces = {str(t): detok([t]) for t in range(100, 4100)}
    except Exception:  # noqa: BLE001  a machine without the model still gets a report to load
        pieces = {str(t): f"t{t} " for t in range(100, 4100)}
    cells = [(m, b, mode, spec) for m in ("tiny-dense", "tiny-hybrid", "tiny-recurrent") for b in ("inproc", "server")
             for mode in ("seq", "par", "no-kv-unified") for spec in ("none", "draft-simple", "ngram-mod", "ngram-simple")]
    rows, verdicts, case_no = [], [], 0
    while len(verdicts) < n_verdicts:
        model, backend, mode, spec = cells[case_no % len(cells)]
        case = f"case{case_no // len(cells)}"
        case_no += 1
        base = {"suite": "quicksort", "case": case, "model": model, "backend": backend, "mode": mode, "spec": spec}
        tokens = [rng.randrange(100, 4100) for _ in range(n_predict)]
        for rnd in range(3):
            drafted = rng.randrange(200, 800) if spec != "none" else 0
            rows.append({**base, "repeat": rnd, "tokens": tokens, "text": "".join(pieces[str(t)] for t in tokens),
                         "stop_reason": "limit", "error": None, "slot_id": 0, "prompt_n": 24,
                         "timings": {"prompt_n": 24, "prompt_ms": 3.1, "predicted_n": n_predict,
                                     "predicted_ms": rng.uniform(300, 900), "predicted_per_second": 200.0},
                         "spec_stats": {"draft_n": drafted, "draft_n_accepted": drafted // 2} if drafted else {},
                         "kv_scan": {"healthy": True, "totals": {"cells": 150, "duplicate_cells": 0, "orphans": 0,
                                                                 "missing_positions": 0}, "duplicates": [],
                                     "orphans": [], "holes": [], "duplicate_tails": {}}})
        for check in REPORT_CHECKS:
            if len(verdicts) == n_verdicts:
                break
            failing = check in COMPARISONS and rng.random() < fail_rate * len(REPORT_CHECKS) / len(COMPARISONS)
            evidence: dict = {"compared": 3, "matching": 3}
            message = ""
            if failing:
                index = rng.randrange(1, n_predict - 1)
                other = tokens[:index] + [tokens[index] + 1] + [rng.randrange(100, 4100) for _ in range(n_predict - index - 1)]
                margins = [round(rng.lognormvariate(0, 1.5), 4) for _ in range(n_predict)]
                evidence = {"compared": 3, "matching": 0, "first_divergence": {
                    "round": 0, "index": index, "kind": rng.choice(["near-tie", "hard", "drift"]),
                    "reason": "the margin is below the noise floor", "ref_token": tokens[index],
                    "other_token": other[index], "ref_text": pieces[str(tokens[index])],
                    "other_text": pieces.get(str(other[index]), ""), "before": "", "margin": margins[index],
                    "noise_floor": 0.05, "reference": "seq output", "reference_tokens": tokens, "tokens": other,
                    "reference_margins": margins}}
                message = f"3 of 3 outputs differ from the seq output; round 0: First divergence at token {index}"
            verdicts.append({**base, "check": check, "passed": not failing, "message": message, "evidence": evidence})
    meta = {"format": 1, "tool": "specharness bench report", "command": "specharness bench report",
            "harness_version": "bench", "started": "", "cells": [], "backends": {}, "models": {}}
    write_files(out, rows, verdicts, {}, {m: pieces for m in ("tiny-dense", "tiny-hybrid", "tiny-recurrent")}, meta)
    return out


def bench_report(n_verdicts: int, loads: int) -> dict:
    """Render a synthetic run of `n_verdicts` verdicts and load it `loads` times in headless chromium."""
    from harness.report import publish
    from harness.report.browser import open_report

    with tempfile.TemporaryDirectory(prefix="specharness-bench-") as tmp:
        run = synthetic_run(Path(tmp) / "run", n_verdicts)
        t0 = time.perf_counter()
        index = publish(run)
        render_ms = 1000 * (time.perf_counter() - t0)
        times, painted, errors = [], [], []
        for _ in range(loads):
            with open_report(index) as loaded:
                times.append(loaded.load_ms)
                painted.append(loaded.painted_ms)
                errors += loaded.console_errors
        failing = sum(1 for line in (run / "checks.json").read_text().splitlines() if '"passed": false' in line)
        return {"verdicts": n_verdicts, "failing": failing, "index_html_mb": round(index.stat().st_size / 2**20, 2),
                "run_dir_mb": round(sum(p.stat().st_size for p in run.iterdir()) / 2**20, 2),
                "render_ms": round(render_ms), "load_ms_median": round(statistics.median(times)),
                "load_ms_max": round(max(times)), "painted_ms_median": round(statistics.median(painted)),
                "painted_ms_max": round(max(painted)), "console_errors": len(errors)}


def cmd_bench(args: argparse.Namespace) -> int:
    """Print the measurements as a table."""
    console = Console()
    if args.what == "scan":
        row = bench_scan(args.model or "tiny-dense", args.cells, args.repeats)
    elif args.what == "build-step":
        row = bench_build_step(args.file, args.jobs)
    elif args.what == "report":
        row = bench_report(args.verdicts, args.loads)
    else:
        row = bench_overhead(args.model or "gemma3-270m", args.n_predict)
    for key, value in row.items():
        console.print(f"{key:>28}: {value}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness bench`."""
    p = sub.add_parser("bench", help="measure speed on this machine (KV scan, engine overhead, incremental builds, "
                                     "report loading)")
    p.add_argument("what", choices=("scan", "overhead", "build-step", "report"))
    p.add_argument("--model", help="registry name or .gguf (scan: tiny-dense; overhead: gemma3-270m)")
    p.add_argument("--cells", type=int, default=32768, help="cells in the scanned state (scan)")
    p.add_argument("--repeats", type=int, default=20, help="timed scans (scan)")
    p.add_argument("--n-predict", type=int, default=256, help="generated tokens (overhead)")
    p.add_argument("--file", default="tools/server/server-context.cpp",
                   help="source file the incremental step changes (build-step)")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (build-step; default all cores)")
    p.add_argument("--verdicts", type=int, default=2000, help="check verdicts in the generated report (report)")
    p.add_argument("--loads", type=int, default=5, help="browser loads timed (report)")
    p.set_defaults(func=cmd_bench)
