"""KV scans judge only their own request: on llama-server a request's slot is saved after it ended, and the
saved state must be the request's own (issue 28, item 1).

With more requests than slots, llama-server gave the slot a request just freed to a queued request before its
save (`the slot keeps positions 97..139 after 33 prompt + 64 returned tokens`: another request's 140 tokens),
and with a unified KV cache it clears idle slots whenever a task starts (`--cache-idle-slots`), so a save can
also find the slot empty. The session lends each request its slot (pinned with `id_slot`, given to no other
request before the save), and the saved token list must be the request's prompt and output; a state that is
not provably the request's own is "not judged", never a pass or a failure."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.client import LlamaClient
from harness.backends.server_backend import ServerBackend
from harness.backends.server_slots import SlotPool, slot_ownership
from harness.checks import kv_healthy, kv_problems
from harness.result import Result
from harness.suites.request import Request, Sampling

P = [1, 10, 11, 12, 13]
G = [20, 21, 22]


def result(prompt=P, tokens=G, stop="limit", truncated=False, kv_scan=None) -> Result:
    return Result(
        prompt_tokens=list(prompt), tokens=list(tokens), stop_reason=stop, truncated=truncated, kv_scan=kv_scan
    )


# ------------------------------------------------------------------------------ the ownership proof


@pytest.mark.parametrize(
    "held",
    [
        P + G[:-1],  # stopped at its limit: the last token sampled, never decoded
        P + G,  # stopped at an end-of-generation token (not among the returned tokens)
        P + G + [2, 30],  # kept tokens past those returned (drafts past an EOG): past_returned judges them
    ],
)
def test_a_slot_holding_the_requests_prompt_and_output_is_its_own(held):
    assert slot_ownership(held, result()) is None


def test_a_context_shift_keeps_the_first_tokens_and_the_end():
    own = P + G
    shifted = own[:1] + own[3:-1]  # n_keep 1, 2 discarded, up to the last token
    assert slot_ownership(shifted, result(truncated=True)) is None
    assert slot_ownership(shifted, result()) is not None  # only a request that reached the context end shifts


def test_an_empty_slot_is_not_the_requests():
    why = slot_ownership([], result())
    assert why is not None and "empty" in why and "--cache-idle-slots" in why


@pytest.mark.parametrize(
    "held",
    [
        [1, 10, 11, 40, 41, 42, 43, 44],  # another request's prompt and output
        P + G[:1],  # only part of the request's output: cleared and refilled, or a shorter request's state
        [1, 10],
    ],
)
def test_another_state_is_not_the_requests(held):
    why = slot_ownership(held, result())
    assert why is not None and "5 prompt + 3 returned tokens" in why


def test_no_token_list_is_no_proof():
    assert "no token list" in slot_ownership(None, result())


# ------------------------------------------------------------------------------ the check's side


def test_an_unjudged_scan_is_no_verdict_of_kv_healthy():
    foreign = {"judged": False, "reason": "the slot was empty when saved"}
    healthy = {
        "healthy": True,
        "totals": {"duplicate_cells": 0, "orphans": 0, "missing_positions": 0},
        "pos_max": {"0": 6},
        "duplicates": [],
        "orphans": [],
        "holes": [],
    }
    assert kv_problems(result(kv_scan=foreign)) == []

    def outcome(scan, round_=0):
        return SimpleNamespace(result=result(kv_scan=scan), round=round_)

    only_foreign = kv_healthy(SimpleNamespace(completed=lambda: [outcome(foreign)]))
    assert only_foreign is not None and only_foreign.not_run is not None
    assert "the slot was empty when saved" in only_foreign.not_run
    mixed = kv_healthy(SimpleNamespace(completed=lambda: [outcome(foreign), outcome(healthy, 1)]))
    assert mixed.passed and mixed.not_run is None
    assert mixed.evidence["scanned"] == 1 and mixed.evidence["not_judged"]["requests"] == 1


# ------------------------------------------------------------------------------ seq: one slot, nothing else on it


HEALTHY = {
    "healthy": True,
    "totals": {"duplicate_cells": 0, "orphans": 0, "missing_positions": 0},
    "pos_max": {},
    "duplicates": [],
    "orphans": [],
    "holes": [],
}


def scan_saved(tmp_path, monkeypatch, mode: str, held: list[int] | None, r: Result) -> dict | None:
    """`ServerSession._scan_slot` of a session serving `mode`, on a saved slot holding `held` (the save and the
    scan stand-ins: no llama-server)."""
    from harness.backends import server_backend

    monkeypatch.setattr(
        server_backend,
        "scan_file",
        lambda path, layout=None: SimpleNamespace(
            token_ids=held, brief=lambda: {**HEALTHY, "pos_max": {"0": len(held) - 1} if held else {}}
        ),
    )
    session = SimpleNamespace(
        config=ServeConfig(model=tmp_path / "m.gguf", mode=mode, kv_scan="request"),
        slots_dir=tmp_path,
        _saves=iter(range(100)),
        layout=None,
        _lock=threading.Lock(),
        unscannable=None,
        logs=SimpleNamespace(cite=lambda path=None: path),
    )
    client = SimpleNamespace(
        slot_idle=lambda slot_id: None,
        save_slot=lambda slot_id, name: (tmp_path / name).write_bytes(b"") or {},
    )
    return server_backend.ServerSession._scan_slot(session, None, client, r, None)


@pytest.mark.parametrize("held", [[], P, P + G[:1]])
def test_in_seq_a_slot_saved_shorter_than_its_request_lost_cells_and_fails_kv_healthy(tmp_path, monkeypatch, held):
    """In `seq` the one slot is saved right after its own request, with no other request on the server and no
    idle-slot clearing (`--cache-idle-slots` clears slots of a unified cache only, and `seq` is not unified):
    a slot holding fewer cells than the request's prompt + returned tokens (save the last, sampled one) lost
    cells. That is KV damage, never "not judged"; in `par` and `no-kv-unified` it stays not judged."""
    r = result(prompt=P, tokens=G)  # 5 + 3: the slot must hold at least 7 cells
    scan = scan_saved(tmp_path, monkeypatch, "seq", held, r)
    assert scan is not None and scan.get("judged", True), scan
    assert "file" in scan  # the slot file is kept as evidence
    r.kv_scan = scan
    problems = kv_problems(r)
    lost = 7 - len(held)
    named = f"{lost} cell{'s' if lost > 1 else ''} lost"
    assert problems and named in problems[0] and "5 prompt + 3 returned tokens" in problems[0]
    assert f"holds {len(held)} " in problems[0]
    verdict = kv_healthy(SimpleNamespace(completed=lambda: [SimpleNamespace(result=r, round=0)]))
    assert verdict is not None and verdict.not_run is None and not verdict.passed
    assert named in verdict.message and verdict.evidence["lost_cells"] == lost
    for mode in ("par", "no-kv-unified"):  # other slots' tasks may clear or take the slot: not judged there
        other = scan_saved(tmp_path, monkeypatch, mode, held, result(prompt=P, tokens=G))
        assert other is not None and other["judged"] is False and "5 prompt + 3 returned tokens" in other["reason"]


def test_in_seq_the_requests_own_slot_and_other_excuses_are_unchanged(tmp_path, monkeypatch):
    """What `slot_ownership` accepts stays accepted in `seq`, and a truncated request's context shift the
    ownership proof cannot match, a slot file without a token list and a state of other tokens stay not judged."""
    for held in (P + G[:-1], P + G, P + G + [2, 30]):
        scan = scan_saved(tmp_path, monkeypatch, "seq", held, result())
        assert scan.get("judged", True) and "lost" not in scan
    r = result()
    r.kv_scan = scan_saved(tmp_path, monkeypatch, "seq", P + G[:-1], r)
    assert kv_problems(r) == []
    shifted = scan_saved(tmp_path, monkeypatch, "seq", P[:1], result(truncated=True))
    assert shifted["judged"] is False
    other = scan_saved(tmp_path, monkeypatch, "seq", [1, 10, 11, 40, 41, 42, 43, 44], result())
    assert other["judged"] is False
    no_list = scan_saved(tmp_path, monkeypatch, "seq", None, result())
    assert no_list["judged"] is False and "no token list" in no_list["reason"]


# ------------------------------------------------------------------------------ the dispatch


def test_a_slot_is_lent_to_one_request_at_a_time_least_recently_used_or_most_similar_first():
    pool = SlotPool(2)
    a, b = pool.acquire([5, 6]), pool.acquire([7, 8])
    assert {a, b} == {0, 1}
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire([9])))
    waiter.start()
    time.sleep(0.2)
    assert not got  # none free
    pool.release(b, [7, 8, 100])
    waiter.join(5)
    assert got == [b]
    pool.release(a, [5, 6, 101])
    pool.release(b, [7, 8, 100, 9])
    assert pool.acquire([7, 8, 100, 3]) == b  # the slot holding most of the prompt
    pool.release(b, [7, 8, 100, 3, 103])
    assert pool.acquire([42]) == a  # no similar slot: the least recently used


# ------------------------------------------------------------------------------ a real llama-server


def requests_of(n: int) -> list[Request]:
    """n requests with distinct prompts (no common prefix beyond the first token) and greedy outputs."""
    return [
        Request(prompt=[1] + [100 + 7 * i + k for k in range(12 + i)], sampling=Sampling(n_predict=24 + 3 * i))
        for i in range(n)
    ]


def _own_positions(r: Result) -> bool:
    """The judged scan holds the request's positions: up to its last token (EOG) or the one before (limit)."""
    last = max(int(p) for p in r.kv_scan["pos_max"].values())
    return last in (len(r.prompt_tokens) + len(r.tokens) - 1, len(r.prompt_tokens) + len(r.tokens) - 2)


