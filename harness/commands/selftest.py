"""`specharness selftest`: the catch matrix, under control.

Each fault switch of the speculative engine is turned on, one at a time, and the selftest plan runs on
the in-process engine; the same plan also runs with no fault (the clean row), which must report zero
failures — so a catch is measured exactly where the faults show. A fault counts as caught only when its
expected check fails with its expected evidence (`EXPECTED`); a Python exception of the harness is a
harness error, reported in its own column, never a catch. `--clean-runs N` adds N runs of every suite's
default matrix with no fault, which must also report zero failures.

The cells without speculation of the plan are served once and shared by the rows (`Unspeculated`): a fault
switch acts only inside the engine's speculation, which such a cell does not have.
"""

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from rich.table import Table

from harness import interrupt
from harness.backends.choose import backend_factories
from harness.checks import CHECKS
from harness.engine.faults import FAULTS
from harness.execute import ExecOptions, Executor
from harness.report.files import check_records
from harness.running import run_suites, wide_console
from harness.signatures import group
from harness.suites import load_suite, suite_files, suites_dir
from harness.verdict.baselines import BaselineStore, default_root
from harness.verdict.known_failures import FILE_NAME as KNOWN_FAILURES
from harness.verdict.known_failures import load as load_known
from harness.verdict.known_failures import tag

