"""llama-server's sampling surface in both engines: the fields (names, defaults, validation), the
in-process chain against a real llama-server token for token, sampler state on rollback, and the
`sampling` suite catching `no-penalty-restore`."""

import json
import math
from dataclasses import fields

import numpy as np
import pytest
import requests
from helpers import LANGS, first_divergence, quicksort
from skips import require_model

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.choose import backend_factories
from harness.backends.client import LlamaClient
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.engine.model import Model
from harness.engine.sampler import Sampler, logit_biases
from harness.errors import HarnessError
from harness.execute import ExecOptions, Executor
from harness.running import run_suites
from harness.suites import load_suite, parse_suite
from harness.suites.request import Request, Sampling
from harness.verdict.baselines import BaselineStore, default_root

TINY = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
PROJECT_DEFAULTS = {"temperature", "n_predict", "seed", "n_probs"}
"""Fields whose default is the project's, not llama-server's (greedy, 128 tokens, the backend's seed,
the run's --logit-top-k)."""
ACCEPTANCE = {"repeat_penalty": 1.5, "repeat_last_n": 64, "temperature": 0.7, "seed": 42}
JSON_GRAMMAR = r"""
root ::= "{" ws "\"lang\":" ws ("\"C\"" | "\"Java\"") "," ws "\"n\":" ws [0-9] [0-9]? ws "}"
ws   ::= " "?
"""
CHAINS = {
    "greedy, penalties": dict(temperature=0, repeat_penalty=1.5, repeat_last_n=64),
    "greedy, frequency, presence, DRY": dict(
        temperature=0, repeat_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5, dry_multiplier=0.8
    ),
    "greedy, logit bias, ignore_eos": dict(
        temperature=0, logit_bias=[[" the", -5], [15, 3], [29871, False]], ignore_eos=True
    ),
    "sampled, penalties": ACCEPTANCE,
    "sampled, DRY, XTC, typical, top-n-sigma": dict(
        temperature=0.9,
        seed=7,
        dry_multiplier=0.8,
        xtc_probability=0.5,
        xtc_threshold=0.1,
        typical_p=0.9,
        top_n_sigma=2.0,
    ),
    "mirostat 2": dict(temperature=0.8, seed=3, mirostat=2),
    "dynamic temperature, sampler order": dict(
        temperature=0.8,
        seed=5,
        dynatemp_range=0.5,
        repeat_penalty=1.2,
        samplers=["top_k", "temperature", "penalties", "min_p"],
    ),
    "sampled under a grammar": dict(temperature=1.0, seed=11, grammar=JSON_GRAMMAR),
}


@pytest.fixture(scope="module")
def build():
    return ensure_server(None, "cpu", [], jobs=None)


@pytest.fixture(scope="module")
def vocab_model(tiny_models):
    model = Model(tiny_models["tiny-dense"].path)
    yield model
    model.close()


# ------------------------------------------------------------------------------------ fields


def test_defaults_are_llama_servers_own(build, tiny_models, tmp_path):
    with ServerBackend(build, run_dir=tmp_path).open(ServeConfig(model=tiny_models["tiny-dense"].path)) as session:
        server = requests.get(f"{session.server.url}/props", timeout=30).json()["default_generation_settings"]["params"]
    ours = Sampling()
    compared = 0
    for f in fields(Sampling):
        if f.name in server and f.name not in PROJECT_DEFAULTS:
            value = getattr(ours, f.name)
            assert server[f.name] == (pytest.approx(value) if isinstance(value, float) else value), f.name
            compared += 1
    assert compared >= 25
    assert ours.dry_sequence_breakers == ["\n", ":", '"', "*"] and ours.logit_bias == []  # common.h


