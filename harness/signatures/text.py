"""The distinct failures and their patterns on the console: the headline, then per failure its signature,
its reading and its grid (mode × drafter rows, model kind × backend columns)."""

from rich.table import Table

from harness.signatures.group import Failure, headline
from harness.signatures.pattern import FAILED, NOT_RUN, PASSED, Pattern

MARKS = {FAILED: "[red]✗ {failed}/{cases}[/]", PASSED: "[green]✓ {cases}[/]", NOT_RUN: "[dim]not run[/]"}
"""A grid cell on the console: failed (cases with the failure / cases run), passed (cases run), not run."""


def grid_table(p: Pattern) -> Table:
    """The pattern's grid as a rich table."""
    table = Table(show_edge=False, pad_edge=False, box=None)
    table.add_column("mode · drafter")
    for kind, backend in p.columns:
        table.add_column(f"{kind} · {backend}", justify="center")
    for row in p.rows:
        spots = [p.grid.get((row, col), {"state": NOT_RUN}) for col in p.columns]
        table.add_row(" · ".join(row), *(MARKS[s["state"]].format(**s) for s in spots))
    return table


def summary_lines(found: list[tuple[Failure, Pattern]]) -> list[str]:
    """The headline, then per failure `N. <signature>` and its reading, indented ([] when there are none)."""
    if not found:
        return []
    out = [headline([f for f, _ in found])]
    for n, (failure, p) in enumerate(found, 1):
        out += [f"{n}. {failure.signature}", f"   {p.reading}" + _folds(failure)]
    return out


def _folds(failure: Failure, shown: int = 2) -> str:
    """The evidence of the refused batches folded under a failure (its first `shown`), on the reading's lines."""
    if not failure.folds:
        return ""
    more = len(failure.folds) - shown
    lines = [f"\n   consequence: {line}" for line in failure.folds[:shown]]
    return "".join(lines) + (f"\n   (and {more} more refused batches on the same evidence)" if more > 0 else "")


NEW_SUITE = "known_failure_new_suite"
"""Evidence key of a verdict a known defect explains in a suite its entry does not list
(harness.verdict.known_failures)."""


def new_suites(failures: list[Failure]) -> list[str]:
    """The suites a known defect's entry does not list yet where it showed in these failures (sorted)."""
    return sorted(
        {
            str((v.get("evidence") or {}).get(NEW_SUITE))
            for f in failures
            for v in f.verdicts + f.consequences
            if (v.get("evidence") or {}).get(NEW_SUITE)
        }
    )


def known_lines(known: dict[str, list[Failure]]) -> list[str]:
    """One line per known llama.cpp defect of a run: what it explained, by signature, and the suites its entry
    does not list yet where it showed (a known defect seen in a new suite: it does not fail the run) ([] when
    none)."""
    out = []
    for kid, failures in known.items():
        line = f"known llama.cpp defect {kid}: " + headline(failures).replace("distinct failure", "signature")
        new = new_suites(failures)
        if new:
            line += (
                f"; seen in a new suite: {', '.join(new)} (known defect, not failing the run: add the suite to the "
                "entry in suites/known-failures.yaml)"
            )
        out.append(line)
    return out


def print_failures(found: list[tuple[Failure, Pattern]], console, known: dict[str, list[Failure]]) -> None:
    """The run's distinct failures, most severe first, each with its reading and grid (nothing when none), then
    what each known llama.cpp defect explained, by signature."""
    for line in known_lines(known):
        console.print(line, style="yellow", markup=False, highlight=False)
    lines = summary_lines(found)
    if not lines:
        return
    console.print(lines[0], style="bold red", markup=False, highlight=False)
    for (_, p), title, reading in zip(found, lines[1::2], lines[2::2], strict=False):
        console.print(title, style="bold", markup=False, highlight=False)
        console.print(reading, markup=False, highlight=False)
        console.print(grid_table(p))