PLAN = [
    (
        "quicksort",
        {
            "models": ["tiny-dense", "tiny-hybrid"],
            "modes": ["seq", "par"],
            "specs": ["none", "scripted-wrong-at-2"],
            "backends": ["inproc"],
        },
    ),
    (
        "grammar-json",
        {"models": ["tiny-hybrid"], "modes": ["seq"], "specs": ["none", "scripted-reject"], "backends": ["inproc"]},
    ),
    ("kv-fill", {"models": ["tiny-dense"], "modes": ["par"], "specs": ["draft-simple"], "backends": ["inproc"]}),
    (
        "sampling",
        {"models": ["tiny-hybrid"], "modes": ["seq"], "specs": ["none", "draft-simple"], "backends": ["inproc"]},
    ),
]
"""Suites and the matrix part each runs: rollbacks by seq_rm (dense) and by checkpoint (hybrid), a
grammar under forced rejections, decode failures during speculative steps, and penalties under
checkpoint rollbacks."""
MTP_PART = (
    "quicksort",
    {"models": ["tiny-hybrid-mtp"], "modes": ["seq"], "specs": ["draft-mtp"], "backends": ["inproc"]},
)
"""draft-mtp on the hybrid with an MTP head: rolled back inside its recurrent snapshots (`partial`), one slot,
where `work` compares a request's counts exactly with its baseline's."""
HEADS_PART = (
    "quicksort",
    {
        "models": ["tiny-hybrid-mtp"],
        "modes": ["seq"],
        "specs": ["draft-eagle3", "draft-dflash"],
        "backends": ["inproc"],
    },
)
"""The draft heads fed with the target's layer inputs on the hybrid with an MTP head (its generated EAGLE3 and DFlash
heads), one slot, where `acceptance` and `work` compare a request with its baseline's."""
DISTRIBUTION_PART = (
    "statistical/sampling-distribution",
    {
        "models": ["tiny-dense"],
        "modes": ["seq"],
        "specs": ["draft-simple-probabilistic"],
        "backends": ["inproc"],
        "sampling": {"temperature": 0.5, "n_predict": 1536, "ignore_eos": True},
    },
)
"""Rejection sampling judged by `distribution`: the statistical suite's cases with the `sampling` given to every
case (`load_parts`), a sample on which every rejection fault that moves the distribution fails the check."""
FAULT_PLAN = {
    "stale-draft-context": [
        (
            "quicksort",
            {
                "models": ["tiny-dense", "tiny-hybrid"],
                "modes": ["seq"],
                "specs": ["draft-simple"],
                "backends": ["inproc"],
            },
        )
    ],
    "shared-drafter-state": [
        (
            "quicksort",
            {
                "models": ["tiny-dense-loop"],
                "modes": ["seq", "par"],
                "specs": ["ngram-map-k"],
                "backends": ["inproc"],
                # its par round: in seq rounds every request is served by slot 0, whose state is the shared one
                "run_order": ["seq", "seq", "par"],
            },
        )
    ],
    # ngram-cache drafts only from n-grams of a prompt (llama-server counts generated tokens only in chunks of
    # accepted drafts): echo's prompts hold the -loop model's own text, so it drafts there; seq serves the three on
    # one slot, where a kept cache drafts from the request before (Kotlin: 32 of 92 accepted -> 0 of 24)
    "ngram-cache-kept-across-requests": [
        (
            "echo",
            {"models": ["tiny-dense-loop"], "modes": ["seq"], "specs": ["ngram-cache"], "backends": ["inproc"]},
        )
    ],
    # the MTP head of tiny-hybrid-mtp weighs the hidden row at 0.1 (its eh_proj), so a wrong row moves its drafts
    # a little either way (C: 14 of 48 accepted → 13 of 53, Java and Python slightly better): the exact `work` of
    # seq sees the request that decodes more, acceptance's tolerance does not
    "mtp-wrong-row": [MTP_PART],
    "stale-partial-rollback": [MTP_PART],
    "eagle3-stale-boundary": [HEADS_PART],
    "head-wrong-layer": [HEADS_PART],
    "head-draft-left-in-cache": [HEADS_PART],
    # rejection sampling on tiny-dense: the statistical suite's two cases (a suite below suites/ by its relative
    # name) at temperature 0.5 (at its own temperature 1 q-wrong-temperature's wrong q is the right one), 1536 tokens
    # each, end-of-generation ignored (an output that ends early has too few tokens to fail): measured 2026-11-28
    "lenient-accept": [DISTRIBUTION_PART],
    "residual-unnormalised": [DISTRIBUTION_PART],
    "q-wrong-temperature": [DISTRIBUTION_PART],
    # the same sample on tiny-hybrid, which rolls back through a checkpoint restore (the fault is llama-server b11434's
    # defect, known failure server-rejection-rng-rewound-on-checkpoint-restore)
    "rejection-rng-rewound": [(DISTRIBUTION_PART[0], {**DISTRIBUTION_PART[1], "models": ["tiny-hybrid"]})],
    # a whole draft's bonus token drawn from the row before: only a draft accepted most of the time reaches it
    # (sampling-close's close draft on tiny-dense, both verification kinds, one slot)
    "bonus-wrong-row": [
        (
            "sampling-close",
            {
                "models": ["tiny-dense"],
                "modes": ["seq"],
                "specs": ["draft-simple-close", "draft-simple-close-probabilistic"],
                "backends": ["inproc"],
            },
        )
    ],
    # sample-and-match on tiny-dense (rolled back by seq_rm: a checkpoint restore would put the sampler back) in
    # every mode: no committed model's verification logits are bit-identical to a single-token decode's, so the
    # shifted draws are proven by the seeded count of the group (harness.checks.seeded), which needs more than
    # seq's two seeded sampled requests
    "extra-draw-after-reject": [
        (
            "sampling",
            {
                "models": ["tiny-dense"],
                "modes": ["seq", "par", "no-kv-unified"],
                "specs": ["none", "draft-simple"],
                "backends": ["inproc"],
            },
        )
    ],
}
"""What a fault needs beyond the plan: draft-model speculation, an n-gram drafter with a state per slot
on a model whose text repeats (the dense `-loop` model: on Gemma's three quicksort prompts, nearly the same
text, a shared state moves one token per request, which no acceptance check can tell from noise), draft-mtp
with its partial rollback, rejection sampling on a sample large enough for `distribution`, and sample-and-match on a
target rolled back by seq_rm in every mode (the seeded count of `lossless`). A fault runs the plan and its own part;
the clean row runs the plan and every fault's part (each once)."""