def test_every_field_is_sent_as_is_and_applied_by_the_server(build, tiny_models, tmp_path):
    odd = Sampling(
        temperature=0.55,
        top_k=7,
        top_p=0.8,
        min_p=0.02,
        typical_p=0.97,
        top_n_sigma=1.5,
        xtc_probability=0.25,
        xtc_threshold=0.2,
        dynatemp_range=0.1,
        dynatemp_exponent=1.3,
        repeat_last_n=16,
        repeat_penalty=1.25,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        dry_multiplier=0.4,
        dry_base=2.0,
        dry_allowed_length=3,
        dry_penalty_last_n=32,
        mirostat_tau=4.0,
        mirostat_eta=0.2,
        adaptive_target=0.5,
        adaptive_decay=0.5,
        min_keep=2,
        ignore_eos=True,
        samplers=["top_k", "penalties", "temperature"],
        seed=1234,
        n_probs=3,
        n_predict=4,
        n_keep=5,
        n_discard=7,
    )
    with ServerBackend(build, run_dir=tmp_path).open(ServeConfig(model=tiny_models["tiny-dense"].path)) as session:
        client = LlamaClient(session.server.url)
        payload = {"prompt": "Hello", **odd.server_fields(), "n_probs": odd.n_probs}
        echoed = client.completion(payload)["generation_settings"]
    for name, value in payload.items():
        if name in echoed and name != "logit_bias":
            assert echoed[name] == (pytest.approx(value) if isinstance(value, float) else value), name
    assert {
        "repeat_penalty",
        "dry_multiplier",
        "samplers",
        "ignore_eos",
        "min_keep",
        "xtc_threshold",
        "n_keep",
        "n_discard",
    } <= set(echoed)
    eog = Model(tiny_models["tiny-dense"].path)
    try:  # ignore_eos: the server adds its vocabulary's end-of-generation biases (-inf shows as null)
        assert echoed["logit_bias"] == [{"bias": None, "token": t} for t in eog.vocabulary.eog_tokens]
    finally:
        eog.close()


