"""Every check of the check list (harness.checks.CHECKS) is shown to fail where it should (issue 28, "every verdict
earned"): on a real llama.cpp output (the in-process engine or llama-server on a tiny model) or on a named seeded
fault (an engine fault switch, harness/engine/faults.py, or a fault this module seeds into the engine). Each row
of `FAILS` names its scenario and the test that proves the case in depth; the test here produces the failing
verdict itself, through the one evaluation (harness.checks.evaluate_cell). A check added to CHECKS without a row
fails `test_the_check_fails_on_real_output_or_a_seeded_fault[<check>]`.

That every check can also be "not run" with its reason, shown in index.html and junit.xml, is
tests/test_verdict_outcomes.py::test_every_check_can_be_not_run_with_a_reason_shown_in_index_html_and_junit.

One run per scenario (module scope, made on first use), tiny models, few cases: about 20 s on 2 busy cores."""

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.backends.choose import backend_factories
from harness.checks import CHECKS, evaluate_cell
from harness.engine import ContextParams, Engine
from harness.engine.drafters.scripted import Scripted
from harness.engine.slot import Slot
from harness.engine.spec_config import SpecConfig
from harness.engine.speculative import Speculation
from harness.execute import ExecOptions, Executor
from harness.matrix import Cell
from harness.models import resolve
from harness.result.cellrun import CellRun, Outcome
from harness.suites import load_suite
from harness.suites.request import Request
from harness.verdict.baselines import BaselineStore, default_root

pytestmark = pytest.mark.xdist_group("every-check-fails")  # one worker makes each scenario's run once

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Failing:
    """Where a check fails: the scenario (`SCENARIOS`), the cell and case judged, a pattern its failing message
    must match, and the test that proves the case in depth (`file::function`)."""

    scenario: str
    cell: Cell
    case: str
    """The case judged; `a|b` where the fault shows in one of them, which one by chance (the slot a request gets)."""
    evidence: str
    proved_by: str


SCENARIOS = {
    "start-up abort": "real: llama.cpp aborts while the engine loads the model, a logical batch smaller than the "
    "sequences (-b 1 -np 2): GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)",
    "random seed": "real: seed -1, llama.cpp draws a new seed per request, so rounds and modes sample other tokens",
    "p-min 0.99": "real: --spec-draft-p-min 0.99 (upstream's setting) on tiny-dense, whose draft model's top "
    "probabilities stay below 0.6: the draft model never drafts",
    "no-sampler-restore": "seeded fault no-sampler-restore (harness/engine/faults.py) under forced rejection",
    "rollback-off-by-one": "seeded fault rollback-off-by-one (harness/engine/faults.py) under forced rejection",
    "stale-draft-context": "seeded fault stale-draft-context (harness/engine/faults.py) with the draft model",
    "llama-server eog": "real: llama-server at the vendored commit keeps a drafted EOG token in the slot "
    "(known failure server-spec-keeps-eog, ggml-org/llama.cpp#28049)",
    "llama-server probs": "real: llama-server withholds the probabilities of speculative tokens (known failure "
    "server-spec-tokens-without-probs, ggml-org/llama.cpp#27972)",
    "llama-server slot restore": "real: llama-server restores a saved slot without its draft context (known "
    "failure slot-restore-drops-draft-context, ggml-org/llama.cpp#28619)",
    "draft-past-n-predict": "seeded fault draft-past-n-predict (this module): drafts are not capped at "
    "n_remaining - 1 and a step's accepted tokens are all returned, as llama-server did before "
    "ggml-org/llama.cpp#10641",
    "lenient-accept": "seeded fault lenient-accept (harness/engine/faults.py): rejection sampling accepts every "
    "drafted token the target gives any probability",
    "llama-server metrics lost": "seeded fault in llama-server (tests/test_metrics_agree.py LOST_ACCEPTED): slots "
    "above 0 never add their accepted drafts to /metrics",
    "llama-server short drafts kept": "seeded fault in llama-server (tests/test_draft_size.py N_MIN_BREAK, mutant "
    "9905836fa1b6 of `specharness mutate`): draft-simple's loop over the slots stops at the first draft it drops "
    "for being shorter than --spec-draft-n-min, and the later slots verify theirs",
    "llama-server synth rates": "real: llama-server served with --spec-synth-rates 0.5,0.3,0.2,0.1 and judged "
    "against the synth-rates preset's 0.9,0.7,0.5,0.3 (the executor that judges was not given the override)",
}

