"""Seeded identity of sampled speculative output, judged by counting (docs/guide/sampled-speculation.md).

Where verification is sample-and-match (every drafter at 0c1e570; b11434 without `--spec-draft-sampling
probabilistic`), a seeded sampled request returns the non-speculative request's tokens, except where numerical
noise in the verification batch's logits moves a draw across a boundary. The in-process engine proves each
divergence with its logits (`lossless`: identical logits at the divergence fail); llama-server gives no logits
of verified tokens, so one divergence proves nothing there, but many do: a build whose sampled verification is
wrong diverges in a large share of its seeded sampled draws.

The count. A divergence that `lossless` cannot prove is judged with the seeded sampled draws of its group: the
speculative sample-and-match cells of the same suite and backend the run serves (every model, mode and spec config).
A draw is one distinct (cell, case record, seed): its requests, one per round, each with the non-speculative round
0's prompt, against that cell's tokens without speculation (round 0). Rounds that replay a seed count once, and a
draw diverged when any of its rounds did: the rounds of one seed are not independent samples (a `seq` round
replays the same batches, so a noise divergence comes back in every round; counted per request, one divergence
was a correlated pair, and the binomial test below would assume independence it does not have). Two cases with
other seeds (or the same case in another cell) are two draws. With k of n draws diverged, the group fails when
P(X ≥ k) < ALPHA for X ~ Binomial(n, r), r the one-sided 95 % upper bound of the noise rate (`noise_bound`:
measured on clean builds in distinct draws, NOISE, per backend and mode; the group takes its cells' largest).

Error rates (`false_alarm`, `run_false_alarm`, `detectable_rate`; tests/test_seeded_count.py recomputes each from
these constants). At the documented bound r = 1.855 % (0 of 160), a clean group fails with probability at most
7.4e-5 over every group size up to MAX_GROUP_DRAWS = 24 draws, the largest group the default suites make (`sampling`
on one backend: 12 sample-and-match cells × 2 seeded sampled cases; its rounds replay them, 48 requests); the
exact binomial tail P(X ≥ k*) at k* the smallest count the test fails, scipy.stats.binom: 6.95e-5 at 24 draws (k* =
5), the worst 7.40e-5 at 13 draws (k* = 4). A run judges at most MAX_GROUPS_PER_RUN = 10 groups, so a clean run
turns red through this rule with probability at most 7.4e-4 (the union bound: 10 × 7.4e-5; the default suites' 4
groups, 24 and 4 draws on each backend, 1.9e-4); counted per request, as before, the 48-request group alone failed
a clean run with probability 9.3e-4. r's own 5 % uncertainty is on top of that. Power: at 24 draws the count
detects a divergence rate of 26.4 % with 80 % probability (the smallest such rate).
"""

from dataclasses import dataclass, field

from harness.checks.base import CheckContext
from harness.matrix import Cell, cells
from harness.result.cellrun import CellRun
from harness.suites import Suite, case_keys

ALPHA = 1e-4
"""The group's binomial p-value below which its count fails."""
MAX_GROUPS_PER_RUN = 10
"""Groups (suite, backend) with seeded sampled draws a run judges at most (the default suites hold 4: sampling and
probs, on both backends)."""
MAX_GROUP_DRAWS = 24
"""The largest group, in distinct draws, the default suites make: `sampling` on one backend (12 sample-and-match
cells × 2 seeded sampled cases; probs makes 4). tests/test_distribution.py recounts it from suites/*.yaml."""
RUN_FALSE_ALARM = 1e-3
"""What a clean run may turn red through the count with, at most (issue 59's acceptance)."""
POWER = 0.8
"""The power `detectable_rate` is stated at."""

NOISE = {
    # (backend, mode): (distinct seeded sampled draws that diverged, of how many distinct draws), measured on clean
    # builds by `specharness bench seeded` (docs/benchmarks.md, "Seeded identity: the noise rate"): 2 cases × 20
    # fresh seeds × 4 sample-and-match cells, each (cell, case, seed) once. Measured on one 2-core CPU (AMD EPYC,
    # vendored 0c1e570): another device's numerics may diverge more; the calibration pass measures the rate on
    # each device it calibrates (harness.calibration.seeded), and that rate replaces these (`measured_noise`).
    ("server", "seq"): (0, 160),
    ("server", "par"): (0, 160),
    ("server", "no-kv-unified"): (0, 160),
    ("inproc", "seq"): (0, 160),
    ("inproc", "par"): (0, 160),
    ("inproc", "no-kv-unified"): (0, 160),
}
UNMEASURED = (0, 60)
"""What a (backend, mode) NOISE lacks is taken to be: a wide bound (4.9 %), so that an unmeasured place cries wolf
less, not more (and is caught less: a sample-and-match bug then needs more divergences to fail)."""