ROUNDS = {"quicksort": ["seq"], "sampling": ["seq"]}
"""The rounds the selftest serves of these suites, in place of their `run_order` (quicksort's [seq, seq, par],
sampling's [seq, seq]): one `seq` round. The selftest shows that each fault is caught by a default check, not that a
run repeats itself (`repeat-identical` is left out: one round; the default matrices of `--clean-runs` serve every
round); a seq round is the one every baseline stores as round 0, so `acceptance`, `work` and `baseline` compare it
as before. The other suites serve one `par` round already (what `kv-fill` needs to fill the cache)."""

EXPECTED: dict[str, list[tuple[str, str]]] = {
    "skip-seq-rm-after-restore": [("kv-healthy", r"[1-9]\d* duplicate cells")],
    "no-sampler-restore": [("grammar-valid", r"invalid outputs"), ("lossless", r"Class (hard|drift)")],
    "no-penalty-restore": [("lossless", r"the sampler's state differed")],
    "keep-drafts-on-decode-failure": [("no-crash", r"rejected the batch as invalid")],
    "rollback-off-by-one": [
        ("kv-healthy", r"[1-9]\d* (duplicate cells|orphans)"),
        ("no-crash", r"rejected the batch as invalid"),
    ],
    "partial-checkpoint-only": [
        ("kv-healthy", r"[1-9]\d* (duplicate cells|orphans)"),
        ("lossless", r"Class (hard|drift|kv-corrupt)"),
    ],
    "stale-draft-context": [
        ("kv-healthy", r"the draft context: \d+ duplicate cells, [1-9]\d* orphans"),
        ("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)"),
    ],
    "shared-drafter-state": [("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)")],
    "ngram-cache-kept-across-requests": [
        ("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)")
    ],
    "full-checkpoint": [("work", r"more work than the baseline in ckpt_created_bytes, ckpt_restored_bytes")],
    "mtp-wrong-row": [
        ("work", r"more work than the baseline in target_decoded"),
        ("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)"),
    ],
    "stale-partial-rollback": [("lossless", r"Class (hard|drift)")],
    "eagle3-stale-boundary": [
        ("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)"),
        ("work", r"more work than the baseline in target_decoded"),
    ],
    "head-wrong-layer": [
        ("acceptance", r"against baseline \(tolerance [\d.e-]+\): (acceptance|accepted tokens)"),
        ("work", r"more work than the baseline in target_decoded"),
    ],
    "head-draft-left-in-cache": [("no-crash", r"rejected the batch as invalid")],
    "lenient-accept": [("distribution", r"not draws from the target's distribution")],
    "residual-unnormalised": [("distribution", r"not draws from the target's distribution")],
    "q-wrong-temperature": [("distribution", r"not draws from the target's distribution")],
    "rejection-rng-rewound": [("distribution", r"not draws from the target's distribution")],
    "bonus-wrong-row": [
        ("distribution", r"not draws from the target's distribution|outside the chain's support beyond what numerics"),
    ],
    "extra-draw-after-reject": [("lossless", r"diverged from the non-speculative output: the measured noise rate")],
}
"""Per fault, the (check, evidence) pairs that count as catching it (any one): the check must fail and its
message must match the evidence — the bug class, not just any failure."""


@dataclass
class Row:
    """One line of the catch matrix: failing verdicts per check, catches by expected evidence, harness errors."""

    fault: str
    failures: dict[str, int] = field(default_factory=dict)
    caught: dict[str, int] = field(default_factory=dict)
    """check → failing verdicts that carry the fault's expected evidence."""
    harness_errors: list[str] = field(default_factory=list)
    label: str = ""
    failing_cells: set[str] = field(default_factory=set)
    """The cells (`<mode>-<spec>-<model>-<backend>`) with a failing verdict."""
    distinct: list[str] = field(default_factory=list)
    """The failure signatures of its failing verdicts (harness.signatures), most severe first."""

    @property
    def ok(self) -> bool:
        if self.harness_errors:
            return False
        if self.fault == "none":
            return not any(self.failures.values())
        return any(self.caught.values())


