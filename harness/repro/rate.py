"""How often a failure reproduces, and what that asks of a reproducer and of a shrinking step.

An intermittent failure (a par batch composed by request timing, a race in a restore) shows in some runs of its
case and not in others. Its rate is measured by running the original case (`specharness shrink` / `repro`:
`--tries` runs, and up to RATE_RUNS when they disagree). From it:

- `retries`: the runs repro.sh makes before it says "not reproduced": the smallest N with (1 − r)^N ≤ 1 −
  CONFIDENCE at the measured rate r = shown / runs, so that a build with the failure at that rate shows it at least
  once with probability ≥ CONFIDENCE (99 %). A failure seen in every run measured takes one run.
- `comparable`: the policy of a shrinking step: a smaller case holds when it shows the signature in at least k of
  n runs (n the runs the rate was measured with), k the largest count that a case reproducing at the original's
  rate reaches with probability ≥ HOLD (90 %): a step that lowers the rate much fails, so shrinking does not drift
  to a rarer failure that a reproducer then misses.
"""

import math

from scipy import stats

CONFIDENCE = 0.99
"""The probability with which repro.sh's runs show a failure of the measured rate at least once."""
HOLD = 0.9
"""The probability with which a shrinking step that keeps the original's rate holds."""
RATE_RUNS = 10
"""The runs of the original case that measure the rate of a failure its first `--tries` runs disagree on."""
MAX_RETRIES = 100
"""repro.sh never runs more attempts than this (a rate under about 4.5 % would ask for more)."""


def retries(shown: int, runs: int, confidence: float = CONFIDENCE) -> int:
    """The runs a reproducer makes before it says "not reproduced", for a failure measured in `shown` of `runs`."""
    if runs <= 0 or shown <= 0:
        return 1
    rate = shown / runs
    if rate >= 1.0:
        return 1
    return min(MAX_RETRIES, max(1, math.ceil(math.log(1.0 - confidence) / math.log(1.0 - rate))))


def comparable(shown: int, runs: int, hold: float = HOLD) -> tuple[int, int]:
    """(k, n): a smaller case holds when it shows the signature in at least k of n = `runs` runs, k the largest
    count with P(X ≥ k) ≥ `hold` for X ~ Binomial(n, shown / runs) (at least 1)."""
    rate = shown / runs
    k = max((k for k in range(1, runs + 1) if stats.binom.sf(k - 1, runs, rate) >= hold), default=1)
    return k, runs


def miss_probability(shown: int, runs: int, attempts: int) -> float:
    """The probability that `attempts` runs of a build failing at the measured rate all pass."""
    return (1.0 - shown / runs) ** attempts if runs else 1.0
