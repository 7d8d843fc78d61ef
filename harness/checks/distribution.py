"""`distribution`: the tokens a speculative cell returns at temperature > 0 are draws from the target's
distribution under the request's sampler chain (docs/guide/sampled-speculation.md).

The statistic. Every returned token is scored under the target at its prefix (harness.engine.score: one
non-speculative decode of prompt + output in the in-process engine, whichever backend served the cell; the
chain's transforms applied as the sampler applies them). With p the token's probability and `below` the mass of
the tokens ranked before it (descending probability, ties by the lower id), the randomised probability integral
transform u = below + V·p, V ~ U(0, 1) drawn by the harness from a seed of the cell and case, is uniform on [0, 1)
under the null, and the u of successive tokens are independent (each is uniform given its prefix: Rosenblatt's
transform; Brockwell 2007 for the randomised discrete case).

Independent outputs only (`independent`). The sampler of a seeded request draws from a generator seeded by the
request's seed, one uniform per token where the chain sorts its candidates, and the token it draws is the inverse
of the same ranking the transform uses: two outputs with one seed have nearly the same u position by position,
whatever their prompts, cells or models (the rounds of a case replay its seed; every cell of a suite sends a case's
seed; a sample-and-match cell returns the output without speculation). Their transforms are not independent
samples, and scoring a prefix they share twice, with two V, counts one draw twice. So a test takes ONE output per
randomness source: per seed, the first completed output in a fixed order (cells in the matrix's order, cases in the
suite's, rounds in order: never chosen by its tokens); a request with a random seed (-1) is a source of its own
(every such output counts, identical ones too: independent draws that agree are still two draws); requests without
a seed share the backend's `seed` option, one source.

End-of-generation. A request that does not ignore it stops where it draws an end-of-generation token, which it
does not return: each returned token is scored under the chain's law conditioned on "not end-of-generation"
(harness.engine.score), under which it is a draw, and the stop is a stopping time of the sequence. Counts of u in
any interval then have exactly their null mean (optional stopping of the martingale sum of 1{u ≤ x} - x), but the
length is data-dependent, so the fixed-n null distribution of the statistics holds asymptotically, not exactly.
The statistical cases remove it instead: they set `ignore_eos` (llama-server then biases every end-of-generation
token to -inf before the chain, which the scorer's chain does too), so every output has n_predict tokens and the
null is exact. Evidence counts the outputs that ended on end-of-generation (`eog_stops`).

Strata. The returned tokens are tested together (`all`) and by their place in the speculative step that emitted
them, a function of what came before the token, never of whether it was accepted: `undrafted` (a step without a
draft, the first token after the prompt among them), `drafted` (a position that had a drafted token: the draft
accepted there, or the draw after its rejection), `bonus` (the token after a wholly accepted draft). Whether a
position had a draft token is decided before it is verified (the draft's length), and the bonus position is
reached through the tokens before it, so under the null each stratum's u are uniform given their past (Doob's
optional skipping: a predictable selection of an independent uniform sequence is one); a stratum's size is random,
so its fixed-n null holds asymptotically. The residual draw is no stratum of its own: a token is a residual draw
only when its own draft was rejected, which conditions on the token (conditioned on rejection, the token follows the
residual law, not the target's). The in-process engine records each token's stratum (`token_strata`); llama-server
does not, so its outputs are tested in `all` only.

The tests. In each stratum: the one-sample Kolmogorov-Smirnov test (`scipy.stats.kstest`, exact: kstwo) and two tail
counts, the number of u in [0, TAIL) and in [1 - TAIL, 1), each an exact two-sided binomial test
(`scipy.stats.binomtest`, Binomial(n, TAIL) under the null): KS is weak where the transform's distribution moves
only near 0 or 1, the tail counts are not (`power`: at 1,536 tokens a shift of 3.9 % of the mass into the top 5 %
band is found with 80 % probability, by KS alone only one of 7.2 %). A case makes TESTS_PER_CASE = 4 strata × 3
statistics tests and fails where the smallest p-value times TESTS_PER_CASE (Bonferroni) is below ALPHA: a clean case
fails with probability at most ALPHA. The KS test can fail at any sample size (D approaches 1 as the u do 0 or 1):
every scored case is tested (`min_tokens()` = 1; its exact critical distance, kstwo at ALPHA / TESTS_PER_CASE, is
0.99999996 at 1 token, 0.818 at 10, 0.678 at 16, 0.496 at 32, 0.128 at 512, 0.0742 at 1,536: the KS test of a few
tokens finds only gross faults); a tail count only from `tail_min_tokens()` (6) tokens on, below which even all n in one
band leave p above its level (0.05^n). Why tail counts and not Anderson-Darling: a test here must resolve p-values
near 1e-7, and scipy has no Anderson-Darling test against a fully specified uniform that does (`anderson` fits
normal, exponential, logistic, Gumbel or Weibull laws; `anderson_ksamp` compares samples and floors p at 0.001
without a resampling method; `goodness_of_fit` and the resampling methods are Monte Carlo, their p no finer than
one over their draws); the binomial counts are exact at any level.

Out-of-support tokens (p = 0 under the chain: a truncation sampler cut them) fail outright, beyond a tolerance from
the logit margin: the scorer's decode computes the logits in other batches than the run did, which moves them by
numerics; a token may fall outside the support only where its logit raised by the calibrated near-tie floor of the
cell (NoiseFloor.near_tie: the largest margin between two logits that numerics is measured to move, in the cell's
mode) would bring it inside (`lift` <= floor, harness.engine.score.lift: its logit raised, the others unchanged;
that is the worst case for top-k and min-p, whose cut compares two logits, not quite for top-p, whose cut is a sum
that numerics lowering several tokens before it could also move). Such a token is reported and left out of
the transforms (its u would be 1); any other fails the case. A token the grammar forbids fails outright too.

Pooled tests. The independent outputs of every speculative cell of a run that share one law (suite, model and
sampler chain: every backend, mode and spec config) are pooled into one test per law (`pool`), the same 12 tests at
ALPHA_POOL / TESTS_PER_CASE each (the first output of each seed in the matrix's order: a later cell's output of a
seed already pooled stays out); a pooled failure fails the cases whose outputs it holds, naming the pool and its
stratum. It runs only where the pool holds an independent output beyond the case's own. A suite of shared seeds
sends one seed per case to every cell (what lossless and the seeded comparisons need), so its pools hold no output
beyond a case's (the default `sampling` job: one 32-token output per law). The default job's pools are
`sampling-pooled`'s and `sampling-close`'s (the same sizes): `seeds: per-cell` gives each cell its own seed
(harness.suites.suite.cell_seed), so each of a model's speculative cells adds an independent 160-token output:
POOL_TOKENS = 9 × 160 = 1,440 tokens a law with the vendored llama-server (its rejection-sampling cells are not
run), 12 × 160 = 1,920 with one that has `--spec-draft-sampling`. Under pytest-xdist a per-cell suite's model runs
on one worker (its cells of both backends), so a pool is the whole law's whichever worker serves it.

False alarms per run (the union bound over the tests a run makes): at most MAX_TESTS_PER_RUN cases at ALPHA and
MAX_POOLS_PER_RUN pools at ALPHA_POOL: RUN_FALSE_ALARM = 500 × 1e-6 + 50 × 1e-5 = 1e-3. The default suites
(suites/*.yaml) judge 180 cases with it (96 in `sampling`, whose 8 laws hold one seed each, 48 in
`sampling-pooled` and 36 in `sampling-close`, per-cell seeds) and test 7 pools (one a model and suite):
180 × 1e-6 + 7 × 1e-5 = 2.5e-4 per run
(tests/test_distribution_power.py recounts them).

Power (`power`, `detectable_shift`; tests/test_distribution_power.py recomputes every number here). The
alternatives (`SHIFTS`): the transform's law moved by total variation δ, mass δ moved from [1/2, 1) to [0, 1/2)
(`half`: a lenient acceptance over-weights the likely tokens, whose u are small), or into the top TAIL band from the
rest (`tail`: a residual that over-weights unlikely tokens). The smallest δ found with probability 80 % / 95 % by the
`all` stratum's three tests of one case (a lower bound on the case's power: the other strata only add failures),
simulated with POWER_SAMPLES = 4,000 samples per δ from numpy seed 61, bisection to 0.002 (`detectable_shift`):

| tokens per test | half shift 80 % / 95 % | tail shift 80 % / 95 % | where |
|---|---|---|---|
| 32 | 0.492 / 0.498 | 0.386 / 0.453 | the default job's cases; its pools hold one output |
| 512 | 0.143 / 0.158 | 0.072 / 0.083 | the statistical suite, per case |
| 1,536 | 0.084 / 0.092 | 0.039 / 0.046 | the selftest's statistical part, per case |

A pool is tested at ALPHA_POOL = 1e-5 (not 1e-6), so it finds a shift at fewer tokens (same simulation, seed 61):

| pooled tokens | half shift 80 % / 95 % | tail shift 80 % / 95 % | where |
|---|---|---|---|
| 1,440 | 0.080 / 0.090 | 0.037 / 0.045 | the default job's pools (`sampling-pooled`, vendored llama-server) |
| 1,920 | 0.070 / 0.078 | 0.033 / 0.037 | the same with a llama-server that has rejection sampling |

The KS test alone at 1e-6 (the check before the tail counts and the strata) found the half shift at 0.131 / 0.148
(512 tokens) and 0.078 / 0.086 (1,536), the tail shift only at 0.128 / 0.143 and 0.072 / 0.080: the tail counts
halve the tail shift found, the Bonferroni factor of 12 costs 8-10 % on the half shift. The PIT's shift in total
variation is at most the mean per-token total-variation shift of the token law, so a fault that moves the token law
by less than these is not found: a 2 % shift needs tens of thousands of independent tokens per test.
"""

