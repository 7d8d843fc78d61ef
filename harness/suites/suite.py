"""A loaded suite and its cases."""

import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from harness.matrix import Cell, block_of
from harness.suites.request import Request, Sampling
from harness.suites.schema import NONE_REFERENCE_CHECKS


@dataclass
class Case:
    """One named case: a completion prompt, or a chat whose turns are sent one after another."""

    name: str
    sampling: Sampling
    prompt: str | None = None
    turns: list[str] = field(default_factory=list)
    expect_accepts: bool = True
    """Whether `spec-ran` expects some drafts of this case accepted (a grammar the drafter does not see
    may reject them all: then speculation must run, but need not pay off)."""

    @property
    def is_chat(self) -> bool:
        return bool(self.turns)

    def request(self, deadline_s: float | None = None) -> Request:
        """The completion request (chats are built turn by turn by the runner)."""
        return Request(prompt=self.prompt, sampling=self.sampling, tag=self.name, deadline_s=deadline_s)


@dataclass
class Suite:
    """A validated suite file."""

    name: str
    path: Path | None
    cases: list[Case]
    matrix: list[dict]
    """The blocks of the run matrix (see harness.matrix.cells)."""
    checks: list[str]
    serve: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    """In-process engine options (`rollback`, `checkpoint_flags`, `checkpoint_attempts`) for its inproc cells;
    llama-server has no such options, so server cells ignore them."""
    rounds: list[str] = field(default_factory=lambda: ["par"])
    """How each round sends the cases to the one session of a cell: `seq` one request at a time,
    `par` all at once (in `seq` mode the one slot still serves them one after another)."""
    allow_errors: list[str] = field(default_factory=list)
    expect: dict[str, Any] = field(default_factory=dict)
    """What a cell must exercise (the `exercised` check): `completed_min` (share of requests with output)
    and `spec_stats_min` (speculative counter → minimum total over the cell)."""
    slow: bool = False
    """Its pytest items carry the `slow` marker (`-m "not slow"` leaves them out)."""
    tolerances: dict[str, float] = field(default_factory=dict)
    """`logits-close` tolerances (harness.result.logits.Tolerances fields) and the triage's `near_tie` margin."""
    deadline_s: float | None = None
    """Seconds each request may take before it ends as `timeout`; None: derived from n_predict and the
    measured speed (harness.backends.base.request_deadline)."""
    restore_after: int | None = None
    """`restore.after_turn`: the chat turn after which RESTORE_ROUNDS save the slot and restore it."""
    seeds: str = "shared"
    """`shared` or `per-cell` (harness.suites.schema.SEEDS): whether a cell sends a case's seed or its own."""
    prompt_cache: bool = True
    """False: every request of every round reads its prompt whole (llama-server's `cache_prompt` off), as a `fresh`
    round's do. Not a suite field: calibration's servings (harness.calibration.measure), whose prompts come from
    many suites and must not go on from each other's cached state."""

    def cell_case(self, case: Case, model: str) -> Case:
        """`case` as the cells of `model` run it: with its matrix block's sampling overrides applied."""
        overrides = block_of(self.matrix, model).get("sampling")
        return replace(case, sampling=replace(case.sampling, **overrides)) if overrides else case

    @property
    def reads_none_cell(self) -> bool:
        """Whether a check of the suite compares a speculative cell with its cell without speculation."""
        return any(check in NONE_REFERENCE_CHECKS for check in self.checks)

    def sent_case(self, case: Case, cell: Cell) -> Case:
        """`case` as `cell` sends it: `cell_case`, and with `seeds: per-cell` the cell's own seed (`cell_seed`; an
        unset or random seed stays as it is)."""
        case = self.cell_case(case, cell.model)
        seed = case.sampling.seed
        if self.seeds != "per-cell" or seed is None or case.sampling.random_seed:
            return case
        return replace(case, sampling=replace(case.sampling, seed=cell_seed(seed, cell.id)))

    @property
    def first_key(self) -> str:
        """The record name of the first case (where cell-level checks report)."""
        return case_keys(self.cases[0])[0]


def cell_seed(seed: int, cell_id: str) -> int:
    """The seed a `per-cell` suite's cell sends for a case seed: the case's plus the CRC-32 of the cell's id, modulo
    2^32 less the random seed's value (0xFFFFFFFF, which would ask for a random draw). The same in every run, and
    different between the cells of one suite (a collision of two ids' CRC-32 would be a shared draw: the pooled
    test keeps one output per seed, so it would count it once)."""
    return (seed + zlib.crc32(cell_id.encode())) % 0xFFFFFFFF


def case_keys(case: Case) -> list[str]:
    """The record names of a case: its name, or `<name>.turnN` for each turn of a chat."""
    return [f"{case.name}.turn{i + 1}" for i in range(len(case.turns))] if case.is_chat else [case.name]
