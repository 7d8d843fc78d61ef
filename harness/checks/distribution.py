"""`distribution`: the tokens a speculative cell returns at temperature > 0 are draws from the target's
distribution under the request's sampler chain (docs/guide/sampled-speculation.md).

The statistic. Every returned token is scored under the target at its prefix (harness.engine.score: one
non-speculative decode of prompt + output in the in-process engine, whichever backend served the cell; the
chain's transforms applied as the sampler applies them; end-of-generation conditioned out). With p the token's
probability and `below` the mass of the tokens ranked before it (descending probability, ties by the lower id),
the randomised probability integral transform u = below + V·p, V ~ U(0, 1) drawn by the harness from a seed of
the cell and case, is uniform on [0, 1) under the null, and the u of successive tokens are independent
(each is uniform given its prefix: Rosenblatt's transform; Brockwell 2007 for the randomised discrete case).
The check pools the u of every distinct output of the case and tests uniformity with the one-sample
Kolmogorov-Smirnov test (`scipy.stats.kstest`, exact p-values for n ≤ 10,000 where scipy computes them).

False alarms: the test fails at p < ALPHA. A run judges at most MAX_TESTS_PER_RUN cases with it (each case of a
speculative sampled cell is one test; the default suites hold far fewer), so a clean run turns red through this
check with probability at most ALPHA · MAX_TESTS_PER_RUN = 1e-3 by construction (a union bound).

Power is a property of the sample: a verdict needs enough tokens. The default `sampling` suite's cases (32
tokens each) catch only gross departures; `suites/sampling-distribution.yaml` holds the sample that measures the
fault classes of docs/benchmarks.md (a suite of its own, run by its own CI job).
"""

import zlib

import numpy as np
from scipy import stats

from harness.checks.base import NO_OUTPUT, NOT_SPECULATIVE, CheckContext, CheckResult, not_run
from harness.suites.request import Request

ALPHA = 1e-6
"""The p-value below which the test fails."""
MAX_TESTS_PER_RUN = 1000
"""The most cases one run judges with this check (the budget behind ALPHA: ALPHA × this = 1e-3 red runs)."""
MIN_TOKENS = 16
"""Fewer scored tokens than this cannot reach ALPHA whatever they are: not run."""


def pit(scores: list[list[float]], seed: int) -> np.ndarray:
    """The randomised probability integral transforms of scored tokens ([p, below] each), V drawn from `seed`."""
    a = np.asarray(scores, dtype=np.float64).reshape(-1, 2)
    v = np.random.default_rng(seed).random(len(a))
    return np.clip(a[:, 1] + v * a[:, 0], 0.0, 1.0)


def uniformity(u: np.ndarray) -> tuple[float, float]:
    """(Kolmogorov-Smirnov statistic, p-value) of `u` against U(0, 1)."""
    test = stats.kstest(u, "uniform")
    return float(test.statistic), float(test.pvalue)


def case_seed(ctx: CheckContext) -> int:
    """The harness's own seed for the V of a case: stable across runs, different per cell and case."""
    return zlib.crc32(f"{ctx.run.suite.name}/{ctx.cell.id}/{ctx.case}".encode())


def output_distribution(ctx: CheckContext) -> CheckResult | None:
    """A speculative cell's sampled tokens are draws from the target's distribution under the request's chain."""
    sampling = ctx.case_def.sampling
    if not ctx.cell.preset.speculative:
        return not_run("distribution", NOT_SPECULATIVE)
    if sampling.greedy:
        return not_run("distribution", "the case decodes greedily: its tokens are the argmax, not draws")
    if sampling.stop:
        return not_run("distribution", "the case stops on strings: a stop cuts a draw the output does not return")
    outputs = {}
    for o in ctx.completed():
        outputs.setdefault((tuple(o.result.prompt_tokens), tuple(o.result.tokens)), o)
    if not outputs:
        return not_run("distribution", NO_OUTPUT)
    pairs = [(Request(prompt=list(o.result.prompt_tokens), sampling=sampling), o.result) for o in outputs.values()]
    with ctx.executor.token_scorer() as scorer:
        scored = scorer.score(ctx.run.suite, ctx.cell, pairs)
    why = next((s["unscorable"] for s in scored if "unscorable" in s), None)
    if why is not None:
        return not_run("distribution", why)
    return _judge(ctx, list(outputs.values()), scored)


def _judge(ctx: CheckContext, outcomes: list, scored: list[dict]) -> CheckResult:
    """The verdict on the scored outputs: a token the grammar forbids fails outright; else the KS test."""
    forbidden = [
        f"round {o.round}: token {o.result.tokens[s['impossible_at']]} at position {s['impossible_at']} "
        "is forbidden by the grammar"
        for o, s in zip(outcomes, scored, strict=True)
        if "impossible_at" in s
    ]
    scores = [row for s in scored for row in s["scores"]]
    evidence = {
        "tokens": len(scores),
        "outputs": len(outcomes),
        "alpha": ALPHA,
        "outside_support": sum(1 for p, _ in scores if p == 0.0),
    }
    if forbidden:
        return CheckResult("distribution", False, forbidden[0], evidence, failures=forbidden)
    if len(scores) < MIN_TOKENS:
        return not_run("distribution", f"{len(scores)} scored tokens (a test needs at least {MIN_TOKENS})")
    u = pit(scores, case_seed(ctx))
    statistic, p_value = uniformity(u)
    evidence.update(ks_statistic=round(statistic, 6), p_value=p_value, mean_pit=round(float(u.mean()), 6))
    if p_value >= ALPHA:
        return CheckResult("distribution", True, evidence=evidence)
    message = (
        f"the returned tokens are not draws from the target's distribution: Kolmogorov-Smirnov D = {statistic:.4f} "
        f"over {len(scores)} tokens of {len(outcomes)} outputs, p = {p_value:.2e} < {ALPHA:g} "
        f"(mean PIT {u.mean():.3f}, 0.5 expected; {evidence['outside_support']} tokens outside the chain's support)"
    )
    return CheckResult("distribution", False, message, evidence, failures=[message])