GRAMMAR = Cell("inproc", "seq", "scripted-reject", "tiny-hybrid")
SERVER = Cell("server", "seq", "draft-simple", "tiny-hybrid")
FAILS = {
    "no-crash": Failing(
        "start-up abort",
        Cell("inproc", "par", "none", "tiny-dense"),
        "hello",
        r"GGML_ASSERT\(n_outputs_max <= cparams\.n_outputs_max\) failed",
        "test_verdict_outcomes.py::test_a_llama_cpp_abort_at_start_up_is_a_no_crash_failure_with_its_abort_line_on_"
        "both_backends",
    ),
    "repeat-identical": Failing(
        "random seed",
        Cell("inproc", "seq", "none", "tiny-dense"),
        "a",
        r"2 unique outputs over 2 runs",
        "test_checks.py::test_repeat_identical",
    ),
    "lossless": Failing(
        "no-sampler-restore",
        GRAMMAR,
        "sort_report",
        r"outputs differ from the non-speculative output",
        "test_selftest.py::test_the_fault_is_caught_by_its_expected_check_and_evidence",
    ),
    "mode-invariant": Failing(
        "random seed",
        Cell("inproc", "par", "none", "tiny-dense"),
        "a",
        r"[12] of 2 outputs differ from the seq output",
        "test_checks.py::test_mode_invariant_fails_par_and_no_kv_unified_unless_a_proven_near_tie",
    ),
    "baseline": Failing(
        "no-sampler-restore",
        GRAMMAR,
        "sort_report",
        r"outputs differ from the baseline fixtures/baselines/grammar-json/sort_report--tiny-hybrid--inproc--cpu\.json",
        "test_checks.py::test_baseline",
    ),
    "spec-ran": Failing(
        "p-min 0.99",
        Cell("inproc", "seq", "draft-simple", "tiny-dense"),
        "a",
        r"no drafts at all for the case",
        "test_checks.py::test_spec_ran",
    ),
    "acceptance": Failing(
        "stale-draft-context",
        Cell("inproc", "seq", "draft-simple", "tiny-dense"),
        "C",
        r"against baseline \(tolerance [\d.e-]+\): acceptance",
        "test_selftest.py::test_the_fault_is_caught_by_its_expected_check_and_evidence",
    ),
    "grammar-valid": Failing(
        "no-sampler-restore",
        GRAMMAR,
        "sort_report",
        r"1 invalid outputs; round 0: ",
        "test_selftest.py::test_the_fault_is_caught_by_its_expected_check_and_evidence",
    ),
    "kv-healthy": Failing(
        "rollback-off-by-one",
        GRAMMAR,
        "sort_report",
        r"left an unhealthy KV cache \([1-9]\d* duplicate cells",
        "test_selftest.py::test_the_fault_is_caught_by_its_expected_check_and_evidence",
    ),
    "logits-close": Failing(
        "rollback-off-by-one",
        GRAMMAR,
        "sort_report",
        r"logits differ from the seq / no-speculation run beyond the near-tie floor",
        "test_checks.py::test_logits_close",
    ),
    "exercised": Failing(
        "start-up abort",
        Cell("inproc", "par", "none", "tiny-dense"),
        "hello",
        r"only 0 of 1 requests completed \(expected at least 100%\)",
        "test_checks.py::test_exercised_needs_completed_requests_and_the_counted_path",
    ),
    "probs-complete": Failing(
        "llama-server probs",
        SERVER,
        "logprobs",
        r"of 32 generated tokens without probabilities \(n_probs 5\), first at token [1-9]",
        "test_probs.py::test_llama_server_returns_no_probabilities_for_speculative_tokens_and_the_entry_explains_it",
    ),
    "prompt-reuse": Failing(
        "llama-server eog",
        SERVER,
        "chat.turn2",
        r"chat\.turn2 reused \d+ of its \d+ prompt tokens from the cache, \d+ in seq-none-tiny-hybrid-server "
        r"\(chat\.turn1 left positions",
        "test_eog.py::test_the_hybrids_next_turn_reprocesses_the_previous_answer_on_llama_server_only",
    ),
    "restore-identical": Failing(
        "llama-server slot restore",
        Cell("server", "seq", "draft-simple", "tiny-dense"),
        "chat.turn2",
        r"round 1 \(restore\): .*accepted \d+ of \d+ drafted tokens, \d+ of \d+ in the uninterrupted round 0",
        "test_slot_restore.py::test_restore_identical_fails_on_a_restore_that_lost_the_draft_context",
    ),
    "within-n-predict": Failing(
        "draft-past-n-predict",
        Cell("inproc", "seq", "scripted-accept", "tiny-dense"),
        "a",
        r"1 of 1 requests broke n_predict; round 0: 1[0-9] tokens returned for n_predict 9",
        "test_checks.py::test_within_n_predict",
    ),
    "draft-size": Failing(
        "llama-server short drafts kept",
        Cell("server", "par", "draft-p-min-0.2-n-min-2", "tiny-dense"),
        "C|Python",
        r"requests verified drafts outside \[2, 4\]; round \d: \d+ drafts of \[1\] tokens verified, below n_min 2",
        "test_draft_size.py::test_a_server_that_keeps_short_drafts_of_later_slots_fails_draft_size_in_par_only",
    ),
    "distribution": Failing(
        "lenient-accept",
        Cell("inproc", "seq", "draft-simple-probabilistic", "tiny-dense"),
        "prose",
        r"the returned tokens are not draws from the target's distribution: Kolmogorov-Smirnov D = [\d.]+ over "
        r"\d+ tokens of 1 outputs, p = [\d.e+-]+ < 1e-06",
        "test_selftest.py::test_the_fault_is_caught_by_its_expected_check_and_evidence",
    ),
    "synth-acceptance": Failing(
        "llama-server synth rates",
        Cell("server", "seq", "synth-rates", "tiny-dense"),
        "C",
        r"round 0: \d+ of \d+ drafted tokens accepted, [\d.]+ expected at rates \[0\.9, 0\.7, 0\.5, 0\.3\]: "
        r"p = [\d.e+-]+ < alpha",
        "test_synth_acceptance.py::test_llama_server_counts_fail_against_rates_it_was_not_given",
    ),
    "metrics-agree": Failing(
        "llama-server metrics lost",
        Cell("server", "par", "draft-simple", "tiny-hybrid"),
        "code_python",
        r"llama-server's /metrics disagree with its answers: .*spec_decode_num_accepted_tokens_total moved by \d+, "
        r"the answers' draft_n_accepted add up to \d+",
        "test_metrics_agree.py::"
        "test_a_server_whose_metrics_lose_the_accepted_drafts_of_slots_above_0_fails_metrics_agree_outside_seq",
    ),
    "work": Failing(
        "stale-draft-context",
        Cell("inproc", "seq", "draft-simple", "tiny-dense"),
        "C",
        # the stale context drafts otherwise (acceptance's to judge; work compares no rounds of other drafts), and
        # both contexts decode more per generated token
        r"more work than the baseline in target_decoded, draft_decoded",
        "test_work.py::test_full_checkpoint_fails_work_naming_the_bytes_and_nothing_else",
    ),
}

