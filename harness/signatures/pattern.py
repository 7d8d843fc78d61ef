"""Where a failure shows: over the axes the run covered (mode × drafter × model kind × backend, and the
suites and cases), which values it failed in, which ran without it, which did not run; a mode × drafter by
model kind × backend grid of the same; and the one-line reading a maintainer would write
("only par / no-kv-unified, only draft-simple, only hybrid / recurrent; seq clean")."""

from collections.abc import Iterable
from dataclasses import dataclass, field

from harness.signatures.group import CELL, Failure, case_key, group

FAILED, PASSED, NOT_RUN = "failed", "passed", "not run"
AXES = ("mode", "spec", "kind", "backend")
"""The axes of a pattern: a cell's mode, its spec config (the drafter), its model's kind, its backend."""
LABELS = {"mode": "mode", "spec": "drafter", "kind": "model kind", "backend": "backend"}


@dataclass
class RunCell:
    """A cell of the run as a pattern sees it: its axes, whether it ran, its cases."""

    suite: str
    axes: dict[str, str]
    ran: bool
    cases: set[tuple] = field(default_factory=set)

    @property
    def key(self) -> tuple:
        return (self.suite, self.axes["mode"], self.axes["spec"], self.axes["model"], self.axes["backend"])


def run_cells(checks: Iterable[dict], meta: dict) -> list[RunCell]:
    """The run's cells in plan order (run.json's, then any only the verdicts name, for runs without it),
    with the model kind from run.json (the model's name where not recorded) and the cases judged in each."""
    models = meta.get("models") or {}
    out: dict[tuple, RunCell] = {}

    def add(row: dict, ran: bool) -> RunCell:
        key = tuple(row[a] for a in CELL)
        if key not in out:
            kind = (models.get(row["model"]) or {}).get("kind") or row["model"]
            out[key] = RunCell(row["suite"], {a: row[a] for a in CELL[1:]} | {"kind": kind}, ran)
        return out[key]

    for c in meta.get("cells") or []:
        if all(a in c for a in CELL):  # (hand-made run.json files may name a cell by its id alone)
            add(c, c.get("status") == "done")
    for v in checks:
        add(v, True).cases.add(case_key(v))
    return list(out.values())


def _state(states: list[str]) -> str:
    """A group of cells: failed if any failed, passed if any ran without the failure, else not run."""
    return FAILED if FAILED in states else PASSED if PASSED in states else NOT_RUN


@dataclass
class Pattern:
    """A failure's pattern over a run's cells."""

    axes: dict[str, dict[str, str]]
    """axis → value → failed / passed / not run (in the run's order of values), among the cells whose other
    axes take values it failed in: `seq` is clean when the seq cells with the failing drafters, model kinds
    and backends ran without it, not when some other seq cell did."""
    rows: list[tuple[str, str]]
    """The grid's rows: (mode, drafter)."""
    columns: list[tuple[str, str]]
    """The grid's columns: (model kind, backend)."""
    grid: dict[tuple, dict]
    """(row, column) → {"state", "failed": cases with the failure, "cases": cases that ran} (rows × columns the
    run had no cell for are absent: not run)."""
    suites: tuple[int, int]
    """(suites it failed in, suites that ran)."""
    cases: tuple[int, int]
    """(cases it failed in, cases that ran), a case being one case of one cell."""

    @property
    def reading(self) -> str:
        """The one-line reading: per axis the values it showed in (`only ...` where others ran clean), then
        the values that ran clean and those that did not run there."""
        where, clean, untried = [], [], []
        for values in self.axes.values():
            failed, passed, not_run = (
                [v for v, s in values.items() if s == state] for state in (FAILED, PASSED, NOT_RUN)
            )
            if failed and (passed or not_run):
                where.append(("only " if passed else "") + " / ".join(failed))
            if failed and passed:
                clean.append(" / ".join(passed) + " clean")
            if failed and not_run:
                untried.append(" / ".join(not_run) + " not run there")
        text = ", ".join(where) or "wherever the run looked"
        text += f"; {', '.join(clean + untried)}" if clean or untried else ""
        return text + f" ({self.cases[0]} of {self.cases[1]} cases, {self.suites[0]} of {self.suites[1]} suites)"


def pattern(failure: Failure, cells: list[RunCell]) -> Pattern:
    """Where `failure` failed, passed and did not run among `cells` (run_cells)."""
    failing = set(failure.cases)
    hit = {c[: len(CELL)] for c in failing}
    state = {c.key: FAILED if c.key in hit else PASSED if c.ran else NOT_RUN for c in cells}
    showing = {axis: {c.axes[axis] for c in cells if state[c.key] == FAILED} for axis in AXES}
    axes: dict[str, dict[str, list[str]]] = {axis: {} for axis in AXES}
    for c in cells:
        for axis in AXES:
            alike = all(c.axes[other] in showing[other] for other in AXES if other != axis)
            axes[axis].setdefault(c.axes[axis], []).append(state[c.key] if alike else NOT_RUN)
    rows = list(dict.fromkeys((c.axes["mode"], c.axes["spec"]) for c in cells))
    columns = list(dict.fromkeys((c.axes["kind"], c.axes["backend"]) for c in cells))
    grid: dict[tuple, dict] = {}
    for c in cells:
        spot = grid.setdefault(
            ((c.axes["mode"], c.axes["spec"]), (c.axes["kind"], c.axes["backend"])),
            {"states": [], "failed": 0, "cases": 0},
        )
        spot["states"].append(state[c.key])
        spot["failed"] += len(c.cases & failing)
        spot["cases"] += len(c.cases) if c.ran or state[c.key] == FAILED else 0  # a cell not served fails too
    for spot in grid.values():
        spot["state"] = _state(spot.pop("states"))
    suites_ran = {c.suite for c in cells if c.ran}
    return Pattern(
        axes={a: {v: _state(s) for v, s in values.items()} for a, values in axes.items()},
        rows=rows,
        columns=columns,
        grid=grid,
        suites=(len({c[0] for c in failing}), len(suites_ran)),
        cases=(len(failing), sum(len(c.cases) for c in cells if c.ran or state[c.key] == FAILED)),
    )


def failure_patterns(checks: list[dict], records: list[dict], meta: dict, failed) -> list[tuple[Failure, Pattern]]:
    """A stored run's distinct failures (group.group, `failed` telling a failing verdict), each with its pattern."""
    cells = run_cells(checks, meta)
    kinds = {name: info.get("kind") for name, info in (meta.get("models") or {}).items() if isinstance(info, dict)}
    return [(f, pattern(f, cells)) for f in group(checks, records, failed, {k: v for k, v in kinds.items() if v})]
