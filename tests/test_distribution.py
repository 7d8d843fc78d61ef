"""The `distribution` check and seeded identity by count (issue 46): the scorer's law is the law the sampler
draws from, the randomised PIT is uniform on clean output and not on biased output, and the seeded count's
binomial rule."""

from dataclasses import replace

import numpy as np
import pytest
from skips import require_model

import harness.checks.distribution as distribution
from harness.checks import seeded
from harness.engine.context import ContextParams
from harness.engine.engine import Engine
from harness.engine.score import rank_mass, score, unscorable
from harness.models import resolve
from harness.suites.request import Request, Sampling

JSON_GRAMMAR = r"""
root ::= "{" ws "\"lang\":" ws ("\"C\"" | "\"Java\"" | "\"Python\"") "," ws "\"n\":" ws [0-9] [0-9]? ws "}"
ws   ::= " "?
"""


def test_rank_mass_orders_by_probability_then_by_lower_id():
    p = np.array([0.1, 0.4, 0.1, 0.4, 0.0])
    assert rank_mass(p, 1) == (0.4, 0.0)
    assert rank_mass(p, 3) == (0.4, pytest.approx(0.4))  # the tie with token 1 ranks the lower id first
    assert rank_mass(p, 0) == (0.1, pytest.approx(0.8))
    assert rank_mass(p, 2) == (0.1, pytest.approx(0.9))
    assert rank_mass(p, 4) == (0.0, pytest.approx(1.0))  # outside the support: the transform is 1


def test_randomised_pit_of_exact_draws_is_uniform_and_of_biased_draws_is_not():
    """4,000 draws from random 50-token laws: uniform p-value well above ALPHA; the same draws from a law
    that over-weights its most probable token (a lenient acceptance's bias) fail at ALPHA."""
    rng = np.random.default_rng(0)
    clean, biased = [], []
    for _ in range(4000):
        p = rng.dirichlet(np.full(50, 0.3))
        q = p.copy()
        q[p.argmax()] += 0.3
        q /= q.sum()
        clean.append(rank_mass(p, int(rng.choice(50, p=p))))
        biased.append(rank_mass(p, int(rng.choice(50, p=q))))
    _, p_clean = distribution.uniformity(distribution.pit(clean, 1))
    _, p_biased = distribution.uniformity(distribution.pit(biased, 1))
    assert p_clean > 1e-3
    assert p_biased < distribution.ALPHA


def test_unscorable_chains_are_named():
    assert "greedy" in unscorable(Sampling(temperature=0))
    assert "mirostat" in unscorable(Sampling(temperature=0.8, mirostat=2))
    assert "XTC" in unscorable(Sampling(temperature=0.8, xtc_probability=0.5))
    assert unscorable(Sampling(temperature=0.8, repeat_penalty=1.3, dry_multiplier=0.8)) is None


@pytest.fixture(scope="module")
def engine():
    require_model("tiny-dense")
    with Engine(resolve("tiny-dense").path, ContextParams(n_ctx=2048)) as e:
        yield e


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.8, repeat_penalty=1.3),
        dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, dry_multiplier=0.8, frequency_penalty=0.5),
        dict(temperature=0.9, grammar=JSON_GRAMMAR),
    ],
    ids=["penalties", "no-truncation-dry-frequency", "grammar"],
)
def test_non_speculative_engine_output_scores_uniform_under_its_own_chain(engine, sampling):
    """The engine's own non-speculative sampling (llama.cpp's samplers) scored by the scorer: every token in the
    support, and the transforms uniform (KS p > 1e-3 over 30 seeds): the scorer's law is the sampler's."""
    prompt = engine.model.tokenize("Write a quicksort demo in C.")
    scores = []
    for seed in range(30):
        s = Sampling(n_predict=48, seed=seed, **sampling)
        result = engine.run([Request(prompt=prompt, sampling=s)])[0]
        scored = score(engine.model, engine.ctx, s, result.prompt_tokens, result.tokens)
        assert "impossible_at" not in scored
        scores += scored["scores"]
    assert all(p > 0 for p, _ in scores)
    _, p_value = distribution.uniformity(distribution.pit(scores, 7))
    assert p_value > 1e-3, p_value


def test_a_token_the_grammar_forbids_ends_the_scoring(engine):
    s = Sampling(temperature=0.9, grammar=JSON_GRAMMAR, seed=1)
    prompt = engine.model.tokenize("JSON:")
    ok = engine.run([Request(prompt=prompt, sampling=replace(s, n_predict=16))])[0]
    bad = [*ok.tokens[:2], engine.model.tokenize("zzz", add_special=False)[0]]
    scored = score(engine.model, engine.ctx, s, ok.prompt_tokens, bad)
    assert scored["impossible_at"] == 2


