"""`probs-complete` and `post_sampling_probs` on real outputs of both backends (tiny-dense, the `probs`
suite's seq cells): llama-server withholds the probabilities of every token a speculative step emits (a
known failure, ggml-org/llama.cpp#27972), the in-process engine returns what llama-server returns without
speculation, and the check fails a missing list, a list of the wrong size and probabilities beyond the
calibrated tolerance, while the known-failure entry explains only the first in llama-server's cells."""

import copy
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from harness.backends.choose import backend_factories
from harness.checks import lossless
from harness.checks.base import CheckContext, CheckResult
from harness.checks.probs import probs_complete
from harness.execute import CellRun, ExecOptions, Executor
from harness.matrix import Cell
from harness.result.logits import PositionLogits, check, compare
from harness.suites import load_suite
from harness.verdict import noise
from harness.verdict.known_failures import load as load_known
from harness.verdict.known_failures import tag

REPO = Path(__file__).resolve().parents[1]
SUITE = load_suite(str(REPO / "suites" / "probs.yaml"))
CASES = ("logprobs", "post_sampling", "post_sampling_sampled")
SERVER_SPEC = Cell("server", "seq", "draft-simple", "tiny-dense")
SERVER_PLAIN = SERVER_SPEC.reference(spec="none")
ENGINE_SPEC = SERVER_SPEC.reference(backend="inproc")
ENGINE_PLAIN = ENGINE_SPEC.reference(spec="none")
[ENTRY] = [e for e in load_known(REPO / "suites" / "known-failures.yaml") if e.id == "server-spec-tokens-without-probs"]


@pytest.fixture(scope="module")
def executor(tiny_models):
    ex = Executor(ExecOptions(backends=backend_factories(), kv_scan="off"))
    ex.expect([(SUITE, c) for c in (SERVER_SPEC, SERVER_PLAIN, ENGINE_SPEC, ENGINE_PLAIN)])
    return ex


def verdict(executor, cell: Cell, case: str, run: CellRun | None = None) -> CheckResult | None:
    ctx = CheckContext(run or executor.run(SUITE, cell), case, executor, None, str, "repro")
    return probs_complete(ctx)


def edited(executor, cell: Cell, case: str, edit) -> CellRun:
    """A copy of a real cell run whose `case` result (round 0) `edit` changed."""
    run = copy.deepcopy(executor.run(SUITE, cell))
    edit(next(o.result for o in run.outcomes if o.case == case))
    return run


def test_llama_server_returns_no_probabilities_for_speculative_tokens_and_the_entry_explains_it(executor):
    for case in CASES:
        result = verdict(executor, SERVER_SPEC, case)
        assert not result.passed
        found = re.match(
            r"seq-draft-simple-tiny-dense-server: (\d+) of 32 generated tokens without probabilities "
            r"\(n_probs 5(, post_sampling_probs)?\), first at token 1 of round 0$",
            result.message,
        )
        assert found and int(found[1]) >= 16, result.message  # most tokens come out of a verification step
        assert result.evidence["without_probs"] == int(found[1])
        assert tag([ENTRY], "probs", SERVER_SPEC, [result]) == [] and result.evidence["known_failure"] == ENTRY.id
        for cell in (SERVER_PLAIN, ENGINE_SPEC, ENGINE_PLAIN):  # the other cells carry every list
            clean = verdict(executor, cell, case)
            assert clean.passed and clean.evidence["without_probs"] == 0, (cell, clean.message)
    for case in ("logprobs", "post_sampling"):  # compared with the non-speculative cell, position by position
        assert verdict(executor, ENGINE_SPEC, case).evidence["compared_positions"] == 32


def test_a_withheld_position_is_re_scored_only_in_its_own_configuration_and_the_result_stays_as_returned(executor):
    result = next(o.result for o in executor.run(SUITE, SERVER_SPEC).outcomes if o.case == "logprobs")
    pos = next(p for p, rec in enumerate(result.logits) if len(rec.top_ids) == 0)
    before = verdict(executor, SERVER_SPEC, "logprobs").message
    plain = next(o.result for o in executor.run(SUITE, SERVER_PLAIN).outcomes if o.case == "logprobs")
    with executor.rescorer() as rescorer:
        # the speculative run's own batches replayed (harness.backends.server_rescore), never a plain decode: the
        # re-scored row picks the token the run emitted there, and says how it was computed
        mine = rescorer.score(SUITE, SERVER_SPEC, result, pos)
        assert (
            mine is not None
            and int(mine.top_ids[0]) == result.tokens[pos]
            and "replayed as its log lists them" in mine.how
        )
        scored = rescorer.score(SUITE, SERVER_PLAIN, plain, pos)  # a run without speculation: its own cell
    assert scored is not None and len(scored.top_ids) == 10
    assert len(result.logits[pos].top_ids) == 0
    assert verdict(executor, SERVER_SPEC, "logprobs").message == before


