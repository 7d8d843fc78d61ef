"""Named checks: each a small function of a CheckContext returning pass/fail plus evidence.

- `registry`: the check list (`CHECKS`) and the one evaluation of a cell's checks (`evaluate_cell`);
- `lossless`: a cell's outputs compared (no-crash, repeat-identical, lossless, mode-invariant, baseline);
- `speculation`: what speculation did (spec-ran, acceptance, exercised);
- `health`: what lies behind the outputs (grammar-valid, kv-healthy, logits-close);
- one module per other check (`acceptance`, `work`, `restore`, ...), and what they share: `base` (the context and
  the result), `compare` (the one policy of token comparison), `seeded` (the noise rate of seeded identity).
"""

from harness.checks.health import kv_healthy, kv_problems
from harness.checks.lossless import lossless
from harness.checks.registry import CHECKS, evaluate, evaluate_cell, harness_errors
from harness.checks.speculation import exercised

__all__ = [
    "CHECKS",
    "evaluate",
    "evaluate_cell",
    "exercised",
    "harness_errors",
    "kv_healthy",
    "kv_problems",
    "lossless",
]