import zlib
from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from harness.checks.base import NO_OUTPUT, NOT_SPECULATIVE, CheckContext, CheckResult, not_run
from harness.errors import HarnessError
from harness.matrix import cells
from harness.suites import case_keys
from harness.suites.request import Request
from harness.verdict.noise import NEAR_TIE

ALPHA = 1e-6
"""The Bonferroni-adjusted p-value (smallest p × TESTS_PER_CASE) below which a case fails."""
MAX_TESTS_PER_RUN = 500
"""The most cases one run judges with this check (their share of the run's budget: ALPHA × this = 5e-4)."""
ALPHA_POOL = 1e-5
"""The adjusted p-value below which a pooled law fails."""
POOL_TOKENS = 1440
"""The fewest tokens a pool of the default job holds (`sampling-pooled` with the vendored llama-server: 9 cells ×
160): a 10 % shift of the transforms, either kind, is found there with probability >= 95 % (module docstring)."""
MAX_POOLS_PER_RUN = 50
"""The most pooled laws one run tests (their share: ALPHA_POOL × this = 5e-4)."""
RUN_FALSE_ALARM = ALPHA * MAX_TESTS_PER_RUN + ALPHA_POOL * MAX_POOLS_PER_RUN
"""The probability that a clean run turns red through this check, at most (the union bound): 1e-3."""
STRATA = {
    "all": "every returned token",
    "undrafted": "tokens of steps without a draft",
    "drafted": "positions with a drafted token, accepted or redrawn",
    "bonus": "tokens after a wholly accepted draft",
}
"""The strata a case's transforms are tested in (module docstring)."""
LETTERS = {"u": "undrafted", "d": "drafted", "b": "bonus"}
"""`token_strata`'s letters (harness.engine.speculative)."""
TAIL = 0.05
"""The width of the two tail bands whose counts are tested."""
STATISTICS = ("ks", "low-tail", "high-tail")
TESTS_PER_CASE = len(STRATA) * len(STATISTICS)
"""The tests a case (and a pool) makes: every stratum × statistic, whether or not a stratum holds tokens (a fixed
count, so that the Bonferroni bound does not depend on the data)."""


