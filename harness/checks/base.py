"""What a check sees and what it returns.

A check sees its own cell's run and, through `CellSource` (which the executor implements), the other cells it
compares with; it never starts anything itself.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from harness.errors import HarnessError
from harness.matrix import Cell
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome
from harness.result.logits import PositionLogits
from harness.suites import Case, Suite, case_keys
from harness.verdict import noise
from harness.verdict.check_result import NO_OUTPUT as NO_OUTPUT
from harness.verdict.check_result import NOT_SPECULATIVE as NOT_SPECULATIVE
from harness.verdict.check_result import CheckResult as CheckResult
from harness.verdict.check_result import harness_fault as harness_fault
from harness.verdict.check_result import not_run as not_run
from harness.verdict.noise import NoiseFloor


class Rescorer(Protocol):
    """Re-scores a position of a run whose logits a backend withheld (harness.execute.Rescorer)."""

    def score(self, suite: Suite, cell: Cell, result: Result, pos: int) -> PositionLogits | None: ...


class TokenScorer(Protocol):
    """Scores returned tokens under their request's sampler chain (harness.execute.TokenScorer)."""

    def score(self, suite: Suite, cell: Cell, pairs: list) -> list[dict]: ...


class CellSource(Protocol):
    """What checks see of the other cells of a run: their runs (served on first use), the facts of the backend
    that served a cell, a re-scorer and a token scorer. harness.execute.Executor implements it."""

    def run(self, suite: Suite, cell: Cell) -> CellRun: ...

    def environment(self, cell: Cell) -> dict: ...

    def rescorer(self) -> AbstractContextManager[Rescorer]: ...

    def token_scorer(self) -> AbstractContextManager[TokenScorer]: ...

    def planned(self, suite: Suite, cell: Cell) -> bool: ...


@dataclass
class CheckContext:
    """One case (record name) of one cell, plus what a check needs to look at other cells."""

    run: CellRun
    case: str
    executor: CellSource
    """The other cells (the executor, seen through CellSource)."""
    baselines: Any
    detokenize: Callable[[list[int]], str]
    repro: str
    """A command that reproduces this cell, for failure messages."""

    @property
    def cell(self) -> Cell:
        return self.run.cell

    @property
    def case_def(self) -> Case:
        """The suite case this record name belongs to (a chat's turns share one), as this cell ran it."""
        case = next(c for c in self.run.suite.cases if self.case in case_keys(c))
        return self.run.suite.sent_case(case, self.cell)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.run.of_case(self.case)

    @property
    def excuses_near_ties(self) -> bool:
        """Whether a proven near-tie in this cell is reported, not failed (NoiseFloor.excuses_near_ties: the one
        policy)."""
        return self.noise_floor.excuses_near_ties(self.cell.mode)

    @property
    def noise_floor(self) -> NoiseFloor:
        """The calibrated noise floor of this cell's (model, backend, device), its near-tie floor the one measured
        in this cell's mode (NoiseFloor.for_mode), with the suite's own `tolerances:` applied on top when it
        declares any (NoiseFloor.declared)."""
        floor = self.calibration(self.cell).for_mode(self.cell.mode)
        return floor.declared(self.run.suite.tolerances, self.run.suite.name)

    def calibration(self, cell: Cell) -> NoiseFloor:
        """The calibration of `cell`'s (model, backend) on the device and build that serves it, as calibrated
        (no mode or suite applied): this cell's or another of its group's."""
        return noise.load(
            cell.model,
            cell.backend,
            self.executor.environment(cell),
            self.baselines.calibration_of(self.run.suite) if self.baselines else None,
        )

    def allowed(self, outcome: Outcome) -> bool:
        """True when an error outcome is one the suite allows (e.g. context_full in kv-fill)."""
        error = outcome.result.error or ""
        return any(error.startswith(kind) for kind in self.run.suite.allow_errors)

    def completed(self) -> list[Outcome]:
        """The outcomes that produced output."""
        return [o for o in self.outcomes if o.result.ok]

    def other_run(self, cell: Cell) -> CellRun:
        """Another cell's run (served on demand); a HarnessError when the harness could not serve it, so that a
        check comparing with it reports a harness error, not a verdict on this cell."""
        run = self.run if cell == self.cell else self.executor.run(self.run.suite, cell)
        if run.fault is not None:
            raise HarnessError(f"the reference cell {cell.id} had a harness error: {run.fault.splitlines()[0]}")
        return run

    def other(self, cell: Cell) -> list[Outcome]:
        """This case's outcomes in another cell (run on demand)."""
        return self.other_run(cell).of_case(self.case)

    def reference_outcome(self, cell: Cell, round_: int = 0) -> Outcome | None:
        return next((o for o in self.other(cell) if o.round == round_), None)

    @property
    def earlier_turns(self) -> list[str]:
        """The record names of a chat turn's earlier turns, whose replies its prompt carries ([] for a prompt)."""
        keys = case_keys(next(c for c in self.run.suite.cases if self.case in case_keys(c)))
        return keys[: keys.index(self.case)]

    def earlier_replies(self, cell: Cell, round_: int = 0) -> list[list[int] | None]:
        """The tokens `cell` replied to this chat turn's earlier turns in round `round_` (None: no reply)."""
        run = self.other_run(cell)
        return [
            next((o.result.tokens for o in run.of_case(k) if o.round == round_ and o.result.ok), None)
            for k in self.earlier_turns
        ]

    def prompt_differs(self, outcome: Outcome, reference: list[list[int] | None]) -> str | None:
        """The first earlier turn whose reply in `outcome`'s round differs from the reference's (`reference`: its
        earlier replies, None where unknown), so that this turn's prompt is another conversation's; None when
        the prompts are the same (or it cannot tell)."""
        mine = self.earlier_replies(self.cell, outcome.round)
        return next(
            (k for k, a, b in zip(self.earlier_turns, reference, mine, strict=False) if a is not None and a != b), None
        )


def kv_findings(result: Result, who: str) -> list[str]:
    """The KV scanner's findings on one request's cache, one line (empty when healthy or not scanned)."""
    scan = result.kv_scan
    if not scan or scan.get("healthy", True):
        return []
    t = scan["totals"]
    return [
        f"the KV scan of the {who} found {t['duplicate_cells']} duplicate (seq_id, pos) cells, "
        f"{t['orphans']} orphans and {t['missing_positions']} missing positions"
    ]


def past_returned(result: Result) -> tuple[int, int] | None:
    """(first, last) position of the request's sequence that its KV scan found at or past its prompt plus the
    tokens it returned, or None. Without speculation a slot never holds more (the token a request ends on,
    an end-of-generation token included, is sampled, never decoded); a slot that does keeps tokens it never
    returned, e.g. drafts accepted past an end-of-generation token (ggml-org/llama.cpp#28049), which the next
    turn's prompt does not continue (a hybrid model then re-processes it, `prompt-reuse`).

    A request that reached the end of the context (`truncated`) is not judged: a speculative step there decodes
    positions past the token the context limit ends the request on, on both backends (llama-server 0c1e570
    keeps them, seen in kv-fill, par: positions 509..510 after 447 + 62 tokens; the engine keeps the step's
    positions too while it returns the non-speculative tokens). The context end is judged by
    `within-n-predict` and `lossless` in the draft-budget suite (ggml-org/llama.cpp#10641)."""
    if result.truncated:
        return None
    last = max((int(p) for p in (result.kv_scan or {}).get("pos_max", {}).values()), default=-1)
    bound = len(result.prompt_tokens) + len(result.tokens)
    return (bound, last) if last >= bound else None
