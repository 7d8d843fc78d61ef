"""The exact fixed-prefix test: many short independent samples of one prompt against their exact joint law.

The `distribution` check tests a long output's tokens one at a time (a transform per token), which finds only
shifts of several per cent of a token's law at the sample sizes a run makes (its docstring, "Power"). This test
asks less of each request and more of their number: one prompt, N requests of k tokens each (k = 2-4,
end-of-generation ignored), every request with its own seed, served with speculation. Each output is one draw of
the k-token sequence, the N draws are independent (distinct seeds, one request each), and the law of that
sequence is computed exactly from the target's logits (harness.engine.joint: the same sampler chain the scorer
applies, every prefix down to a probability of MIN_EXPECTED / N). A verification bug that moves the law of the
tokens moves the sequence's law by at least as much in total variation (TV) at the position it acts on.

Categories. The sequences whose exact probability q gives an expected count N·q >= MIN_EXPECTED are categories of
their own, the rest one category `other` (merged into the least likely named one where its own expected count is
below MIN_EXPECTED). The categories depend on the exact law and N only, never on the sample: the most probable
sequences, as many (at most MAX_CATEGORIES) as make the sample-free part of the TV bound below smallest.

The test. The likelihood-ratio (G) test of the counts against N·q (`scipy.stats.power_divergence`, lambda
"log-likelihood", chi-square with (categories - 1) degrees of freedom: every expected count >= 5); the case fails
where p < ALPHA. A clean build fails with probability ALPHA per test (asymptotically: measured in
`null_rate`, which draws multinomial samples from an exact law and counts the G test's rejections).

The TV bound, at CONFIDENCE (95 %). With P the law the build samples from and Q the exact law, both coarsened to the
m categories, Weissman et al. (2003, "Inequalities for the L1 deviation of the empirical distribution") give
Pr(||P_hat - P||_1 >= e) <= (2^m - 2)·exp(-N e^2 / 2), so with probability >= CONFIDENCE every set A of categories
has P(A) <= P_hat(A) + eta, eta = sqrt(ln((2^m - 2) / (1 - CONFIDENCE)) / (2 N)). Then the TV of the coarsened laws
is at most TV(P_hat, Q) + eta, and within `other` the laws can differ by at most Q(other) more (their mass there
is split in ways the categories do not see: half the L1 distance within `other` exceeds half the coarse difference
by at most min(P(other), Q(other))). So "TV < TV(P_hat, Q) + eta + Q(other)" holds with probability >= 95 %: an
upper bound on the total-variation distance between what the build samples and the target's law of the k-token
sequence, whatever the fault. It says how small a fault could hide behind a pass.

False alarms. The statistical job runs at most MAX_TESTS_PER_RUN of these tests, so ALPHA × that = RUN_FALSE_ALARM
is their share of a clean run's false-alarm probability (the `distribution` tests' share is
harness.checks.distribution.RUN_FALSE_ALARM at most).
"""

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 1e-5
"""The p-value below which one exact test fails."""
MAX_TESTS_PER_RUN = 20
"""The most exact tests one run makes (backend × verification kind × model kind, and the faults' own)."""
RUN_FALSE_ALARM = ALPHA * MAX_TESTS_PER_RUN
"""Their share of a clean run's false-alarm probability, at most (the union bound): 2e-4."""
MIN_EXPECTED = 5.0
"""The smallest expected count of a category (the chi-square approximation of the G test holds from there)."""
MAX_CATEGORIES = 16
"""The most sequences named as categories of their own (the most probable): the G test's power falls as its degrees
of freedom grow (tests/test_exact_law.py: a 2 % shift found 97.5 % of the time over 16 categories, 92.5 % over 24)."""
CONFIDENCE = 0.95
"""The confidence of the TV upper bound."""


@dataclass(frozen=True)
class Categories:
    """The named sequences (most probable first), their exact probabilities, and the mass left to `other`."""

    sequences: list[tuple[int, ...]]
    probs: list[float]
    other: float

    @property
    def count(self) -> int:
        """Categories tested: the named ones, and `other` where it holds mass."""
        return len(self.sequences) + (1 if self.other > 0 else 0)


def categories(law: dict[tuple[int, ...], float], n: int) -> Categories:
    """The categories of an exact law (sequence -> probability, the sequences whose probability is known; the rest
    of the mass is `other`) for a sample of n: the most probable sequences (ties by the sequence) with
    n·q >= MIN_EXPECTED, as many (at most MAX_CATEGORIES) as make the TV bound's data-free part, eta(categories)
    + the unnamed mass, smallest; `other` below MIN_EXPECTED / n is merged into the last named one. Only the
    exact law and n choose them, never the sample."""
    ranked = sorted(law.items(), key=lambda kv: (-kv[1], kv[0]))
    eligible = [(s, q) for s, q in ranked if n * q >= MIN_EXPECTED][:MAX_CATEGORIES]
    if not eligible:
        raise ValueError(f"no sequence has an expected count of {MIN_EXPECTED} in {n} draws")
    named = min((eligible[:m] for m in range(1, len(eligible) + 1)), key=lambda cut: _data_free(cut, n))
    other = max(0.0, 1.0 - sum(q for _, q in named))
    if 0 < n * other < MIN_EXPECTED and len(named) > 1:
        seqs = [s for s, _ in named]
        return Categories(seqs, [q for _, q in named[:-1]] + [named[-1][1] + other], 0.0)
    return Categories([s for s, _ in named], [q for _, q in named], other)


