"""`synth-acceptance` (harness/checks/synth.py): llama-server's synthetic acceptance (`--spec-synth-rates`) accepts
each draft position at its configured rate, and the same seed draws the same counts.

The tests of the statistics on made-up counts, then one real llama-server run (the vendored build, tiny-dense,
the synth-acceptance suite's `synth-rates` seq cell: about 6 s) that passes the check, whose per-step log lines
give the same totals and per-position counts at the rates, and whose counts fail it when judged against rates the
server was not given."""

import json
import re

import numpy as np
import pytest

from harness.checks import CHECKS
from harness.checks.base import CheckContext
from harness.checks.synth import (
    ALPHA,
    NAME,
    RUN_FALSE_ALARM,
    accepts_synthetically,
    judge_positions,
    judge_total,
    per_position,
    rates_of,
    step_law,
    steps_from_log,
    synth_acceptance,
    total_law,
)
from harness.cli import main
from harness.execute import CellRun, Outcome
from harness.llama import log as llama_log
from harness.matrix import SPEC_PRESETS, Cell
from harness.result import Result
from harness.suites import Case, Suite, load_suite
from harness.suites.request import Sampling

RATES = [0.9, 0.7, 0.5, 0.3]
CELL = Cell("server", "seq", "synth-rates", "tiny-dense")


def simulate(rates: list[float], n_predict: int, seed: int, n_max: int = 4) -> tuple[list[tuple[int, int]], int]:
    """llama-server's synthetic steps of one request (draft-simple, p_min 0): (drafted, accepted) per step, and the
    generated count. `rates` are the unconditional rates the simulated server uses."""
    rng = np.random.default_rng(seed)
    steps, g = [], 1
    while g < n_predict:
        n = min(n_max, n_predict - g - 1)
        if n <= 0:
            g += 1
            continue
        a, before = 0, 1.0
        while a < n and rng.random() < (rates[a] / before if before > 0 else 0.0):
            before = rates[a]
            a += 1
        steps.append((n, a))
        g += a + 1
    return steps, g


# ------------------------------------------------------------------------------------------ the statistics


def test_the_preset_sets_four_non_increasing_rates_of_draft_simple_on_llama_server_only():
    preset = SPEC_PRESETS["synth-rates"]
    rates = rates_of(preset.options)
    assert rates == RATES and rates == sorted(rates, reverse=True)
    assert preset.options["spec-type"] == "draft-simple" and preset.options["spec-draft-n-max"] == len(rates)
    assert preset.runs_on("server") and not preset.runs_on("inproc")
    assert accepts_synthetically(preset.options)
    assert not accepts_synthetically(SPEC_PRESETS["synth-reject"].options)  # rates 0: the target's output
    assert not accepts_synthetically(SPEC_PRESETS["draft-simple"].options)


def test_alpha_spends_the_run_budget_over_positions_cases_and_cells():
    assert RUN_FALSE_ALARM == 1e-3 and ALPHA == pytest.approx(1e-3 / (4 * 3 * 2))
    quicksort = load_suite("synth-acceptance")
    assert NAME in quicksort.checks
    from harness.matrix import cells

    judged = [c for c in cells(quicksort.matrix) if c.spec == "synth-rates"]
    assert len(rates_of(SPEC_PRESETS["synth-rates"].options)) * len(quicksort.cases) * len(judged) == 4 * 3 * 2


def test_positions_pass_at_the_configured_rates_and_fail_where_one_is_off():
    drafted = [200] * 4
    assert judge_positions(drafted, [180, 140, 100, 60], RATES)["passed"]
    off = judge_positions(drafted, [100, 78, 56, 33], RATES)  # position 0 at 0.5, not 0.9 (the rest follow it)
    assert not off["passed"] and off["positions"][0]["p_value"] < ALPHA
    one = judge_positions(drafted, [180, 140, 100, 100], RATES)  # only the last position off: 0.5 for 0.3
    assert not one["passed"] and [r["p_value"] < ALPHA for r in one["positions"]] == [False, False, False, True]
    assert judge_positions([0, 0, 0, 0], [0, 0, 0, 0], RATES) == {
        "passed": True,
        "positions": [{"position": i, "drafted": 0, "accepted": 0, "rate": r} for i, r in enumerate(RATES)],
        "min_p": None,
    }


