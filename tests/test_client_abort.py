"""SGLang's abort test, on llama-server: a client drops its streaming request in the middle of speculative decoding
(rolled-back drafts, a hybrid target's checkpoints); the slot's next requests must be what they were before the
abort, token for token, greedy and seeded sampled (temperature 0.8), and the slot must be released. llama-server
cancels the task when the connection closes (server_http's `is_connection_closed`), between verification steps;
what it leaves in the slot is what the next request reuses from its prompt cache.
"""

import json

import pytest
import requests

from harness.backends.build import ensure_server
from harness.backends.client import LlamaClient, completion_payload
from harness.backends.server import LlamaServer
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell
from harness.suites.request import Sampling
from tests.helpers import QUICKSORT_PROMPT

ABORT_AFTER = 12
"""Streamed tokens read before the client closes the connection (the request asked 96)."""
REQUEST_TIMEOUT_S = 120.0
SAMPLINGS = {
    "greedy": Sampling(n_predict=48, temperature=0),
    "seeded": Sampling(n_predict=48, temperature=0.8, seed=7),
}


def _abort_midway(server: LlamaServer, prompt: list[int]) -> int:
    """Stream a long request and close the connection after ABORT_AFTER tokens; the tokens read."""
    payload = {**completion_payload(prompt, Sampling(n_predict=96, temperature=0)), "stream": True}
    seen = 0
    with requests.post(f"{server.url}/completion", json=payload, stream=True, timeout=REQUEST_TIMEOUT_S) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and "content" in json.loads(line[6:]):
                seen += 1
            if seen >= ABORT_AFTER:
                break
    return seen


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-hybrid"])
def test_the_requests_after_a_client_abort_under_speculation_are_the_ones_before_it(model, tmp_path):
    build = ensure_server(None, "cpu", [], jobs=None)
    config = serve_config(Cell("server", "seq", "draft-simple", model), ExecOptions(backends={}))
    server = LlamaServer.from_config(config, build.server_bin, log_path=tmp_path / "llama-server.log")
    with server:
        client = LlamaClient(server.url, timeout=REQUEST_TIMEOUT_S)
        prompts = {lang: client.tokenize(QUICKSORT_PROMPT.format(lang=lang)) for lang in ("C", "Python")}

        def serve(name: str) -> list[int]:
            data = client.completion(completion_payload(prompts["C"], SAMPLINGS[name]))
            assert data["timings"].get("draft_n", 0) > 0, f"{name}: nothing drafted"
            return data["tokens"]

        before = {name: serve(name) for name in SAMPLINGS}
        assert _abort_midway(server, prompts["Python"]) == ABORT_AFTER
        assert client.slot_idle(0, within=30.0), "the aborted request's slot was never released"
        after = {name: serve(name) for name in SAMPLINGS}
        assert server.alive
    for name in SAMPLINGS:
        assert after[name] == before[name], f"{model} {name}: the output after the abort differs from before it"
