"""Seeded identity of sampled speculative output, judged by counting (docs/guide/sampled-speculation.md).

Where verification is sample-and-match (every drafter at 0c1e570; b11434 without `--spec-draft-sampling
probabilistic`), a seeded sampled request returns the non-speculative request's tokens, except where numerical
noise in the verification batch's logits moves a draw across a boundary. The in-process engine proves each
divergence with its logits (`lossless`: identical logits at the divergence fail); llama-server gives no logits
of verified tokens, so one divergence proves nothing there, but many do: a build whose sampled verification is
wrong diverges in a large share of its seeded sampled requests.

The count. A divergence that `lossless` cannot prove is judged with the seeded sampled requests of its group: the
speculative sample-and-match cells of the same suite and backend the run serves (every model, mode and spec config),
each request's tokens (every round) against its own cell's without speculation (round 0). With k diverged of n, the
group fails when P(X ≥ k) < ALPHA for X ~ Binomial(n, r), r the noise rate's one-sided 95 % upper bound measured on
clean builds (NOISE, per backend and mode; the group takes its modes' largest). A default run holds at most
MAX_GROUPS_PER_RUN such groups, so a clean run turns red through this rule with probability at most
ALPHA · MAX_GROUPS_PER_RUN = 1e-3 (a union bound; r's own 5 % uncertainty is on top of that).
"""

from scipy import stats

from harness.checks.base import CheckContext
from harness.matrix import cells, spec_preset
from harness.suites import case_keys

ALPHA = 1e-4
"""The group's binomial p-value below which its count fails."""
MAX_GROUPS_PER_RUN = 10
"""Groups (suite, backend) with seeded sampled requests a run judges at most (the default suites hold 4: sampling and
probs, on both backends)."""

NOISE = {
    # (backend, mode): (seeded sampled requests that diverged, of how many), measured on clean builds by
    # `specharness bench seeded` (docs/benchmarks.md, "Seeded identity: the noise rate")
    ("server", "seq"): (0, 160),
    ("server", "par"): (0, 160),
    ("server", "no-kv-unified"): (0, 160),
    ("inproc", "seq"): (0, 160),
    ("inproc", "par"): (0, 160),
    ("inproc", "no-kv-unified"): (0, 160),
}
UNMEASURED = (0, 60)
"""What a (backend, mode) NOISE lacks is taken to be: a wide bound (5 %), so that an unmeasured place cries wolf
less, not more."""


def noise_bound(backend: str, mode: str) -> float:
    """The one-sided 95 % Clopper-Pearson upper bound of the noise rate measured at (backend, mode)."""
    k, n = NOISE.get((backend, mode), UNMEASURED)
    return float(stats.binomtest(k, n).proportion_ci(0.90, method="exact").high)


def seeded_case(ctx: CheckContext, key: str) -> bool:
    """Whether record `key` of the suite is a seeded sampled request (temperature > 0, a fixed seed)."""
    case = next(c for c in ctx.run.suite.cases if key in case_keys(c))
    sampling = ctx.run.suite.cell_case(case, ctx.cell.model).sampling
    return not sampling.greedy and not sampling.random_seed


def group_cells(ctx: CheckContext) -> list:
    """The group of a cell: the speculative cells of its suite and backend the run serves (every model, mode and spec
    config), the cell itself included (group_count leaves out those that verify by rejection sampling)."""
    suite = ctx.run.suite
    group = [
        c
        for c in (cells(suite.matrix) if suite.matrix else [])
        if c.backend == ctx.cell.backend
        and spec_preset(c.spec).speculative
        and (c == ctx.cell or ctx.executor.planned(suite, c))
    ]
    return group if ctx.cell in group else [ctx.cell, *group]


def group_count(ctx: CheckContext) -> tuple[int, int, list, list[str]]:
    """(diverged, compared, the group's cells compared, one line per divergence) over the group's seeded sampled
    requests, every round of each against its own non-speculative cell's round 0 (as `lossless` compares)."""
    suite = ctx.run.suite
    keys = [k for c in suite.cases for k in case_keys(c) if seeded_case(ctx, k)]
    diverged, compared, lines, judged = 0, 0, [], []
    for cell in group_cells(ctx):
        mine, reference = ctx.other_run(cell), ctx.other_run(cell.reference(spec="none"))
        if not mine.keeps_seeded_tokens or mine.unservable is not None:  # rejection sampling; or never served
            continue
        judged.append(cell)
        for key in keys:
            b = next((o.result for o in reference.of_case(key) if o.round == 0 and o.result.ok), None)
            for o in mine.of_case(key):
                a = o.result
                if b is None or not a.ok or a.prompt_tokens != b.prompt_tokens:
                    continue
                compared += 1
                if a.tokens != b.tokens:
                    diverged += 1
                    at = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), None)
                    at = min(len(a.tokens), len(b.tokens)) if at is None else at
                    lines.append(f"{cell.id} {key} round {o.round}: diverged at token {at}")
    return diverged, compared, judged, lines


def judge(ctx: CheckContext) -> tuple[bool, str, dict]:
    """The group's count against the noise rate: (passed, message, evidence)."""
    diverged, compared, group, lines = group_count(ctx)
    modes = sorted({c.mode for c in group}) or [ctx.cell.mode]
    rate = max(noise_bound(ctx.cell.backend, m) for m in modes)
    p_value = float(stats.binom.sf(diverged - 1, compared, rate)) if compared else 1.0
    evidence = {
        "group_diverged": diverged,
        "group_compared": compared,
        "group_cells": len(group),
        "noise_rate_bound": round(rate, 6),
        "group_p_value": p_value,
        "alpha": ALPHA,
    }
    what = (
        f"{diverged} of {compared} seeded sampled requests of {ctx.run.suite.name}'s {len(group)} speculative "
        f"{ctx.cell.backend} cells diverged from the non-speculative output"
    )
    if p_value >= ALPHA:
        return True, f"{what}: within the measured noise (rate <= {rate:.4f}, p = {p_value:.3g})", evidence
    evidence["group_divergences"] = lines
    return False, f"{what}: the measured noise rate (<= {rate:.4f}) makes that p = {p_value:.2e} < {ALPHA:g}", evidence