def test_seeded_count_noise_bound_and_threshold():
    """The measured noise (0 of 160 distinct draws per backend and mode) bounds the rate at 1.85 %; a group of 24
    seeded sampled draws (the `sampling` suite on one backend: 12 cells × 2 cases, each seed once however many rounds
    replay it) fails from 5 diverged draws on (p < ALPHA), 4 stay within the noise (tests/test_seeded_count.py)."""
    from scipy import stats

    rate = seeded.noise_bound("server", "par")
    assert 0.018 < rate < 0.019
    assert stats.binom.sf(3, 24, rate) > seeded.ALPHA  # 4 of 24
    assert stats.binom.sf(4, 24, rate) < seeded.ALPHA  # 5 of 24
    assert seeded.noise_bound("server", "unknown-mode") > rate  # unmeasured: a wider bound
    assert seeded.ALPHA * seeded.MAX_GROUPS_PER_RUN <= 1e-3
    assert distribution.ALPHA * distribution.MAX_TESTS_PER_RUN <= 1e-3


def test_bench_repeats_each_case_with_fresh_seeds_and_the_given_sampling():
    from harness.bench.distribution import SEED_STRIDE, repeated, summary
    from harness.suites import load_suite

    suite = load_suite("statistical/sampling-distribution")
    twice = repeated(suite, 2, {"temperature": 0.5})
    assert [c.name for c in twice.cases] == ["code-r0", "prose-r0", "code-r1", "prose-r1"]
    assert [c.sampling.seed for c in twice.cases] == [1, 2, 1 + SEED_STRIDE, 2 + SEED_STRIDE]
    assert {c.sampling.temperature for c in twice.cases} == {0.5} and twice.rounds == suite.rounds[:1]
    row = summary([0.5, 0.05, 1e-7, 0.9], [10, 10, 10, 10])
    assert row["tests"] == 4 and row["failed"] == 1 and sum(row["histogram"]) == 4


def test_bench_sampling_option_is_checked_in_one_line(capsys):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "harness.cli", "bench", "distribution", "--sampling", '{"temprature": 1}'],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "specharness: error: --sampling: unknown fields temprature (llama-server's /completion names)"
    ]


