"""Drafts that run through an end-of-generation token (ggml-org/llama.cpp#28049) and the prompt a chat turn
reuses (`prompt-reuse`): the checks on hand-made outcomes, then the `eog` suite's seq cells on both backends.
llama-server at 0c1e570 keeps the EOG token in the slot (known failure server-spec-keeps-eog) and counts it
as an accepted draft token; the in-process engine does neither; the entry explains only that."""

import copy
import re
from pathlib import Path

import pytest

from harness.backends.choose import backend_factories
from harness.checks import CHECKS, kv_healthy
from harness.checks.base import CheckContext, CheckResult
from harness.checks.reuse import prompt_reuse
from harness.execute import CellRun, ExecOptions, Executor, Outcome
from harness.matrix import Cell
from harness.result import Result, Timings
from harness.suites import Case, Suite, load_suite
from harness.suites.request import Sampling
from harness.verdict.known_failures import load as load_known
from harness.verdict.known_failures import tag

REPO = Path(__file__).resolve().parents[1]
SUITE = load_suite(str(REPO / "suites" / "eog.yaml"))
KNOWN = {e.id: e for e in load_known(REPO / "suites" / "known-failures.yaml")}
EOG = KNOWN["server-spec-keeps-eog"]


# ---------------------------------------------------------------------------------------------- hand-made


def scanned(prompt: int, tokens: int, pos_max: int, stop: str = "eos", **timings) -> Result:
    """A request whose KV scan found a healthy sequence reaching position `pos_max`."""
    scan = {
        "healthy": True,
        "totals": {"duplicate_cells": 0, "orphans": 0, "missing_positions": 0},
        "pos_max": {"0": pos_max},
        "duplicates": [],
        "orphans": [],
        "holes": [],
    }
    return Result(
        prompt_tokens=list(range(prompt)),
        tokens=list(range(tokens)),
        stop_reason=stop,
        kv_scan=scan,
        timings=Timings(**timings),
    )


def chat_suite() -> Suite:
    return Suite(
        name="demo",
        path=None,
        cases=[Case("chat", Sampling(), turns=["a", "b"])],
        matrix=[],
        checks=list(CHECKS),
        rounds=["seq"],
    )


class Cells:
    """Stands in for the Executor: each cell's outcomes are given."""

    def __init__(self, suite: Suite, cells: dict[Cell, list[Outcome]]):
        self.runs = {cell: CellRun(suite, cell, outcomes) for cell, outcomes in cells.items()}

    def run(self, _suite, cell):
        return self.runs[cell]


SPEC = Cell("server", "seq", "draft-simple", "tiny-hybrid")
PLAIN = SPEC.reference(spec="none")


def ctx_of(cells: dict, case: str, cell: Cell = SPEC) -> CheckContext:
    suite = chat_suite()
    runs = Cells(suite, cells)
    return CheckContext(runs.run(suite, cell), case, runs, None, str, "repro")


def test_kv_healthy_fails_a_slot_that_keeps_positions_past_the_returned_tokens():
    at_end = scanned(31, 26, 56)  # positions 0..56: the prompt and the returned tokens, nothing more
    assert kv_healthy(ctx_of({SPEC: [Outcome("chat.turn1", 0, at_end)]}, "chat.turn1")).passed
    kept = scanned(31, 26, 57)
    failed = kv_healthy(ctx_of({SPEC: [Outcome("chat.turn1", 0, kept)]}, "chat.turn1"))
    assert not failed.passed and failed.evidence["past_returned"] == 1
    assert failed.failures == [
        "round 0: 1 position past the returned tokens: the slot keeps positions 57..57 after "
        "31 prompt + 26 returned tokens (stop: eos)"
    ]
    limit = scanned(31, 26, 55, stop="limit")  # a request stopped by n_predict holds one position less
    assert kv_healthy(ctx_of({SPEC: [Outcome("chat.turn1", 0, limit)]}, "chat.turn1")).passed
    at_context_end = scanned(31, 26, 58, stop="limit")
    at_context_end.truncated = True  # left to the context-end checks (ggml-org/llama.cpp#10641)
    assert kv_healthy(ctx_of({SPEC: [Outcome("chat.turn1", 0, at_context_end)]}, "chat.turn1")).passed