def test_simulated_steps_pass_per_position_and_in_total_and_fail_at_other_rates():
    steps, g = simulate(RATES, 2000, seed=1)
    drafted, accepted = per_position(steps, 4)
    assert judge_positions(drafted, accepted, RATES)["passed"]
    slow = [0.5, 0.35, 0.25, 0.15]  # position 0 at 0.5: a server that draws against other rates
    steps_slow, _ = simulate(slow, 2000, seed=1)
    assert not judge_positions(*per_position(steps_slow, 4), RATES)["passed"]
    # a request's totals (128 tokens, about 37 steps): the exact test of the accepted total
    for seed in range(5):
        steps, g = simulate(RATES, 128, seed)
        d, a = sum(n for n, _ in steps), sum(k for _, k in steps)
        assert judge_total(RATES, 128, g, d, a)["p_value"] >= ALPHA
        steps, g = simulate(slow, 128, seed)
        d, a = sum(n for n, _ in steps), sum(k for _, k in steps)
        assert judge_total(RATES, 128, g, d, a)["p_value"] < ALPHA


def test_the_total_law_is_the_chain_of_full_drafts():
    assert step_law(RATES, 4) == pytest.approx([0.1, 0.2, 0.2, 0.2, 0.3])
    assert step_law(RATES, 2) == pytest.approx([0.1, 0.2, 0.7])
    law = total_law(RATES, 128, 128)
    assert sum(law.values()) == pytest.approx(1.0)
    assert sum(t * p for (t, _), p in law.items()) == pytest.approx(
        judge_total(RATES, 128, 128, 134, 93)["expected_accepted"], abs=1e-3
    )
    # rates 0 (synth-reject): every step drafts 4 until the last 3 (3, 2, 1) and a plain one; none accepted
    assert total_law([0.0] * 4, 32, 32) == {(0, 27 * 4 + 3 + 2 + 1): pytest.approx(1.0)}
    assert judge_total(RATES, 128, 128, 135, 93) is not None  # a tail of 3 + 2 + ... drafts: possible
    assert judge_total(RATES, 128, 128, 4, 93) is None  # not full drafts: not judged
    assert judge_total([1.0] * 4, 128, 128, 134, 93)["p_value"] == 0.0  # all accepted was configured: impossible


def test_the_per_step_log_lines_give_the_steps():
    messages = [
        "processing task",
        "add accepted tokens: sampled=8445, ids.size=3, n_draft=4",
        "add accepted tokens: sampled=12, ids.size=5, n_draft=4",
        "add accepted tokens: sampled=-1, ids.size=1, n_draft=2",
        "stop processing",
    ]
    assert steps_from_log(messages) == [(4, 2), (4, 4), (2, 0)]
    assert per_position(steps_from_log(messages), 4) == ([3, 3, 2, 2], [2, 2, 1, 1])
    restored = [*messages[:2], "restoring speculative checkpoint (pos_min = 0, pos_max = 9, size = 10)", *messages[2:]]
    assert steps_from_log(restored) is None  # the replay's line does not say how many were drafted


# ------------------------------------------------------------------------------------------ the check


class Runs:
    """Stands in for the executor: the cell's outcomes are given."""

    def __init__(self, run: CellRun):
        self.cell_run = run

    def run(self, _suite, _cell):
        return self.cell_run

    def environment(self, _cell):
        return {"device": "cpu"}


def demo_suite(n_predict: int = 128, **sampling) -> Suite:
    return Suite(
        name="demo",
        path=None,
        cases=[Case("a", Sampling(n_predict=n_predict, temperature=0, **sampling), prompt="x")],
        matrix={},
        checks=[NAME],
        rounds=["seq", "seq", "par"],
    )


def context(results: list[Result], cell: Cell = CELL, suite: Suite | None = None) -> CheckContext:
    suite = suite or demo_suite()
    run = CellRun(suite, cell, [Outcome("a", i, r) for i, r in enumerate(results)])
    return CheckContext(run, "a", Runs(run), None, str, "repro")


def request(steps: list[tuple[int, int]], generated: int, per_pos: bool = False) -> Result:
    stats = {"draft_n": sum(n for n, _ in steps), "draft_n_accepted": sum(a for _, a in steps)}
    if per_pos:
        stats["drafted_per_pos"], stats["accepted_per_pos"] = per_position(steps, 4)
    return Result(tokens=list(range(generated)), stop_reason="limit", spec_stats=stats)


