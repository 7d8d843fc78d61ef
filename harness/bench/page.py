"""A bench's numbers as files: `bench.json` (everything measured) and `bench.html` (rendered with the
report templates: tables with the counted work beside acceptance and speed-up, bar charts of tokens/s and
speed-up, the parity targets, the harness costs)."""

import json
from pathlib import Path

from harness.errors import HarnessError
from harness.paths import write_atomic
from harness.report import work as work_report
from harness.report.html import render


def write_json(path: Path, data: dict) -> Path:
    """Write `data` to `path`; an existing file is never overwritten."""
    if path.exists():
        raise HarnessError(f"{path} already exists (choose another path; bench results are never overwritten)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda p: p.write_text(json.dumps(data, indent=1, default=str) + "\n"))
    return path


def _fmt(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def work_text(row: dict, short: bool = True) -> str:
    """A bench row's counted work per repeat (harness.report.work.text; `short`: target decodes per generated
    token, checkpoints and partial rollbacks), `—` for a row without work."""
    work = row.get("work")
    return work_report.text({**work, "generated": row["predicted_n"]}, short=short) if work else "—"


def charts(aggregate: list[dict]) -> list[dict]:
    """Per (group, model): bars of tokens/s per configuration and of speed-up over no speculation."""
    out = []
    for key in dict.fromkeys((r["group"], r["model"]) for r in aggregate):
        rows = [r for r in aggregate if (r["group"], r["model"]) == key and r["tok_s"]]
        label = lambda r: f"{r['engine']} {r['spec']}" + (f" logits {r['logits']}" if r["logits"] else "")  # noqa: E731
        out.append(
            {
                "group": key[0],
                "model": key[1],
                "speed": [(label(r), r["tok_s"], f"{r['tok_s']:.1f} tok/s") for r in rows],
                "speedup": [
                    (label(r), r["speedup"], f"{r['speedup']:.2f}×")
                    for r in rows
                    if r["spec"] != "none" and r["speedup"] is not None
                ],
            }
        )
    return out


def write_html(out_dir: Path, data: dict) -> Path:
    """Render `bench.html` into `out_dir`."""
    html = render("bench.html.j2", bench=data, charts=charts(data.get("aggregate", [])), fmt=_fmt, bench_work=work_text)
    target = out_dir / "bench.html"
    write_atomic(target, lambda p: p.write_text(html, encoding="utf-8"))
    return target