def test_prompt_reuse_compares_each_turn_with_the_same_turn_without_speculation():
    def turns(cache_n: int, kept: int) -> list[Outcome]:
        return [
            Outcome("chat.turn1", 0, scanned(31, 26, kept)),
            Outcome("chat.turn2", 0, scanned(94, 8, 101, cache_n=cache_n)),
        ]

    same = ctx_of({SPEC: turns(57, 56), PLAIN: turns(57, 56)}, "chat.turn2")
    assert prompt_reuse(same).passed and prompt_reuse(same).evidence["cache_n"] == [57]
    less = prompt_reuse(ctx_of({SPEC: turns(27, 57), PLAIN: turns(57, 56)}, "chat.turn2"))
    assert not less.passed
    assert less.failures == [
        "round 0: chat.turn2 reused 27 of its 94 prompt tokens from the cache, 57 in "
        "seq-none-tiny-hybrid-server (chat.turn1 left positions 57..57 past its 26 returned "
        "tokens, stop: eos)"
    ]
    assert prompt_reuse(ctx_of({PLAIN: turns(57, 56)}, "chat.turn2", PLAIN)).not_run  # no speculation
    other_prompt = turns(57, 56)
    other_prompt[1].result.prompt_tokens = list(range(95))  # an earlier reply differed: lossless reports it
    assert prompt_reuse(ctx_of({SPEC: turns(27, 57), PLAIN: other_prompt}, "chat.turn2")).not_run


@pytest.mark.parametrize("entry", ["server-spec-keeps-eog", "server-spec-keeps-eog-sampled"])
def test_the_entry_explains_its_stop_and_nothing_else(entry):
    EOG = KNOWN[entry]  # noqa: N806 (the module's name for the entry, per parameter)
    eog = CheckResult(
        "kv-healthy",
        False,
        "x",
        failures=[
            "round 0: 1 position past the returned tokens: the slot "
            "keeps positions 21..21 after 12 prompt + 9 returned "
            "tokens (stop: eos)"
        ],
    )
    for other in ("limit", "word"):  # positions kept past a stop string or n_predict are something else
        assert not EOG.explains(CheckResult("kv-healthy", False, "x", failures=[eog.failures[0].replace("eos", other)]))
    assert EOG.explains(eog)
    dup = "round 0: 2 duplicate cells, 0 orphans: 3 cells at (seq 0, pos 3)"
    assert not EOG.explains(CheckResult("kv-healthy", False, "x", failures=[eog.failures[0], dup]))
    unexplained = CheckResult(
        "prompt-reuse",
        False,
        "x",
        failures=[
            "round 0: chat.turn2 reused 27 of its 94 prompt tokens from the cache, 57 in seq-none-tiny-hybrid-server"
        ],
    )
    assert not EOG.explains(unexplained)  # less reuse the previous turn's leftover does not account for
    if entry.endswith("-sampled"):  # only kv-healthy, only the cells it names
        assert EOG.covers("sampling", Cell("server", "par", "draft-simple", "tiny-recurrent"))
        assert not EOG.covers("sampling", Cell("server", "par", "draft-simple", "tiny-hybrid"))


# ---------------------------------------------------------------------------------------------- real runs

CELLS = {
    (backend, model, spec): Cell(backend, "seq", spec, model)
    for backend in ("inproc", "server")
    for model in ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
    for spec in ("none", "draft-simple")
}


@pytest.fixture(scope="module")
def executor(tiny_models):
    ex = Executor(ExecOptions(backends=backend_factories(), kv_scan="request"))
    ex.expect([(SUITE, c) for c in CELLS.values()])
    return ex


def result_of(executor, backend: str, model: str, spec: str, case: str) -> Result:
    return next(o.result for o in executor.run(SUITE, CELLS[(backend, model, spec)]).outcomes if o.case == case)


def check(executor, name: str, backend: str, model: str, case: str, run: CellRun | None = None) -> CheckResult:
    cell = CELLS[(backend, model, "draft-simple")]
    return CHECKS[name](CheckContext(run or executor.run(SUITE, cell), case, executor, None, str, "repro"))


REPRODUCED = [("tiny-dense", "last_draft"), ("tiny-recurrent", "replay"), ("tiny-hybrid", "chat.turn1")]


