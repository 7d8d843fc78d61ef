"""`specharness bench distribution`: the `distribution` check's false-alarm rate and power, measured.

A suite's cases are repeated `runs` times with fresh seeds (case seed + SEED_STRIDE·i), so that each repetition
is an independent sample of the test the check makes on one case of one cell: the same cells, the same prompts,
the same sample size, other draws. Every cell of the suite's matrix (narrowed by backend, mode, spec and model)
serves them in one session, then the `distribution` check judges each case. On a clean build the p-values are
uniform and a test fails with probability alpha; with an engine fault switched on (`--fault`, in-process cells
only) the share of failing tests is the check's power against that fault at the suite's sample size.

`specharness bench seeded` (`measure_seeded`) repeats a suite's seeded sampled cases the same way, in the suite's own
rounds, and counts the seeded noise rate of `lossless`'s count (harness.checks.seeded.NOISE) in distinct draws: a
(cell, case, seed) once, however many rounds replay it.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy import stats

from harness.checks import evaluate_cell, seeded
from harness.execute import Executor
from harness.matrix import cells
from harness.suites import Suite, load_suite

SEED_STRIDE = 7919
"""Seed step between repetitions (a prime: the repetitions' seeds never meet another case's)."""
SEED_SPACE = 2**32
"""Seeds are uint32: a repetition's seed wraps around (SEED_STRIDE is odd, so i -> seed + SEED_STRIDE·i mod 2^32 is
one-to-one: no two of 2^32 repetitions share a seed)."""
BINS = 10
"""Histogram bins of the p-values (equal width on [0, 1])."""


def repeated(suite: Suite, runs: int, sampling: dict | None = None, rounds: list[str] | None = None) -> Suite:
    """`suite` with every case repeated `runs` times, repetition i seeded case seed + SEED_STRIDE·i mod 2^32 (named
    `<case>-r<i>`), served in `rounds` (default: the suite's first round alone); `sampling` (Sampling fields)
    replaces those fields of every case."""
    cases = []
    for i in range(runs):
        for case in suite.cases:
            seed = ((case.sampling.seed if case.sampling.seed is not None else 42) + SEED_STRIDE * i) % SEED_SPACE
            fields = {**(sampling or {}), "seed": seed}
            cases.append(replace(case, name=f"{case.name}-r{i}", sampling=replace(case.sampling, **fields)))
    return replace(suite, cases=cases, rounds=list(rounds) if rounds else [suite.rounds[0]])


def summary(p_values: list[float], tokens: list[int], alpha: float = 1e-6, ks_p: list[float] | None = None) -> dict:
    """The p-values of one cell: how many tests failed at `alpha` (the check's p-values, as its verdicts record
    them: Bonferroni-adjusted over its tests), and the histogram and uniformity of `ks_p` (each case's KS p-value of
    every token, exactly uniform on a clean build; `p_values` where not given)."""
    checked = np.asarray(p_values, dtype=float)
    failed = int((checked < alpha).sum())
    p = checked if ks_p is None else np.asarray(ks_p, dtype=float)
    counts, _ = np.histogram(p, bins=BINS, range=(0.0, 1.0))
    return {
        "tests": len(p),
        "failed": failed,
        "failed_upper_95": _upper(failed, len(p)),
        "min_p": float(checked.min()) if len(p) else math.nan,
        "histogram": counts.tolist(),
        "p_uniform_ks": float(stats.kstest(p, "uniform").pvalue) if len(p) else math.nan,
        "tokens_per_test": float(np.mean(tokens)) if tokens else 0.0,
    }


def _upper(k: int, n: int) -> float:
    """The one-sided 95 % Clopper-Pearson upper bound of a rate seen k times in n (scipy's binomtest)."""
    return float(stats.binomtest(k, n).proportion_ci(0.90, method="exact").high) if n else math.nan


def measure(
    suite_name: str,
    runs: int,
    executor: Executor,
    only: dict,
    on_cell=None,
    suites_dir: Path | None = None,
    sampling: dict | None = None,
) -> dict:
    """{cell id: summary} for every cell the narrowing `only` leaves; cells whose check did not run say why."""
    suite = repeated(load_suite(suite_name, suites_dir), runs, sampling)
    out = {}
    for cell in cells(suite.matrix, only):
        if cell.spec == "none":
            continue
        run = executor.run(suite, cell)
        verdicts = [r for _, r in evaluate_cell(run, executor, None, ["distribution"], "")]
        judged = [r for r in verdicts if r.is_verdict]
        if not judged:
            reasons = sorted({r.not_run or r.harness_error or "" for r in verdicts})
            out[cell.id] = {"not_run": "; ".join(reasons)[:300]}
        else:
            out[cell.id] = summary(
                [r.evidence.get("p_value", 0.0) for r in judged],
                [r.evidence["tokens"] for r in judged],
                ks_p=[r.evidence.get("p_ks_all", r.evidence.get("p_value", 0.0)) for r in judged],
            )
            out[cell.id]["first_failure"] = next((r.message for r in judged if not r.passed), None)
            pools = {
                json.dumps(r.evidence["pool"], sort_keys=True)
                for r in judged
                if isinstance(r.evidence.get("pool"), dict)
            }
            out[cell.id]["pools"] = [json.loads(p) for p in sorted(pools)]  # the law's pooled test over the repetitions
            out[cell.id].update(fault_bias(run))
        if on_cell:
            on_cell(cell.id, out[cell.id])
    return out


def power_table(sweep: list[dict]) -> str:
    """One line per (fault, cell) of a sweep: the share of tests that failed (the power at the cell's sample size,
    with its exact 95 % interval), the pooled tests over the repetitions (one law's independent outputs together),
    and the fault's mean total variation per drafted position and per token."""
    lines = [
        "fault | cell | tokens per test | failed / tests (power, 95 % CI) | pooled | TV per drafted | TV per token"
    ]
    for entry in sweep:
        for cell, row in entry["cells"].items():
            if "tests" not in row:
                lines.append(f"{entry['fault']} | {cell} | not run: {row.get('not_run', '')}")
                continue
            n, k = row["tests"], row["failed"]
            ci = stats.binomtest(k, n).proportion_ci(0.95, method="exact") if n else None
            power = f"{k} / {n} ({k / n:.2f}, {ci.low:.2f}-{ci.high:.2f})" if n else "0 / 0"
            pools = ", ".join(
                f"{pool['tokens']} tokens p {pool['p_value']:.3g}{' failed' if pool['p_value'] < pool['alpha'] else ''}"
                for pool in row.get("pools", [])
            )
            lines.append(
                f"{entry['fault']} | {cell} | {row.get('tokens_per_test')} | {power} | {pools or '-'} | "
                f"{row.get('tv_per_drafted', '-')} | {row.get('tv_per_token', '-')}"
            )
    return "\n".join(lines)


def fault_bias(run) -> dict:
    """Under the graded fault `over-accept=ε`: the mean total variation of a verified drafted position's law from
    the target's (the engine's `fault_tv`, harness.engine.sampler.over_accept_tv) and per returned token (drafted
    or not: the shift the pooled transforms see); {} without it."""
    stats = [o.result.spec_stats for o in run.outcomes if o.result is not None]
    positions = sum(s.get("fault_tv_n", 0) for s in stats)
    if not positions:
        return {}
    total = sum(s.get("fault_tv", 0.0) for s in stats)
    tokens = sum(len(o.result.tokens) for o in run.outcomes if o.result is not None)
    return {"tv_per_drafted": round(total / positions, 5), "tv_per_token": round(total / max(tokens, 1), 5)}


def measure_seeded(
    suite_name: str, runs: int, executor: Executor, only: dict, on_cell=None, suites_dir: Path | None = None
) -> dict:
    """The noise rate of seeded identity (harness.checks.seeded.NOISE), counted as the check counts it: per
    speculative sample-and-match cell, how many of its seeded sampled draws (the suite's cases repeated `runs` times
    with fresh seeds, served in the suite's own rounds) returned other tokens than the same request without
    speculation. A draw is one distinct (cell, case, seed) however many rounds replay it, and diverged when any
    round did (harness.checks.seeded.draws); with the totals per (backend, mode), and the requests behind them."""
    base = load_suite(suite_name, suites_dir)
    keep = [c for c in base.cases if not c.is_chat and not c.sampling.greedy and not c.sampling.random_seed]
    suite = repeated(replace(base, cases=keep), runs, rounds=base.rounds)
    plan = [c for c in cells(suite.matrix, only) if c.spec != "none" and c.preset.keeps_seeded_tokens]
    executor.expect([(suite, c) for c in plan])
    out: dict = {"cells": {}, "by_backend_mode": {}}
    for cell in plan:
        mine, reference = executor.run(suite, cell), executor.run(suite, cell.reference(spec="none"))
        found = seeded.draws(mine, reference, seeded.seeded_keys(suite, cell.model))
        row = {
            "diverged": sum(d.diverged for d in found),
            "compared": len(found),
            "requests": sum(len(d.rounds) for d in found),
            "rounds_diverged": sum(t is not None for d in found for t in d.rounds.values()),
        }
        out["cells"][cell.id] = row
        total = out["by_backend_mode"].setdefault(f"{cell.backend} {cell.mode}", dict.fromkeys(row, 0))
        for k, v in row.items():
            total[k] += v
        if on_cell:
            on_cell(cell.id, row)
    return out