def critical_distance(n: int, alpha: float = ALPHA) -> float:
    """The exact KS distance at which one of a case's tests fails at n tokens (scipy.stats.kstwo)."""
    from scipy import stats

    return float(stats.kstwo.isf(alpha / TESTS_PER_CASE, n))


def _smallest_n(reachable) -> int:
    return next(n for n in range(1, 10_000) if reachable(n))


@cache
def min_tokens() -> int:
    """The fewest scored tokens a case is tested with: the smallest n at which the KS test's most extreme distance
    (D approaching 1) reaches its level, exactly (kstwo): 1. Fewer tokens only mean a larger critical distance
    (`critical_distance`), never a test that cannot fail. (Functions, not constants: scipy.stats is imported when
    a sampled case is judged, not by every run that loads the checks.)"""
    from scipy import stats

    return _smallest_n(lambda n: stats.kstwo.sf(1.0 - 1e-12, n) < ALPHA / TESTS_PER_CASE)


@cache
def tail_min_tokens() -> int:
    """The fewest tokens a tail count is tested with: below it, all n in one band (p = TAIL^n) stay above its
    level (6)."""
    from scipy import stats

    return _smallest_n(lambda n: stats.binomtest(n, n, TAIL).pvalue < ALPHA / TESTS_PER_CASE)


