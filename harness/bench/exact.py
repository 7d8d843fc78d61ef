"""`specharness bench exact`: the exact fixed-prefix test (harness.checks.exact_law) on the cells of a suite.

Per cell: the suite's one case repeated `draws` times with fresh seeds (harness.bench.distribution.repeated:
case seed + SEED_STRIDE·i, one request each, so the draws are independent), served with speculation; every output
of n_predict tokens is one sample of the sequence. The cell's target computes the exact law of that sequence
(harness.execute.TokenScorer.joint_law, every prefix down to MIN_EXPECTED / draws), the G test judges the counts
and the TV bound says how far from that law the build can be at 95 %. A request that fails, or returns other than
n_predict tokens, is a harness error of the cell (the sample would no longer be the fixed-length one the law is of).
"""

from dataclasses import replace
from pathlib import Path

from harness.bench.distribution import SEED_SPACE, SEED_STRIDE, fault_bias, repeated
from harness.checks import exact_law
from harness.errors import HarnessError
from harness.execute import Executor
from harness.matrix import cells
from harness.suites import Suite, load_suite

SUITE = "suites/statistical/exact/fixed-prefix.yaml"
"""The default suite: its one case, its cells."""
DRAWS = 20000
"""Requests per cell by default: a 2 % total-variation shift of the sequence's law is found (tests/test_exact_law.py
and docs/benchmarks.md measure the power)."""


def measure(
    suite_name: str,
    draws: int,
    executor: Executor,
    only: dict,
    on_cell=None,
    suites_dir: Path | None = None,
    repeat: int = 1,
    first_test: int = 0,
) -> dict:
    """{cell id: the exact test's result} for every speculative cell of the suite the narrowing `only` keeps; with
    `repeat` > 1, {cell id: `power` of that many independent tests} (each on fresh seeds, none shared between
    tests): the share that failed with its exact 95 % interval. Tests are numbered from `first_test`, and test r's
    seeds are the r-th block of `draws`: a campaign split between processes (tests 0-49 and 50-99) shares no seed."""
    base = load_suite(suite_name, suites_dir)
    if len(base.cases) != 1:
        raise HarnessError(f"{suite_name}: the exact test takes a suite of one case, not {len(base.cases)}")
    plan = [
        cell
        for cell in cells(base.matrix)  # the narrowing picks among the suite's cells (it adds none)
        if cell.spec != "none" and not any(v and getattr(cell, axis[:-1]) not in v for axis, v in only.items())
    ]
    out = {}
    for cell in plan:
        tests = []
        case = base.cases[0]
        first = case.sampling.seed if case.sampling.seed is not None else 42
        for r in range(first_test, first_test + repeat):
            seed = (first + SEED_STRIDE * draws * r) % SEED_SPACE  # test r's draws follow test r-1's: no seed shared
            # a suite of its own name per test: the executor keeps one run per (suite, cell)
            fresh = replace(
                base,
                name=f"{base.name}-t{r}" if r else base.name,
                cases=[replace(case, sampling=replace(case.sampling, seed=seed))],
            )
            sample = repeated(fresh, draws)
            tests.append(judge(sample, cell, executor))
            executor.forget(sample, cell)  # 20,000 results a test: only the verdict is kept
            if repeat > 1 and on_cell:
                on_cell(f"{cell.id} test {r + 1}/{first_test + repeat}", tests[-1])
        out[cell.id] = tests[0] if repeat == 1 else power(tests)
        if on_cell:
            on_cell(cell.id, out[cell.id])
    return out


def power(tests: list[dict]) -> dict:
    """The share of judged tests that failed (the power against what the build does, at this sample size) with its
    exact 95 % interval (scipy's binomtest), the mean TV bound, and the fault's TV where one was switched on."""
    from scipy import stats

    judged = [t for t in tests if "passed" in t]
    failed = sum(not t["passed"] for t in judged)
    row: dict = {"tests": len(judged), "failed": failed, "not_judged": len(tests) - len(judged)}
    if judged:
        ci = stats.binomtest(failed, len(judged)).proportion_ci(0.95, method="exact")
        row.update(
            rejection_rate=round(failed / len(judged), 4),
            ci_95=[round(ci.low, 4), round(ci.high, 4)],
            p_values=[t.get("p_value") for t in judged],
            message=f"{failed} of {len(judged)} tests failed ({failed / len(judged):.2f}, 95 % CI "
            f"{ci.low:.2f}-{ci.high:.2f})",
        )
        for key in ("tv_per_drafted", "tv_per_token", "tv_upper_95", "tv_empirical"):
            values = [t[key] for t in judged if key in t]
            if values:
                row[f"mean_{key}"] = round(sum(values) / len(values), 5)
    return row


def judge(suite: Suite, cell, executor: Executor) -> dict:
    """The exact test of one cell's run of the repeated case (or why it could not be made)."""
    run = executor.run(suite, cell)
    if run.unservable:  # e.g. a llama-server without --spec-draft-sampling: the check does not apply
        return {"not_run": run.unservable}
    if run.crash:  # llama.cpp aborted: a finding, no sample to judge
        return {"passed": False, "message": f"{cell.id}: llama.cpp aborted: {run.crash}"}
    if run.error:
        return {"harness_error": run.error}
    k = suite.cases[0].sampling.n_predict
    results = [o.result for o in run.outcomes if o.result is not None]
    if not results:
        return {"harness_error": "the cell served no request"}
    short = [r for r in results if not r.ok or len(r.tokens) != k]
    if short or len(results) != len(suite.cases):
        first = short[0] if short else None
        why = (first.error or f"{len(first.tokens)} tokens") if first else "requests without a result"
        return {
            "harness_error": f"{len(short) or len(suite.cases) - len(results)} of {len(suite.cases)} requests "
            f"did not return {k} tokens (first: {why})"
        }
    prompt = results[0].prompt_tokens
    if any(r.prompt_tokens != prompt for r in results):
        return {"harness_error": "the requests' prompts were tokenized differently"}
    law = executor.token_scorer().joint_law(
        suite, cell, suite.cases[0].sampling, prompt, k, exact_law.MIN_EXPECTED / len(results)
    )
    if "unscorable" in law:
        return {"not_run": law["unscorable"]}
    cats = exact_law.categories({tuple(s): q for s, q in law["leaves"]}, len(results))
    row = exact_law.test(cats, exact_law.counts(cats, [tuple(r.tokens) for r in results]))
    row["message"] = exact_law.message(row, cell.id)
    row["decodes"] = law["decodes"]
    row.update(_acceptance(run))
    row.update(fault_bias(run))
    return row


def _acceptance(run) -> dict:
    """The cell's drafted and accepted tokens (spec_stats summed over its requests)."""
    stats = [o.result.spec_stats for o in run.outcomes if o.result is not None]
    drafted = sum(s.get("draft_n", 0) for s in stats)
    accepted = sum(s.get("draft_n_accepted", 0) for s in stats)
    return {"drafted": drafted, "accepted": accepted}