def _data_free(named: list[tuple[tuple[int, ...], float]], n: int) -> float:
    """The part of the TV bound the sample does not move: eta over the categories plus the unnamed mass."""
    other = max(0.0, 1.0 - sum(q for _, q in named))
    return eta(len(named) + (1 if other > 0 else 0), n) + other


def counts(cats: Categories, samples: list[tuple[int, ...]]) -> np.ndarray:
    """How many samples fall in each category (named ones in order, then `other` where it is tested); a sample
    merged with `other` into the last named category counts there."""
    index = {s: i for i, s in enumerate(cats.sequences)}
    merged = cats.other == 0.0
    out = np.zeros(cats.count, dtype=np.int64)
    for s in samples:
        i = index.get(tuple(s))
        if i is None:
            i = len(cats.sequences) - 1 if merged else len(cats.sequences)
        out[i] += 1
    return out


def expected(cats: Categories) -> np.ndarray:
    """The categories' exact probabilities (named, then `other` where it is tested)."""
    probs = list(cats.probs) + ([cats.other] if cats.other > 0 else [])
    return np.asarray(probs, dtype=float)


def eta(m: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The simultaneous deviation of every set of m categories' empirical mass from its true mass, at `confidence`
    (Weissman et al. 2003: half the L1 deviation bound)."""
    return math.sqrt(math.log(max(2.0**m - 2.0, 1.0) / (1.0 - confidence)) / (2.0 * n))


def test(cats: Categories, observed: np.ndarray) -> dict:
    """The G test of `observed` against the exact law, the empirical TV and the 95 % TV upper bound."""
    from scipy import stats

    q = expected(cats)
    n = int(observed.sum())
    if n == 0:
        raise ValueError("no samples")
    g = stats.power_divergence(observed, n * q, lambda_="log-likelihood")
    empirical = 0.5 * float(np.abs(observed / n - q).sum())
    other = cats.other if cats.other > 0 else 0.0
    bound = min(1.0, empirical + eta(len(q), n) + other)
    return {
        "samples": n,
        "categories": len(q),
        "g": float(g.statistic),
        "p_value": float(g.pvalue),
        "alpha": ALPHA,
        "passed": bool(g.pvalue >= ALPHA),
        "tv_empirical": round(empirical, 5),
        "tv_upper_95": round(bound, 5),
        "other_mass": round(other, 5),
        "eta": round(eta(len(q), n), 5),
    }


def message(result: dict, what: str) -> str:
    """One line: the verdict, the test's figures and the TV bound."""
    head = (
        f"{what}: {result['samples']} independent samples in {result['categories']} categories, "
        f"G = {result['g']:.1f}, p = {result['p_value']:.3g}"
    )
    if not result["passed"]:
        return (
            f"{head} < {result['alpha']:g}: the sequences are not draws from the target's exact law "
            f"(empirical TV {result['tv_empirical']:.4f})"
        )
    return (
        f"{head} >= {result['alpha']:g}; TV from the target's exact law < {result['tv_upper_95']:.4f} at 95 % "
        f"(empirical {result['tv_empirical']:.4f} + deviation {result['eta']:.4f} + unnamed mass "
        f"{result['other_mass']:.4f})"
    )


def null_rate(law: dict[tuple[int, ...], float], n: int, trials: int, seed: int, alpha: float = ALPHA) -> dict:
    """The G test's rejection rate at `alpha` and its p-values' uniformity, on `trials` multinomial samples of n
    from the exact law itself (numpy, `seed`): the test's false-alarm rate measured, not assumed."""
    from scipy import stats

    cats = categories(law, n)
    q = expected(cats)
    q = q / q.sum()
    p = _g_p_values(np.random.default_rng(seed).multinomial(n, q, trials), n * q)
    return {
        "trials": trials,
        "rejected": int((p < alpha).sum()),
        "p_uniform_ks": float(stats.kstest(p, "uniform").pvalue),
        "histogram": np.histogram(p, bins=10, range=(0.0, 1.0))[0].tolist(),
    }


def power(
    law: dict[tuple[int, ...], float], shifted: dict[tuple[int, ...], float], n: int, trials: int, seed: int
) -> dict:
    """The share of `trials` multinomial samples of n from `shifted` (another law of the same sequences) that the
    test rejects at ALPHA, with the TV between the two laws on the categories: the power against that shift."""
    cats = categories(law, n)
    q = expected(cats)
    index = {s: i for i, s in enumerate(cats.sequences)}
    last = len(cats.sequences) - 1 if cats.other == 0 else len(cats.sequences)
    p = np.zeros(len(q))
    for s, mass in shifted.items():
        p[index.get(s, last)] += mass
    p[last] += max(0.0, 1.0 - p.sum())
    pv = _g_p_values(np.random.default_rng(seed).multinomial(n, p, trials), n * q)
    return {
        "trials": trials,
        "rejected": int((pv < ALPHA).sum()),
        "tv_coarse": round(0.5 * float(np.abs(p - q).sum()), 5),
    }


def _g_p_values(samples: np.ndarray, expected_counts: np.ndarray) -> np.ndarray:
    """The G test's p-value of each row of counts against the expected counts."""
    from scipy import stats

    return np.array([stats.power_divergence(c, expected_counts, lambda_="log-likelihood").pvalue for c in samples])
