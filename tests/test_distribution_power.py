"""The `distribution` check's stated error rates (harness.checks.distribution's docstring), recomputed: the exact
critical distances and smallest samples, the run's false-alarm budget, and the power table simulated from its seed."""

from pathlib import Path

import pytest
from scipy import stats

import harness.checks.distribution as distribution
from harness.matrix import cells, spec_preset
from harness.suites import case_keys, load_suite

ROOT = Path(__file__).resolve().parent.parent


def default_judged() -> tuple[dict[str, int], dict[tuple, dict]]:
    """For every suite in suites/*.yaml that runs `distribution`: the case records it judges (speculative cells ×
    sampled case records without stop strings), and each law's randomness sources (seeds as each cell sends them; a
    random seed's request) with the tokens each adds to its pool when the vendored llama-server serves the run (it
    has no --spec-draft-sampling: its rejection-sampling cells are not run; the first cell of a source counts)."""
    judged: dict[str, int] = {}
    laws: dict[tuple, dict] = {}
    for path in sorted((ROOT / "suites").glob("*.yaml")):
        if path.stem == "known-failures":
            continue
        suite = load_suite(path.stem)
        if "distribution" not in suite.checks or not suite.matrix:
            continue
        for cell in cells(suite.matrix):
            if not spec_preset(cell.spec).speculative:
                continue
            for case in suite.cases:
                sampling = suite.sent_case(case, cell).sampling
                if sampling.greedy or sampling.stop:
                    continue
                judged[suite.name] = judged.get(suite.name, 0) + len(case_keys(case))
                law = laws.setdefault((suite.name, cell.model, distribution.chainless(sampling)), {})
                source = ("request", cell.id, case.name) if sampling.random_seed else ("seed", sampling.seed)
                served = not (cell.backend == "server" and "probabilistic" in cell.spec)
                if source not in law or not law[source]:
                    law[source] = sampling.n_predict if served else 0
    return judged, laws


POOLED_SUITES = ("sampling-pooled", "sampling-close")
"""The default suites whose seeds are per cell: their laws' pools are what the default job's pooled test adds up."""


def test_the_false_alarm_budget_of_a_run_is_the_union_over_its_cases_and_pools():
    assert distribution.TESTS_PER_CASE == 12  # 4 strata x (KS, low tail, high tail)
    assert distribution.ALPHA * distribution.MAX_TESTS_PER_RUN == pytest.approx(5e-4)
    assert distribution.ALPHA_POOL * distribution.MAX_POOLS_PER_RUN == pytest.approx(5e-4)
    assert distribution.RUN_FALSE_ALARM == pytest.approx(1e-3)
    # the default suites: 96 cases in `sampling`, whose 8 laws hold one seed each (no pool beyond a case's own), 48
    # in `sampling-pooled`, whose 4 laws (one a model) hold 12 seeds each, 36 in `sampling-close`, 3 laws of 12: 7 pools
    judged, laws = default_judged()
    assert judged == {"sampling": 96, "sampling-pooled": 48, "sampling-close": 36} and len(laws) == 15
    pools = [sources for (suite, *_), sources in laws.items() if len(sources) > 1]
    assert all(len(sources) == 1 for (suite, *_), sources in laws.items() if suite not in POOLED_SUITES)
    assert len(pools) == 7 and all(len(sources) == 12 for sources in pools)
    assert sum(judged.values()) <= distribution.MAX_TESTS_PER_RUN and len(laws) <= distribution.MAX_POOLS_PER_RUN
    false_alarm = sum(judged.values()) * distribution.ALPHA + len(pools) * distribution.ALPHA_POOL
    assert false_alarm == pytest.approx(2.5e-4)


