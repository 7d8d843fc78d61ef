"""Slot save / restore (suites/slot-restore.yaml): the suite format, the `restore-identical` check, and the in-process
engine's save / restore of a slot with its draft context (llama-server's is the suite's, ggml-org/llama.cpp#28619)."""

from dataclasses import replace

import pytest

from harness.backends.base import ServeConfig
from harness.backends.inproc import InprocBackend
from harness.checks import CHECKS
from harness.checks.base import CheckContext
from harness.engine.context import Context, ContextParams
from harness.engine.model import Model
from harness.engine.slot_state import SavedSlot
from harness.errors import HarnessError
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome
from harness.suites import load_suite, parse_suite
from harness.suites.request import Request, Sampling

TURNS = [
    "Write a quicksort implementation in C with detailed comments.",
    "Now write a merge sort in C with the same style and commenting pattern.",
]

SUITE = """
suite: s
matrix: {modes: [seq], specs: [none, draft-simple]}
run_order: [seq, restore, restore-fresh]
restore: {after_turn: 1}
cases:
  - name: chat
    chat: [a, b, c]
"""


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (("restore: {after_turn: 1}\n", ""), "run_order: 'restore' needs `restore: {after_turn: N}`"),
        (("run_order: [seq, restore, restore-fresh]", "run_order: [seq, par]"), "no run_order round restores a slot"),
        (("chat: [a, b, c]", "chat: [a]"), "restore rounds need a chat of more than 1 turns"),
        (("modes: [seq]", "modes: [seq, par]"), "matrix.modes: restore rounds need `modes: [seq]`"),
        (("after_turn: 1", "after_turn: 0"), "restore.after_turn: 0 is less than the minimum of 1"),
    ],
)
def test_a_bad_restore_suite_is_a_one_line_error(change, error):
    assert parse_suite(SUITE).restore_after == 1
    with pytest.raises(HarnessError) as err:
        parse_suite(SUITE.replace(*change))
    assert error in str(err.value) and "\n" not in str(err.value)


def _result(tokens, drafted, accepted, cache_n=0):
    result = Result(prompt_tokens=[1, 2, 3], tokens=list(tokens), stop_reason="limit", slot_id=0)
    result.spec_stats = {"draft_n": drafted, "draft_n_accepted": accepted}
    result.timings.cache_n = cache_n
    return result


def _context(
    case: str, restored: tuple[int, int], spec: str = "draft-simple", backend: str = "server", reused: int = 73
) -> CheckContext:
    """A cell of a suite with rounds seq, restore, restore-fresh: turn 1 the same everywhere, `case` drafted
    (69, 29) uninterrupted with 73 prompt tokens reused, and `restored` with `reused` in both restore rounds."""
    suite = parse_suite(SUITE)
    run = CellRun(suite, Cell(backend, "seq", spec, "tiny-dense"))
    for r in range(3):
        run.outcomes.append(Outcome("chat.turn1", r, _result([5, 6], 49, 34)))
        counts = (69, 29) if r == 0 else restored
        run.outcomes.append(Outcome(case, r, _result([7, 8, 9], *counts, cache_n=reused if r else 73)))
    return CheckContext(run, case, None, None, str, "repro")


def test_restore_identical_passes_when_the_restored_turns_draft_as_uninterrupted():
    result = CHECKS["restore-identical"](_context("chat.turn2", (69, 29)))
    assert result.passed and result.not_run is None
    assert [c["kind"] for c in result.evidence["compared"]] == ["restore", "restore-fresh"]


def test_restore_identical_fails_on_a_restore_that_lost_the_draft_context():
    # llama-server at 0c1e570 on tiny-dense: the same output, 24 of 88 accepted instead of 29 of 69
    result = CHECKS["restore-identical"](_context("chat.turn2", (88, 24)))
    assert not result.passed
    assert result.failures == [
        f"round {r} ({kind}): chat.turn2 accepted 24 of 88 drafted tokens, 29 of 69 in the uninterrupted round 0 "
        "(same output)"
        for r, kind in ((1, "restore"), (2, "restore-fresh"))
    ]