def test_the_check_judges_totals_and_per_position_counts_and_the_rounds():
    steps, g = simulate(RATES, 128, seed=3)
    ok = CHECKS[NAME](context([request(steps, g)] * 3))
    assert ok.passed and ok.not_run is None and ok.evidence["rounds_compared"] == 3
    assert ok.evidence["statistic"].startswith("exact test") and ok.evidence["p_value"] >= ALPHA
    per_pos = CHECKS[NAME](context([request(steps, g, per_pos=True)] * 3))
    assert per_pos.passed and per_pos.evidence["statistic"] == "per-position binomial"
    # the same seed drew other counts in one round (a generator not reseeded per request)
    other, g2 = simulate(RATES, 128, seed=4)
    assert g2 == g
    drifted = CHECKS[NAME](context([request(steps, g), request(steps, g), request(other, g)]))
    assert not drifted.passed and "round 2 drew" in drifted.message
    # a server that accepts at other rates
    slow, g3 = simulate([0.5, 0.35, 0.25, 0.15], 128, seed=3)
    failed = CHECKS[NAME](context([request(slow, g3)]))
    assert not failed.passed and "p = " in failed.message and failed.evidence["p_value"] < ALPHA


def test_the_check_is_not_run_where_it_cannot_judge():
    steps, g = simulate(RATES, 128, seed=3)
    plain = CHECKS[NAME](context([request(steps, g)], CELL.reference(spec="draft-simple")))
    assert plain.status == "not run" and "spec-synth-rates" in plain.not_run
    assert CHECKS[NAME](context([Result(error="crashed", stop_reason="crashed")])).status == "not run"
    short = request(steps, g)
    short.spec_stats["draft_n"] = 3  # drafts shorter than draft-simple's full ones: the totals cannot say
    assert "no path" in CHECKS[NAME](context([short])).not_run
    # the lossless and baseline checks do not judge output that is not the target's
    assert CHECKS["lossless"](context([request(steps, g)])).status == "not run"


# ------------------------------------------------------------------------------------------ a real llama-server


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_models):
    """synth-acceptance's synth-rates seq cell on the vendored llama-server: (run directory, checks, results)."""
    out = tmp_path_factory.mktemp("synth") / "run"
    args = ["run", "--suite", "synth-acceptance", "--spec", "synth-rates", "--model", "tiny-dense", "--mode", "seq"]
    status = main([*args, "--out", str(out)])
    checks = json.loads((out / "checks.json").read_text())
    results = json.loads((out / "results.json").read_text())
    return status, out, checks, results


@pytest.mark.xdist_group("synth-acceptance-server")  # one worker serves the run once
def test_llama_server_accepts_at_the_configured_rates(served):
    status, out, checks, results = served
    synth = [c for c in checks if c["check"] == NAME and c["spec"] == "synth-rates"]
    assert status == 0 and len(synth) == 3, [c for c in checks if not c["passed"]][:2]
    assert all(c["passed"] and not c.get("not_run") for c in synth), synth
    assert all(c["evidence"]["rounds_compared"] == 3 and c["evidence"]["p_value"] >= ALPHA for c in synth)
    # the per-step log lines (-lv 5) give the totals the response gave, and per-position counts at the rates
    records = [r for r in results if r["spec"] == "synth-rates"]
    tasks: dict[str, list[str]] = {}
    for log in sorted((out / "server-logs").glob("llama-server-seq-*.log")):
        for message in llama_log.messages(llama_log.read(log, 0)):
            m = re.search(r"\| task (\d+) \| (.*)", message)
            if m and "add accepted tokens" in m.group(2):
                tasks.setdefault(f"{log.name}/{m.group(1)}", []).append(m.group(2))
    per_task = [steps_from_log(messages) for messages in tasks.values()]
    assert sorted((sum(n for n, _ in s), sum(a for _, a in s)) for s in per_task) == sorted(
        (r["spec_stats"]["draft_n"], r["spec_stats"]["draft_n_accepted"]) for r in records
    )
    verdict = judge_positions(*per_position(per_task[0], 4), RATES)
    assert verdict["passed"], verdict


@pytest.mark.xdist_group("synth-acceptance-server")  # one worker serves the run once
def test_llama_server_counts_fail_against_rates_it_was_not_given(served):
    _, _, _, results = served
    suite = load_suite("synth-acceptance")
    records = [r for r in results if r["spec"] == "synth-rates" and r["case"] == "C"]
    outcomes = [
        Result(tokens=r["tokens"], stop_reason=r["stop_reason"], slot_id=r["slot_id"], spec_stats=r["spec_stats"])
        for r in records
    ]
    run = CellRun(suite, CELL, [Outcome("C", i, o) for i, o in enumerate(outcomes)])
    ctx = CheckContext(run, "C", Runs(run), None, str, "repro")
    assert synth_acceptance(ctx).passed
    wrong = synth_acceptance(ctx, rates=[0.5, 0.3, 0.2, 0.1])
    assert not wrong.passed and wrong.evidence["p_value"] < ALPHA, wrong.evidence
    assert "expected at rates [0.5, 0.3, 0.2, 0.1]" in wrong.message