@pytest.mark.parametrize("mode", ["seq", "no-kv-unified", "par"])
def test_a_slot_saved_late_is_still_the_requests_own(tiny_models, tmp_path, monkeypatch, mode):
    """The first request's save waits 1 s (a descheduled client thread on a busy machine) while the other
    requests go on: before the fix the server gave its freed slot to the next request (or, with a unified cache,
    cleared it), and the scan read that state as the first request's. Now every scan is of the request's own
    state or not judged, saying why; without a unified cache (no idle-slot clearing) every scan is judged, and in
    `seq` (one slot, one request at a time) none lost cells (`lost_cells` cries no wolf on a clean run)."""
    save = LlamaClient.save_slot
    delayed = []

    def late_save(self, slot_id, filename):
        if not delayed:
            delayed.append(slot_id)
            time.sleep(1.0)
        return save(self, slot_id, filename)

    monkeypatch.setattr(LlamaClient, "save_slot", late_save)
    backend = ServerBackend(ensure_server(), run_dir=tmp_path)
    config = ServeConfig(model=tiny_models["tiny-dense"].path, mode=mode, parallel=2, kv_scan="request")
    with backend.open(config) as session:
        results = session.run(requests_of(8))
    assert all(r.ok for r in results), [r.error for r in results]
    judged = [r for r in results if r.kv_scan.get("judged", True)]
    assert all(_own_positions(r) for r in judged), [
        (len(r.prompt_tokens), len(r.tokens), r.kv_scan["pos_max"]) for r in judged
    ]
    assert all(r.kv_scan["healthy"] and "lost" not in r.kv_scan for r in judged)
    assert not [p for r in results for p in kv_problems(r)]
    unjudged = [r.kv_scan["reason"] for r in results if not r.kv_scan.get("judged", True)]
    if mode in ("seq", "no-kv-unified"):
        assert not unjudged
    else:
        assert len(judged) >= 4 and all("empty" in why for why in unjudged), unjudged