# --- the scenarios' suites: the repository's, narrowed, or written here ------------------------------------------

START_UP_ABORT = """\
suite: meta-abort
matrix: {backends: [inproc], modes: [par], specs: [none], models: [tiny-dense]}
serve: {n_ctx: 256, n_batch: 1, n_ubatch: 1, parallel: 2}
sampling: {n_predict: 4, temperature: 0}
expect: {completed_min: 1.0}
checks: [no-crash, exercised]
cases:
  - {name: hello, prompt: "Hello"}
"""
RANDOM_SEED = """\
suite: meta-random
matrix: {backends: [inproc], modes: [seq, par], specs: [none], models: [tiny-dense]}
sampling: {n_predict: 16, temperature: 1.0, seed: -1}
run_order: [seq, seq]
checks: [repeat-identical, mode-invariant]
cases:
  - {name: a, prompt: "Write a quicksort demo in C."}
"""
DRAFTS = """\
suite: meta-drafts
matrix: {backends: [inproc], modes: [seq], specs: [draft-simple], models: [tiny-dense]}
sampling: {n_predict: 16, temperature: 0}
checks: [spec-ran]
cases:
  - {name: a, prompt: "Write a quicksort demo in C."}
"""
BUDGET = """\
suite: meta-budget
matrix: {backends: [inproc], modes: [seq], specs: [scripted-accept], models: [tiny-dense]}
sampling: {n_predict: 9, temperature: 0, ignore_eos: true}
checks: [within-n-predict]
cases:
  - {name: a, prompt: "Write a quicksort demo in C."}
"""