@pytest.mark.parametrize("model, case", REPRODUCED)
def test_llama_server_keeps_the_eog_token_and_the_engine_does_not(executor, model, case):
    served = result_of(executor, "server", model, "draft-simple", case)
    engine = result_of(executor, "inproc", model, "draft-simple", case)
    plain = result_of(executor, "server", model, "none", case)
    assert served.stop_reason == engine.stop_reason == plain.stop_reason == "eos"
    assert served.tokens == engine.tokens == plain.tokens  # the same reply: the defect is in what the slot keeps
    bound = len(served.prompt_tokens) + len(served.tokens)
    assert max(map(int, plain.kv_scan["pos_max"].values())) == bound - 1  # without speculation: nothing more
    assert max(map(int, engine.kv_scan["pos_max"].values())) == bound - 1
    verdict = check(executor, "kv-healthy", "server", model, case)
    assert not verdict.passed and verdict.failures == [
        f"round 0: 1 position past the returned tokens: the slot keeps positions {bound}..{bound} after "
        f"{len(served.prompt_tokens)} prompt + {len(served.tokens)} returned tokens (stop: eos)"
    ]
    cell = CELLS[("server", model, "draft-simple")]
    assert tag([EOG], "eog", cell, [verdict]) == [] and verdict.evidence["known_failure"] == EOG.id
    assert check(executor, "kv-healthy", "inproc", model, case).passed


def test_the_hybrids_next_turn_reprocesses_the_previous_answer_on_llama_server_only(executor):
    verdict = check(executor, "prompt-reuse", "server", "tiny-hybrid", "chat.turn2")
    turn1 = result_of(executor, "server", "tiny-hybrid", "none", "chat.turn1")
    found = re.match(
        r"round 0: chat\.turn2 reused (\d+) of its (\d+) prompt tokens from the cache, (\d+) in "
        r"seq-none-tiny-hybrid-server \(chat\.turn1 left positions (\d+)\.\.\d+ past",
        verdict.failures[0],
    )
    assert not verdict.passed and found, verdict.message
    kept, _, plain, left = map(int, found.groups())
    assert plain == len(turn1.prompt_tokens) + len(turn1.tokens) == left  # without speculation: all of turn 1
    assert kept < len(turn1.prompt_tokens)  # with it: a checkpoint inside turn 1's prompt
    assert tag([EOG], "eog", CELLS[("server", "tiny-hybrid", "draft-simple")], [verdict]) == []
    engine = check(executor, "prompt-reuse", "inproc", "tiny-hybrid", "chat.turn2")
    assert result_of(executor, "inproc", "tiny-hybrid", "draft-simple", "chat.turn2").timings.cache_n == 0
    # the engine decodes every prompt whole: no prompt cache to compare (0 with 0 proved nothing)
    assert engine.not_run is not None and "the in-process engine reports no prompt-cache reuse" in engine.not_run


def test_llama_server_counts_a_drafted_eog_as_accepted(executor):
    served = result_of(executor, "server", "tiny-dense", "draft-simple", "last_draft")
    engine = result_of(executor, "inproc", "tiny-dense", "draft-simple", "last_draft")
    stats = engine.spec_stats
    # every step emits its accepted drafts plus one sampled token; the first token comes from the prompt and
    # the EOG (not returned) is the last step's sampled token: nothing past it counted
    assert len(engine.tokens) == stats["draft_n_accepted"] + stats["spec_cycles"] + stats["spec_empty"]
    assert served.spec_stats["draft_n"] == stats["draft_n"]
    assert served.spec_stats["draft_n_accepted"] == stats["draft_n_accepted"] + 1  # the EOG, at 0c1e570


def test_the_entry_does_not_hide_another_failure_of_the_same_cells(executor):
    cell = CELLS[("server", "tiny-dense", "draft-simple")]
    run = copy.deepcopy(executor.run(SUITE, cell))
    result = next(o.result for o in run.outcomes if o.case == "last_draft")
    result.kv_scan.update(healthy=False, duplicates=[{"part": "kv", "stream": 0, "seq_id": 0, "pos": 4, "count": 2}])
    result.kv_scan["totals"]["duplicate_cells"] = 1
    both = check(executor, "kv-healthy", "server", "tiny-dense", "last_draft", run)
    assert len(both.failures) == 2 and tag([EOG], "eog", cell, [both]) == [both]
    assert "explains 1 of 2 failing requests" in both.message
    hybrid = CELLS[("server", "tiny-hybrid", "draft-simple")]
    run = copy.deepcopy(executor.run(SUITE, hybrid))
    for o in run.outcomes:
        if o.case == "chat.turn1":
            o.result.kv_scan["pos_max"] = {"0": len(o.result.prompt_tokens) + len(o.result.tokens) - 1}
    unexplained = check(executor, "prompt-reuse", "server", "tiny-hybrid", "chat.turn2", run)
    assert not unexplained.passed and "left positions" not in unexplained.message
    assert tag([EOG], "eog", hybrid, [unexplained]) == [unexplained]