def test_the_engine_returns_llama_servers_own_probabilities_in_both_modes(executor):
    tol = noise.load("tiny-dense", "server", "cpu").tolerances
    for case in CASES:
        mine = next(o.result for o in executor.run(SUITE, ENGINE_PLAIN).outcomes if o.case == case)
        theirs = next(o.result for o in executor.run(SUITE, SERVER_PLAIN).outcomes if o.case == case)
        assert mine.tokens == theirs.tokens and len(mine.logits) == len(theirs.logits) == 32
        assert [len(p.top_ids) for p in mine.logits] == [len(p.top_ids) for p in theirs.logits]
        passed, message = check(compare(theirs.logits, mine.logits), tol)
        assert passed, f"{case}: {message}"
    greedy = next(o.result for o in executor.run(SUITE, ENGINE_PLAIN).outcomes if o.case == "post_sampling")
    assert all(
        rec.top_ids.tolist() == [t] and rec.top_logits.tolist() == [0.0]  # the pick, at probability 1
        for t, rec in zip(greedy.tokens, greedy.logits, strict=False)
    )
    sampled = next(o.result for o in executor.run(SUITE, ENGINE_PLAIN).outcomes if o.case == "post_sampling_sampled")
    assert max(len(rec.top_ids) for rec in sampled.logits) == 5
    assert all(np.exp(rec.top_logits).sum() <= 1.0 + 1e-6 for rec in sampled.logits)


def shifted(result, positions=None) -> None:
    """Move the second candidate's log-probability by 0.01 nats at `positions` (every listed one by default)."""
    for p, rec in enumerate(result.logits):
        if len(rec.top_ids) > 1 and (positions is None or p in positions):
            rec.top_logits = rec.top_logits.copy()
            rec.top_logits[1] += np.float32(0.01)


def test_probabilities_beyond_the_calibrated_tolerance_fail_and_the_entry_does_not_explain_them(executor):
    off = verdict(executor, ENGINE_SPEC, "logprobs", edited(executor, ENGINE_SPEC, "logprobs", shifted))
    assert not off.passed and off.failures == [off.message.split(": ", 1)[1]]
    assert off.message.startswith(
        "seq-draft-simple-tiny-dense-inproc: round 0: probabilities differ from the "
        "non-speculative run's beyond the near-tie floor"
    )
    assert "calibrated" in off.message
    # in llama-server's cells: the tokens it did return probabilities for disagree, besides the missing ones
    both = verdict(executor, SERVER_SPEC, "logprobs", edited(executor, SERVER_SPEC, "logprobs", shifted))
    assert len(both.failures) == 2 and re.match(r"round 0: \d+ of 32 tokens without probabilities", both.failures[0])
    assert both.failures[1].startswith("round 0: probabilities differ from the non-speculative run's")
    assert "; also round 0: probabilities differ" in both.message
    assert tag([ENTRY], "probs", SERVER_SPEC, [both]) == [both]
    assert "explains 1 of 2 failing requests" in both.message


def test_a_list_of_the_wrong_size_fails_and_the_entry_does_not_explain_it(executor):
    def cut(result, keep=3, at=4):
        rec = result.logits[at]
        result.logits[at] = replace(rec, top_ids=rec.top_ids[:keep], top_logits=rec.top_logits[:keep])

    short = verdict(executor, ENGINE_SPEC, "logprobs", edited(executor, ENGINE_SPEC, "logprobs", cut))
    assert not short.passed and short.message == (
        "seq-draft-simple-tiny-dense-inproc: round 0: 1 of 32 tokens with a "
        "top list of the wrong size, first at token 4 (3 entries, expected 5)"
    )

    def doubled(result):  # a greedy post-sampling list holds the pick alone
        rec = result.logits[2]
        result.logits[2] = replace(
            rec,
            top_ids=np.append(rec.top_ids, 7).astype(np.int32),
            top_logits=np.append(rec.top_logits, -9.0).astype(np.float32),
        )

    extra = verdict(executor, ENGINE_PLAIN, "post_sampling", edited(executor, ENGINE_PLAIN, "post_sampling", doubled))
    assert not extra.passed and "first at token 2 (2 entries, expected 1)" in extra.message
    served = verdict(
        executor, SERVER_SPEC, "logprobs", edited(executor, SERVER_SPEC, "logprobs", lambda r: cut(r, at=0))
    )
    assert len(served.failures) == 2 and tag([ENTRY], "probs", SERVER_SPEC, [served]) == [served]