def pit(scores: list[list[float]], seed: int) -> np.ndarray:
    """The randomised probability integral transforms of scored tokens ([p, below] each), V drawn from `seed`."""
    a = np.asarray(scores, dtype=np.float64).reshape(-1, 2)
    v = np.random.default_rng(seed).random(len(a))
    return np.clip(a[:, 1] + v * a[:, 0], 0.0, 1.0)


def uniformity(u: np.ndarray) -> tuple[float, float]:
    """(Kolmogorov-Smirnov statistic, p-value) of `u` against U(0, 1)."""
    from scipy import stats

    test = stats.kstest(u, "uniform")
    return float(test.statistic), float(test.pvalue)


def tail_test(u: np.ndarray, side: str) -> tuple[int, float]:
    """(count, exact two-sided binomial p-value) of the u in the low ([0, TAIL)) or high ([1 - TAIL, 1]) band."""
    from scipy import stats

    k = int((u < TAIL).sum()) if side == "low" else int((u >= 1.0 - TAIL).sum())
    return k, float(stats.binomtest(k, len(u), TAIL).pvalue)


@dataclass
class Test:
    """One test of one stratum: its statistic (the KS distance, or a tail count), sample size and p-value."""

    stratum: str
    statistic: str
    n: int
    value: float
    p_value: float

    def describe(self, outputs: str = "") -> str:
        """`Kolmogorov-Smirnov D = 0.1633 over 512 tokens of 1 outputs`, or `41 of 512 tokens of 1 outputs with a
        transform in [0.95, 1) (25.6 expected)`."""
        tokens = f"{self.n} tokens{' ' + outputs if outputs else ''}"
        if self.statistic == "ks":
            return f"Kolmogorov-Smirnov D = {self.value:.4f} over {tokens}"
        band = f"[0, {TAIL:g})" if self.statistic == "low-tail" else f"[{1 - TAIL:g}, 1)"
        return f"{int(self.value)} of {tokens} with a transform in {band} ({TAIL * self.n:.1f} expected)"

    def to_dict(self) -> dict:
        return {"stratum": self.stratum, "statistic": self.statistic, "n": self.n, "value": self.value,
                "p_value": self.p_value}  # fmt: skip


def strata_of(tokens: int, letters: str | None) -> list[str | None]:
    """Each scored token's stratum (None where the backend did not record it: such a token is in `all` only)."""
    if letters is None:
        return [None] * tokens
    return [LETTERS.get(c) for c in letters[:tokens].ljust(tokens, "u")]


def tests(u: np.ndarray, strata: list[str | None]) -> list[Test]:
    """Every stratum's tests of the transforms `u` (KS from 1 token on, the tail counts from `tail_min_tokens()` on)."""
    labels = np.array([s or "" for s in strata], dtype=object)
    out = []
    for name in STRATA:
        x = u if name == "all" else u[labels == name]
        if len(x) < min_tokens():
            continue
        d, p = uniformity(x)
        out.append(Test(name, "ks", len(x), round(d, 6), p))
        if len(x) >= tail_min_tokens():
            for side in ("low", "high"):
                k, p = tail_test(x, side)
                out.append(Test(name, f"{side}-tail", len(x), k, p))
    return out


