"""How often a failure reproduces, and what that asks of a reproducer and of a shrinking step.

An intermittent failure (a par batch composed by request timing, a race in a restore) shows in some runs of its
case and not in others. Its rate is measured by running the original case (`specharness shrink` / `repro`:
`--tries` runs, and up to RATE_RUNS when they disagree). From it:

- `lowest_rate`: the lowest rate a measurement of `shown` of `runs` does not rule out, the exact one-sided
  (Clopper-Pearson) lower bound at RATE_BOUND (95 %): a few runs that all showed it do not make a failure
  deterministic (3 of 3 leaves a rate of 37 % open, 10 of 10 one of 74 %).
- `retries`: the runs repro.sh makes before it says "not reproduced": the smallest N with (1 − r)^N ≤ 1 −
  CONFIDENCE at that lowest rate r, so that a build failing at any rate the measurement leaves open shows it at
  least once with probability ≥ CONFIDENCE (99 %). repro.sh stops at the first reproduction: a failure that shows
  in every run costs one run; only a clean build pays all N. One run measures no rate (`--tries 1`, the caller's
  statement that the failure is deterministic): N = 1.
- `comparable`: the policy of a shrinking step: a smaller case holds when it shows the signature in at least k of
  n runs (n the runs the rate was measured with), k the largest count that a case reproducing at the original's
  rate reaches with probability ≥ HOLD (90 %): a step that lowers the rate much fails, so shrinking does not drift
  to a rarer failure that a reproducer then misses. A failure seen in every run of the original is shrunk with
  steps of one run each (cheap), and the shrunk case's rate is measured at the end: where it is not comparable,
  the shrink goes back along its kept steps to the smallest case that is (harness.shrink.cli).
- `retry_loop`: repro.sh's lines that run its `attempt` up to N times and print the verdict.
"""

import math

from scipy import stats

CONFIDENCE = 0.99
"""The probability with which repro.sh's runs show a failure of the measured rate at least once."""
HOLD = 0.9
"""The probability with which a shrinking step that keeps the original's rate holds."""
RATE_RUNS = 10
"""The runs of the original case that measure the rate of a failure its first `--tries` runs disagree on."""
RATE_BOUND = 0.95
"""The confidence of the lower bound on a measured rate that repro.sh's runs are sized for."""
MAX_RETRIES = 100
"""repro.sh never runs more attempts than this (a lowest rate under about 4.5 % would ask for more)."""


def lowest_rate(shown: int, runs: int, bound: float = RATE_BOUND) -> float:
    """The lowest rate that `shown` of `runs` does not rule out: the exact one-sided lower confidence bound at
    `bound` (Clopper-Pearson: the (1 − bound) quantile of Beta(shown, runs − shown + 1))."""
    if runs <= 0 or shown <= 0:
        return 0.0
    return float(stats.beta.ppf(1.0 - bound, shown, runs - shown + 1))


def retries(shown: int, runs: int, confidence: float = CONFIDENCE) -> int:
    """The runs a reproducer makes before it says "not reproduced", for a failure measured in `shown` of `runs`:
    enough for a build failing at the lowest rate the measurement leaves open to show it with `confidence`."""
    if runs <= 1:  # one run measures no rate: `--tries 1` states the failure deterministic
        return 1
    low = lowest_rate(shown, runs)
    if low <= 0.0:
        return 1
    if low >= 1.0:
        return 1
    return min(MAX_RETRIES, max(1, math.ceil(math.log(1.0 - confidence) / math.log(1.0 - low))))


def comparable(shown: int, runs: int, hold: float = HOLD) -> tuple[int, int]:
    """(k, n): a smaller case holds when it shows the signature in at least k of n = `runs` runs, k the largest
    count with P(X ≥ k) ≥ `hold` for X ~ Binomial(n, shown / runs) (at least 1)."""
    rate = shown / runs
    k = max((k for k in range(1, runs + 1) if stats.binom.sf(k - 1, runs, rate) >= hold), default=1)
    return k, runs


def miss_probability(shown: int, runs: int, attempts: int) -> float:
    """The probability that `attempts` runs of a build failing at the lowest rate the measurement leaves open all
    pass."""
    return (1.0 - lowest_rate(shown, runs)) ** attempts if runs else 1.0


def is_comparable(rate: tuple[int, int], original: tuple[int, int]) -> bool:
    """Whether a case measured at `rate` (shown, runs) reproduces at a rate comparable to the original's: at least
    the share k / n of `comparable(*original)`."""
    k, n = comparable(*original)
    return rate[1] > 0 and rate[0] * n >= k * rate[1]


def retry_loop(reproduction: dict) -> list[str]:
    """repro.sh's runs of `attempt` (`retries`): up to RETRIES, stopping at the first that reproduces
    (every one with REPRO_ALL=1, which counts the rate); "not reproduced" only after RETRIES clean runs; a run that
    could not tell (exit 2: llama-server did not start) ends it at once."""
    n = reproduction.get("retries", 1)
    if reproduction.get("measured"):
        rate = f"{reproduction['shown']} of {reproduction['runs']} runs"
        low = lowest_rate(reproduction["shown"], reproduction["runs"])
        why = (
            f"it showed in {rate} when measured, which leaves a rate of {low:.0%} open: a build failing at that "
            f"rate shows it in {n} runs"
        )
    else:
        rate, why = "not measured", f"its rate was not measured: {n} run"
    confidence = reproduction.get("confidence", 0.99)
    return [
        "",
        f"# Runs of the case: up to {n} ({why}"
        + (f" with probability >= {confidence:.0%}" if reproduction.get("measured") else "")
        + "); REPRO_RUNS=N sets them, REPRO_ALL=1 runs every one (the rate).",
        f'RETRIES="${{REPRO_RUNS:-{n}}}"',
        "SHOWN=0; DIFFERED=0; RAN=0",
        'for TRY in $(seq 1 "$RETRIES"); do',
        '  if [ "$RETRIES" -gt 1 ]; then echo "== run $TRY of up to $RETRIES"; fi',
        "  ( attempt ); STATUS_OF_RUN=$?",
        "  RAN=$((RAN + 1))",
        '  case "$STATUS_OF_RUN" in',
        '    1) SHOWN=$((SHOWN + 1)); if [ "${REPRO_ALL:-0}" != 1 ]; then break; fi ;;',
        "    3) DIFFERED=$((DIFFERED + 1)) ;;",
        "    0) ;;",
        '    *) exit "$STATUS_OF_RUN" ;;',
        "  esac",
        "done",
        f'if [ $SHOWN -gt 0 ]; then echo "REPRODUCED: reproduced $SHOWN of $RAN runs (measured: {rate})"; exit 1; fi',
        "if [ $DIFFERED -gt 0 ]; then"
        ' echo "DIFFERENT FAILURE in $DIFFERED of $RAN runs, the signature in none"; exit 3; fi',
        f'echo "not reproduced: 0 of $RAN runs showed the signature (measured: {rate})"',
        "exit 0",
    ]