def test_a_missing_list_fails_in_any_cell_but_a_stop_strings_tail_is_excused(executor):
    def emptied(result):
        result.logits[7] = PositionLogits(np.empty(0, np.int32), np.empty(0, np.float32))

    gap = verdict(executor, ENGINE_PLAIN, "logprobs", edited(executor, ENGINE_PLAIN, "logprobs", emptied))
    assert not gap.passed and gap.message == (
        "seq-none-tiny-dense-inproc: 1 of 32 generated tokens without "
        "probabilities (n_probs 5), first at token 7 of round 0"
    )
    assert tag([ENTRY], "probs", ENGINE_PLAIN, [gap]) == [gap]  # the entry covers llama-server's speculative cells

    def trimmed(result, reason):
        result.logits = result.logits[:-2]
        result.stop_reason = reason

    assert verdict(
        executor, ENGINE_PLAIN, "logprobs", edited(executor, ENGINE_PLAIN, "logprobs", lambda r: trimmed(r, "word"))
    ).passed
    tail = verdict(
        executor, ENGINE_PLAIN, "logprobs", edited(executor, ENGINE_PLAIN, "logprobs", lambda r: trimmed(r, "limit"))
    )
    assert not tail.passed and "2 of 32 generated tokens without probabilities" in tail.message
    assert "first at token 30" in tail.message


def test_sampled_post_sampling_probabilities_are_checked_for_presence_not_compared(executor):
    moved = verdict(
        executor, ENGINE_SPEC, "post_sampling_sampled", edited(executor, ENGINE_SPEC, "post_sampling_sampled", shifted)
    )
    assert moved.passed and "compared_positions" not in moved.evidence
    compared = verdict(
        executor,
        ENGINE_SPEC,
        "post_sampling",
        edited(
            executor,
            ENGINE_SPEC,
            "post_sampling",
            lambda r: setattr(r.logits[3], "top_logits", np.array([-0.5], np.float32)),
        ),
    )
    assert not compared.passed and "probabilities differ" in compared.message


def test_the_entry_explains_no_other_failure_of_its_cells(executor):
    def none_at_all(result):  # a server that returned no probabilities at all is another defect
        result.logits = [PositionLogits(np.empty(0, np.int32), np.empty(0, np.float32)) for _ in result.tokens]

    everything = verdict(executor, SERVER_SPEC, "logprobs", edited(executor, SERVER_SPEC, "logprobs", none_at_all))
    assert "32 of 32 generated tokens" in everything.message and "first at token 0" in everything.message
    assert tag([ENTRY], "probs", SERVER_SPEC, [everything]) == [everything]
    run = edited(executor, SERVER_SPEC, "logprobs", lambda r: r.tokens.__setitem__(5, r.tokens[5] + 1))
    lossy = lossless(CheckContext(run, "logprobs", executor, None, str, "repro"))
    assert not lossy.passed and tag([ENTRY], "probs", SERVER_SPEC, [lossy]) == [lossy]
    assert not ENTRY.covers("probs", SERVER_PLAIN) and not ENTRY.covers("probs", ENGINE_SPEC)


def test_without_n_probs_the_check_does_not_apply(executor):
    plain = replace(SUITE, cases=[replace(c, sampling=replace(c.sampling, n_probs=None)) for c in SUITE.cases])
    run = replace(executor.run(SUITE, ENGINE_PLAIN), suite=plain)
    assert verdict(executor, ENGINE_PLAIN, "logprobs", run).not_run


def test_triage_reads_the_models_logits_not_post_sampling_probabilities(executor):
    run = edited(executor, ENGINE_SPEC, "post_sampling", lambda r: r.tokens.__setitem__(5, r.tokens[5] + 1))
    lossy = lossless(CheckContext(run, "post_sampling", executor, None, str, "repro"))
    first = lossy.evidence["first_divergence"]
    assert not lossy.passed and first["index"] == 5
    # the logged lists hold the pick alone at probability 1 (no margin): the reference is re-scored instead
    assert "reference at 5" in first["rescored"] and first["margin"] is not None and first["margin"] > 0


def test_a_token_llama_server_gives_no_entry_keeps_no_probabilities_and_later_entries_stay_on_their_tokens():
    """llama-server leaves out the entry of a token after which the text ends inside a UTF-8 character
    (process_token adds it only when the text is complete): matched by id, that token gets an empty record and the
    next entry stays on its own token; tokens after the last entry (a stop string's) keep none."""
    from harness.result.logits import from_server_probs

    def entry(token: int) -> dict:
        return {"id": token, "logprob": -0.1, "top_logprobs": [{"id": token, "logprob": -0.1}]}

    records = from_server_probs([entry(5), entry(7), entry(8)], [5, 236, 7, 8, 9, 10])
    assert [r.top_ids.tolist() for r in records] == [[5], [], [7], [8]]
    assert [r.top_ids.tolist() for r in from_server_probs([entry(5), entry(7)])] == [[5], [7]]  # no tokens: as listed
