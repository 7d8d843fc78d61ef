"""What one matrix cell of a suite produced: its requests' outcomes and how the cell ended.

Data only: the executor (harness.execute) fills these in; checks (harness.checks) and reports read them without
importing the executor.
"""

from dataclasses import dataclass, field

from harness.matrix import Cell, keeps_seeded_tokens
from harness.result.record import Result
from harness.suites import Suite


@dataclass
class Outcome:
    """One request of a cell: which case (chat turns get `.turnN`), which round, and its Result."""

    case: str
    round: int
    result: Result


@dataclass
class CellRun:
    """Everything one cell produced.

    How it can end short of serving every request:
    - `crash`: llama.cpp itself aborted where no request was in flight (llama-server in its start-up or warm-up,
      the engine while loading the model): a finding of the software under test. The requests it did not serve
      end `crashed` with the abort line, which `no-crash` fails on.
    - `error`: the harness could not serve the cell (a start-up timeout, a missing model or flag, an unmade draft
      model, a backend that broke mid-run): a harness fault, never a check verdict (exit 3, a pytest ERROR).
    - `harness_error`: the traceback when that fault was a bug of the harness itself (`error` says so too).
    - `unservable`: the model has nothing the cell's speculative type needs (errors.Unservable): nothing is served
      and every check of the cell is `not run` with this reason.
    """

    suite: Suite
    cell: Cell
    outcomes: list[Outcome] = field(default_factory=list)
    error: str | None = None
    harness_error: str | None = None
    crash: str | None = None
    unservable: str | None = None
    spec: dict | None = None
    """The speculative options the cell was served with (its preset's and the run's `--spec-*` overrides, llama-server
    flag names); None when it was never served."""

    @property
    def keeps_seeded_tokens(self) -> bool:
        """Whether the cell's verification keeps seeded sampled tokens (matrix.keeps_seeded_tokens)."""
        return keeps_seeded_tokens(self.spec if self.spec is not None else self.cell.preset.options)

    @property
    def fault(self) -> str | None:
        """Why the harness could not serve this cell (None when it could: its verdicts are earned)."""
        return self.error or (self.harness_error.strip().splitlines()[-1] if self.harness_error else None)

    def of_case(self, case: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.case == case]