def adjusted(found: list[Test]) -> tuple[Test | None, float]:
    """The test with the smallest p-value and that p-value × TESTS_PER_CASE (at most 1): the case's p-value."""
    if not found:
        return None, 1.0
    first = min(found, key=lambda t: t.p_value)
    return first, min(1.0, first.p_value * TESTS_PER_CASE)


def case_seed(ctx: CheckContext) -> int:
    """The harness's own seed for the V of a case: stable across runs, different per cell and case."""
    return zlib.crc32(f"{ctx.run.suite.name}/{ctx.cell.id}/{ctx.case}".encode())


def source(outcome, sampling, cell, key: str) -> tuple:
    """The randomness an output was drawn with: its seed (shared by every request that sends it; a request without
    one shares the backend's `seed` option), or, for a random seed (-1), the request itself."""
    if sampling.random_seed:
        return ("request", cell.id, key, outcome.round)
    return ("seed", None if sampling.seed is None else sampling.seed & 0xFFFFFFFF)


def independent(outcomes: list, sampling, cell, key: str, seen: set | None = None) -> list:
    """One completed outcome per randomness source (`source`), the first in round order; sources in `seen` are
    skipped and the kept ones added to it."""
    seen = set() if seen is None else seen
    kept = []
    for o in sorted(outcomes, key=lambda o: o.round):
        if not o.result.ok:
            continue
        s = source(o, sampling, cell, key)
        if s not in seen:
            seen.add(s)
            kept.append(o)
    return kept


def output_distribution(ctx: CheckContext) -> CheckResult | None:
    """A speculative cell's sampled tokens are draws from the target's distribution under the request's chain."""
    sampling = ctx.case_def.sampling
    if not ctx.cell.preset.speculative:
        return not_run("distribution", NOT_SPECULATIVE)
    if sampling.greedy:
        return not_run("distribution", "the case decodes greedily: its tokens are the argmax, not draws")
    if sampling.stop:
        return not_run("distribution", "the case stops on strings: a stop cuts a draw the output does not return")
    outcomes = independent(ctx.completed(), sampling, ctx.cell, ctx.case)
    if not outcomes:
        return not_run("distribution", NO_OUTPUT)
    scored = _score(ctx, ctx.cell, outcomes, sampling)
    why = next((s["unscorable"] for s in scored if "unscorable" in s), None)
    if why is not None:
        return not_run("distribution", why)
    result = _judge(ctx, outcomes, scored)
    if result.not_run is None and result.passed:
        _pooled(ctx, result, outcomes)
    return result


def _score(ctx: CheckContext, cell, outcomes: list, sampling) -> list[dict]:
    pairs = [(Request(prompt=list(o.result.prompt_tokens), sampling=sampling), o.result) for o in outcomes]
    with ctx.executor.token_scorer() as scorer:
        return scorer.score(ctx.run.suite, cell, pairs)


def near_tie_floor(ctx: CheckContext) -> tuple[float, str]:
    """The cell's calibrated near-tie floor (nats) and where it came from (the default where none loads)."""
    try:
        floor = ctx.noise_floor
        return floor.near_tie, floor.source
    except (HarnessError, OSError, AttributeError, KeyError, TypeError):
        return NEAR_TIE, "default (uncalibrated)"


@dataclass
class Sample:
    """The transforms of some scored outputs, with their strata, and what was left out of them."""

    u: np.ndarray
    strata: list
    excused: list[str]
    beyond: list[str]
    eog_stops: int


