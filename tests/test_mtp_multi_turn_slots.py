"""ggml-org/llama.cpp#27296 on llama-server (CPU): draft-mtp with `-np 2` and two multi-turn chats at once, each turn
carrying the earlier replies (the report: truncated tool-call arguments, then HTTP 500 on the next turn). Every turn
must come back whole and equal to the same chat without speculation on one slot, with and without a unified KV
cache. Not reproduced at 0c1e570 on CPU (docs/upstream-defects.md): a regression test."""

import pytest

from harness.backends.build import ensure_server
from harness.backends.server_backend import ServerBackend
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell
from harness.suites.request import Request, Sampling

MODEL = "tiny-hybrid-mtp"
N_PREDICT = 48
CHATS = (
    (
        "Write a quicksort implementation in C with detailed comments.",
        "Now write a merge sort in C with the same style and commenting pattern.",
        "Refactor: extract the timing logic into a reusable benchmark() function.",
    ),
    (
        "Call the get_weather tool for Paris and reply with the JSON arguments only.",
        "Now call search_web with the query 'llama.cpp MTP', JSON arguments only.",
        "Call get_weather again for Berlin, JSON arguments only.",
    ),
)


def _converse(backend, mode: str, spec: str, parallel: int) -> list[list]:
    """Per turn, the two chats' results; both chats' turn t are sent together (one after the other on 1 slot)."""
    options = ExecOptions(backends={}, kv_scan="off", logit_top_k=0, parallel=parallel)
    session = backend.open(serve_config(Cell("server", mode, spec, MODEL), options))
    history: list[list[dict]] = [[] for _ in CHATS]
    turns = []
    try:
        for t in range(len(CHATS[0])):
            requests = []
            for chat, messages in zip(CHATS, history, strict=True):
                messages.append({"role": "user", "content": chat[t]})
                sampling = Sampling(n_predict=N_PREDICT, temperature=0)
                requests.append(Request(messages=list(messages), sampling=sampling, tag=f"turn{t + 1}"))
            results = session.run(requests)
            for messages, result in zip(history, results, strict=True):
                messages.append({"role": "assistant", "content": result.text})
            turns.append(results)
    finally:
        session.close()
    return turns


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    backend = ServerBackend(ensure_server(None, "cpu", [], jobs=None), run_dir=tmp_path_factory.mktemp("server"))
    return {
        "reference": _converse(backend, "seq", "none", 1),
        "par": _converse(backend, "par", "draft-mtp", 2),
        "no-kv-unified": _converse(backend, "no-kv-unified", "draft-mtp", 2),
    }


@pytest.mark.parametrize("mode", ["par", "no-kv-unified"])
def test_two_mtp_chats_on_two_slots_return_every_turn_whole_and_as_without_speculation(conversations, mode):
    for t, (got, want) in enumerate(zip(conversations[mode], conversations["reference"], strict=True)):
        for c, (result, reference) in enumerate(zip(got, want, strict=True)):
            where = f"{mode} chat {c} turn {t + 1}"
            assert result.ok and result.error is None, f"{where}: {result.error}"
            assert result.stop_reason == reference.stop_reason, where
            assert result.tokens == reference.tokens, f"{where}: output differs from the chat without speculation"
            assert result.spec_stats.get("draft_n", 0) > 0, f"{where}: draft-mtp drafted nothing"
