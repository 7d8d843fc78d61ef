"""The speculative engine on real tiny models: lossless greedy output, rollback on every model kind,
sampler/grammar restore, decode failures under a full KV cache, and the fault switches."""

import json

import pytest
from helpers import LANGS, first_divergence, quicksort

from harness.engine import ContextParams, Engine
from harness.engine.drafters.scripted import Scripted
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.models import resolve
from harness.suites.request import Request, Sampling

ARCHS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
MODES = {"seq": (1, False), "par": (4, True), "no-kv-unified": (4, False)}
SCHEMA = {
    "type": "object",
    "properties": {"lang": {"enum": ["C", "Java", "Python"]}, "stable": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["lang", "stable", "n"],
}


def run(model, requests, mode="seq", spec=None, **params):
    parallel, unified = MODES[mode]
    with Engine(model.path, ContextParams(parallel=parallel, kv_unified=unified, **params), spec) as engine:
        return engine.run(requests)


def solo(model, requests, **params):
    """Each request alone on a fresh one-slot engine: the reference output."""
    return [run(model, [r], **params)[0] for r in requests]


def totals(results):
    keys = ("draft_n", "draft_n_accepted", "spec_skip", "ckpt_restored")
    return {k: sum(r.spec_stats.get(k, 0) for r in results) for k in keys}


def assert_lossless(reference, results):
    for lang, a, b in zip(LANGS, reference, results, strict=False):
        assert b.ok, b.error
        assert a.tokens == b.tokens, f"{lang}: first divergence at token {first_divergence(a.tokens, b.tokens)}"


@pytest.fixture(scope="module")
def shared():
    """Runs that several tests read (the same model, requests, mode and config), by key: each runs once per module
    (per xdist worker) and every test that needs it reads it."""
    return {}


def once(shared, key, make):
    if key not in shared:
        shared[key] = make()
    return shared[key]


def draft_model_spec(name, fault=None):
    return SpecConfig(
        spec_type=("draft-simple",), spec_draft_model=resolve(f"{name}-draft").path, spec_draft_n_max=4, fault=fault
    )


@pytest.fixture(scope="module")
def greedy_reference(tiny_models):
    """The non-speculative greedy output of each quicksort prompt, per arch (the same in every mode)."""
    return {name: solo(tiny_models[name], [quicksort(lang) for lang in LANGS]) for name in ARCHS}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHS)
def test_scripted_drafts_with_planted_rejections_are_lossless(tiny_models, greedy_reference, name, mode):
    reference = greedy_reference[name]
    requests = [quicksort(lang) for lang in LANGS]
    if mode == "seq":
        results = [
            run(
                tiny_models[name],
                [rq],
                spec=SpecConfig(drafters=[Scripted(ref.tokens, wrong_at=lambda s, j, k: k == 2)]),
            )[0]
            for rq, ref in zip(requests, reference, strict=False)
        ]
    else:
        # slot i serves request i: the script is keyed by slot (sequence) id
        script = {i: ref.tokens for i, ref in enumerate(reference)}
        spec = SpecConfig(drafters=[Scripted(script, wrong_at=lambda s, j, k: k == 2)])
        results = run(tiny_models[name], requests, mode, spec)
    assert_lossless(reference, results)
    t = totals(results)
    assert t["draft_n_accepted"] > 0 and t["draft_n"] > t["draft_n_accepted"], t


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHS)
def test_draft_model_speculation_is_lossless(tiny_models, greedy_reference, shared, name, mode):
    requests = [quicksort(lang) for lang in LANGS]
    results = once(
        shared, ("draft-simple", name, mode), lambda: run(tiny_models[name], requests, mode, draft_model_spec(name))
    )
    assert_lossless(greedy_reference[name], results)
    t = totals(results)
    assert t["draft_n_accepted"] > 0 and t["draft_n"] > t["draft_n_accepted"], t
    if name != "tiny-dense":
        assert t["ckpt_restored"] > 0, "partial acceptances on a hybrid/recurrent target restore checkpoints"