def load_parts(parts) -> list:
    """The (suite, narrowing) plan of selftest parts (suite name, narrowing), each suite served its `ROUNDS`; a
    part's `sampling` is set on every case of its suite (the executor keys runs by suite name: one suite is served
    with one such `sampling` in a selftest)."""
    plan = []
    for name, only in parts:
        only = dict(only)
        suite = load_suite(name)
        suite.rounds = list(only.pop("run_order", None) or ROUNDS.get(name, suite.rounds))
        sampling = only.pop("sampling", None)
        if sampling:
            suite.cases = [replace(case, sampling=replace(case.sampling, **sampling)) for case in suite.cases]
        plan.append((suite, only))
    return plan


class Unspeculated:
    """The runs of cells without speculation, served once and shared by every row of a catch matrix.

    A fault switch is read only by the engine's speculation (harness/engine/speculative.py, and the scheduler
    through it), which a cell without speculation never creates (harness/engine/scheduler.py: no `Speculation`
    unless the spec is enabled): such a cell serves the same with any fault on as with none. So a row takes the
    ones an earlier row served (same suite, same rounds) instead of serving them again."""

    def __init__(self):
        self._runs: dict[tuple, object] = {}

    @staticmethod
    def _key(run) -> tuple:
        return run.suite.name, tuple(run.suite.rounds), run.cell

    def lend(self, executor: Executor, plan: list) -> None:
        """Give `executor` the shared runs of the suites (and rounds) of `plan`."""
        parts = {(suite.name, tuple(suite.rounds)) for suite, _ in plan}
        for (name, rounds, _), run in self._runs.items():
            if (name, rounds) in parts:
                executor.adopt(run)

    def keep(self, executor: Executor) -> None:
        """Remember the runs of cells without speculation that `executor` served whole."""
        for run in executor.runs():
            if run.cell.spec == "none" and run.fault is None and run.crash is None:
                self._runs.setdefault(self._key(run), run)


def run_plan(fault: str | None, plan: list | None = None, shared: Unspeculated | None = None) -> Row:
    """One run of `plan` (default: the selftest plan) with `fault` switched on (None: clean); with `shared`,
    the cells without speculation that an earlier row served are taken from it, not served again."""
    label = fault or ("none (selftest plan)" if plan is None else "none (default matrices)")
    if plan is None:
        extra = FAULT_PLAN.get(fault, []) if fault else [part for parts in FAULT_PLAN.values() for part in parts]
        plan = load_parts(part for i, part in enumerate(PLAN + extra) if part not in (PLAN + extra)[:i])
    executor = Executor(ExecOptions(backends=backend_factories(), engine={"fault": fault}, kv_scan="request"))
    if shared is not None:
        shared.lend(executor, plan)
    verdicts = run_suites(plan, executor, BaselineStore(default_root()))
    if shared is not None:
        shared.keep(executor)
    row = Row(fault or "none", dict.fromkeys(CHECKS, 0), dict.fromkeys(CHECKS, 0), label=label)
    expected = dict(EXPECTED.get(fault or "", []))
    known = load_known(suites_dir() / KNOWN_FAILURES)
    failing = [
        (suite, key, cell, r) for suite, key, cell, r in verdicts if not r.passed and tag(known, suite, cell, [r])
    ]  # a recorded llama.cpp defect is no false positive
    row.distinct = [f.signature for f in group(check_records(failing), (), lambda v: True)]
    for _suite, _, cell, r in failing:
        row.failures[r.name] += 1
        row.failing_cells.add(cell.id)
        pattern = expected.get(r.name)
        if pattern and re.search(pattern, r.message):
            row.caught[r.name] += 1
    row.harness_errors = [
        f"{run.suite.name} {run.cell.id}: {run.error}" for run in executor.runs() if run.harness_error
    ]
    return row


def default_matrices() -> list:
    """Every suite's default matrix on the in-process engine."""
    return [(load_suite(str(path)), {"backends": ["inproc"]}) for path in suite_files()]