def test_restore_identical_does_not_judge_turns_before_the_restore_nor_in_process_cells_without_drafts():
    assert CHECKS["restore-identical"](_context("chat.turn1", (88, 24))).not_run
    # the engine keeps no prompt cache: without drafts there is nothing to compare
    assert CHECKS["restore-identical"](_context("chat.turn2", (88, 24), spec="none", backend="inproc")).not_run
    # llama-server without drafts: the prompt reuse alone, the same as uninterrupted here
    plain = CHECKS["restore-identical"](_context("chat.turn2", (88, 24), spec="none"))
    assert plain.passed and plain.not_run is None
    ctx = _context("chat.turn2", (88, 24))
    ctx.run.suite.rounds = ["seq", "seq", "seq"]
    assert "restores no slot" in CHECKS["restore-identical"](ctx).not_run


def test_restore_identical_fails_a_restored_turn_that_reads_its_prompt_again_on_llama_server():
    """ggml-org/llama.cpp#28194: a restored slot without its context checkpoints reads the whole prompt (0 reused)
    where the uninterrupted slot went back to a checkpoint; with or without drafts, on llama-server only."""
    for spec in ("none", "draft-simple"):
        result = CHECKS["restore-identical"](_context("chat.turn2", (69, 29), spec=spec, reused=0))
        assert not result.passed
        assert result.failures == [
            f"round {r} ({kind}): chat.turn2 reused 0 prompt tokens of the restored slot, 73 in the uninterrupted "
            "round 0"
            for r, kind in ((1, "restore"), (2, "restore-fresh"))
        ]
    engine = CHECKS["restore-identical"](_context("chat.turn2", (69, 29), backend="inproc", reused=0))
    assert engine.passed  # the engine's cache_n is evidence only


def test_a_regenerate_turn_sends_the_last_prompt_again_and_replaces_its_reply():
    from harness.execute import Executor
    from harness.suites import REGENERATE

    suite = parse_suite(SUITE.replace("chat: [a, b, c]", "chat: [a, {regenerate: true}, c]"))
    case = suite.cases[0]
    assert case.turns[1] is REGENERATE
    histories = {"chat": []}
    first = Executor._request(case, 0, histories, None)
    histories["chat"].append({"role": "assistant", "content": "reply 1"})
    again = Executor._request(case, 1, histories, None)
    assert again.messages == first.messages == [{"role": "user", "content": "a"}]
    with pytest.raises(HarnessError, match="first turn has no reply to regenerate"):
        parse_suite(SUITE.replace("chat: [a, b, c]", "chat: [{regenerate: true}, b, c]"))


def test_the_slot_restore_suite_runs_by_default_on_both_backends():
    suite = load_suite("slot-restore")
    assert "restore-identical" in suite.checks and {"restore", "restore-fresh", "restore-over"} <= set(suite.rounds)
    assert suite.rounds[-1] == "restore-over"  # last: its abort on llama-server (a hybrid draft) spares the others
    block = suite.matrix[0]
    assert set(block["backends"]) == {"inproc", "server"} and "draft-simple" in block["specs"]
    assert {"tiny-dense", "tiny-hybrid"} <= set(block["models"]) and not suite.slow


def _empty(config: ServeConfig) -> bytes:
    """The state of an empty sequence of the draft model's context, as llama.cpp serializes it."""
    model = Model(config.draft_model)
    ctx = Context(model, ContextParams(n_ctx=config.n_ctx))
    try:
        return ctx.state_seq(0)
    finally:
        ctx.close()
        model.close()