@pytest.mark.long
def test_bench_sweeps_a_graded_fault_and_prints_the_power_and_the_faults_total_variation(tmp_path, tiny_models):
    """`bench distribution --fault over-accept=0,over-accept=1`: at ε 0 the rule is exact (no bias, no failure
    expected at α 1e-6); at ε 1 every drafted token q proposes where p/q >= 1/2 is kept, a bias of about 0.3 in
    total variation per token (measured 2026-12-07: 0.29-0.31) that every 512-token test finds."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench"
    args = ["bench", "distribution", "--runs", "1", "--model", "tiny-dense", "--engine", "inproc", "--mode", "seq"]
    args += ["--spec", "draft-simple-probabilistic", "--fault", "over-accept=0,over-accept=1", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "fault | cell | tokens per test | failed / tests" in proc.stdout  # the power table
    sweep = json.loads((out / "bench.json").read_text())["sweep"]
    (clean,), (biased,) = (list(entry["cells"].values()) for entry in sweep)
    assert [e["fault"] for e in sweep] == ["over-accept=0", "over-accept=1"]
    assert clean["tv_per_token"] == 0.0 and clean["failed"] == 0
    assert biased["tv_per_token"] > 0.1 and biased["failed"] == biased["tests"] == 2


def _outcome(round_, tokens, seed=42, strata=None, stop="limit", ok=True):
    from types import SimpleNamespace

    from harness.result import Result

    result = Result(prompt_tokens=[1, 2], tokens=list(tokens), stop_reason=stop if ok else "error",
                    error=None if ok else "boom")  # fmt: skip
    if strata is not None:
        result.spec_stats = {"token_strata": strata}
    return SimpleNamespace(round=round_, result=result)


def test_one_output_per_seed_and_every_output_of_a_random_seed():
    """Rounds replaying a seed share its uniforms (and a prefix): one of them, the first in round order, whatever its
    tokens; outputs of random seeds are independent draws, identical ones included."""
    from types import SimpleNamespace

    cell = SimpleNamespace(id="inproc-seq-draft-simple-probabilistic-tiny-dense")
    rounds = [_outcome(1, [5, 6, 7]), _outcome(0, [5, 6, 8]), _outcome(2, [5, 6, 7])]
    kept = distribution.independent(rounds, Sampling(temperature=0.8, seed=42), cell, "a")
    assert [o.round for o in kept] == [0]
    failed_first = [_outcome(0, [], ok=False), _outcome(1, [5, 6])]
    assert [o.round for o in distribution.independent(failed_first, Sampling(temperature=0.8, seed=3), cell, "a")] == [
        1
    ]
    random = [_outcome(0, [5, 6]), _outcome(1, [5, 6]), _outcome(2, [9])]
    assert len(distribution.independent(random, Sampling(temperature=0.8, seed=-1), cell, "a")) == 3
    seen: set = set()  # a pool: the same seed in another cell or case adds nothing
    assert len(distribution.independent(rounds, Sampling(temperature=0.8, seed=42), cell, "a", seen)) == 1
    assert distribution.independent(rounds, Sampling(temperature=0.8, seed=42), cell, "b", seen) == []


def test_a_token_outside_the_support_fails_beyond_the_near_tie_floor_and_is_left_out_within_it():
    outcomes = [_outcome(0, [5, 6, 7])]
    scored = [{"scores": [[0.5, 0.0], [0.0, 1.0], [0.2, 0.3]], "lift": [[1, 0.01]]}]
    within = distribution.sample(outcomes, scored, 1, floor=0.05)
    assert len(within.u) == 2 and len(within.excused) == 1 and not within.beyond
    beyond = distribution.sample(outcomes, [{**scored[0], "lift": [[1, 3.2]]}], 1, floor=0.05)
    assert len(beyond.beyond) == 1 and "needs +3.2 nats" in beyond.beyond[0]
    assert len(beyond.u) == 3  # reported, not left out: the case fails on it


def _ctx(floor=0.05):
    from types import SimpleNamespace

    return SimpleNamespace(
        noise_floor=SimpleNamespace(near_tie=floor, source="test"),
        run=SimpleNamespace(suite=SimpleNamespace(name="s")),
        cell=SimpleNamespace(id="c"),
        case="a",
    )


def test_an_impossible_token_fails_the_case_whatever_its_ks():
    outcomes = [_outcome(0, [5, 6, 7])]
    scored = [{"scores": [[0.5, 0.0], [0.0, 1.0], [0.2, 0.3]], "lift": [[1, float("inf")]]}]
    result = distribution._judge(_ctx(), outcomes, scored)
    assert not result.passed
    assert result.message.startswith("1 of 3 returned tokens are outside the chain's support beyond what numerics")
    assert "token 6 at position 1" in result.message


def _draws(n, rng, bias_in=None, strata="udb"):
    """n scored tokens of random 50-token laws, their strata cycling through `strata`; in stratum `bias_in` the token
    comes from a law that over-weights the most probable token (a lenient acceptance's bias)."""
    rows, letters = [], ""
    for i in range(n):
        p = rng.dirichlet(np.full(50, 0.3))
        letter = strata[i % len(strata)]
        q = p.copy()
        if letter == bias_in:
            q[p.argmax()] += 0.5
            q /= q.sum()
        rows.append(list(rank_mass(p, int(rng.choice(50, p=q)))))
        letters += letter
    return rows, letters


def test_a_bias_in_one_stratum_is_caught_and_named():
    """3,000 tokens, a third of them bonus tokens drawn from a biased law: the case fails, in the bonus stratum,
    with the message's head unchanged; the same draws unbiased pass."""
    rng = np.random.default_rng(5)
    rows, letters = _draws(3000, rng, bias_in="b")
    outcomes = [_outcome(0, range(3000), strata=letters)]
    result = distribution._judge(_ctx(), outcomes, [{"scores": rows}])
    assert not result.passed
    assert result.evidence["caught_by"]["stratum"] == "bonus", result.evidence["tests_made"]
    assert (
        result.message.startswith(
            "the returned tokens are not draws from the target's distribution: Kolmogorov-Smirnov D = "
        )
        or "tail count" in result.message
    )
    assert "caught in stratum bonus" in result.message
    assert result.evidence["strata"] == {"all": 3000, "undrafted": 1000, "drafted": 1000, "bonus": 1000}
    clean_rows, _ = _draws(3000, np.random.default_rng(6))
    clean = distribution._judge(_ctx(), outcomes, [{"scores": clean_rows}])
    assert clean.passed and clean.evidence["p_value"] >= distribution.ALPHA


def test_a_backend_without_strata_is_tested_in_all_only():
    rows, _ = _draws(200, np.random.default_rng(7))
    result = distribution._judge(_ctx(), [_outcome(0, range(200))], [{"scores": rows}])
    assert result.passed and result.evidence["strata"] == {"all": 200}
    assert {t["stratum"] for t in result.evidence["tests_made"]} == {"all"}


def test_a_few_tokens_are_tested_not_skipped():
    rows, _ = _draws(3, np.random.default_rng(8))
    result = distribution._judge(_ctx(), [_outcome(0, range(3))], [{"scores": rows}])
    assert result.not_run is None and result.passed and result.evidence["tokens"] == 3


def test_the_engine_records_each_tokens_place_in_its_step():
    """`token_strata`: one letter per returned token, the first undrafted; a `d` for every accepted draft token and
    at most one redraw per step, at most one bonus per step; under checkpoint rollback (replays) too."""
    from test_engine_rejection import serve

    for model, rollback in (("tiny-dense", "auto"), ("tiny-hybrid", "checkpoint")):
        require_model(model)
        for r in serve(model, 0.8, rollback=rollback):
            s, letters = r.spec_stats, r.spec_stats["token_strata"]
            assert len(letters) == len(r.tokens) and set(letters) <= set("udb") and letters[0] == "u"
            assert s["draft_n_accepted"] <= letters.count("d") <= s["draft_n_accepted"] + s["spec_cycles"]
            assert letters.count("b") <= s["spec_cycles"] - s["spec_skip"]


def test_the_lift_of_a_token_outside_top_k_is_its_logit_gap_to_the_kth(engine):
    """The scorer's `lift`: the raise of a cut token's logit that brings it inside the chain's support; under top-k
    alone, the gap between its logit and the k-th largest (bisection to 4e-6 nats)."""
    from harness.engine.score import ChainLaw, lift

    prompt = engine.model.tokenize("Write a quicksort demo in C.")
    (row,) = [np.asarray(r, dtype=np.float32) for r in _rows(engine, prompt)]
    sampling = Sampling(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    law = ChainLaw(sampling, engine.model)
    try:
        law.accept_prompt(prompt)
        order = np.argsort(-row.astype(np.float64), kind="stable")
        assert law.law(row)[order[9]] == 0.0 and law.law(row)[order[4]] > 0.0
        gap = float(row[order[4]]) - float(row[order[9]])
        assert lift(law, row, int(order[9])) == pytest.approx(gap, abs=1e-4)
        assert lift(law, row, int(order[4])) == pytest.approx(0.0, abs=1e-4)
    finally:
        law.free()


def _rows(engine, prompt):
    from harness.engine.score import _logit_rows

    return _logit_rows(engine.ctx, prompt, [0])


def _pooled_run(fault: str | None) -> list:
    """The statistical suite's two cases repeated 6 times with fresh seeds (64 tokens each at temperature 0.5, no
    end-of-generation) in the in-process draft-simple-probabilistic cell of tiny-dense: one law, 12 seeds."""
    from harness.backends.choose import backend_factories
    from harness.bench.distribution import repeated
    from harness.checks import evaluate_cell
    from harness.execute import ExecOptions, Executor
    from harness.matrix import Cell
    from harness.suites import load_suite

    require_model("tiny-dense")
    sampling = {"temperature": 0.5, "n_predict": 64, "ignore_eos": True}
    suite = repeated(load_suite("statistical/sampling-distribution"), 6, sampling)
    engine = {"fault": fault} if fault else {}
    executor = Executor(ExecOptions(backends=backend_factories(), kv_scan="off", engine=engine))
    run = executor.run(suite, Cell("inproc", "seq", "draft-simple-probabilistic", "tiny-dense"))
    return [r for _, r in evaluate_cell(run, executor, None, ["distribution"], "")]


def test_the_pool_of_a_laws_independent_outputs_finds_what_no_case_alone_does():
    """lenient-accept at 64 tokens a case: no case fails alone (measured: adjusted p 0.015 to 1), the pool of the
    12 seeds' outputs (768 tokens) does, in the drafted stratum (p 2.3e-11), and fails every case it holds; the
    clean engine's pool passes (p 0.13)."""
    faulty = _pooled_run("lenient-accept")
    assert len(faulty) == 12 and all(r.evidence["p_value"] >= distribution.ALPHA for r in faulty)
    assert all(not r.passed for r in faulty)
    pool = faulty[0].evidence["pool"]
    assert pool["outputs"] == 12 and pool["tokens"] == 768 and pool["p_value"] < distribution.ALPHA_POOL
    assert pool["caught_by"]["stratum"] == "drafted"
    assert faulty[0].message.startswith("tiny-dense's outputs pooled over 1 cells: the returned tokens are not draws")
    clean = _pooled_run(None)
    assert all(r.passed for r in clean), [r.message for r in clean if not r.passed]
    assert (
        clean[0].evidence["pool"]["outputs"] == 12 and clean[0].evidence["pool"]["p_value"] >= distribution.ALPHA_POOL
    )


def test_per_cell_seeds_pool_a_models_cells_and_find_what_no_cell_alone_does():
    """`sampling-pooled` (seeds: per-cell) on tiny-dense's 6 in-process cells with over-accept=0.5: every cell sends
    its own seed, the pool holds their 6 outputs (960 tokens) and fails in the drafted stratum, where no cell's own
    test does (measured 2026-12-07: the cells' smallest adjusted p 0.0028, the pool's 2.2e-7; the clean engine's
    pool passes, p 0.17, as the suite does in every default run)."""
    from harness.backends.choose import backend_factories
    from harness.checks import evaluate_cell
    from harness.execute import ExecOptions, Executor
    from harness.matrix import cells
    from harness.suites import load_suite

    require_model("tiny-dense")
    suite = load_suite("sampling-pooled")
    mine = [c for c in cells(suite.matrix) if c.model == "tiny-dense" and c.backend == "inproc"]
    assert len(mine) == 6 and len({suite.sent_case(suite.cases[0], c).sampling.seed for c in mine}) == 6
    executor = Executor(ExecOptions(backends=backend_factories(), kv_scan="off", engine={"fault": "over-accept=0.5"}))
    executor.expect([(suite, c) for c in mine])
    results = [
        r for cell in mine for _, r in evaluate_cell(executor.run(suite, cell), executor, None, ["distribution"], "")
    ]
    assert len(results) == 6 and all(not r.passed for r in results)
    assert all(r.evidence["p_value"] >= distribution.ALPHA for r in results)  # no cell alone
    pool = results[0].evidence["pool"]
    assert pool["outputs"] == 6 and pool["tokens"] == 960 and pool["p_value"] < distribution.ALPHA_POOL
    assert pool["caught_by"]["stratum"] == "drafted"


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid-mtp-close"])
def test_the_close_drafts_of_sampling_close_are_accepted_at_least_70_percent_of_the_time(model):
    """`sampling-close`'s premise on tiny-dense and the MTP target, both backends: every cell's close draft
    (`tiny-dense-close-draft`, noise 0.005; tiny-hybrid-mtp-close's own head, draft-mtp) at temperature 0.05 is
    accepted in >= 70 % of its drafted tokens (measured 2026-12-07: tiny-dense in-process sample-and-match 0.76-0.90,
    rejection sampling 0.91-0.98, llama-server sample-and-match 0.76-0.86; tiny-hybrid 0.75-0.96; tiny-hybrid-mtp-close
    0.75-0.93 in-process, 0.88-0.95 on llama-server), and the cells' outputs are draws of the target's law. At
    temperature 0.1 tiny-dense's sample-and-match fell to 0.64-0.74 (it is capped by the target's top probability),
    at 0.7 every cell to about 0.18 (the draft offers its top 10 candidates, which hold little of a flat tiny model's
    mass)."""
    from harness.backends.choose import backend_factories
    from harness.checks import evaluate_cell
    from harness.execute import ExecOptions, Executor
    from harness.matrix import cells
    from harness.suites import load_suite

    require_model(model)
    suite = load_suite("sampling-close")
    assert suite.cases[0].sampling.temperature == 0.05
    mine = [
        c for c in cells(suite.matrix) if c.model == model and (c.backend == "inproc" or c.preset.keeps_seeded_tokens)
    ]
    assert len(mine) == 9
    executor = Executor(ExecOptions(backends=backend_factories(), kv_scan="off"))
    executor.expect([(suite, c) for c in mine])
    rates = {}
    for cell in mine:
        results = [
            r for _, r in evaluate_cell(executor.run(suite, cell), executor, None, ["spec-ran", "distribution"], "")
        ]
        assert all(r.passed for r in results), [r.message for r in results if not r.passed]
        rates[cell.id] = next(r for r in results if r.name == "spec-ran").evidence["acceptance"]
    assert min(rates.values()) >= 0.7, rates
