"""The `Result` record: one per request, filled the same way by every backend.

- `record`: `Result` and its `Timings`; `work`: the deterministic work a request's decoding did (`Work`);
- `logits`: a position's top-k logits and how two runs' logits compare; `cellrun`: a cell's run, one `Outcome` per
  request.
"""

from harness.result.record import Result, Timings
from harness.result.work import WORK_COUNTERS, Work

__all__ = ["WORK_COUNTERS", "Result", "Timings", "Work"]