def sample(outcomes: list, scored: list[dict], seed: int, floor: float, where: str = "") -> Sample:
    """The transforms of the scored outputs (V from `seed`), out-of-support tokens judged against `floor`: within it
    excused and left out, beyond it listed as failures."""
    rows, strata, excused, beyond = [], [], [], []
    for o, s in zip(outcomes, scored, strict=True):
        lifts = {int(i): float(v) for i, v in s.get("lift", [])}
        labels = strata_of(len(s["scores"]), (o.result.spec_stats or {}).get("token_strata"))
        for i, (row, label) in enumerate(zip(s["scores"], labels, strict=True)):
            if row[0] == 0.0:
                lift = lifts.get(i, float("inf"))
                line = (
                    f"{where}round {o.round}: token {o.result.tokens[i]} at position {i} is outside the chain's "
                    f"support: its logit needs +{lift:.3g} nats to enter it (near-tie floor {floor:.3g})"
                )
                (excused if lift <= floor else beyond).append(line)
                if lift <= floor:
                    continue
            rows.append(row)
            strata.append(label)
    eog = sum(1 for o in outcomes if o.result.stop_reason == "eos")
    return Sample(pit(rows, seed) if rows else np.zeros(0), strata, excused, beyond, eog)


def _judge(ctx: CheckContext, outcomes: list, scored: list[dict]) -> CheckResult:
    """The verdict on the scored outputs: a token the grammar forbids, or one outside the chain's support beyond the
    near-tie floor, fails outright; else the strata's tests."""
    forbidden = [
        f"round {o.round}: token {o.result.tokens[s['impossible_at']]} at position {s['impossible_at']} "
        "is forbidden by the grammar"
        for o, s in zip(outcomes, scored, strict=True)
        if "impossible_at" in s
    ]
    floor, floor_source = near_tie_floor(ctx)
    got = sample(outcomes, scored, case_seed(ctx), floor)
    n_scored = sum(len(s["scores"]) for s in scored)
    evidence = {
        "tokens": len(got.u),
        "outputs": len(outcomes),
        "alpha": ALPHA,
        "tests": TESTS_PER_CASE,
        "outside_support": len(got.excused) + len(got.beyond),
        "outside_support_excused": len(got.excused),
        "near_tie_floor": floor,
        "eog_stops": got.eog_stops,
    }
    if forbidden:
        return CheckResult("distribution", False, forbidden[0], evidence, failures=forbidden)
    if got.beyond:
        evidence["near_tie_source"] = floor_source
        message = (
            f"{len(got.beyond)} of {n_scored} returned tokens are outside the chain's support beyond what numerics "
            f"moves (a logit raise above the near-tie floor {floor:.3g} nats, {floor_source}); first: {got.beyond[0]}"
        )
        return CheckResult("distribution", False, message, evidence, failures=got.beyond)
    if got.excused:
        evidence["outside_support_lines"] = got.excused
    if len(got.u) < min_tokens():
        return not_run("distribution", f"{n_scored} scored tokens, none inside the chain's support to test")
    found = tests(got.u, got.strata)
    first, p_value = adjusted(found)
    by = {(t.stratum, t.statistic): t for t in found}
    ks = by[("all", "ks")]
    evidence.update(
        ks_statistic=ks.value,
        p_ks_all=ks.p_value,
        p_value=p_value,
        mean_pit=round(float(got.u.mean()), 6),
        strata={name: by[(name, "ks")].n for name in STRATA if (name, "ks") in by},
        tests_made=[t.to_dict() for t in found],
    )
    if p_value >= ALPHA:
        return CheckResult("distribution", True, evidence=evidence)
    evidence["caught_by"] = {"stratum": first.stratum, "statistic": first.statistic}
    message = failure_message(first, p_value, ALPHA, got, f"of {len(outcomes)} outputs")
    return CheckResult("distribution", False, message, evidence, failures=[message])


def failure_message(first: Test, p_value: float, alpha: float, got: Sample, outputs: str, head: str = "") -> str:
    """`the returned tokens are not draws ...`: the test that caught it, in its stratum."""
    labels = np.array([s or "" for s in got.strata], dtype=object)
    x = got.u if first.stratum == "all" else got.u[labels == first.stratum]
    what = first.describe(outputs)
    return (
        f"{head}the returned tokens are not draws from the target's distribution: {what}, p = {p_value:.2e} < "
        f"{alpha:g} (mean PIT {x.mean():.3f}, 0.5 expected; {len(got.excused)} tokens outside the chain's support "
        f"within the near-tie floor; caught in stratum {first.stratum}: {STRATA[first.stratum]}, by "
        f"{_statistic_name(first.statistic)}, p Bonferroni-adjusted over {TESTS_PER_CASE} tests)"
    )