def test_partial_rollback_with_recurrent_snapshots_is_lossless(tiny_models, greedy_reference):
    spec = SpecConfig(
        spec_type=("draft-simple",),
        spec_draft_model=resolve("tiny-hybrid-draft").path,
        spec_draft_n_max=4,
        rollback="partial",
    )
    results = run(tiny_models["tiny-hybrid"], [quicksort(lang) for lang in LANGS], "par", spec)
    assert_lossless(greedy_reference["tiny-hybrid"], results)
    t = totals(results)
    assert t["draft_n"] > t["draft_n_accepted"] > 0 and t["ckpt_restored"] == 0


def test_full_state_checkpoints_are_lossless(tiny_models, greedy_reference):
    spec = SpecConfig(
        drafters=[Scripted({i: r.tokens for i, r in enumerate(greedy_reference["tiny-hybrid"])}, reject_all=True)],
        checkpoint_flags="full",
    )
    results = run(tiny_models["tiny-hybrid"], [quicksort(lang) for lang in LANGS], "no-kv-unified", spec)
    assert_lossless(greedy_reference["tiny-hybrid"], results)
    assert totals(results)["ckpt_restored"] > 0


@pytest.mark.parametrize(
    "rollback, name, message",
    [
        ("seq-rm", "tiny-hybrid", "cannot roll back the recurrent state"),
        ("seq-rm", "tiny-recurrent", "cannot roll back the recurrent state"),
        ("partial", "tiny-recurrent", "needs a hybrid model"),
        ("partial", "tiny-dense", "needs a hybrid model"),
    ],
)
def test_rollback_that_would_be_lossy_is_refused(tiny_models, rollback, name, message):
    spec = SpecConfig(drafters=[Scripted([])], rollback=rollback)
    with pytest.raises(HarnessError, match=message):
        run(tiny_models[name], [quicksort("C")], spec=spec)


@pytest.mark.parametrize("drafter", ["scripted-reject-all", "draft-simple-p-min-0.99"])
def test_forced_rejections_over_20_sequential_requests_stay_identical(tiny_models, greedy_reference, drafter):
    model = tiny_models["tiny-hybrid"]
    reference = greedy_reference["tiny-hybrid"][0]
    if drafter == "scripted-reject-all":
        spec = SpecConfig(drafters=[Scripted(reference.tokens, reject_all=True)])
    else:
        spec = SpecConfig(
            spec_type=("draft-simple",),
            spec_draft_model=resolve("tiny-hybrid-draft").path,
            spec_draft_n_max=4,
            spec_draft_p_min=0.99,
        )
    results = run(model, [quicksort("C") for _ in range(20)], spec=spec, n_ctx=256)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert len({tuple(r.tokens) for r in results}) == 1 and results[0].tokens == reference.tokens


def json_request():
    return Request(prompt="Describe quicksort as JSON.", sampling=Sampling(n_predict=64, json_schema=SCHEMA))


def valid_json(text):
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return set(value) == {"lang", "stable", "n"}


@pytest.mark.parametrize("fault, expect_intact", [(None, True), ("no-sampler-restore", False)])
def test_json_schema_under_forced_rejections(tiny_models, shared, fault, expect_intact):
    model = tiny_models["tiny-hybrid"]
    reference = once(shared, "json-reference", lambda: solo(model, [json_request()])[0])
    assert valid_json(reference.text), reference.text
    outcomes = []
    for i in range(20):
        wrong = {"reject_all": True} if i % 2 == 0 else {"wrong_at": lambda s, j, k, i=i: k == 1 + i % 3}
        spec = SpecConfig(drafters=[Scripted(reference.tokens, **wrong)], fault=fault)
        r = run(model, [json_request()], spec=spec)[0]
        outcomes.append(valid_json(r.text) and r.tokens == reference.tokens)
    if expect_intact:
        assert all(outcomes), f"{outcomes.count(False)} of 20 runs invalid or different"
    else:
        assert not all(outcomes), "the fault should leave a ghost token in the grammar state"


def chats(n_turns=3):
    turns = [
        "Write a quicksort implementation in C with detailed comments.",
        "Now write a merge sort in C with the same style and commenting pattern.",
        "Add a benchmark harness that compares both sorting algorithms.",
    ]
    return [
        Request(messages=[{"role": "user", "content": t} for t in turns[: i + 1]], sampling=Sampling(n_predict=200))
        for i in range(n_turns)
    ]