def noise_bound(backend: str, mode: str, measured: tuple[int, int] | None = None) -> float:
    """The one-sided 95 % Clopper-Pearson upper bound of the seeded noise rate at (backend, mode), per distinct
    draw: from `measured` (diverged, distinct draws: a rate measured on the device and build being judged) when
    given, else the committed NOISE, else UNMEASURED. The one place a rate enters the count."""
    from scipy import stats

    k, n = measured if measured is not None else NOISE.get((backend, mode), UNMEASURED)
    return float(stats.binomtest(k, n).proportion_ci(0.90, method="exact").high)


def measured_noise(ctx: CheckContext, cell: Cell) -> tuple[int, int] | None:
    """The seeded noise measured for `cell`'s model on the device and build the run judges, as (diverged, distinct
    draws) in `cell.mode`: the calibration pass measures it (harness.calibration.seeded) into the calibration file
    the cell is judged with; None where that file holds none (a committed file measured before, or none: NOISE's
    committed rate applies)."""
    return ctx.calibration(cell).seeded.get(cell.mode)


def threshold(n: int, rate: float, alpha: float = ALPHA) -> int | None:
    """The smallest count of n draws the test fails (P(X ≥ k) < alpha, X ~ Binomial(n, rate)); None if none can."""
    from scipy import stats

    return next((k for k in range(n + 1) if stats.binom.sf(k - 1, n, rate) < alpha), None)


def false_alarm(n: int, rate: float, alpha: float = ALPHA) -> float:
    """The exact probability that a clean group of n draws, each diverging with probability `rate`, fails."""
    from scipy import stats

    k = threshold(n, rate, alpha)
    return float(stats.binom.sf(k - 1, n, rate)) if k is not None else 0.0


def worst_false_alarm(rate: float, max_draws: int = MAX_GROUP_DRAWS, alpha: float = ALPHA) -> tuple[float, int]:
    """The largest `false_alarm` over group sizes 1..max_draws (it is not monotone in n), and that size."""
    return max((false_alarm(n, rate, alpha), n) for n in range(1, max_draws + 1))


def run_false_alarm(rate: float, max_draws: int = MAX_GROUP_DRAWS, groups: int = MAX_GROUPS_PER_RUN) -> float:
    """The probability that a clean run turns red through the count, at most: the union over its groups."""
    return groups * worst_false_alarm(rate, max_draws)[0]


