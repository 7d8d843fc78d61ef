"""`specharness selftest`: the catch matrix. Each fault switch of the speculative engine is turned on,
one at a time, the selftest plan runs on the in-process engine, and a table shows which checks caught
it. Every fault must be caught by the check expected for its bug class, and clean runs (no fault, every
suite's default matrix) must report zero failures."""

import argparse
from dataclasses import dataclass, field

from rich.table import Table

from harness.backends.choose import backend_factories
from harness.baselines import BaselineStore, default_root
from harness.checks import CHECKS
from harness.engine.faults import FAULTS
from harness.execute import ExecOptions, Executor
from harness.runner import run_suites, wide_console
from harness.suites import load_suite, suite_files

PLAN = [
    ("quicksort", {"models": ["tiny-dense", "tiny-hybrid"], "modes": ["seq", "par"],
                   "specs": ["none", "scripted-wrong-at-2"], "backends": ["inproc"]}),
    ("grammar-json", {"models": ["tiny-hybrid"], "modes": ["seq"], "specs": ["none", "scripted-reject"],
                      "backends": ["inproc"]}),
    ("kv-fill", {"models": ["tiny-dense"], "modes": ["par"], "specs": ["draft-simple"], "backends": ["inproc"]}),
    ("sampling", {"models": ["tiny-hybrid"], "modes": ["seq"], "specs": ["none", "draft-simple"], "backends": ["inproc"]}),
]
"""Suites and the matrix part each runs: rollbacks by seq_rm (dense) and by checkpoint (hybrid), a
grammar under forced rejections, decode failures during speculative steps, and penalties under
checkpoint rollbacks."""

EXPECTED = {
    "skip-seq-rm-after-restore": {"kv-healthy"},
    "no-sampler-restore": {"grammar-valid", "lossless"},
    "no-penalty-restore": {"lossless"},
    "keep-drafts-on-decode-failure": {"no-crash"},
    "rollback-off-by-one": {"kv-healthy", "no-crash"},
    "partial-checkpoint-only": {"lossless"},
}
"""The checks that must catch each fault (any one of them)."""


@dataclass
class Row:
    """One line of the catch matrix: failing items per check."""

    fault: str
    failures: dict[str, int] = field(default_factory=dict)
    runs: int = 1

    @property
    def caught_by(self) -> set[str]:
        return {name for name, n in self.failures.items() if n}

    @property
    def ok(self) -> bool:
        if self.fault == "none":
            return not self.caught_by
        return bool(self.caught_by & EXPECTED[self.fault])


def run_plan(fault: str | None) -> dict[str, int]:
    """Failing check verdicts per check name: with a fault, one run of the selftest plan; without,
    one run of every suite's default matrix on the in-process engine."""
    executor = Executor(ExecOptions(backends=backend_factories(), engine={"fault": fault}, kv_scan="request"))
    if fault:
        plan = [(load_suite(name), only) for name, only in PLAN]
    else:
        plan = [(load_suite(str(path)), {"backends": ["inproc"]}) for path in suite_files()]
    verdicts = run_suites(plan, executor, BaselineStore(default_root()))
    failures = dict.fromkeys(CHECKS, 0)
    for *_, r in verdicts:
        failures[r.name] += not r.passed
    return failures


def catch_matrix(clean_runs: int = 10, faults: list[str] | None = None) -> list[Row]:
    """The matrix rows: every fault once, then `clean_runs` runs with no fault (failures summed)."""
    rows = [Row(f, run_plan(f)) for f in (faults or list(FAULTS))]
    clean = Row("none", dict.fromkeys(CHECKS, 0), clean_runs)
    for _ in range(clean_runs):
        for name, n in run_plan(None).items():
            clean.failures[name] += n
    return rows + [clean]


def table(rows: list[Row]) -> Table:
    """fault × check: failing items, with the expected catchers marked."""
    t = Table(title="specharness selftest: which check caught which fault")
    t.add_column("fault")
    for name in CHECKS:
        t.add_column(name, justify="right")
    t.add_column("verdict")
    for row in rows:
        label = row.fault if row.fault != "none" else f"none ({row.runs} runs)"
        expected = EXPECTED.get(row.fault, set())
        cells = [(f"[bold]{n}[/]" if name in expected else str(n)) if n else "·" for name, n in row.failures.items()]
        verdict = "[green]caught[/]" if row.ok and row.fault != "none" else "[green]clean[/]" if row.ok else (
            "[red]NOT CAUGHT[/]" if row.fault != "none" else "[red]false positives[/]")
        t.add_row(label, *cells, verdict)
    return t


def cmd_selftest(args: argparse.Namespace) -> int:
    """`specharness selftest`: 0 when every fault is caught as expected and clean runs have no failures."""
    rows = catch_matrix(args.clean_runs, args.fault)
    wide_console().print(table(rows))
    return 0 if all(r.ok for r in rows) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness selftest`."""
    p = sub.add_parser("selftest", help="prove every fault switch is caught by the expected check")
    p.add_argument("--clean-runs", type=int, default=10,
                   help="runs of every suite's default matrix with no fault, which must report zero failures")
    p.add_argument("--fault", action="append", choices=sorted(FAULTS), help="only these faults (default all)")
    p.set_defaults(func=cmd_selftest)