@pytest.mark.parametrize(
    "text, line, where, says",
    [
        ("    sampling: {repeat_penalt: 1.5}\n", 5, "cases.0.sampling.repeat_penalt", "did you mean 'repeat_penalty'"),
        (
            "    sampling: {repeat_penalty: high}\n",
            5,
            "cases.0.sampling.repeat_penalty",
            "'high' is not of type 'number'",
        ),
        (
            "    sampling:\n      samplers: [top_k, nucleus]\n",
            6,
            "cases.0.sampling.samplers.1",
            "'nucleus' is not one of",
        ),
        (
            "    sampling:\n      logit_bias: [[15, true]]\n",
            6,
            "cases.0.sampling.logit_bias.0.1",
            "not a number or false",
        ),
        ("    sampling: {n_predict: 0}\n", 5, "cases.0.sampling.n_predict", "-1 (until the context is full)"),
        ("    sampling: {mirostat: 3}\n", 5, "cases.0.sampling.mirostat", "3 is not one of [0, 1, 2]"),
        (
            "    sampling: {repeat_penalty: 0}\n",
            5,
            "cases.0.sampling.repeat_penalty",
            "less than or equal to the minimum",
        ),
    ],
)
def test_a_wrong_sampling_field_is_one_line_with_file_line_and_field(tmp_path, text, line, where, says):
    path = tmp_path / "demo.yaml"
    path.write_text("suite: demo\ncases:\n  - name: one\n    prompt: hello\n" + text)
    with pytest.raises(HarnessError) as err:
        load_suite(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: {where}: ") and says in message and "\n" not in message


def test_acceptance_penalty_config_parses_from_a_suite_file():
    suite = parse_suite(
        "suite: d\nsampling: {repeat_penalty: 1.5, repeat_last_n: 64, temperature: 0.7, seed: 42}\n"
        "cases:\n  - {name: a, prompt: x, sampling: {logit_bias: {'15': -1, hello: false}}}\n"
    )
    sampling = suite.cases[0].sampling
    assert (sampling.repeat_penalty, sampling.repeat_last_n, sampling.temperature, sampling.seed) == (1.5, 64, 0.7, 42)
    assert not sampling.greedy and Sampling(temperature=0, repeat_penalty=2).greedy


# ------------------------------------------------------------------------------------ the in-process chain


def test_logit_bias_follows_llama_servers_parsing(vocab_model):
    model = vocab_model
    hello = model.tokenize("hello", add_special=False, parse_special=False)
    as_list = logit_biases(Sampling(logit_bias=[[15, 2.0], ["hello", False], [10**9, 1.0], [3, True], [4.5, 1]]), model)
    assert as_list == [(15, 2.0)] + [(t, -math.inf) for t in hello]
    as_mapping = logit_biases(Sampling(logit_bias={"15": 2.0, " 16": -1, "hello": False, 17: 0.5}), model)
    assert as_mapping == [(15, 2.0), (16, -1.0)] + [(t, -math.inf) for t in hello] + [(17, 0.5)]
    eog = logit_biases(Sampling(ignore_eos=True), model)
    assert eog == [(t, -math.inf) for t in model.vocabulary.eog_tokens] and eog


def _row(model, hot: dict[int, float]) -> np.ndarray:
    row = np.zeros(model.n_vocab, dtype=np.float32)
    for token, value in hot.items():
        row[token] = value
    return row


def test_the_prompt_reaches_the_penalties_but_not_the_grammar(vocab_model):
    model = vocab_model
    a, b = 1000, 2000
    row = _row(model, {a: 10.0, b: 9.0})
    plain = Sampler.for_request(Sampling(temperature=0, repeat_penalty=100.0), 42, model)
    assert plain.sample(None, 0, row) == a
    fed = Sampler.for_request(Sampling(temperature=0, repeat_penalty=100.0), 42, model)
    fed.accept_prompt([5, a, 7])
    assert fed.sample(None, 0, row) == b  # a is in the prompt: 10 / 100 < 9
    grammar = 'root ::= "x" [a-z]*'
    x = next(t for t in range(model.n_vocab) if model.piece(t) == b"x")
    guarded = Sampler.for_request(Sampling(temperature=0, grammar=grammar), 42, model)
    guarded.accept_prompt(model.tokenize("y y y", add_special=False, parse_special=False))  # grammar not fed
    assert guarded.sample(None, 0, _row(model, {x: 1.0, a: 5.0})) == x  # a is rejected, re-sampled with the grammar
    for s in (plain, fed, guarded):
        s.free()


def test_clone_restores_penalties_dry_grammar_and_rng(vocab_model):
    model = vocab_model
    rng = np.random.RandomState(0)
    rows = [rng.randn(model.n_vocab).astype(np.float32) * 3 for _ in range(12)]
    sampling = Sampling(
        temperature=0.9,
        seed=5,
        repeat_penalty=1.5,
        dry_multiplier=0.8,
        xtc_probability=0.3,
        grammar="root ::= [^\\x00]*",
    )
    sampler = Sampler.for_request(sampling, 42, model)
    first = [sampler.sample(None, 0, r) for r in rows[:6]]
    backup = sampler.clone()
    tail = [sampler.sample(None, 0, r) for r in rows[6:]]
    replayed = [backup.sample(None, 0, r) for r in rows[6:]]
    assert replayed == tail and len(set(first + tail)) > 6
    # the no-penalty-restore fault: the restored sampler takes the penalty history that saw the rejected tokens
    faulty = Sampler.for_request(sampling, 42, model)
    [faulty.sample(None, 0, r) for r in rows[:6]]
    restored = faulty.clone()
    rejected = [faulty.sample(None, 0, r) for r in rows[6:9]]
    restored.keep_penalties_of(faulty)
    assert rejected == tail[:3] and [restored.sample(None, 0, r) for r in rows[6:]] != tail
    for s in (sampler, backup, faulty, restored):
        s.free()


def _serve_both(model_path, requests_, mode="seq", **config):
    cfg = ServeConfig(model=model_path, mode=mode, flash_attn="off", **config)
    inproc = InprocBackend().open(cfg)
    try:
        ours = inproc.run(requests_)
    finally:
        inproc.close()
    with ServerBackend().open(cfg) as session:
        theirs = session.run(requests_)
    return ours, theirs


@pytest.mark.parametrize("name", TINY)
def test_inproc_and_server_agree_token_for_token_for_every_chain(tiny_models, name):
    chains = list(CHAINS.items())
    reqs = [quicksort(lang, n_predict=48, **sampling) for _, sampling in chains for lang in LANGS[:2]]
    ours, theirs = _serve_both(tiny_models[name].path, reqs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        label = chains[i // 2][0]
        assert a.ok and b.ok, (label, a.error, b.error)
        assert a.tokens == b.tokens, f"{label}: first divergence at {first_divergence(a.tokens, b.tokens)}"
        assert a.stop_reason == b.stop_reason
    assert all(json.loads(r.text)["lang"] in ("C", "Java") for r in ours[-2:])  # the grammar case


def test_inproc_and_server_agree_for_greedy_with_penalties_on_gemma():
    gemma = require_model("gemma3-270m")
    reqs = [quicksort(lang, n_predict=32, **CHAINS["greedy, penalties"]) for lang in LANGS]
    ours, theirs = _serve_both(gemma.path, reqs)
    for lang, a, b in zip(LANGS, ours, theirs, strict=False):
        assert a.tokens == b.tokens, f"{lang}: first divergence at {first_divergence(a.tokens, b.tokens)}"


@pytest.mark.parametrize("backend", ["inproc", "server"])
def test_same_seed_and_config_five_times_gives_identical_tokens(tiny_models, backend):
    cfg = ServeConfig(model=tiny_models["tiny-hybrid"].path, mode="par", flash_attn="off")
    session = (InprocBackend() if backend == "inproc" else ServerBackend()).open(cfg)
    try:
        runs = [session.run([quicksort(lang, n_predict=48, **ACCEPTANCE) for lang in LANGS]) for _ in range(5)]
    finally:
        session.close()
    for i, lang in enumerate(LANGS):
        assert len({tuple(run[i].tokens) for run in runs}) == 1, lang
    assert len({tuple(r.tokens) for r in runs[0]}) == len(LANGS)


def test_context_limit_and_unlimited_n_predict_match_the_server(tiny_models):
    unlimited = Request(prompt="Write a quicksort demo in C.", sampling=Sampling(n_predict=-1, ignore_eos=True))
    ours, theirs = _serve_both(tiny_models["tiny-dense"].path, [unlimited], n_ctx=256)
    assert ours[0].stop_reason == theirs[0].stop_reason == "limit"
    assert ours[0].tokens == theirs[0].tokens
    # n_tokens (decoded: the prompt and all but the last generated token) + 1 >= n_ctx
    assert len(ours[0].prompt_tokens) + len(ours[0].tokens) == 256


# ------------------------------------------------------------------------------------ the sampling suite


def test_sampling_suite_catches_no_penalty_restore():
    """(Clean runs of the same cells pass in `pytest suites/`; the selftest checks the catch matrix.)"""
    only = {"backends": ["inproc"], "modes": ["seq"], "specs": ["draft-simple"], "models": ["tiny-hybrid"]}
    executor = Executor(ExecOptions(backends=backend_factories(), engine={"fault": "no-penalty-restore"}))
    verdicts = run_suites([(load_suite("sampling"), only)], executor, BaselineStore(default_root()))
    failing = {(case, r.name) for _, case, _, r in verdicts if not r.passed}
    assert ("w1_greedy_dry.turn1", "lossless") in failing
    assert {name for _, name in failing} == {"lossless"}
