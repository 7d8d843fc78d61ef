"""Context shift (`context_shift`, llama-server's --context-shift): the in-process engine shifts as llama-server
does (same n_keep / n_discard, same tokens), both stop at the context end without it or where the memory
cannot shift, the drafters are begun again after a shift, and the known-failure entry of the server's abort
explains exactly that abort."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server import LlamaServer
from harness.backends.server_backend import ServerBackend
from harness.checks.base import CheckResult
from harness.engine.ctxshift import needs_shift, shift_span
from harness.engine.drafters.base import DraftRequest
from harness.engine.drafters.ngram_map import NgramMapK
from harness.engine.drafters.scripted import Scripted
from harness.matrix import SPEC_PRESETS, Cell
from harness.models import draft_for, resolve
from harness.suites.request import Request, Sampling
from harness.verdict.known_failures import load, tag

REPO = Path(__file__).resolve().parents[1]
N_CTX = 256
PROMPT = "one two three four five six seven eight nine ten one two three four five six seven eight nine ten"
SHIFT_LOG = re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)")


@pytest.mark.parametrize(
    "n_tokens, n_prompt, n_keep, n_discard, add_bos, expected",
    [
        (255, 30, 0, 0, True, (1, 127)),  # the defaults: BOS kept, half of the other 254 discarded
        (255, 30, 0, 0, False, (0, 127)),  # 255 // 2
        (255, 30, -1, 0, True, (31, 112)),  # -1 keeps the prompt, and BOS adds one more
        (255, 30, 10, 50, False, (10, 50)),
        (255, 30, 10, 500, False, (10, 244)),  # at most n_left - 1: one token after the kept ones stays
        (255, 30, 300, 0, True, (252, 1)),  # n_keep at most n_ctx - 4
        (2, 30, 5, 0, False, (5, 0)),  # nothing left to discard
    ],
)
def test_shift_span_is_llama_servers_arithmetic(n_tokens, n_prompt, n_keep, n_discard, add_bos, expected):
    assert shift_span(n_tokens, n_prompt, N_CTX, n_keep, n_discard, add_bos) == expected


def test_a_slot_shifts_when_its_next_token_would_fill_the_context():
    assert not needs_shift(N_CTX - 2, N_CTX) and needs_shift(N_CTX - 1, N_CTX)


def test_ngram_map_is_begun_again_after_a_shift():
    """ngram-map refuses a history shorter than the last one it drafted on (llama.cpp aborts there: the
    server's defect); `shift_context` begins it again on the shifted history, after which it drafts."""
    history = [1, 2, 3, 4, 5, 6, 7, 8] * 8
    drafter = NgramMapK(size_n=3, size_m=4)
    drafter.begin(0, history[:20])
    assert drafter.draft(DraftRequest(0, history, 1, 4)) == [2, 3, 4, 5]
    shifted = history[:1] + history[1 + 24 :]
    with pytest.raises(ValueError, match="shorter than at the last"):
        drafter.draft(DraftRequest(0, shifted, 1, 4))
    drafter.shift_context(0, 1, 24, shifted)
    assert drafter.draft(DraftRequest(0, shifted, 1, 4)) == [2, 3, 4, 5]


def test_scripted_drafter_keeps_its_place_in_the_script_across_a_shift():
    script = list(range(100, 140))
    drafter = Scripted(script, n_max=3)
    prompt = list(range(10))
    drafter.begin(0, prompt)
    history = prompt + script[:5]  # five output tokens decoded; the sixth is id_last
    assert drafter.draft(DraftRequest(0, history, script[5], 3)) == script[6:9]
    shifted = history[:1] + history[7:]
    drafter.shift_context(0, 1, 6, shifted)
    assert drafter.draft(DraftRequest(0, shifted, script[5], 3)) == script[6:9]


# ------------------------------------------------------------------------------------ both backends


@pytest.fixture(scope="module")
def build():
    return ensure_server(None, "cpu", [], jobs=None)


def serve(backend, model: Path, context_shift: bool, requests: list[Request], **config):
    config = ServeConfig(model=model, mode="seq", n_ctx=N_CTX, context_shift=context_shift, **config)
    session = backend.open(config)
    try:
        return session.run(requests)
    finally:
        session.close()


def requests() -> list[Request]:
    return [
        Request(prompt=PROMPT, sampling=Sampling(n_predict=400, ignore_eos=True)),
        Request(prompt=PROMPT, sampling=Sampling(n_predict=400, ignore_eos=True, n_keep=-1, n_discard=50)),
    ]


def test_engine_shifts_as_llama_server_does(build, tiny_models, tmp_path):
    """Past the context end, both backends give the same 400 tokens with the default n_keep / n_discard and
    with the request's own; llama-server's log states the spans `shift_span` computes."""
    model = tiny_models["tiny-dense"].path
    server = serve(ServerBackend(build, run_dir=tmp_path), model, True, requests())
    engine = serve(InprocBackend(), model, True, requests())
    for s, e in zip(server, engine, strict=False):
        assert s.ok and e.ok and len(s.tokens) == 400 and s.truncated and e.truncated
        assert e.tokens == s.tokens
    logged = [
        tuple(map(int, m)) for log in tmp_path.glob("*.log") for m in SHIFT_LOG.findall(log.read_text(errors="replace"))
    ]
    n_prompt = len(server[0].prompt_tokens)
    spans = [shift_span(N_CTX - 1, n_prompt, N_CTX, r.sampling.n_keep, r.sampling.n_discard, True) for r in requests()]
    expected = []
    for (keep, discard), r in zip(
        spans, server, strict=False
    ):  # every shift happens at n_tokens = N_CTX - 1 without speculation
        n_tokens, shifts = n_prompt + len(r.tokens) - 1, 0
        while n_tokens >= N_CTX - 1:
            n_tokens -= discard
            shifts += 1
        expected += [(keep, N_CTX - 1 - keep, discard)] * shifts
    assert sorted(logged) == sorted(expected) and len(expected) >= 4


def test_draft_model_context_shifts_with_the_target(build, tiny_models, tmp_path):
    """llama-server shifts the draft model's context with the target's (common_memory); so does the engine's
    draft-simple, which then drafts exactly what llama-server's does (a draft context left unshifted drafts
    from stale positions: other drafts, other counts)."""
    draft = dict(draft_model=resolve(draft_for("tiny-dense")).path, spec=dict(SPEC_PRESETS["draft-simple"].options))
    model = tiny_models["tiny-dense"].path
    [s] = serve(ServerBackend(build, run_dir=tmp_path), model, True, requests()[:1], **draft)
    [e] = serve(InprocBackend(), model, True, requests()[:1], **draft)
    assert s.ok and e.ok and s.truncated and e.tokens == s.tokens
    counts = ("draft_n", "draft_n_accepted")
    assert [e.spec_stats[k] for k in counts] == [s.spec_stats[k] for k in counts] and s.spec_stats["draft_n"] > 0


@pytest.mark.parametrize("model_name, context_shift", [("tiny-dense", False), ("tiny-hybrid", True)])
def test_both_stop_at_the_context_end_without_a_shift(build, tiny_models, tmp_path, model_name, context_shift):
    """Context shift off, or asked for on a model whose memory cannot shift (the hybrid's M-RoPE): both
    backends end at the context end, `limit` and `truncated`, with the same tokens."""
    model = tiny_models[model_name].path
    request = [Request(prompt=PROMPT, sampling=Sampling(n_predict=400, ignore_eos=True))]
    [s] = serve(ServerBackend(build, run_dir=tmp_path), model, context_shift, request)
    [e] = serve(InprocBackend(), model, context_shift, request)
    assert s.stop_reason == e.stop_reason == "limit" and s.truncated and e.truncated
    assert e.tokens == s.tokens and len(s.prompt_tokens) + len(s.tokens) == N_CTX


def test_command_maps_context_shift(build, tiny_models):
    config = ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq")
    for on in (True, False):
        server = LlamaServer.from_config(replace(config, context_shift=on), build.server_bin)
        server.port = 1234
        assert ("--context-shift" in server.command()) is on and ("--no-context-shift" in server.command()) is not on


# ------------------------------------------------------------------------------------ the known failure


def test_known_failure_explains_only_the_ngram_map_abort_in_its_cells():
    [entry] = [e for e in load(REPO / "suites" / "known-failures.yaml") if e.id == "server-ngram-map-context-shift"]
    cell = Cell("server", "seq", "ngram-map-k", "tiny-dense")
    abort = (
        "round 0: llama-server was killed by SIGABRT: /src/common/ngram-map.cpp:242: common_ngram_map_draft: "
        "map.idx_last_check > cur_len: 253 > 128; log server.log ends with: ..."
    )
    crash = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[abort])
    assert tag([entry], "context-shift", cell, [crash]) == [] and crash.evidence["known_failure"] == entry.id
    other = "round 0: llama-server was killed by SIGABRT: /src/common/ngram-map.cpp:257: map.size_last_begin > cur_len"
    for failures in ([other], [abort, other], ["round 0: llama-server was killed by SIGSEGV"]):
        unexplained = CheckResult("no-crash", False, "requests failed", failures=list(failures))
        assert tag([entry], "context-shift", cell, [unexplained]) == [unexplained]
    lossless = CheckResult("lossless", False, abort)  # another check of the same cell stays a failure
    assert tag([entry], "context-shift", cell, [lossless]) == [lossless]
    for elsewhere in (
        replace(cell, backend="inproc"),
        replace(cell, spec="ngram-simple"),
        replace(cell, spec="ngram-mod"),
        replace(cell, spec="draft-simple"),
    ):
        fresh = CheckResult("no-crash", False, "1 of 1 requests failed", failures=[abort])
        assert tag([entry], "context-shift", elsewhere, [fresh]) == [fresh]