def test_concurrent_chats_filling_the_kv_cache_during_speculation_end_cleanly(tiny_models):
    model = tiny_models["tiny-dense"]
    spec = SpecConfig(
        spec_type=("draft-simple",), spec_draft_model=resolve("tiny-dense-draft").path, spec_draft_n_max=6
    )
    requests = chats() + chats()[:1]
    results = run(model, requests, "par", spec, n_ctx=512)
    assert all(r.ok or r.error.startswith("context_full") for r in results), [r.error for r in results]
    assert any(not r.ok for r in results), "the context is small enough to fill"
    alone = solo(model, requests, n_ctx=512)
    for got, ref in zip(results, alone, strict=False):
        if got.ok:
            assert got.tokens == ref.tokens, f"first divergence at {first_divergence(got.tokens, ref.tokens)}"


def test_keep_drafts_on_decode_failure_fault_breaks_the_next_decode(tiny_models):
    model = tiny_models["tiny-dense"]
    reference = solo(model, [quicksort(lang, n_predict=300) for lang in LANGS[:2]])
    script = {i: r.tokens for i, r in enumerate(reference)}
    outcomes = {}
    for fault in (None, "keep-drafts-on-decode-failure"):
        spec = SpecConfig(drafters=[Scripted(script, n_max=8)], fault=fault)
        results = run(model, [quicksort(lang, n_predict=300) for lang in LANGS[:2]], "par", spec, n_ctx=256)
        outcomes[fault] = [r.error or "" for r in results]
    assert all(e == "" or e.startswith("context_full") for e in outcomes[None]), outcomes[None]
    assert any("invalid" in e for e in outcomes["keep-drafts-on-decode-failure"]), outcomes


@pytest.mark.parametrize(
    "fault, name",
    [
        ("skip-seq-rm-after-restore", "tiny-hybrid"),
        ("rollback-off-by-one", "tiny-hybrid"),
        ("rollback-off-by-one", "tiny-dense"),
        ("partial-checkpoint-only", "tiny-hybrid"),
    ],
)
def test_rollback_faults_change_the_output(tiny_models, shared, fault, name):
    model = tiny_models[name]
    reference = once(shared, ("C-128", name), lambda: solo(model, [quicksort("C", n_predict=128)])[0])
    spec = SpecConfig(drafters=[Scripted(reference.tokens, wrong_at=lambda s, j, k: k == 1)], fault=fault)
    faulty = run(model, [quicksort("C", n_predict=128)], spec=spec)[0]
    assert not faulty.ok or faulty.tokens != reference.tokens


NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
SMALL_NGRAMS = dict(
    spec_ngram_simple_size_n=3,
    spec_ngram_simple_size_m=8,
    spec_ngram_map_k_size_n=3,
    spec_ngram_map_k_size_m=8,
    spec_ngram_map_k4v_size_n=3,
    spec_ngram_map_k4v_size_m=8,
    spec_ngram_mod_n_match=3,
    spec_ngram_mod_n_min=1,
    spec_ngram_mod_n_max=8,
)


@pytest.fixture(scope="module")
def loop_reference():
    """Greedy non-speculative output of the `-loop` models (they repeat themselves, so n-grams match)."""
    return {name: solo(resolve(f"{name}-loop"), [quicksort(lang, n_predict=128) for lang in LANGS]) for name in ARCHS}


def ngram_run(spec_type, name, mode, fault=None):
    """The quicksort prompts (128 tokens) on the `-loop` model with one n-gram type."""
    spec = SpecConfig(spec_type=(spec_type,), **SMALL_NGRAMS, fault=fault)
    return run(resolve(f"{name}-loop"), [quicksort(lang, n_predict=128) for lang in LANGS], mode, spec)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("spec_type", NGRAM_TYPES)