def _statistic_name(statistic: str) -> str:
    return {"ks": "Kolmogorov-Smirnov", "low-tail": "the low-tail count", "high-tail": "the high-tail count"}[statistic]


def chainless(sampling) -> str:
    """A case's sampler chain as it enters the law it is pooled under: every field but the seed and the length."""
    return repr(replace(sampling, seed=None, n_predict=0))


def _pool_cells(ctx: CheckContext) -> list:
    """The speculative cells of the suite with this case's model that the run serves (every backend, mode, spec)."""
    suite = ctx.run.suite
    found = [
        c
        for c in (cells(suite.matrix) if suite.matrix else [])
        if c.model == ctx.cell.model and c.preset.speculative and (c == ctx.cell or ctx.executor.planned(suite, c))
    ]
    return found if ctx.cell in found else [ctx.cell, *found]


def pool(ctx: CheckContext) -> dict:
    """The pooled test of this case's law (the suite's speculative cells of its model, its cases with this chain:
    one output per randomness source, `independent`), computed once per executor and law."""
    suite = ctx.run.suite
    law = (ctx.cell.model, chainless(ctx.case_def.sampling))
    pooled = _pool_cells(ctx)
    key = (suite.name, law, tuple(c.id for c in pooled))  # a run serves its planned cells; a bench one by one
    cache = ctx.executor.__dict__.setdefault("_distribution_pools", {})
    if key in cache:
        return cache[key]
    seen: set = set()
    members, scored_all, sources, cells_used, where = [], [], set(), set(), set()
    for cell in pooled:
        try:
            run = ctx.other_run(cell)
        except HarnessError:  # a cell the harness failed to serve: the pool does without it
            continue
        if run.unservable is not None:
            continue
        for case in suite.cases:
            sampling = suite.sent_case(case, cell).sampling
            if sampling.greedy or sampling.stop or chainless(sampling) != law[1]:
                continue
            for record in case_keys(case):
                kept = independent(run.of_case(record), sampling, cell, record, seen)
                if not kept:
                    continue
                for o, s in zip(kept, _score(ctx, cell, kept, sampling), strict=True):
                    if "unscorable" not in s and "impossible_at" not in s:
                        members.append(o)
                        scored_all.append(s)
                        sources.add(source(o, sampling, cell, record))
                        cells_used.add(cell.id)
                        where.add((cell.id, record, o.round))
    seed = zlib.crc32(f"{suite.name}/pool/{law[0]}/{law[1]}".encode())
    got = sample(members, scored_all, seed, near_tie_floor(ctx)[0])
    first, p_value = adjusted(tests(got.u, got.strata) if len(got.u) else [])
    out = {
        "outputs": len(members),
        "cells": len(cells_used),
        "tokens": len(got.u),
        "p_value": p_value,
        "alpha": ALPHA_POOL,
        "sources": sources,
        "members": where,
    }
    if first is not None and p_value < ALPHA_POOL:
        head = f"{law[0]}'s outputs pooled over {len(cells_used)} cells: "
        out["message"] = failure_message(first, p_value, ALPHA_POOL, got, f"of {len(members)} outputs", head)
        out["caught_by"] = {"stratum": first.stratum, "statistic": first.statistic}
    cache[key] = out
    return out