def catch_matrix(clean_runs: int = 0, faults: list[str] | None = None) -> Iterator[Row]:
    """Every fault once on the plan, the plan's clean row, then `clean_runs` clean runs of the default matrices
    (row by row: an interrupted selftest still shows the rows that finished)."""
    shared = Unspeculated()
    for fault in faults or list(FAULTS):
        yield run_plan(fault, shared=shared)
    yield run_plan(None, shared=shared)
    if clean_runs:
        clean = Row(
            "none",
            dict.fromkeys(CHECKS, 0),
            dict.fromkeys(CHECKS, 0),
            label=f"none (default matrices, {clean_runs} runs)",
        )
        for _ in range(clean_runs):
            row = run_plan(None, default_matrices())
            for name, n in row.failures.items():
                clean.failures[name] += n
            clean.harness_errors += row.harness_errors
            clean.failing_cells |= row.failing_cells
            clean.distinct += [d for d in row.distinct if d not in clean.distinct]  # a false positive names itself
        yield clean


def table(rows: list[Row]) -> Table:
    """fault × check: failing verdicts (bold where they carry the expected evidence), harness errors, verdict."""
    t = Table(title="specharness selftest: which check caught which fault")
    t.add_column("fault")
    for name in CHECKS:
        t.add_column(name, justify="right")
    t.add_column("harness errors", justify="right")
    t.add_column("distinct failures", justify="right")
    t.add_column("verdict")
    for row in rows:
        cells = [
            ("·" if not n else f"[bold]{n}[/]" if row.caught.get(name) else str(n)) for name, n in row.failures.items()
        ]
        if row.harness_errors:
            verdict = "[red]HARNESS ERROR[/]"
        elif row.fault == "none":
            verdict = "[green]clean[/]" if row.ok else "[red]false positives[/]"
        else:
            verdict = "[green]caught[/]" if row.ok else "[red]NOT CAUGHT[/]"
        t.add_row(
            row.label,
            *cells,
            str(len(row.harness_errors)) if row.harness_errors else "·",
            str(len(row.distinct)) if row.distinct else "·",
            verdict,
        )
    return t


def cmd_selftest(args: argparse.Namespace) -> int:
    """`specharness selftest`: 0 when every fault is caught as expected and clean runs have no failures
    (interrupted: the rows that finished, and 130 / 143)."""
    rows = []
    try:
        for row in catch_matrix(args.clean_runs, args.fault):
            rows.append(row)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the workers are stopped; show what finished
        pass
    with interrupt.deferred():  # the rows that finished are shown in full
        interrupt.phase("report")
        console = wide_console()
        console.print(table(rows))
        for row in rows:
            if row.distinct:
                plural = "s" if len(row.distinct) > 1 else ""
                console.print(
                    f"{row.label}: {len(row.distinct)} distinct failure{plural}: " + "; ".join(row.distinct),
                    markup=False,
                    highlight=False,
                )
                if row.fault == "none":
                    cells = ", ".join(sorted(row.failing_cells))
                    console.print(f"{row.label}: failing cells: {cells}", markup=False, highlight=False)
            for error in row.harness_errors:
                console.print(f"harness error with fault {row.fault}: {error}", markup=False, highlight=False)
        if interrupt.received():
            planned = len(args.fault or FAULTS) + 1 + bool(args.clean_runs)
            console.print(f"interrupted: {len(rows)} of {planned} rows ran", markup=False)
            return interrupt.status()
    return 0 if all(r.ok for r in rows) else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness selftest`."""
    p = sub.add_parser("selftest", help="prove every fault switch is caught by the expected check")
    p.add_argument(
        "--clean-runs",
        type=int,
        default=1,
        help="runs of every suite's default matrix with no fault, which must report zero failures "
        "(default 1; the selftest plan's own clean row always runs)",
    )
    p.add_argument("--fault", action="append", choices=sorted(FAULTS), help="only these faults (default all)")
    p.set_defaults(func=cmd_selftest)
