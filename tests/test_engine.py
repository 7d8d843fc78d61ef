"""The in-process engine on real tiny models: kinds, determinism, modes, and errors as results."""

import ctypes
import random
from types import SimpleNamespace

import llama_cpp
import pytest
from helpers import LANGS, first_divergence, quicksort
from skips import require_model

from harness.backends.base import ServeConfig
from harness.backends.inproc import InprocBackend
from harness.engine.context import Context, ContextParams
from harness.engine.detok import detokenizer
from harness.engine.model import Model
from harness.engine.slot import Slot
from harness.kv.scan import layout_from_model, scan_bytes
from harness.models import resolve
from harness.suites.request import Request, Sampling

ARCHS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
KINDS = {"tiny-dense": "dense", "tiny-hybrid": "hybrid", "tiny-recurrent": "recurrent"}


def serve(model, mode, requests, **config):
    session = InprocBackend().open(ServeConfig(model=model.path, mode=mode, **config))
    try:
        return session.run(requests)
    finally:
        session.close()


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_model_loads_with_its_kind(tiny_models, name):
    model = Model(tiny_models[name].path)
    try:
        assert model.kind == KINDS[name] == tiny_models[name].kind
    finally:
        model.close()


@pytest.mark.parametrize("mode", ("seq", "par", "no-kv-unified"))
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_output_identical_over_5_repeats(tiny_models, name, mode):
    results = serve(tiny_models[name], mode, [quicksort("C") for _ in range(5)])
    assert all(r.ok for r in results), [r.error for r in results]
    unique = {tuple(r.tokens) for r in results}
    assert len(unique) == 1, f"{len(unique)} unique outputs over 5 runs"
    assert len(results[0].tokens) == 64 and results[0].stop_reason == "limit"


def test_engine_context_keeps_a_window_sized_swa_cache_as_llama_server():
    # llama-server runs without --swa-full; llama.cpp's context default is swa_full = true, which would keep
    # every SWA cell (here 1100 instead of n_swa 512 + n_ubatch 512)
    path = require_model("gemma3-270m").path
    model = Model(path)
    ctx = Context(model, ContextParams(n_ctx=2048))
    try:
        batch = ctx.new_batch()
        for pos in range(1100):
            batch.add(10 + pos, pos, 0, pos == 1099)
        assert ctx.decode(batch) == 0
        size = llama_cpp.llama_state_get_size(ctx.ptr)
        buf = (ctypes.c_uint8 * size)()
        state = scan_bytes(
            bytes(buf[: llama_cpp.llama_state_get_data(ctx.ptr, buf, size)]), layout=layout_from_model(path)
        )
        cells = {
            p.name: {s: (v["cells"], v["pos_min"], v["pos_max"]) for s, v in p.sequences().items()} for p in state.parts
        }
        assert cells == {"kv-base": {0: (1100, 0, 1099)}, "kv-swa": {0: (1024, 76, 1099)}}
    finally:
        batch.free()
        ctx.close()
        model.close()


@pytest.mark.parametrize("name", ARCHS)
def test_seq_equals_no_kv_unified_with_flash_attn_off(tiny_models, name):
    requests = [quicksort(lang) for lang in LANGS[:3]]
    seq = serve(tiny_models[name], "seq", requests)
    split = serve(tiny_models[name], "no-kv-unified", requests)
    for lang, a, b in zip(LANGS, seq, split, strict=False):
        assert a.ok and b.ok
        assert a.tokens == b.tokens, f"{lang}: first divergence at token {first_divergence(a.tokens, b.tokens)}"
    assert {r.slot_id for r in split} == {0, 1, 2}, "no-kv-unified served the requests on separate slots"


@pytest.mark.parametrize("name", ARCHS)
def test_par_four_concurrent_requests_each_equal_their_seq_output(tiny_models, name):
    requests = [quicksort(lang) for lang in LANGS]
    seq = serve(tiny_models[name], "seq", requests)
    par = serve(tiny_models[name], "par", requests)
    assert sorted(r.slot_id for r in par) == [0, 1, 2, 3]
    for lang, a, b in zip(LANGS, seq, par, strict=False):
        assert a.ok and b.ok
        assert a.tokens == b.tokens, f"{lang}: first divergence at token {first_divergence(a.tokens, b.tokens)}"