def narrowed(name: str, cases: list[str]):
    """A suite of suites/ with only `cases` (same name, so the same baselines)."""
    suite = load_suite(name)
    return dataclasses.replace(suite, cases=[c for c in suite.cases if c.name in cases])


def executor(**options) -> Executor:
    return Executor(ExecOptions(backends=backend_factories(), kv_scan="request", **options))


def draft_past_n_predict(suite, cell: Cell) -> CellRun:
    """The seeded fault `draft-past-n-predict`, in an engine run in this process (a fault switch reaches the
    engine's worker process only through harness/engine/faults.py): each step drafts as if the request had no
    n_predict (llama-server's get_n_draft_max without its `n_remaining - 1` cap) and returns every token the step
    accepted, meeting n_predict only after the step. The drafter proposes the request's own greedy output, so
    every draft is accepted and the last step runs past n_predict."""
    case = suite.cases[0]
    model, params = resolve(cell.model).path, ContextParams(n_ctx=256)
    longer = dataclasses.replace(case.sampling, n_predict=32)
    with Engine(model, params, None) as engine:
        (script,) = engine.run([Request(prompt=case.prompt, sampling=longer)])
    remaining, plan, emit_all = Slot.n_remaining, Speculation.plan, Slot.emit_all

    def uncapped(slot, call):
        slot.seeded_uncapped = True
        try:
            return call()
        finally:
            slot.seeded_uncapped = False

    def emit_every_token(slot, tokens, logits) -> bool:
        done = uncapped(slot, lambda: emit_all(slot, tokens, logits))
        return done or (slot.request.sampling.n_predict >= 0 and slot.n_remaining <= 0 and slot._finish("limit"))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            Slot,
            "n_remaining",
            property(lambda s: 1 << 30 if getattr(s, "seeded_uncapped", False) else remaining.fget(s)),
        )
        patch.setattr(Speculation, "plan", lambda self, slot, room: uncapped(slot, lambda: plan(self, slot, room)))
        patch.setattr(Slot, "emit_all", emit_every_token)
        with Engine(model, params, SpecConfig(drafters=[Scripted(script.tokens, n_max=4)])) as engine:
            (result,) = engine.run([Request(prompt=case.prompt, sampling=case.sampling)])
    return CellRun(suite, cell, [Outcome(case.name, 0, result)])


