"""The seeded count of `lossless` (harness/checks/seeded.py, issue 59): a seed counts once however many rounds replay
it, its error rates are recomputed from the module's constants, and the noise bench counts as the check counts."""

from pathlib import Path

import pytest
from scipy import stats

from harness.bench.distribution import SEED_STRIDE, measure_seeded, repeated
from harness.checks import CHECKS, seeded
from harness.checks.base import CheckContext
from harness.execute import CellRun, Outcome
from harness.matrix import Cell, cells, spec_preset
from harness.result import Result
from harness.suites import Case, Suite, load_suite
from harness.suites.request import Sampling

ROOT = Path(__file__).resolve().parents[1]
SEQ = Cell("server", "seq", "none", "m")
SPEC = SEQ.reference(spec="draft-simple")
PAR_SPEC = SPEC.reference(mode="par")
MATRIX = [{"backends": ["server"], "modes": ["seq", "par"], "specs": ["none", "draft-simple"], "models": ["m"]}]
SAMPLED = {"temperature": 0.7, "n_predict": 3}


def ok(tokens, prompt=(7, 8)) -> Result:
    return Result(prompt_tokens=list(prompt), tokens=list(tokens), stop_reason="limit")


class Served:
    """Stands in for the Executor: every cell's outcomes are given (case → one Result per round), nothing is run."""

    def __init__(self, suite: Suite, runs: dict[Cell, dict[str, list[Result]]]):
        self.suite, self.asked = suite, []
        self.runs = {
            cell: CellRun(
                suite, cell, [Outcome(k, r, res) for k, rounds in by_case.items() for r, res in enumerate(rounds)]
            )
            for cell, by_case in runs.items()
        }

    def run(self, suite, cell):
        return self.runs[cell] if suite is self.suite else self._bench(suite, cell)

    def _bench(self, suite, cell):  # measure_seeded's repeated suite: the same outcomes per repetition
        self.asked.append(cell)
        base = self.runs[cell]
        outcomes = [
            Outcome(case.name, o.round, o.result)
            for case in suite.cases
            for o in base.outcomes
            if o.case == case.name.rsplit("-r", 1)[0]
        ]
        return CellRun(suite, cell, outcomes)

    def planned(self, suite, cell):
        return cell in self.runs

    def expect(self, jobs):
        pass

    def environment(self, cell):
        return {"device": "cpu"}

    def rescorer(self):  # llama-server gave no logits, and nothing re-scores them here
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def score(self, *args):
        return None


def two_seeds_suite(rounds=("seq", "seq")) -> Suite:
    """Cases `a` (seed 1) and `b` (seed 2): the same prompt, other seeds; `g` greedy."""
    return Suite(
        name="demo",
        path=None,
        cases=[
            Case("a", Sampling(seed=1, **SAMPLED), prompt="x"),
            Case("b", Sampling(seed=2, **SAMPLED), prompt="x"),
            Case("g", Sampling(temperature=0, n_predict=3), prompt="x"),
        ],
        matrix=MATRIX,
        checks=["lossless"],
        rounds=list(rounds),
    )


def context(served: Served, cell: Cell, case: str = "a") -> CheckContext:
    return CheckContext(served.runs[cell], case, served, None, lambda t: " ".join(map(str, t)), "repro")


def test_the_seeded_count_counts_a_seed_once_however_many_rounds_replay_it():
    """Case `a` diverged in both rounds of the seq cell (a correlated pair): one draw diverged, not two; `b`, the
    same prompt with another seed, is a draw of its own; the par cell's `a` another; a greedy case none."""
    s = two_seeds_suite()
    same = {"a": [ok([1, 2, 3])] * 2, "b": [ok([4, 5, 6])] * 2, "g": [ok([1, 1, 1])] * 2}
    served = Served(
        s,
        {
            SEQ: same,
            SPEC: {**same, "a": [ok([1, 9, 3]), ok([1, 9, 3])]},
            PAR_SPEC.reference(spec="none"): same,
            PAR_SPEC: same,
        },
    )
    diverged, compared, judged, lines = seeded.group_count(context(served, SPEC))
    assert (diverged, compared) == (1, 4) and set(judged) == {SPEC, PAR_SPEC}
    assert lines == [f"{SPEC.id} a seed 1: diverged in 2 of 2 rounds (round 0 at token 1, round 1 at token 1)"]
    # one of the two rounds diverged: still one draw diverged
    served.runs[SPEC] = Served(s, {SPEC: {**same, "a": [ok([1, 2, 3]), ok([1, 9, 3])]}}).runs[SPEC]
    assert seeded.group_count(context(served, SPEC))[:2] == (1, 4)
    # two seeds diverged, each in both rounds: two draws diverged (rounds with other seeds count twice)
    served.runs[SPEC] = Served(s, {SPEC: {**same, "a": [ok([1, 9, 3])] * 2, "b": [ok([4, 9, 6])] * 2}}).runs[SPEC]
    diverged, compared, _, lines = seeded.group_count(context(served, SPEC))
    assert (diverged, compared) == (2, 4) and [line.split(":")[0] for line in lines] == [
        f"{SPEC.id} a seed 1",
        f"{SPEC.id} b seed 2",
    ]
    # a round whose prompt is not the reference's is not compared (its chat history differed): no draw of its own
    served.runs[SPEC] = Served(s, {SPEC: {**same, "a": [ok([1, 2, 3]), ok([1, 9, 3], prompt=(7, 9))]}}).runs[SPEC]
    draws, _ = seeded.group_draws(context(served, SPEC))
    assert {d.key: d.rounds for d in draws if d.cell == SPEC.id} == {"a": {0: None}, "b": {0: None, 1: None}}