def test_a_batch_as_small_as_the_slots_bounds_the_drafts_and_keeps_the_output(tiny_models):
    """n_batch = parallel = 2 with an n-gram drafter: the first slot's draft leaves a token for the second
    (found by `specharness shrink`: the planner overflowed the batch), and the output is no speculation's."""
    model = resolve("tiny-dense-loop")
    requests = [quicksort(lang) for lang in LANGS[:2]]
    plain = serve(model, "par", requests, parallel=2, n_batch=2, n_ubatch=2)
    drafted = serve(
        model,
        "par",
        requests,
        parallel=2,
        n_batch=2,
        n_ubatch=2,
        spec={
            "spec-type": "ngram-map-k",
            "spec-ngram-map-k-size-n": 1,
            "spec-ngram-map-k-size-m": 1,
            "spec-ngram-map-k-min-hits": 1,
        },
    )
    assert all(r.ok for r in plain + drafted), [r.error for r in plain + drafted]
    assert sum(r.spec_stats.get("draft_n", 0) for r in drafted) > 0
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_models):
    model = tiny_models["tiny-dense"]
    sampled = [quicksort("C", temperature=0.8, seed=s) for s in (1, 1, 2)]
    results = serve(model, "par", sampled)
    assert results[0].tokens == results[1].tokens
    assert results[0].tokens != results[2].tokens


def test_overlong_prompt_is_an_error_result_while_other_slots_finish(tiny_models):
    too_long = Request(prompt=" ".join(["word"] * 400), sampling=Sampling(n_predict=16))
    results = serve(
        tiny_models["tiny-dense"],
        "no-kv-unified",
        [quicksort("C"), too_long, quicksort("Java")],
        n_ctx=1024,
        parallel=4,
    )
    assert results[1].error and "slot holds 256" in results[1].error and results[1].stop_reason == "error"
    assert results[0].ok and results[2].ok and len(results[0].tokens) == 64


def test_kv_cache_full_ends_only_the_request_that_does_not_fit(tiny_models):
    # two slots share 256 unified cells; each may grow to 256 alone, so together they run out
    requests = [quicksort("C", n_predict=400), quicksort("Java", n_predict=400)]
    results = serve(tiny_models["tiny-dense"], "par", requests, n_ctx=256, parallel=2)
    failed = [r for r in results if not r.ok]
    assert len(failed) == 1 and failed[0].error.startswith("context_full")
    survivor = next(r for r in results if r.ok)
    assert survivor.stop_reason == "limit" and survivor.tokens


def test_chat_request_is_rendered_with_a_template(tiny_models):
    chat = Request(messages=[{"role": "user", "content": "Write a quicksort in C."}], sampling=Sampling(n_predict=8))
    plain = Request(prompt="Write a quicksort in C.", sampling=Sampling(n_predict=8))
    results = serve(tiny_models["tiny-dense"], "seq", [chat, plain])
    assert all(r.ok for r in results)
    assert len(results[0].prompt_tokens) > len(results[1].prompt_tokens) + 4


