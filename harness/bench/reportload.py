"""Size, render time and browser load time of a large `index.html` (`specharness bench report`): a run
directory of N check verdicts generated with the shapes of real records and evidence."""

import random
import statistics
import tempfile
import time
from pathlib import Path

from harness.models import resolve

REPORT_CHECKS = (
    "no-crash",
    "repeat-identical",
    "lossless",
    "mode-invariant",
    "baseline",
    "spec-ran",
    "kv-healthy",
    "logits-close",
)
COMPARISONS = ("lossless", "mode-invariant", "baseline", "repeat-identical")


MODELS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")


def token_pieces() -> dict[str, str]:
    """Token id → text for the ids the synthetic run draws (100..4099): tiny-dense's vocabulary when the model is
    available, else placeholders."""
    try:
        from harness.engine.detok import detokenizer

        detok = detokenizer(resolve("tiny-dense").path)
        return {str(t): detok([t]) for t in range(100, 4100)}
    except Exception:  # noqa: BLE001  a machine without the model still gets a report to load
        return {str(t): f"t{t} " for t in range(100, 4100)}


def request_rows(base: dict, tokens: list[int], n_predict: int, rng: random.Random, pieces: dict) -> list[dict]:
    """The three rounds' request records of one case and cell (draft counters where it speculates, a clean scan)."""
    rows = []
    for rnd in range(3):
        drafted = rng.randrange(200, 800) if base["spec"] != "none" else 0
        rows.append(
            {
                **base,
                "repeat": rnd,
                "tokens": tokens,
                "text": "".join(pieces[str(t)] for t in tokens),
                "stop_reason": "limit",
                "error": None,
                "slot_id": 0,
                "prompt_n": 24,
                "timings": {
                    "prompt_n": 24,
                    "prompt_ms": 3.1,
                    "predicted_n": n_predict,
                    "predicted_ms": rng.uniform(300, 900),
                    "predicted_per_second": 200.0,
                },
                "spec_stats": {"draft_n": drafted, "draft_n_accepted": drafted // 2} if drafted else {},
                "kv_scan": {
                    "healthy": True,
                    "totals": {"cells": 150, "duplicate_cells": 0, "orphans": 0, "missing_positions": 0},
                    "duplicates": [],
                    "orphans": [],
                    "holes": [],
                    "duplicate_tails": {},
                },
            }
        )
    return rows


def divergence(tokens: list[int], n_predict: int, rng: random.Random, pieces: dict) -> tuple[dict, str]:
    """A failing comparison's evidence (a first divergence with both token lists and the margins) and message."""
    index = rng.randrange(1, n_predict - 1)
    other = tokens[:index] + [tokens[index] + 1] + [rng.randrange(100, 4100) for _ in range(n_predict - index - 1)]
    margins = [round(rng.lognormvariate(0, 1.5), 4) for _ in range(n_predict)]
    evidence = {
        "compared": 3,
        "matching": 0,
        "first_divergence": {
            "round": 0,
            "index": index,
            "kind": rng.choice(["near-tie", "hard", "drift"]),
            "reason": "the margin is below the noise floor",
            "ref_token": tokens[index],
            "other_token": other[index],
            "ref_text": pieces[str(tokens[index])],
            "other_text": pieces.get(str(other[index]), ""),
            "before": "",
            "margin": margins[index],
            "noise_floor": 0.05,
            "reference": "seq output",
            "reference_tokens": tokens,
            "tokens": other,
            "reference_margins": margins,
        },
    }
    return evidence, f"3 of 3 outputs differ from the seq output; round 0: First divergence at token {index}"


def synthetic_run(out: Path, n_verdicts: int, fail_rate: float = 0.1, n_predict: int = 128, seed: int = 0) -> Path:
    """A run directory of `n_verdicts` check verdicts shaped like a real run's: quicksort-like cases over
    cells of 3 models × 3 modes × 4 spec configs × 2 backends, three rounds per case, top-k logits, KV-scan
    verdicts; a `fail_rate` share of the comparison verdicts fail with full first-divergence evidence
    (tokens, margins). Token texts come from tiny-dense's vocabulary when it is available."""
    from harness.report.files import write_files

    rng = random.Random(seed)
    pieces = token_pieces()
    cells = [
        (m, b, mode, spec)
        for m in MODELS
        for b in ("inproc", "server")
        for mode in ("seq", "par", "no-kv-unified")
        for spec in ("none", "draft-simple", "ngram-mod", "ngram-simple")
    ]
    rows, verdicts, case_no = [], [], 0
    while len(verdicts) < n_verdicts:
        model, backend, mode, spec = cells[case_no % len(cells)]
        case = f"case{case_no // len(cells)}"
        case_no += 1
        base = {"suite": "quicksort", "case": case, "model": model, "backend": backend, "mode": mode, "spec": spec}
        tokens = [rng.randrange(100, 4100) for _ in range(n_predict)]
        rows += request_rows(base, tokens, n_predict, rng, pieces)
        for check in REPORT_CHECKS:
            if len(verdicts) == n_verdicts:
                break
            failing = check in COMPARISONS and rng.random() < fail_rate * len(REPORT_CHECKS) / len(COMPARISONS)
            evidence, message = (
                divergence(tokens, n_predict, rng, pieces) if failing else ({"compared": 3, "matching": 3}, "")
            )
            verdicts.append({**base, "check": check, "passed": not failing, "message": message, "evidence": evidence})
    meta = {
        "format": 1,
        "tool": "specharness bench report",
        "command": "specharness bench report",
        "harness_version": "bench",
        "started": "",
        "cells": [],
        "backends": {},
        "models": {},
    }
    write_files(out, rows, verdicts, {}, {m: pieces for m in MODELS}, meta)
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
        return {
            "verdicts": n_verdicts,
            "failing": failing,
            "index_html_mb": round(index.stat().st_size / 2**20, 2),
            "run_dir_mb": round(sum(p.stat().st_size for p in run.iterdir()) / 2**20, 2),
            "render_ms": round(render_ms),
            "load_ms_median": round(statistics.median(times)),
            "load_ms_max": round(max(times)),
            "painted_ms_median": round(statistics.median(painted)),
            "painted_ms_max": round(max(painted)),
            "console_errors": len(errors),
        }