def test_lossless_judges_a_correlated_pair_of_rounds_as_one_divergence_within_the_noise():
    """One seed diverged in both rounds of a 2-draw group: counted per request (2 of 4) it was judged as two
    independent divergences; as one of 2 draws, p = 1 − (1 − r)² is far above ALPHA: reported only."""
    s = two_seeds_suite()
    same = {"a": [ok([1, 2, 3])] * 2, "b": [ok([4, 5, 6])] * 2, "g": [ok([1, 1, 1])] * 2}
    served = Served(s, {SEQ: same, SPEC: {**same, "a": [ok([1, 9, 3])] * 2}})
    result = CHECKS["lossless"](context(served, SPEC))
    assert result.passed and result.evidence["reported_only"]
    assert (result.evidence["group_diverged"], result.evidence["group_compared"]) == (1, 2)
    assert result.evidence["group_requests"] == 4
    rate = seeded.noise_bound("server", "seq")
    assert result.evidence["group_p_value"] == pytest.approx(stats.binom.sf(0, 2, rate))


def test_the_seeded_count_fails_a_group_where_most_seeds_diverge():
    """Every seed of a 4-draw group diverged (a sample-and-match bug): p = r⁴ < ALPHA, a failure naming each draw."""
    s = two_seeds_suite()
    same = {"a": [ok([1, 2, 3])] * 2, "b": [ok([4, 5, 6])] * 2, "g": [ok([1, 1, 1])] * 2}
    bad = {**same, "a": [ok([1, 9, 3])] * 2, "b": [ok([4, 9, 6])] * 2}
    served = Served(s, {SEQ: same, SPEC: bad, PAR_SPEC.reference(spec="none"): same, PAR_SPEC: bad})
    result = CHECKS["lossless"](context(served, SPEC))
    assert not result.passed and "reported_only" not in result.evidence
    assert (result.evidence["group_diverged"], result.evidence["group_compared"]) == (4, 4)
    assert len(result.evidence["group_divergences"]) == 4 and result.evidence["group_p_value"] < seeded.ALPHA
    assert "4 of 4 seeded sampled draws" in result.message


def default_group_draws() -> dict[tuple[str, str], int]:
    """(suite, backend) → distinct seeded sampled draws of its group, for every suite in suites/*.yaml that runs
    `lossless` (each speculative sample-and-match cell × each seeded sampled case record, as group_count counts)."""
    out = {}
    for path in sorted((ROOT / "suites").glob("*.yaml")):
        if path.stem == "known-failures":
            continue
        suite = load_suite(path.stem)
        if "lossless" not in suite.checks or not suite.matrix:
            continue
        for cell in cells(suite.matrix):
            preset = spec_preset(cell.spec)
            if preset.speculative and preset.keeps_seeded_tokens:
                n = len(seeded.seeded_keys(suite, cell.model))
                if n:
                    out[(suite.name, cell.backend)] = out.get((suite.name, cell.backend), 0) + n
    return out