def test_the_default_jobs_pools_find_a_ten_per_cent_shift_with_power_95_per_cent():
    """Every pool of the default job holds at least POOL_TOKENS tokens with the vendored llama-server (9 cells ×
    160 a law), and at that size the pooled test (ALPHA_POOL) finds a 10 % total-variation shift of the transforms,
    towards the likely tokens or into the top tail, with probability >= 95 % (simulated as the power table is)."""
    _, laws = default_judged()
    pooled = [sum(sources.values()) for (suite, *_), sources in laws.items() if suite in POOLED_SUITES]
    assert pooled and min(pooled) == distribution.POOL_TOKENS == 1440
    for shift in ("half", "tail"):
        found = distribution.detectable_shift(distribution.POOL_TOKENS, shift, 0.95, alpha=distribution.ALPHA_POOL)
        assert found is not None and found <= 0.10, (shift, found)


def test_every_case_is_tested_and_the_critical_distances_are_kstwos():
    """No sample is too small for the KS test to fail (D can approach 1): min_tokens() is 1; the critical distances
    quoted in the docstring are kstwo's at ALPHA / 12; a tail count needs 6 tokens (0.05^5 > 1e-6 / 12)."""
    assert distribution.min_tokens() == 1
    assert distribution.tail_min_tokens() == 6
    assert stats.binomtest(5, 5, distribution.TAIL).pvalue > distribution.ALPHA / 12
    quoted = {1: 0.99999996, 10: 0.818, 16: 0.678, 32: 0.496, 512: 0.128, 1536: 0.0742}
    for n, d in quoted.items():
        assert distribution.critical_distance(n) == pytest.approx(d, abs=5e-4 if n > 1 else 1e-8), n


def test_the_vectorised_ks_distance_is_scipys():
    import numpy as np

    u = np.random.default_rng(0).random((5, 40))
    assert distribution.ks_distances(u) == pytest.approx([stats.kstest(x, "uniform").statistic for x in u])


@pytest.mark.parametrize(
    ("n", "half", "tail"),
    [
        (32, (0.492, 0.498), (0.386, 0.453)),
        (512, (0.143, 0.158), (0.072, 0.083)),
        (1536, (0.084, 0.092), (0.039, 0.046)),
    ],
)
def test_the_power_table_of_the_docstring(n, half, tail):
    """The smallest total-variation shift found with probability 80 % / 95 % (4,000 samples, numpy seed 61)."""
    assert tuple(distribution.detectable_shift(n, "half", t) for t in (0.8, 0.95)) == pytest.approx(half, abs=1e-9)
    assert tuple(distribution.detectable_shift(n, "tail", t) for t in (0.8, 0.95)) == pytest.approx(tail, abs=1e-9)


def test_a_clean_sample_fails_about_never_and_the_power_grows_with_the_shift():
    assert distribution.power(512, "half", 0.0, samples=2000) == 0.0
    assert distribution.power(512, "half", 0.05) < distribution.power(512, "half", 0.15)


def _ks_alone(n: int, shift: str, target: float) -> float:
    """The check before issue 61: KS of every token at 1e-6, no tail counts, no Bonferroni (same samples)."""
    import numpy as np

    rng = np.random.default_rng(distribution.POWER_SEED)
    base = (rng.random((distribution.POWER_SAMPLES, n)), rng.random((distribution.POWER_SAMPLES, n)))
    critical = stats.kstwo.isf(1e-6, n)

    def found(delta: float) -> float:
        return float((distribution.ks_distances(distribution.shifted(shift, delta, base)) >= critical).mean())

    low, high = 0.0, 0.5 if shift == "half" else 1 - distribution.TAIL
    while high - low > 0.002:
        mid = (low + high) / 2
        low, high = (low, mid) if found(mid) >= target else (mid, high)
    return round(high, 3)


@pytest.mark.parametrize(
    ("n", "half", "tail"), [(512, (0.131, 0.148), (0.128, 0.143)), (1536, (0.078, 0.086), (0.072, 0.080))]
)
def test_what_the_ks_test_alone_found(n, half, tail):
    """The docstring's comparison: the tail counts halve the tail shift found, the factor 12 costs 8-10 % on the
    half shift."""
    assert tuple(_ks_alone(n, "half", t) for t in (0.8, 0.95)) == pytest.approx(half, abs=1e-9)
    assert tuple(_ks_alone(n, "tail", t) for t in (0.8, 0.95)) == pytest.approx(tail, abs=1e-9)