class Scenarios:
    """Each scenario's cell runs, made on first use: name → (the cells source, {cell: CellRun})."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.made: dict[str, tuple] = {}

    def suite(self, text: str):
        name = text.split("\n", 1)[0].removeprefix("suite: ")
        path = self.tmp / f"{name}.yaml"
        path.write_text(text)
        return load_suite(str(path))

    def get(self, name: str) -> tuple:
        if name not in self.made:
            self.made[name] = self.make(name)
        return self.made[name]

    def make(self, name: str) -> tuple:
        cells = [f.cell for f in FAILS.values() if f.scenario == name]
        if name == "draft-past-n-predict":
            suite = self.suite(BUDGET)
            return None, {cell: draft_past_n_predict(suite, cell) for cell in cells}
        if name == "llama-server metrics lost":  # a one-edit server-context.cpp variant, built through the cache
            from seeded import seeded_tree
            from test_metrics_agree import LOST_ACCEPTED

            from harness.backends.build import ensure_server

            tree = seeded_tree(LOST_ACCEPTED, "seeded-metrics-lost-accepted", "tests/test_metrics_agree.py")
            build = ensure_server(source=tree)
            served = Executor(ExecOptions(backends=backend_factories(build=build), kv_scan="request"))
            return served, {
                cell: served.run(narrowed("categories", ["code_python", "code_cpp", "explain_concept"]), cell)
                for cell in cells
            }
        if name == "llama-server short drafts kept":  # a one-edit speculative.cpp variant, built through the cache
            from seeded import seeded_tree
            from test_draft_size import N_MIN_BREAK, N_MIN_TREE

            from harness.backends.build import ensure_server

            build = ensure_server(source=seeded_tree(N_MIN_BREAK, *N_MIN_TREE))
            served = Executor(ExecOptions(backends=backend_factories(build=build), kv_scan="request"))
            suite = load_suite("forced-rejection")
            suite.rounds = ["par"] * 5  # both requests at once: the slot after slot 0 verifies short drafts in 9 of 10
            return served, {cell: served.run(suite, cell) for cell in cells}
        if name == "llama-server synth rates":  # served with other rates than the judging executor's (the preset's)
            served = executor(spec_overrides={"spec-synth-rates": "0.5,0.3,0.2,0.1"})
            return executor(), {cell: served.run(narrowed("quicksort", ["C"]), cell) for cell in cells}
        suite, ex = {
            "start-up abort": lambda: (self.suite(START_UP_ABORT), executor()),
            "random seed": lambda: (self.suite(RANDOM_SEED), executor()),
            "p-min 0.99": lambda: (self.suite(DRAFTS), executor(spec_overrides={"spec-draft-p-min": 0.99})),
            "no-sampler-restore": lambda: (narrowed("grammar-json", ["sort_report"]), executor(engine={"fault": name})),
            "rollback-off-by-one": lambda: (
                narrowed("grammar-json", ["sort_report"]),
                executor(engine={"fault": name}),
            ),
            "stale-draft-context": lambda: (narrowed("quicksort", ["C"]), executor(engine={"fault": name})),
            "lenient-accept": lambda: (
                narrowed("statistical/sampling-distribution", ["prose"]),
                executor(engine={"fault": name}),
            ),
            "llama-server eog": lambda: (narrowed("eog", ["chat"]), executor()),
            "llama-server probs": lambda: (narrowed("probs", ["logprobs"]), executor()),
            "llama-server slot restore": lambda: (load_suite("slot-restore"), executor()),
        }[name]()
        return ex, {cell: ex.run(suite, cell) for cell in cells}


@pytest.fixture(scope="module")
def scenarios(tiny_models, tmp_path_factory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("every-check-fails"))


def test_the_table_names_registered_checks_known_scenarios_and_existing_tests():
    assert set(FAILS) <= set(CHECKS), set(FAILS) - set(CHECKS)
    assert {f.scenario for f in FAILS.values()} == set(SCENARIOS)
    for check, f in FAILS.items():
        path, _, function = f.proved_by.partition("::")
        assert f"def {function}(" in (TESTS / path).read_text(), f"{check}: {f.proved_by} does not exist"


@pytest.mark.parametrize("check", list(CHECKS))
def test_the_check_fails_on_real_output_or_a_seeded_fault(check, scenarios):
    assert check in FAILS, (
        f"{check} has no case that fails it: add a row to FAILS (a real llama.cpp output or a named seeded fault)"
    )
    f = FAILS[check]
    cells, runs = scenarios.get(f.scenario)
    keys = f.case.split("|")
    results = evaluate_cell(runs[f.cell], cells, BaselineStore(default_root()), [check], "repro", keys=keys)
    assert [key for key, _ in results] == keys
    result = next((r for _, r in results if r.status == "failed"), results[0][1])
    assert result.status == "failed", f"{check} on {f.cell.id} {f.case} ({SCENARIOS[f.scenario]}): {result.message}"
    assert re.search(f.evidence, result.message), result.message
