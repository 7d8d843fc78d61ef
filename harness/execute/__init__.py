"""Running the matrix's cells of a suite: one session (engine or server) per cell serving every case, round after
round, the cells that differ only in their speculative config side by side.

- `executor`: the `Executor` (cells run on demand, each once) and how a cell is served (`serve_config`);
- `rescore`: scoring a run's outputs after the fact (`Rescorer`: withheld logits; `TokenScorer`: token probabilities);
- `slot_restore`: the rounds that save and restore a chat's slot; `run_options`: the command line's executor options.
"""

from harness.execute.executor import ExecOptions, Executor, serve_config
from harness.execute.rescore import Rescorer, TokenScorer
from harness.result.cellrun import CellRun, Outcome
from harness.suites import case_keys

__all__ = ["CellRun", "ExecOptions", "Executor", "Outcome", "Rescorer", "TokenScorer", "case_keys", "serve_config"]