def detectable_rate(n: int, rate: float, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest divergence rate per draw a group of n draws fails on with probability `power`."""
    from scipy import optimize, stats

    k = threshold(n, rate, alpha)
    if k is None:
        return 1.0
    return float(optimize.brentq(lambda q: stats.binom.sf(k - 1, n, q) - power, rate, 1.0, xtol=1e-9))


@dataclass
class Draw:
    """One seeded sampled draw: a (cell, case record, seed), and its rounds compared (every one with the
    non-speculative round 0's prompt): round → the token it diverged at, or None where it matched."""

    cell: str
    key: str
    seed: int | None
    rounds: dict[int, int | None] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        """Whether any of its rounds diverged (the draw counts once either way)."""
        return any(at is not None for at in self.rounds.values())

    def line(self) -> str:
        at = {r: t for r, t in self.rounds.items() if t is not None}
        where = ", ".join(f"round {r} at token {t}" for r, t in sorted(at.items()))
        return f"{self.cell} {self.key} seed {self.seed}: diverged in {len(at)} of {len(self.rounds)} rounds ({where})"


def seeded_keys(suite: Suite, model: str) -> dict[str, int | None]:
    """The record names of `suite`'s seeded sampled requests (temperature > 0, a fixed seed) as `model`'s cells run
    them, with their seed (None: the serve config's, the same in every round)."""
    out = {}
    for case in suite.cases:
        sampling = suite.cell_case(case, model).sampling
        if not sampling.greedy and not sampling.random_seed:
            out.update(dict.fromkeys(case_keys(case), sampling.seed))
    return out


def draws(mine: CellRun, reference: CellRun, keys: dict[str, int | None]) -> list[Draw]:
    """The seeded sampled draws of one speculative cell against its non-speculative cell: per record name in `keys`
    (→ its seed), the rounds served whose prompt is the reference round 0's, each against its tokens."""
    out = []
    for key, seed in keys.items():
        b = next((o.result for o in reference.of_case(key) if o.round == 0 and o.result.ok), None)
        if b is None:
            continue
        draw = Draw(mine.cell.id, key, seed)
        for o in mine.of_case(key):
            a = o.result
            if a.ok and a.prompt_tokens == b.prompt_tokens:
                draw.rounds[o.round] = None if a.tokens == b.tokens else first_difference(a.tokens, b.tokens)
        if draw.rounds:
            out.append(draw)
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def seeded_case(ctx: CheckContext, key: str) -> bool:
    """Whether record `key` of the suite is a seeded sampled request (temperature > 0, a fixed seed)."""
    return key in seeded_keys(ctx.run.suite, ctx.cell.model)


def group_cells(ctx: CheckContext) -> list:
    """The group of a cell: the speculative cells of its suite and backend the run serves (every model, mode and spec
    config), the cell itself included (group_count leaves out those that verify by rejection sampling)."""
    suite = ctx.run.suite
    group = [
        c
        for c in (cells(suite.matrix) if suite.matrix else [])
        if c.backend == ctx.cell.backend and c.preset.speculative and (c == ctx.cell or ctx.executor.planned(suite, c))
    ]
    return group if ctx.cell in group else [ctx.cell, *group]


def group_draws(ctx: CheckContext) -> tuple[list[Draw], list[Cell]]:
    """The group's seeded sampled draws (module docstring: each distinct (cell, case, seed) once) and the cells
    judged (those that keep seeded tokens and were served)."""
    suite = ctx.run.suite
    found, judged = [], []
    for cell in group_cells(ctx):
        mine = ctx.other_run(cell)
        if not mine.keeps_seeded_tokens or mine.unservable is not None:  # rejection sampling; or never served
            continue
        judged.append(cell)
        found += draws(mine, ctx.other_run(cell.reference(spec="none")), seeded_keys(suite, cell.model))
    return found, judged


def group_count(ctx: CheckContext) -> tuple[int, int, list, list[str]]:
    """(draws diverged, draws compared, the group's cells compared, one line per diverged draw) over the group's
    seeded sampled draws: each distinct (cell, case, seed) counts once however many rounds replayed it, and
    diverged when any of them did (rounds replaying a seed are correlated, not independent samples)."""
    found, judged = group_draws(ctx)
    diverged = [d for d in found if d.diverged]
    return len(diverged), len(found), judged, [d.line() for d in diverged]


REFUTED = 0.05
"""A device's measured seeded count refutes the committed rate when it is that unlikely under the committed rate's
upper bound (binomial tail)."""


def device_counts(backend: str, mode: str, measured: tuple[int, int] | None) -> tuple[tuple[int, int], str]:
    """The (diverged, draws) a (backend, mode) is judged with on this device, and where they came from. The
    calibration pass measures a device's own count (`measured_noise`; few draws, to keep calibration short:
    harness.calibration.seeded). Where it is consistent with the committed count (P(X >= k) >= REFUTED at the
    committed rate's upper bound) both are pooled: the same noise, measured more; where it refutes it (a GPU whose
    kernels flip seeded draws far more often), the device's count alone applies."""
    from scipy import stats

    committed = NOISE.get((backend, mode), UNMEASURED)
    if measured is None:
        return committed, "committed (NOISE)"
    k, n = measured
    p = float(stats.binom.sf(k - 1, n, noise_bound(backend, mode, committed))) if k else 1.0
    if p >= REFUTED:
        pooled = (committed[0] + k, committed[1] + n)
        return pooled, f"committed and measured on this device ({k} of {n}), pooled"
    return (
        k,
        n,
    ), f"measured on this device (the committed {committed[0]} of {committed[1]} does not hold: p = {p:.2g})"


def group_rate(ctx: CheckContext, group: list[Cell]) -> tuple[float, str]:
    """The noise rate bound the group is judged at: the largest of its cells' (`noise_bound` of the counts
    `device_counts` takes for its backend and mode on this device), and where that rate came from."""
    rates = []
    for c in group or [ctx.cell]:
        counts, where = device_counts(c.backend, c.mode, measured_noise(ctx, c))
        rates.append((noise_bound(c.backend, c.mode, counts), f"{counts[0]} of {counts[1]} draws, {where}"))
    return max(rates)


def judge(ctx: CheckContext) -> tuple[bool, str, dict]:
    """The group's count against the noise rate: (passed, message, evidence)."""
    from scipy import stats

    found, group = group_draws(ctx)
    lines = [d.line() for d in found if d.diverged]
    diverged, compared = len(lines), len(found)
    rate, rate_from = group_rate(ctx, group)
    p_value = float(stats.binom.sf(diverged - 1, compared, rate)) if compared else 1.0
    evidence = {
        "group_diverged": diverged,
        "group_compared": compared,
        "group_requests": sum(len(d.rounds) for d in found),
        "group_cells": len(group),
        "noise_rate_bound": round(rate, 6),
        "noise_rate_from": rate_from,
        "group_p_value": p_value,
        "alpha": ALPHA,
    }
    what = (
        f"{diverged} of {compared} seeded sampled draws (distinct cell, case and seed; rounds replaying a seed count "
        f"once) of {ctx.run.suite.name}'s {len(group)} speculative {ctx.cell.backend} cells diverged from the "
        "non-speculative output"
    )
    if p_value >= ALPHA:
        return True, f"{what}: within the measured noise (rate <= {rate:.4f}, p = {p_value:.3g})", evidence
    evidence["group_divergences"] = lines
    return False, f"{what}: the measured noise rate (<= {rate:.4f}) makes that p = {p_value:.2e} < {ALPHA:g}", evidence