def _chat(turns: list[str], replies: list[str]) -> Request:
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return Request(messages=messages, sampling=Sampling(n_predict=48, temperature=0.0))


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_the_engine_restores_a_slot_with_its_draft_context(tiny_models, model):
    """Turn 1 served, the slot saved, restored into a fresh engine: turn 2 reuses the restored tokens and drafts
    exactly as the uninterrupted chat; the same target state with an empty draft context (what llama-server's
    restore leaves in a fresh server) drafts otherwise, its output unchanged."""
    cell = Cell("inproc", "seq", "draft-simple", model)
    config = replace(serve_config(cell, ExecOptions(backends={})), engine={"slot_save": True}, kv_scan="off")
    assert isinstance(config, ServeConfig)
    backend = InprocBackend()
    first = backend.open(config)
    try:
        turn1 = first.run([_chat(TURNS[:1], [])])[0]
        saved = first.save_slot(0)
        turn2 = first.run([_chat(TURNS, [turn1.text])])[0]  # uninterrupted: the engine reads the whole prompt
    finally:
        first.close()
    assert turn1.ok and turn2.ok and "error" not in saved
    state = saved["state"]
    assert saved["n_saved"] == len(state.tokens) == len(turn1.prompt_tokens) + len(turn1.tokens) - 1
    assert len(state.drafts) == 1
    for variant in ("whole", "target only"):
        fresh = backend.open(config)
        try:
            restoring = state if variant == "whole" else SavedSlot(state.tokens, state.target, [_empty(config)])
            answer = fresh.restore_slot(0, restoring)
            assert answer.get("n_restored") == len(state.tokens), answer
            again = fresh.run([_chat(TURNS, [turn1.text])])[0]
        finally:
            fresh.close()
        assert again.ok and again.tokens == turn2.tokens
        assert again.timings.cache_n > 0 and again.timings.cache_n + again.timings.prompt_n == len(again.prompt_tokens)
        counts = (again.spec_stats["draft_n"], again.spec_stats["draft_n_accepted"])
        reference = (turn2.spec_stats["draft_n"], turn2.spec_stats["draft_n_accepted"])
        if variant == "whole":
            assert counts == reference
        else:
            assert counts != reference


def test_a_save_before_any_request_is_an_error_answer(tiny_models):
    session = InprocBackend().open(ServeConfig(model=tiny_models["tiny-dense"].path, engine={"slot_save": True}))
    try:
        assert "holds no finished request's state" in session.save_slot(0)["error"]
        assert "no slot 3" in session.restore_slot(3, SavedSlot([1], b""))["error"]
    finally:
        session.close()


class _Recorder:
    """A session that records what a restore round asks of it (each request's prompt, saves, restores)."""

    def __init__(self):
        self.calls = []

    def run(self, requests):
        [request] = requests
        self.calls.append(("run", request.tag or request.messages[-1]["content"], request.sampling.n_predict))
        return [Result(prompt_tokens=[1] * 30, tokens=[2] * 48, stop_reason="limit", slot_id=0)]

    def save_slot(self, slot):
        self.calls.append(("save", slot))
        return {"n_saved": 77, "state": "file"}

    def restore_slot(self, slot, state, erase=False):
        self.calls.append(("restore", slot, state, erase))
        return {"n_restored": 77}


def test_restore_over_serves_another_longer_conversation_then_restores_without_an_erase():
    """`restore-over`: after the saved turn the slot serves DETOUR (greedy, ignore_eos, as many tokens generated as
    the saved turn's prompt and output: the slot then holds more positions than the restore brings back), then the
    saved state comes back with no erase (llama-server's draft context keeps the other conversation: #28619)."""
    from harness.execute.slot_restore import DETOUR, SlotRestore, detour

    session = _Recorder()
    restore = SlotRestore(session, "restore-over", 1, lambda: pytest.fail("restore-over opens no fresh session"))
    for step, turn in enumerate(["a", "b", "c"]):
        assert restore.serve("chat", step, Request(messages=[{"role": "user", "content": turn}])).ok
    assert session.calls == [
        ("run", "a", 128),
        ("save", 0),
        ("run", "detour", 78),
        ("restore", 0, "file", False),
        ("run", "b", 128),
        ("run", "c", 128),
    ]
    other = detour(78)
    assert other.prompt == DETOUR and other.sampling.ignore_eos and other.sampling.temperature == 0