def _pooled(ctx: CheckContext, result: CheckResult, outcomes: list) -> None:
    """Add the law's pooled test to a passing case's verdict (failing it where the pool fails), where the case's
    outputs are in the pool and the pool holds an independent output beyond them."""
    got = pool(ctx)
    mine = {source(o, ctx.case_def.sampling, ctx.cell, ctx.case) for o in outcomes}
    if not got["sources"] - mine:
        result.evidence["pool"] = "no independent output beyond the case's own"
        return
    if not {(ctx.cell.id, ctx.case, o.round) for o in outcomes} & got["members"]:
        result.evidence["pool"] = "the case's seeds are pooled from another cell's outputs"
        return
    result.evidence["pool"] = {k: got[k] for k in ("outputs", "cells", "tokens", "p_value", "alpha")}
    if "message" in got:
        result.passed = False
        result.message = got["message"]
        result.failures = [got["message"]]
        result.evidence["pool"]["caught_by"] = got["caught_by"]


# Power: what a case's (or a pool's) `all` stratum finds, by simulation (the module docstring's numbers).
SHIFTS = ("half", "tail")
"""The alternatives `power` measures: mass δ moved from [1/2, 1) to [0, 1/2), or into [1 - TAIL, 1) from the rest."""
POWER_SEED = 61
POWER_SAMPLES = 4000


@cache
def tail_rejects(n: int, alpha: float = ALPHA) -> np.ndarray:
    """Whether each count 0..n of one tail band fails its test at n tokens (scipy.stats.binomtest, as `tail_test`)."""
    from scipy import stats

    level = alpha / TESTS_PER_CASE
    return np.array([stats.binomtest(k, n, TAIL).pvalue < level for k in range(n + 1)])


def ks_distances(u: np.ndarray) -> np.ndarray:
    """The Kolmogorov-Smirnov distance of each row of `u` against U(0, 1) (kstest's statistic, row by row)."""
    s = np.sort(u, axis=1)
    n = s.shape[1]
    i = np.arange(1, n + 1)
    return np.maximum((i / n - s).max(axis=1), (s - (i - 1) / n).max(axis=1))


def shifted(shift: str, delta: float, base: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Transforms whose law is U(0, 1) moved by total variation `delta` (`SHIFTS`), from fixed uniforms `base` (the
    same for every delta: the power is then monotone in it)."""
    choose, where = base
    if shift == "half":
        return np.where(choose < 0.5 + delta, where / 2, 0.5 + where / 2)
    return np.where(choose < TAIL + delta, 1 - TAIL + TAIL * where, (1 - TAIL) * where)


def power(n: int, shift: str, delta: float, alpha: float = ALPHA, samples: int = POWER_SAMPLES,
          seed: int = POWER_SEED) -> float:  # fmt: skip
    """The probability that the `all` stratum's three tests of n tokens fail (Bonferroni over TESTS_PER_CASE, at
    `alpha`) on transforms moved by `delta` (`shifted`), simulated with `samples` samples from numpy seed `seed`."""
    rng = np.random.default_rng(seed)
    base = (rng.random((samples, n)), rng.random((samples, n)))
    return _power(n, shift, delta, alpha, base)


def _power(n: int, shift: str, delta: float, alpha: float, base) -> float:
    from scipy import stats

    u = shifted(shift, delta, base)
    ks = ks_distances(u) >= stats.kstwo.isf(alpha / TESTS_PER_CASE, n)
    rejects = tail_rejects(n, alpha)
    low, high = rejects[(u < TAIL).sum(axis=1)], rejects[(u >= 1 - TAIL).sum(axis=1)]
    return float((ks | low | high).mean())


def detectable_shift(n: int, shift: str, target: float, alpha: float = ALPHA, samples: int = POWER_SAMPLES,
                     seed: int = POWER_SEED, tolerance: float = 0.002) -> float | None:  # fmt: skip
    """The smallest total-variation shift (`SHIFTS`) that n tokens find with probability `target` (bisection to
    `tolerance` over the largest shift there is: 1/2 for `half`, 1 - TAIL for `tail`); None where even that is
    found less often."""
    rng = np.random.default_rng(seed)
    base = (rng.random((samples, n)), rng.random((samples, n)))
    low, high = 0.0, 0.5 if shift == "half" else 1 - TAIL
    if _power(n, shift, high, alpha, base) < target:
        return None
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (low, mid) if _power(n, shift, mid, alpha, base) >= target else (mid, high)
    return round(high, 3)
