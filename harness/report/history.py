"""`specharness report --history DIR...`: each case across several runs, oldest first.

A case is a `new failure` when it fails in the latest run that has it and did not in the run before,
`fixed` when it failed (or was a known defect) before and passes now, `flaky` when its requests gave
more than one distinct output across the runs (greedy decoding must not), and `stable` otherwise.

Speed across runs is shown as each speculative cell's draft acceptance and its speed-up over no
speculation measured inside each run (`files.speedups`), never as tokens/s: those measure the machine.
"""

from dataclasses import dataclass, field
from pathlib import Path

from harness.paths import write_atomic
from harness.report.files import RunDir, cell_id, item_name, speedups, status, throughput, worst

CATEGORIES = ("new failure", "fixed", "flaky", "stable")


@dataclass
class CaseHistory:
    """One case (pytest item) over the runs."""

    item: str
    statuses: list[str | None] = field(default_factory=list)
    """Per run, the case's worst verdict status (None where the run does not have the case)."""
    outputs: set = field(default_factory=set)

    @property
    def unique_outputs(self) -> int:
        return len(self.outputs)

    @property
    def category(self) -> str:
        present = [s for s in self.statuses if s is not None]
        if present and present[-1] == "failed" and (len(present) == 1 or present[-2] != "failed"):
            return "new failure"
        if len(present) >= 2 and present[-1] in ("passed", "near-tie") and present[-2] in ("failed", "known"):
            return "fixed"
        if self.unique_outputs > 1:
            return "flaky"
        return "stable"


def history(runs: list[RunDir]) -> list[CaseHistory]:
    """Every case of any of the runs, new failures first."""
    cases: dict[str, CaseHistory] = {}
    for i, run in enumerate(runs):
        per_item: dict[str, list[str]] = {}
        for v in run.checks:
            per_item.setdefault(item_name(v), []).append(status(v))
        for name, statuses in per_item.items():
            case = cases.setdefault(name, CaseHistory(name, [None] * len(runs)))
            case.statuses[i] = worst(statuses)
        for r in run.records:
            case = cases.get(item_name(r))
            if case is not None and r.get("error") is None:
                case.outputs.add(tuple(r["tokens"]))
    return sorted(cases.values(), key=lambda c: (CATEGORIES.index(c.category), c.item))


def speculation(runs: list[RunDir]) -> list[dict]:
    """Per speculative cell (`<suite> <cell id>`), per run (None where it did not run): its acceptance and
    its speed-up over no speculation in that run."""
    cells: dict[str, list] = {}
    for i, run in enumerate(runs):
        speed = speedups(run.records)
        groups: dict[str, list[dict]] = {}
        for r in run.records:
            if r["spec"] != "none" and r.get("error") is None:
                groups.setdefault(f"{r['suite']} {cell_id(r)}", []).append(r)
        for cell, rows in groups.items():
            cells.setdefault(cell, [None] * len(runs))[i] = {
                "acceptance": throughput(rows)["acceptance"],
                "speedup": speed.get(cell),
            }
    return [{"cell": cell, "runs": per_run} for cell, per_run in sorted(cells.items())]


def print_history(runs: list[RunDir], rows: list[CaseHistory], console) -> None:
    """The cases that are not stable, and the count per category."""
    from rich.table import Table

    table = Table(title=f"history over {len(runs)} runs: {', '.join(r.run_id for r in runs)}", title_justify="left")
    for column in ("case", "category", "statuses (oldest first)", "unique outputs"):
        table.add_column(column)
    for c in rows:
        if c.category != "stable":
            table.add_row(c.item, c.category, " ".join(s or "-" for s in c.statuses), str(c.unique_outputs))
    console.print(table)
    counts = {cat: sum(1 for c in rows if c.category == cat) for cat in CATEGORIES}
    console.print(", ".join(f"{n} {cat}" for cat, n in counts.items()), markup=False)


def write_history_html(runs: list[RunDir], rows: list[CaseHistory], target: Path) -> Path:
    """Render `history.html`."""
    from harness.report.html import render

    html = render(
        "history.html.j2",
        runs=runs,
        rows=rows,
        categories=CATEGORIES,
        speculation=speculation(runs),
        counts={cat: sum(1 for c in rows if c.category == cat) for cat in CATEGORIES},
    )
    write_atomic(target, lambda p: p.write_text(html, encoding="utf-8"))
    return target