def test_stop_string_cuts_the_text(tiny_models):
    free = serve(tiny_models["tiny-dense"], "seq", [quicksort("C", n_predict=32)])[0]
    word = free.text.strip().split()[len(free.text.split()) // 2]
    stopped = serve(tiny_models["tiny-dense"], "seq", [quicksort("C", n_predict=32, stop=[word])])[0]
    assert stopped.stop_reason == "word"
    assert word not in stopped.text and free.text.startswith(stopped.text)


class _PieceModel:
    """Just enough of a Model for a Slot: token t stands for `pieces[t]`, token 0 ends generation."""

    vocab = None
    vocabulary = SimpleNamespace(eog_tokens=[0], suppress_tokens=[])

    def __init__(self, pieces):
        self.pieces = pieces

    def piece(self, token):
        return self.pieces[token]

    def is_eog(self, token):
        return token == 0


def _emit_until_stop(pieces, tokens, stop):
    slot = Slot(0, _PieceModel(pieces), 10_000, seed=1)
    assert slot.start(0, Request(prompt=[1], sampling=Sampling(n_predict=10_000, stop=stop))) is None
    for i, token in enumerate(tokens):
        slot.n_past += 1
        if slot.emit(token):
            return i, slot.result.text
    return None, bytes(slot.text_bytes)


def _whole_text_stop(pieces, tokens, stop):
    """The reference: decode everything emitted so far (errors ignored) and search it from the start."""
    data = b""
    for i, token in enumerate(tokens):
        data += pieces[token]
        text = data.decode("utf-8", errors="ignore")
        hits = [j for j in (text.find(s) for s in stop) if j >= 0]
        if hits:
            return i, text[: min(hits)]
    return None, data


def test_stop_strings_searched_in_the_tail_match_a_whole_text_search():
    rng = random.Random(5)
    chars = ["a", "b", "é", "€", "😀", " "]

    def piece():
        r = rng.random()
        if r < 0.15:  # a stray byte: invalid, or part of a character split over tokens
            return bytes([rng.choice([0xFF, 0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F])])
        return "".join(rng.choice(chars) for _ in range(rng.randrange(3))).encode()

    stopped = 0
    for _ in range(1500):
        pieces = [b""] + [piece() for _ in range(30)]
        tokens = [rng.randrange(1, len(pieces)) for _ in range(50)]
        stop = ["".join(rng.choice(chars) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        expected = _whole_text_stop(pieces, tokens, stop)
        assert _emit_until_stop(pieces, tokens, stop) == expected, (stop, [pieces[t] for t in tokens])
        stopped += expected[0] is not None
    assert stopped > 500  # most cases stop, many of them over a token boundary


def test_history_follows_n_past_through_growth_and_rollback():
    slot = Slot(0, _PieceModel([b"", b"x"]), 10_000, seed=1)
    slot.start(0, Request(prompt=[1, 1, 1], sampling=Sampling(n_predict=100)))
    for n_past, n_out in ((2, 0), (3, 0), (3, 2), (5, 4), (4, 4), (7, 6), (3, 6), (8, 9)):
        slot.n_past = n_past
        slot.result.tokens = list(range(10, 10 + n_out))
        assert slot.history == (slot.prompt + slot.result.tokens)[:n_past]


def test_detokenizer_shows_the_engines_text(tiny_models):
    info = tiny_models["tiny-dense"]
    result = serve(info, "seq", [quicksort("C", n_predict=48)])[0]
    assert result.ok and detokenizer(info.path)(result.tokens) == result.text


def test_a_killed_engine_worker_crashes_its_requests_and_the_next_run_restarts_it(tiny_models, tmp_path):
    import os
    import signal
    import threading

    session = InprocBackend(tmp_path).open(ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq"))
    try:
        first = session.process
        timer = threading.Timer(0.5, lambda: os.kill(first.pid, signal.SIGKILL))
        timer.start()
        crashed = session.run([quicksort(lang, n_predict=100_000) for lang in LANGS])
        timer.join()
        assert [r.stop_reason for r in crashed] == ["crashed"] * len(LANGS)
        assert "the in-process engine's worker was killed by SIGKILL" in crashed[0].error
        again = session.run([quicksort("C", n_predict=8)])[0]
        assert again.ok and len(again.tokens) == 8 and session.starts == 2
    finally:
        session.close()


def test_an_engine_request_past_its_deadline_times_out_and_the_next_run_goes_on(tiny_models):
    session = InprocBackend().open(ServeConfig(model=tiny_models["tiny-dense"].path, mode="seq"))
    try:
        stalled = quicksort("C", n_predict=-1)
        stalled.deadline_s, stalled.tag = 0.3, "stalled"
        [late] = session.run([stalled])
        assert late.stop_reason == "timeout" and "case stalled did not finish within its deadline" in late.error
        again = session.run([quicksort("C", n_predict=8)])[0]
        assert again.ok and len(again.tokens) == 8 and session.starts == 2
    finally:
        session.close()