def test_ngram_speculation_is_lossless(loop_reference, shared, spec_type, name, mode):
    results = once(shared, (spec_type, name, mode), lambda: ngram_run(spec_type, name, mode))
    assert_lossless(loop_reference[name], results)
    t = totals(results)
    assert t["draft_n_accepted"] > 0 and t["draft_n"] > t["draft_n_accepted"], t


def test_chained_drafters_follow_llama_cpps_priority_ngram_before_draft_model(tiny_models):
    """common/speculative.cpp tries the n-gram types before draft-simple, whatever order the user wrote."""
    from harness.engine.context import Context
    from harness.engine.model import Model
    from harness.engine.spec_config import build_drafters

    model = Model(tiny_models["tiny-dense"].path)
    ctx = Context(model, ContextParams())
    config = SpecConfig(
        spec_type=("draft-simple", "ngram-mod", "ngram-simple"), spec_draft_model=resolve("tiny-dense-draft").path
    )
    drafters = build_drafters(config, ctx)
    try:
        assert [d.name for d in drafters] == ["ngram-simple", "ngram-mod", "draft-simple"]
    finally:
        for d in drafters:
            getattr(d, "close", lambda: None)()
        ctx.close()
        model.close()


def rate(results):
    t = totals(results)
    return t["draft_n_accepted"] / t["draft_n"]


def test_per_position_counters_add_up_to_the_drafted_and_accepted_totals(tiny_models):
    """accepted_per_pos[k] (llama-server's n_accepted_per_pos) counts the steps whose token at draft position k
    was accepted; drafted_per_pos[k] the steps that drafted one there: their sums are the request's totals, and
    a token is accepted at k only after k-1 was."""
    spec = SpecConfig(
        spec_type=("draft-simple",), spec_draft_model=resolve("tiny-hybrid-draft").path, spec_draft_n_max=4
    )
    result = run(tiny_models["tiny-hybrid"], [quicksort("C")], spec=spec)[0]
    s = result.spec_stats
    assert sum(s["drafted_per_pos"]) == s["draft_n"] and sum(s["accepted_per_pos"]) == s["draft_n_accepted"], s
    assert 0 < s["accepted_per_pos"][0] < s["drafted_per_pos"][0], s
    assert all(a >= b for a, b in zip(s["accepted_per_pos"], s["accepted_per_pos"][1:], strict=False)), s
    assert len(s["drafted_per_pos"]) == 4


@pytest.mark.parametrize("name", ARCHS)
def test_stale_draft_context_fault_stays_lossless_and_lowers_acceptance(tiny_models, greedy_reference, shared, name):
    """The draft context keeps its rejected tokens: the target never sees it (output unchanged), the drafts do."""

    requests = [quicksort(lang) for lang in LANGS]
    clean = once(
        shared, ("draft-simple", name, "seq"), lambda: run(tiny_models[name], requests, spec=draft_model_spec(name))
    )
    stale = run(tiny_models[name], requests, spec=draft_model_spec(name, "stale-draft-context"))
    assert_lossless(greedy_reference[name], stale)
    assert rate(stale) < rate(clean) - 0.05, (rate(clean), rate(stale))


def test_shared_drafter_state_fault_lowers_acceptance_in_par_only(loop_reference, shared):
    """n-gram drafters keyed by slot 0 for every slot: seq (one slot) is untouched; in par the other slots'
    drafts come from slot 0's n-gram map (output unchanged, acceptance lower)."""

    def runs(mode):  # the clean run is test_ngram_speculation_is_lossless's (the same requests and config)
        clean = once(shared, ("ngram-map-k", "tiny-dense", mode), lambda: ngram_run("ngram-map-k", "tiny-dense", mode))
        return {
            None: clean,
            "shared-drafter-state": ngram_run("ngram-map-k", "tiny-dense", mode, "shared-drafter-state"),
        }

    seq = runs("seq")
    assert totals(seq[None]) == totals(seq["shared-drafter-state"])
    par = runs("par")
    assert_lossless(loop_reference["tiny-dense"], par["shared-drafter-state"])
    share = {f: [r.spec_stats["draft_n_accepted"] / len(r.tokens) for r in par[f]] for f in par}
    assert max(a - b for a, b in zip(share[None], share["shared-drafter-state"], strict=False)) > 0.2, share
