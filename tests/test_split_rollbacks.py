"""Where a llama-server request's rollbacks sat in the decodes it shared (harness.llama.ubatch,
harness.backends.server_batches): the step known failure `server-par-partial-rollback-diverges` names (issue 48,
item 1).

- split_equal's port on the worked cases of src/llama-batch.cpp at 0c1e570 (a slot verifying one draft beside two
  verifying three goes alone, ahead; per-slot KV takes only consecutive slots; a tail is never cut);
- the same split as libllama's own, decode by decode, on a real llama-server's log (`LLAMA_BATCH_DEBUG=1` makes
  llama_batch_allocr print every ubatch it adds), with the composition read back from the server's lines;
- the failure lines: a divergence at or after such a step names it, one before it or without one names nothing, and
  the known failure's evidence needs the step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.backends.server_batches import Geometry, _decodes, geometry, of_request
from harness.backends.server_work import TaskLog, task_lines
from harness.llama import log as llama_log
from harness.llama.ubatch import split_equal
from harness.result import Result

# ------------------------------------------------------------------------------------ the split


def test_a_slot_verifying_a_shorter_draft_goes_alone_ahead_of_its_batch_mates():
    # n_rs_seq 3: tails of 4 stay whole; seq 0 verifies 1 draft (2 tokens), seqs 1 and 2 verify 3 (4 tokens)
    assert split_equal([(0, 2), (1, 4), (2, 4)], 512, n_keep_tail=4) == [[(0, 2)], [(1, 4), (2, 4)]]
    # the same drafts everywhere: one ubatch
    assert split_equal([(0, 4), (1, 4), (2, 4)], 512, n_keep_tail=4) == [[(0, 4), (1, 4), (2, 4)]]
    # no snapshots (n_keep_tail 0): equal slices, the longer ones finish in a second ubatch
    assert split_equal([(0, 2), (1, 4), (2, 4)], 512) == [[(0, 2), (1, 2), (2, 2)], [(1, 2), (2, 2)]]


def test_a_longer_first_slot_is_finished_alone_and_the_rest_follow_in_order():
    # seq 0 has 2 tokens left after the equal slice (< 4): none of the prefix qualifies, so seq 0 alone, whole
    assert split_equal([(0, 4), (1, 2), (2, 4)], 512, n_keep_tail=4) == [[(0, 4)], [(1, 2)], [(2, 4)]]


def test_per_slot_kv_takes_only_consecutive_slot_ids_in_one_ubatch():
    assert split_equal([(0, 1), (2, 1), (3, 1)], 512, sequential=True) == [[(0, 1)], [(2, 1), (3, 1)]]
    assert split_equal([(0, 1), (2, 1), (3, 1)], 512) == [[(0, 1), (2, 1), (3, 1)]]


def test_a_prompt_longer_than_n_ubatch_is_cut_leaving_its_tail_whole():
    # one sequence of 10 tokens, n_ubatch 8, tails of 4: 6 now (4 left), then 4
    assert split_equal([(5, 10)], 8, n_keep_tail=4) == [[(5, 6)], [(5, 4)]]
    with pytest.raises(ValueError, match="n_ubatch 4 must exceed n_keep_tail 4"):
        split_equal([(0, 2)], 4, n_keep_tail=4)


# ------------------------------------------------------------------------------------ the log

STARTUP = """\
0.00.100.000 I llama_context: n_ubatch              = 512
0.00.100.001 I llama_context: kv_unified            = true
0.00.100.002 I llama_memory_recurrent: size =    0.20 MiB (     4 cells,   2 layers,  4 seqs  3 rs_seq), R (f32)
0.00.100.003 I llama_kv_cache: size =    1.00 MiB (  4096 cells,   1 layers,  4/1 seqs), K (f16):    0.50 MiB
0.00.100.004 I llama_context: n_ubatch              = 512
0.00.100.005 I llama_kv_cache: size =    1.00 MiB (  4096 cells,   1 layers,  4/1 seqs), K (f16):    0.50 MiB
"""
STEP = """\
0.01.000.000 D slot update_slots: id  0 | task 7 | generate_draft: id=11, #tokens=20, #draft=1, pos_next=20
0.01.000.001 D slot update_slots: id  1 | task 8 | generate_draft: id=12, #tokens=21, #draft=3, pos_next=21
0.01.000.002 D slot update_slots: id  2 | task 9 | generate_draft: id=13, #tokens=22, #draft=3, pos_next=22
0.01.000.003 D srv          decode: n_batch (effective) = 2048, off = 0
0.01.000.004 D slot update_slots: id  0 | task 7 | add accepted tokens: sampled=5, ids.size=1, n_draft=1
0.01.000.005 D slot update_slots: id  1 | task 8 | add accepted tokens: sampled=6, ids.size=2, n_draft=3
0.01.000.006 D slot update_slots: id  2 | task 9 | add accepted tokens: sampled=7, ids.size=4, n_draft=3
"""
TASKS = """\
0.00.900.000 I slot launch_slot_: id  0 | task 7 | processing task, is_child = 0
0.00.900.001 I slot launch_slot_: id  1 | task 8 | processing task, is_child = 0
0.00.900.002 I slot launch_slot_: id  2 | task 9 | processing task, is_child = 0
"""
END = """\
0.02.000.000 I slot      release: id  0 | task 7 | stop processing: n_tokens = 30, truncated = 0
0.02.000.001 I slot      release: id  1 | task 8 | stop processing: n_tokens = 30, truncated = 0
"""


def test_a_rollback_from_the_first_of_two_ubatches_is_named_and_one_from_the_last_is_not(tmp_path):
    log = tmp_path / "llama-server.log"
    log.write_text(STARTUP + TASKS + STEP + END)
    assert geometry(log) == Geometry(n_ubatch=512, unified=True, n_rs_seq=3, hybrid=True)
    # slot 0: its 1 draft rejected in ubatch 1 of 2; the first token made from the rolled-back state is token 2
    # (token 0 from the prompt, token 1 the step's own sample)
    messages = llama_log.messages(llama_log.read(log))

    def logged(slot: int) -> TaskLog:  # what server_work.task_log reads of the request on `slot`
        return TaskLog(messages, *task_lines(messages, slot))

    assert of_request(logged(0), geometry(log), 0) == [
        {"token": 2, "slot": 0, "step": 0, "n_draft": 1, "accepted": 0, "plane": 1, "ubatch": 1, "ubatches": 2,
         "batch": [[0, 2], [1, 4], [2, 4]]}
    ]  # fmt: skip
    # rolled back 2 drafts, but in the last ubatch: nothing moves it after
    assert of_request(logged(1), geometry(log), 1) == []
    assert of_request(logged(2), geometry(log), 2) is None  # its task did not end in the log: not read


def test_prompt_batches_count_from_the_next_batch_or_the_prompt_s_end():
    lines = [
        "slot update_slots: id  3 | task 4 | new prompt, n_ctx_slot = 512, n_keep = 0, task.n_tokens = 30",
        "slot update_slots: id  3 | task 4 | main/do_checkpoint = no, pos_min = -1, pos_max = -1",
        "srv          decode: n_batch (effective) = 2048, off = 0",
        "slot update_slots: id  3 | task 4 | main/do_checkpoint = yes, pos_min = 0, pos_max = 25",
        "srv          decode: n_batch (effective) = 2048, off = 0",
        "slot update_slots: id  3 | task 4 | slot decode token, id=5, n_ctx = 512, n_tokens = 30, truncated = 0",
        "srv          decode: n_batch (effective) = 2048, off = 0",
        "srv          decode: n_batch (effective) = 2048, off = 2048",
    ]
    decodes = _decodes(lines)
    assert [d.composition() for d in decodes] == [[(3, 26)], [(3, 4)], None]  # the 2-chunk one is not replayed


def test_a_failure_line_names_the_step_only_at_or_after_its_first_token():
    r = Result(
        split_rollbacks=[
            {"token": 9, "slot": 1, "step": 4, "n_draft": 3, "accepted": 1, "plane": 2, "ubatch": 1, "ubatches": 2,
             "batch": [[0, 4], [1, 2], [2, 4]]}
        ]
    )  # fmt: skip
    assert r.split_rollback_before(8) == ""
    assert r.split_rollback_before(9) == (
        "; after slot 1's partial rollback to snapshot plane 2 in micro-batch 1 of 2 of a decode (step 4: 1 of 3 "
        "drafts kept; tokens per slot: slot 0: 4, slot 1: 2, slot 2: 4) from token 9"
    )
    assert Result().split_rollback_before(9) == ""


def test_the_known_failure_needs_the_step_in_its_evidence():
    from harness.running import known_failures

    (entry,) = [k for k in known_failures()[0] if k.id == "server-par-partial-rollback-diverges"]
    step = Result(
        split_rollbacks=[
            {"token": 3, "slot": 1, "step": 1, "n_draft": 1, "accepted": 0, "plane": 1, "ubatch": 1, "ubatches": 2,
             "batch": [[1, 2], [0, 4]]}
        ]
    ).split_rollback_before(5)  # fmt: skip
    assert entry.matches("round 1: hard at token 5" + step)
    assert entry.matches("round 0: unexplained at token 5" + step)
    assert not entry.matches("round 1: hard at token 5")  # a divergence with no such step before it is not this
    logits = (
        "round 0: logits differ over 2 positions (62 skipped; lengths 64/64): NMSE 0.00119 > 1e-09; mean KL "
        "0.00128 > 1e-09; p95 of max |Δ| 0.55 > 3.34e-05 (max |Δ| 0.55 at position 63 on id 15387)"
    )
    assert entry.matches(logits + step) and not entry.matches(logits)


# ------------------------------------------------------------------------------------ against libllama

_UBATCH = re.compile(r"n_seq_tokens = (\d+)|n_seqs\s+= (\d+)|seq_id_unq = \[ ([\d ]*)\]")


def _printed_ubatches(messages: list[str]) -> list[list[list[tuple[int, int]]]]:
    """The ubatches libllama printed after each decode line (LLAMA_BATCH_DEBUG=1): the first group of each,
    the target's (the draft context's decodes print theirs after it)."""
    groups, current, ubatch = [], None, None  # ubatch: the block of an added ubatch being read (not the input's)
    for message in messages:
        if "n_batch (effective)" in message:
            current, ubatch = [], None
            groups.append(current)
        elif "input batch info" in message:
            ubatch = None
        elif "added ubatch to split" in message:
            ubatch = {}
        elif current is not None and ubatch is not None and (found := _UBATCH.search(message)):
            if found.group(1):
                ubatch["n"] = int(found.group(1))
            elif found.group(3) is not None:
                current.append([(int(s), ubatch["n"]) for s in found.group(3).split()])
                ubatch = None
    return groups


@pytest.fixture(scope="module")
def served_log(tmp_path_factory, tiny_models):
    """A llama-server log of par-rollback's ten prompts served twice on 4 slots, draft-mtp (n_rs_seq 3), with
    libllama printing its ubatches."""
    from harness.backends.build import ensure_server
    from harness.backends.server_backend import ServerBackend
    from harness.models import resolve
    from harness.suites import load_suite

    suite = load_suite("par-rollback")
    requests = [case.request() for case in suite.cases]
    build = ensure_server(None, "cpu", [], jobs=None)
    run_dir = tmp_path_factory.mktemp("split")
    mp = pytest.MonkeyPatch()
    mp.setenv("LLAMA_BATCH_DEBUG", "1")
    try:
        from harness.backends.base import ServeConfig

        backend = ServerBackend(build, run_dir=run_dir)
        spec = {"spec-type": "draft-mtp", "spec-draft-n-max": 3}
        cfg = ServeConfig(model=resolve("tiny-hybrid-mtp").path, mode="par", parallel=4, spec=spec)
        with backend.open(cfg) as session:
            results = [r for _ in range(2) for r in session.run(requests)]
            text = Path(session.server.log_path).read_text(errors="replace")
            copy = run_dir / "kept.log"
            copy.write_text(text)
    finally:
        mp.undo()
    return copy, results


def test_the_replayed_split_is_libllama_s_own_decode_by_decode(served_log):
    log, results = served_log
    messages = llama_log.messages(llama_log.read(log))

    def logged(slot: int) -> TaskLog:  # what server_work.task_log reads of the request on `slot`
        return TaskLog(messages, *task_lines(messages, slot))

    geo = geometry(log)
    assert geo == Geometry(n_ubatch=512, unified=True, n_rs_seq=3, hybrid=True)
    printed = _printed_ubatches(messages)
    decodes = _decodes(messages)
    assert len(decodes) == len(printed)
    replayed = split = 0
    for decode, groups in zip(decodes, printed, strict=True):
        seqs = decode.composition()
        if seqs is None:
            continue
        mine = [sorted(ub) for ub in geo.ubatches(seqs)]  # libllama prints a ubatch's sequence ids sorted
        assert groups[: len(mine)] == mine, (seqs, groups)
        replayed += 1
        split += len(mine) > 1
    assert replayed >= 0.9 * len(decodes) and split > 0, (replayed, split, len(decodes))
    assert all(r.ok for r in results)
    named = [r for r in results if r.split_rollbacks]
    assert all(r.split_rollbacks is not None for r in results) and named, "no request rolled back ahead of another"


# ------------------------------------------------------------------------------------ the engine


def test_the_engine_records_its_own_split_rollbacks_and_names_the_step_before_its_divergence(tiny_models):
    """The in-process engine meets the same libllama defect (engine-par-partial-rollback-diverges): its par draft-mtp
    requests on tiny-hybrid-mtp carry `split_rollbacks` computed from its own batches (harness.llama.ubatch), and
    par-rollback-engine's code_cpp diverges at token 31 right after its slot's rollback from micro-batch 1 of 3,
    every round (the engine schedules deterministically); without the records the line named no step (measured
    2026-12-02: 8 of 8 rounds)."""
    from harness.backends.choose import backend_factories
    from harness.execute import ExecOptions, Executor
    from harness.matrix import Cell
    from harness.suites import load_suite, suites_dir

    suite = load_suite(str(suites_dir() / "par-rollback-engine.yaml"))
    suite.rounds = ["par"]
    executor = Executor(ExecOptions(backends=backend_factories(None, None, None), kv_scan="off"))
    reference = {
        o.case: o.result.tokens for o in executor.run(suite, Cell("inproc", "par", "none", "tiny-hybrid-mtp")).outcomes
    }
    run = executor.run(suite, Cell("inproc", "par", "draft-mtp", "tiny-hybrid-mtp"))
    assert all(o.result.split_rollbacks is not None for o in run.outcomes)
    assert sum(bool(o.result.split_rollbacks) for o in run.outcomes) >= 5  # measured: most requests take the step
    diverged = {}
    for o in run.outcomes:
        at = next((i for i, (x, y) in enumerate(zip(reference[o.case], o.result.tokens, strict=False)) if x != y), None)
        if at is not None:
            diverged[o.case] = (at, o.result.split_rollback_before(at))
    assert set(diverged) == {"code_cpp"}, diverged
    at, step = diverged["code_cpp"]
    assert at == 31 and step.startswith("; after slot ") and step.endswith(" from token 31"), step
    seq = executor.run(suite, Cell("inproc", "seq", "draft-mtp", "tiny-hybrid-mtp"))
    assert all(o.result.split_rollbacks == [] for o in seq.outcomes)  # one slot: one micro-batch, never a step