def test_a_clean_run_turns_red_through_the_seeded_count_with_probability_at_most_1e_3():
    """Recomputed from the module's constants: at the documented noise bound (the largest of NOISE's, and of
    UNMEASURED's), the exact false-alarm probability of a group (the binomial tail at the smallest count the test
    fails) over every size up to the largest group of the default suites, times the run's groups (union bound),
    is ≤ 1e-3. The numbers the module docstring and docs/guide/sampled-speculation.md state are checked too."""
    groups = default_group_draws()
    assert groups == {
        ("probs", "inproc"): 4,
        ("probs", "server"): 4,
        ("sampling", "inproc"): 24,
        ("sampling", "server"): 24,
    }
    assert max(groups.values()) <= seeded.MAX_GROUP_DRAWS and len(groups) <= seeded.MAX_GROUPS_PER_RUN
    documented = max(seeded.noise_bound(backend, mode) for backend, mode in seeded.NOISE)
    for rate in (documented, seeded.noise_bound("server", "unmeasured-mode")):
        assert seeded.run_false_alarm(rate) <= seeded.RUN_FALSE_ALARM
        for n in range(1, seeded.MAX_GROUP_DRAWS + 1):  # the tail at the threshold is the test's size, ≤ ALPHA
            k = seeded.threshold(n, rate)
            assert k is None or stats.binom.sf(k - 1, n, rate) < seeded.ALPHA <= stats.binom.sf(k - 2, n, rate)
    # the documented numbers (module docstring, docs/guide/sampled-speculation.md)
    assert documented == pytest.approx(0.01855, abs=5e-6)
    assert seeded.threshold(24, documented) == 5 and seeded.false_alarm(24, documented) == pytest.approx(
        6.95e-5, rel=1e-3
    )
    worst, at = seeded.worst_false_alarm(documented)
    assert at == 13 and worst == pytest.approx(7.40e-5, rel=1e-3)
    assert seeded.run_false_alarm(documented) == pytest.approx(7.4e-4, rel=1e-3)
    default_run = 1.0
    for n in groups.values():
        default_run *= 1 - seeded.false_alarm(n, documented)
    assert 1 - default_run == pytest.approx(1.9e-4, rel=1e-2)
    # counted per request as before, the sampling group's 48 requests (24 seeds in correlated pairs) failed a
    # clean run from 7 divergences, i.e. 4 diverged seeds: 9.3e-4 for that one group
    k48 = seeded.threshold(48, documented)
    assert k48 == 7 and stats.binom.sf((k48 + 1) // 2 - 1, 24, documented) == pytest.approx(9.3e-4, rel=1e-2)


def test_the_seeded_count_detects_a_divergence_rate_of_26_percent_with_80_percent_power_at_24_draws():
    rate = seeded.noise_bound("server", "par")
    q = seeded.detectable_rate(24, rate)
    assert q == pytest.approx(0.264, abs=5e-4)
    assert stats.binom.sf(seeded.threshold(24, rate) - 1, 24, q) == pytest.approx(seeded.POWER, abs=1e-6)
    assert seeded.detectable_rate(4, rate) == pytest.approx(0.788, abs=5e-4)  # probs' group: 3 of 4 must diverge


def test_the_noise_bound_takes_a_rate_measured_on_the_device_in_place_of_the_committed_one():
    committed = seeded.noise_bound("server", "par")
    assert committed == seeded.noise_bound("server", "par", None)
    assert seeded.noise_bound("server", "par", (3, 160)) > committed  # a noisier device: a wider bound
    assert seeded.noise_bound("server", "par", (0, 1600)) < committed
    assert seeded.noise_bound("server", "unmeasured-mode") > committed  # unmeasured: a wider bound


def test_a_device_count_pools_with_the_committed_one_unless_it_refutes_it():
    """Issue 59: the calibration pass counts a device's own seeded draws (harness.calibration.seeded: 20 per mode).
    None measured: the committed count. Consistent with it (0 of 20, or 1 of 20 at p 0.31 under the committed
    bound 1.855 %): pooled, a tighter bound than either alone. Refuting it (5 of 20, the rate of the H200's 8 of 32
    seeded requests in issue 59): the device's own count, a wide bound, so a noisy GPU does not cry wolf."""
    committed = seeded.NOISE[("server", "par")]
    assert seeded.device_counts("server", "par", None) == (committed, "committed (NOISE)")
    (pooled, where) = seeded.device_counts("server", "par", (0, 20))
    assert pooled == (committed[0], committed[1] + 20) and "pooled" in where
    assert seeded.noise_bound("server", "par", pooled) < seeded.noise_bound("server", "par", committed)
    assert seeded.device_counts("server", "par", (1, 20))[0] == (committed[0] + 1, committed[1] + 20)
    (own, where) = seeded.device_counts("server", "par", (5, 20))
    assert own == (5, 20) and where.startswith("measured on this device (the committed 0 of 160 does not hold")
    assert seeded.noise_bound("server", "par", own) > 0.4


def test_the_seeded_noise_bench_counts_distinct_draws_in_the_suites_own_rounds(monkeypatch):
    """`specharness bench seeded` serves the repeated cases in the suite's rounds and counts as the check counts: a
    repetition diverged in both rounds is one draw diverged (2 requests)."""
    s = two_seeds_suite()
    twice = repeated(s, 2, rounds=s.rounds)
    assert [c.name for c in twice.cases] == ["a-r0", "b-r0", "g-r0", "a-r1", "b-r1", "g-r1"]
    assert [c.sampling.seed for c in twice.cases][:2] == [1, 2] and twice.cases[3].sampling.seed == 1 + SEED_STRIDE
    assert twice.rounds == ["seq", "seq"] and repeated(s, 2).rounds == ["seq"]
    same = {"a": [ok([1, 2, 3])] * 2, "b": [ok([4, 5, 6])] * 2}
    served = Served(s, {SEQ: same, SPEC: {**same, "a": [ok([1, 9, 3])] * 2}})
    monkeypatch.setattr("harness.bench.distribution.load_suite", lambda name, suites_dir=None: s)
    out = measure_seeded("demo", 2, served, {"backends": None, "modes": ["seq"], "specs": None, "models": None})
    assert out["cells"] == {SPEC.id: {"diverged": 2, "compared": 4, "requests": 8, "rounds_diverged": 4}}
    assert out["by_backend_mode"] == {"server seq": out["cells"][SPEC.id]}
