"""What a check sees and what it returns."""

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from harness.execute import CellRun, Executor, Outcome, case_keys
from harness.matrix import Cell
from harness.suites import Case


@dataclass
class CheckResult:
    """A check's verdict on one case of one cell, with its evidence (counts, rates, divergences)."""

    name: str
    passed: bool
    message: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckContext:
    """One case (record name) of one cell, plus what a check needs to look at other cells."""

    run: CellRun
    case: str
    executor: Executor
    baselines: Any
    detokenize: Callable[[list[int]], str]
    repro: str
    """A command that reproduces this cell, for failure messages."""

    @property
    def cell(self) -> Cell:
        return self.run.cell

    @property
    def case_def(self) -> Case:
        """The suite case this record name belongs to (a chat's turns share one)."""
        return next(c for c in self.run.suite.cases if self.case in case_keys(c))

    @property
    def outcomes(self) -> list[Outcome]:
        return self.run.of_case(self.case)

    def allowed(self, outcome: Outcome) -> bool:
        """True when an error outcome is one the suite allows (e.g. context_full in kv-fill)."""
        error = outcome.result.error or ""
        return any(error.startswith(kind) for kind in self.run.suite.allow_errors)

    def completed(self) -> list[Outcome]:
        """The outcomes that produced output."""
        return [o for o in self.outcomes if o.result.ok]

    def other(self, cell: Cell) -> list[Outcome]:
        """This case's outcomes in another cell (run on demand)."""
        return self.executor.run(self.run.suite, cell).of_case(self.case)

    def reference_outcome(self, cell: Cell, round_: int = 0) -> Optional[Outcome]:
        return next((o for o in self.other(cell) if o.round == round_), None)
