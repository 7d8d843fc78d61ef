"""A run directory's files: `results.json` and `results.parquet` (one record per request),
`checks.json` (one record per check verdict) and `logits.parquet` (top-k logits per generated
position, cases named `<suite>/<case>/<cell>/<round>`)."""

import json
from pathlib import Path

import pandas as pd

from harness.errors import HarnessError
from harness.execute import CellRun
from harness.logits import save_parquet, to_frame
from harness.paths import write_atomic

def records(runs: list[CellRun]) -> list[dict]:
    """One JSON-able record per request of every cell run."""
    out = []
    for run in runs:
        c = run.cell
        for o in run.outcomes:
            r = o.result
            out.append({
                "suite": run.suite.name, "case": o.case, "model": c.model, "backend": c.backend, "mode": c.mode,
                "spec": c.spec, "repeat": o.round, "tokens": r.tokens, "text": r.text,
                "stop_reason": r.stop_reason, "error": r.error, "slot_id": r.slot_id,
                "prompt_n": len(r.prompt_tokens), "timings": r.timings.to_dict(), "spec_stats": r.spec_stats,
                "kv_scan": r.kv_scan,
            })
    return out


def check_records(checks: list) -> list[dict]:
    """(suite, case, cell, CheckResult) tuples as JSON-able records."""
    return [{"suite": s, "case": k, "model": c.model, "backend": c.backend, "mode": c.mode, "spec": c.spec,
             "check": r.name, "passed": r.passed, "message": r.message, "evidence": r.evidence}
            for s, k, c, r in checks]


def frame(rows: list[dict]) -> pd.DataFrame:
    """Records as a flat DataFrame (timings and spec counters become columns)."""
    return pd.json_normalize(rows, sep=".")


def write_run(out: Path, runs: list[CellRun], checks: list) -> Path:
    """Write the run directory (refusing to overwrite an existing results.json); returns results.json."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "results.json"
    if target.exists():
        raise HarnessError(f"{target} already exists (choose another --out; results are never overwritten)")
    rows = records(runs)
    write_atomic(out / "checks.json", lambda p: p.write_text(json.dumps(check_records(checks), indent=1, default=str) + "\n"))
    write_atomic(out / "results.parquet", lambda p: frame(rows).to_parquet(p, index=False))
    logits = {f"{run.suite.name}/{o.case}/{run.cell.id}/{o.round}": to_frame(o.result.logits)
              for run in runs for o in run.outcomes if o.result.logits}
    if logits:
        write_atomic(out / "logits.parquet", lambda p: save_parquet(p, logits))
    write_atomic(target, lambda p: p.write_text(json.dumps(rows, indent=1) + "\n"))
    return target
