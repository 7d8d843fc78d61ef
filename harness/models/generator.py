"""Tiny random-weight GGUF models for llama.cpp, written byte-identically from a table of recipes.

The layouts, key sets and weight scales follow the measured recipe in the shared reference
../shared/reference/tiny-gguf.md:
f32 everywhere, matmul weights N(0,1)/sqrt(fan_in), norms 1, an untied `output.weight`.
A draft is its target's weights plus seeded noise N(0, (noise * std(W))^2) on every matmul weight.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from harness.llama.gguf import read_fields

GENERATOR_VERSION = 1
"""Bump whenever the bytes written for an unchanged recipe change (layout, keys, value scales)."""


@dataclass(frozen=True)
class Hparams:
    """Model hyperparameters; each arch writer reads the fields it needs (0 = unused by that arch)."""

    n_layer: int
    n_embd: int = 128
    n_ctx: int = 4096
    n_ff: int = 0
    n_head: int = 0
    n_head_kv: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0
    ssm_inner: int = 0  # mamba2 only: qwen35 derives it as ssm_state * ssm_dt_rank, as llama.cpp requires
    ssm_dt_rank: int = 0
    ssm_group: int = 0
    full_attention_interval: int = 0


@dataclass(frozen=True)
class Recipe:
    """One generated model. A draft (draft_of set) reuses its target's arch, shapes and weights."""

    name: str
    arch: str
    hparams: Hparams
    seed: int  # weight seed; for a draft, the seed of its noise
    draft_of: str | None = None
    noise: float = 0.0  # draft only: noise std as a fraction of each matmul weight's std
    focus: int = 0
    """A `-loop` model: the output rows of `focus` tokens are scaled by `focus_gain`, so greedy decoding
    walks a small set of tokens and soon repeats itself (with context-dependent variations): n-gram
    drafters find matches that are sometimes right and sometimes wrong."""
    focus_gain: float = 1.0
    trunk_gain: float = 1.0
    """Scales every layer's output projection (attention / GatedDeltaNet out, FFN down): below 1 the residual
    stream stays close to the token's embedding, so the next token depends mostly on the current one."""
    mtp: float = 0.0
    """qwen35 only, > 0: one MTP (nextn) block after the trunk (`nextn_predict_layers` 1). Its projection passes
    the token's embedding through and adds this much of the previous hidden state; its attention and FFN write
    at `mtp` scale too: the head predicts from the current token, as the `trunk_gain`-damped trunk mostly does,
    so its drafts are often but not always the target's tokens."""
    head: str = ""
    """A draft head for llama-server's draft-eagle3 / draft-dflash / draft-dspark (`eagle3`, `dflash`, `dspark`),
    fed with the hidden states of `head_of`, whose embedding and output it reuses (see `_write_head`)."""
    head_of: str | None = None
    reads_anchor: bool = False
    """`dflash` heads only: the mask slot attends to the block's anchor token and copies its embedding, so it
    predicts the target's likely next token, as EAGLE3's head does (see `_dflash_anchor_reader`); the block is 2
    (the anchor and one mask slot), so each step drafts one token."""
    decoder_gain: float = 1.0
    """`dspark` heads only: the decoder's output norm weight. Below 1 the decoder's logits flatten beside the
    Markov head's bias (the target's bigram logits of the previous token), so the drafts follow the target's
    bigram chain and the decoder only breaks near-ties."""


_NEW_FIELDS = {
    "trunk_gain": 1.0,
    "mtp": 0.0,
    "head": "",
    "head_of": None,
    "reads_anchor": False,
    "decoder_gain": 1.0,
}
"""Recipe fields added after models were first published: left out of a fingerprint at their defaults, so the
older models keep their file names."""


def _draft(target: Recipe, noise: float, seed: int, kind: str = "draft") -> Recipe:
    """A draft of `target` named `<target>-<kind>`: `draft` is the one draft-simple serves, `close-draft` the one
    the `-close` presets serve (harness.matrix.presets.SpecPreset.draft)."""
    return dataclasses.replace(target, name=f"{target.name}-{kind}", seed=seed, draft_of=target.name, noise=noise)


_DENSE = Recipe("tiny-dense", "llama", Hparams(n_layer=2, n_ff=256, n_head=4, n_head_kv=2), seed=1)
_HYBRID = Recipe(
    "tiny-hybrid",
    "qwen35",
    Hparams(
        n_layer=4,
        n_ff=256,
        n_head=4,
        n_head_kv=2,
        ssm_conv=4,
        ssm_state=32,
        ssm_dt_rank=4,
        ssm_group=2,
        full_attention_interval=4,
    ),
    seed=2,
)
_RECURRENT = Recipe(
    "tiny-recurrent",
    "mamba2",
    Hparams(n_layer=2, ssm_conv=4, ssm_state=16, ssm_inner=256, ssm_dt_rank=8, ssm_group=1),
    seed=3,
)
_LONG = Recipe(
    "tiny-long", "llama", Hparams(n_layer=1, n_embd=64, n_ctx=32768, n_ff=128, n_head=2, n_head_kv=1), seed=4
)
"""A dense model trained (by its GGUF's word) for 32768 positions, one layer and half the width of tiny-dense so
that a 16k-token prompt takes seconds: llama-server caps a slot's context at the model's n_ctx_train, and the
other tiny models say 4096."""

_WIDE = {"n_embd": 256, "n_ff": 512}
"""The `-wide` models' width: 256 columns, so that every matrix takes Q4_K (its 256-value super-blocks; at 128
llama-quantize falls back to Q5_0) and the CPU repacks it (Q4_K 8x8), whose 4-row matrix product rounds otherwise
than the one-row product of a single-token decode: the numerics suite's stand-in for GPU kernels
(docs/near-tie-policy.md#cpu-stand-in)."""

DSPARK_DECODER_GAIN = 0.1
"""The generated DSpark head's `decoder_gain` (quicksort, llama-server, seq: see docs/upstream-defects.md)."""

# Draft noise S: teacher-forced greedy agreement with the target, measured with
# harness.models.agreement.teacher_forced_agreement (4 prompts x 64 tokens; 2 x 48 in brackets).
# Chosen mid-band so drafts are accepted often but not always (S=0.025: dense 0.895, hybrid 0.789).
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        _DENSE,
        _draft(_DENSE, noise=0.05, seed=7),  # 0.758 (0.771)
        _HYBRID,
        _draft(_HYBRID, noise=0.03, seed=7),  # 0.738 (0.750)
        # Close drafts (noise 0.005), the `draft-simple-close` presets' (suites/sampling-close.yaml): expected
        # acceptance per drafted token along target-sampled text (2 prompts x 64 tokens, one position ahead, full
        # vocabulary; rejection sampling sum min(p, q), sample-and-match p(argmax q)) at temperature 0.05: dense
        # 0.975 / 0.927, hybrid 0.964 / 0.920 (at noise 0.01 and temperature 0.1 dense 0.962 / 0.866; at 0.7 dense
        # 0.987 / 0.096: sample-and-match is capped by the target's top probability, and llama.cpp's draft offers
        # its top 10 candidates only, which hold little of a flat model's mass: measured in the suite, 0.18)
        _draft(_DENSE, noise=0.005, seed=8, kind="close-draft"),
        _draft(_HYBRID, noise=0.005, seed=8, kind="close-draft"),
        _RECURRENT,
        _draft(_RECURRENT, noise=0.05, seed=7),  # 0.766 (0.760)
        _LONG,
        _draft(_LONG, noise=0.05, seed=7),  # 0.766 (0.792)
        # Loop variants for the n-gram drafters (greedy, 3 quicksort prompts x 128 tokens, size-n 3 / size-m 8,
        # accepted/drafted): dense ngram-simple 100/218, ngram-mod 145/330; hybrid 6/121, 11/224;
        # recurrent 9/91, 92/239. Same seeds as the targets, so the layers are theirs.
        *(
            dataclasses.replace(r, name=f"{r.name}-loop", focus=32, focus_gain=3.0)
            for r in (_DENSE, _HYBRID, _RECURRENT)
        ),
        # The hybrid with one MTP head for draft-mtp: the trunk's output projections at 0.15 make the next token
        # mostly a function of the current one (greedy still walks 63 distinct tokens in 64), which is what the
        # head predicts (the target's next token equals that prediction at 55 % of 192 greedy positions).
        dataclasses.replace(_HYBRID, name="tiny-hybrid-mtp", trunk_gain=0.15, mtp=0.1),
        # Its close variant for sampled draft-mtp (suites/sampling-close.yaml): trunk and head at 0.01, so the next
        # token is almost a function of the current one and the head agrees with the target most of the time: at
        # temperature 0.05, 160 tokens, accepted / drafted 0.75-0.93 in-process and 0.88-0.95 on llama-server
        # (0c1e570, 2026-12-07; at trunk 0.02 / head 0.02, 0.66-0.85 in-process; tiny-hybrid-mtp's 0.15 / 0.1, 0.25)
        dataclasses.replace(_HYBRID, name="tiny-hybrid-mtp-close", trunk_gain=0.01, mtp=0.01),
        # The numerics suite's targets, quantized to Q4_K by the registry (harness.models.registry.QUANTIZED): the
        # dense and the MTP hybrid at twice the width, with the same seeds and gains as their narrow models
        dataclasses.replace(_DENSE, name="tiny-dense-wide", hparams=dataclasses.replace(_DENSE.hparams, **_WIDE)),
        dataclasses.replace(
            _HYBRID,
            name="tiny-hybrid-mtp-wide",
            hparams=dataclasses.replace(_HYBRID.hparams, **_WIDE),
            trunk_gain=0.15,
            mtp=0.1,
        ),
        # Draft heads for llama-server's draft-eagle3 / -dflash / -dspark on tiny-hybrid-mtp (its layer inputs)
        *(
            dataclasses.replace(
                _HYBRID,
                name=f"tiny-hybrid-mtp-{head}",
                seed=8,
                head=head,
                head_of="tiny-hybrid-mtp",
                reads_anchor=head == "dflash",
                decoder_gain=DSPARK_DECODER_GAIN if head == "dspark" else 1.0,
            )
            for head in ("eagle3", "dflash", "dspark")
        ),
    )
}

_VOCAB = Path(__file__).resolve().parents[1] / "data" / "ggml-vocab-llama-spm.gguf"
"""Package data: the llama SPM vocab (32000 tokens) whose `tokenizer.*` keys every generated model carries."""


@functools.cache
def _tokenizer_fields() -> tuple[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]:
    """The vocab file's `tokenizer.*` keys as (key, value, type, array sub-type) tuples, read once."""
    return tuple(
        (key, value, gguf.GGUFValueType(vtype), None if etype is None else gguf.GGUFValueType(etype))
        for key, value, vtype, etype in read_fields(_VOCAB, "tokenizer.")
    )


def _vocab_size() -> int:
    return next(len(value) for key, value, _, _ in _tokenizer_fields() if key == "tokenizer.ggml.tokens")


@functools.cache
def fingerprint(recipe: Recipe) -> str:
    """Hex sha256 of everything that determines the bytes `write_model(recipe)` writes."""
    spec = {
        "generator": GENERATOR_VERSION,
        "recipe": _fingerprint_fields(recipe),
        "target": _fingerprint_fields(RECIPES[recipe.draft_of or recipe.head_of])
        if recipe.draft_of or recipe.head_of
        else None,
        "vocab": hashlib.sha256(_VOCAB.read_bytes()).hexdigest(),
        "versions": {pkg: importlib.metadata.version(pkg) for pkg in ("gguf", "numpy")},
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _fingerprint_fields(recipe: Recipe) -> dict:
    fields = dataclasses.asdict(recipe)
    for name, default in _NEW_FIELDS.items():
        if fields[name] == default:
            del fields[name]
    return fields


class _Tensors:
    """A model's tensors in writing order, drawn from one rng; remembers which are matmul weights."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.arrays: dict[str, np.ndarray] = {}
        self.matmul: list[str] = []

    def weight(self, name: str, ne0: int, ne1: int, std: float | None = None) -> None:
        """A matmul weight of GGUF shape [ne0, ne1] (numpy (ne1, ne0)), N(0, std^2), std = 1/sqrt(ne0) by default."""
        scale = np.float32(1 / np.sqrt(ne0) if std is None else std)
        self.arrays[name] = self.rng.standard_normal((ne1, ne0), dtype=np.float32) * scale
        self.matmul.append(name)

    def vector(self, name: str, values: Any) -> None:
        """A non-matmul f32 tensor (norm, conv, ssm parameter); numpy shape as given."""
        self.arrays[name] = np.ascontiguousarray(values, dtype=np.float32)

    def ones(self, name: str, *shape: int) -> None:
        self.vector(name, np.ones(shape))

    def add_noise(self, noise: float, rng: np.random.Generator) -> None:
        """Add N(0, (noise * std(W))^2) to every matmul weight W, in writing order."""
        for name in self.matmul:
            w = self.arrays[name]
            w += rng.standard_normal(w.shape, dtype=np.float32) * np.float32(noise * w.std())


def _ffn(t: _Tensors, blk: str, hp: Hparams) -> None:
    t.weight(f"{blk}.ffn_gate.weight", hp.n_embd, hp.n_ff)
    t.weight(f"{blk}.ffn_up.weight", hp.n_embd, hp.n_ff)
    t.weight(f"{blk}.ffn_down.weight", hp.n_ff, hp.n_embd)


def _llama(hp: Hparams, w: gguf.GGUFWriter, t: _Tensors) -> None:
    head_dim = hp.n_embd // hp.n_head
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    for i in range(hp.n_layer):
        blk = f"blk.{i}"
        t.ones(f"{blk}.attn_norm.weight", hp.n_embd)
        t.weight(f"{blk}.attn_q.weight", hp.n_embd, hp.n_head * head_dim)
        t.weight(f"{blk}.attn_k.weight", hp.n_embd, hp.n_head_kv * head_dim)
        t.weight(f"{blk}.attn_v.weight", hp.n_embd, hp.n_head_kv * head_dim)
        t.weight(f"{blk}.attn_output.weight", hp.n_head * head_dim, hp.n_embd)
        t.ones(f"{blk}.ffn_norm.weight", hp.n_embd)
        _ffn(t, blk, hp)


def _qwen35(hp: Hparams, w: gguf.GGUFWriter, t: _Tensors) -> None:
    head_dim = hp.n_embd // hp.n_head
    key_dim = hp.ssm_state * hp.ssm_group
    value_dim = hp.ssm_state * hp.ssm_dt_rank
    conv_dim = 2 * key_dim + value_dim
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim // 4)  # partial rotary; the sections below sum to n_rot / 2
    w.add_rope_dimension_sections([2, 1, 1, 0])
    w.add_full_attention_interval(hp.full_attention_interval)
    w.add_ssm_conv_kernel(hp.ssm_conv)
    w.add_ssm_state_size(hp.ssm_state)
    w.add_ssm_group_count(hp.ssm_group)
    w.add_ssm_time_step_rank(hp.ssm_dt_rank)
    w.add_ssm_inner_size(value_dim)
    for i in range(hp.n_layer):
        blk = f"blk.{i}"
        t.ones(f"{blk}.attn_norm.weight", hp.n_embd)
        if (i + 1) % hp.full_attention_interval:  # GatedDeltaNet layer
            t.weight(f"{blk}.attn_qkv.weight", hp.n_embd, conv_dim)
            t.weight(f"{blk}.attn_gate.weight", hp.n_embd, value_dim)
            t.vector(f"{blk}.ssm_conv1d.weight", t.rng.standard_normal((conv_dim, hp.ssm_conv)) / np.sqrt(hp.ssm_conv))
            t.vector(f"{blk}.ssm_dt.bias", np.full(hp.ssm_dt_rank, -2.0))
            t.vector(f"{blk}.ssm_a", -t.rng.uniform(0.1, 1.0, hp.ssm_dt_rank))
            t.weight(f"{blk}.ssm_beta.weight", hp.n_embd, hp.ssm_dt_rank)
            t.weight(f"{blk}.ssm_alpha.weight", hp.n_embd, hp.ssm_dt_rank)
            t.ones(f"{blk}.ssm_norm.weight", hp.ssm_state)
            t.weight(f"{blk}.ssm_out.weight", value_dim, hp.n_embd)
        else:  # gated full attention: attn_q holds [query, gate] interleaved per head
            t.weight(f"{blk}.attn_q.weight", hp.n_embd, 2 * hp.n_head * head_dim)
            t.weight(f"{blk}.attn_k.weight", hp.n_embd, hp.n_head_kv * head_dim)
            t.weight(f"{blk}.attn_v.weight", hp.n_embd, hp.n_head_kv * head_dim)
            t.weight(f"{blk}.attn_output.weight", hp.n_head * head_dim, hp.n_embd)
            t.ones(f"{blk}.attn_q_norm.weight", head_dim)
            t.ones(f"{blk}.attn_k_norm.weight", head_dim)
        t.ones(f"{blk}.post_attention_norm.weight", hp.n_embd)
        _ffn(t, blk, hp)


def _qwen35_mtp(hp: Hparams, w: gguf.GGUFWriter, t: _Tensors, mix: float) -> None:
    """One MTP block at index n_layer (block_count counts it): a gated full-attention block plus the nextn
    tensors (src/models/qwen35.cpp `load_block_mtp`); no own embedding or head (the model's are shared)."""
    head_dim = hp.n_embd // hp.n_head
    blk = f"blk.{hp.n_layer}"
    w.add_nextn_predict_layers(1)
    t.ones(f"{blk}.attn_norm.weight", hp.n_embd)
    t.weight(f"{blk}.attn_q.weight", hp.n_embd, 2 * hp.n_head * head_dim)
    t.weight(f"{blk}.attn_k.weight", hp.n_embd, hp.n_head_kv * head_dim)
    t.weight(f"{blk}.attn_v.weight", hp.n_embd, hp.n_head_kv * head_dim)
    t.weight(f"{blk}.attn_output.weight", hp.n_head * head_dim, hp.n_embd, std=mix / np.sqrt(hp.n_head * head_dim))
    t.ones(f"{blk}.attn_q_norm.weight", head_dim)
    t.ones(f"{blk}.attn_k_norm.weight", head_dim)
    t.ones(f"{blk}.post_attention_norm.weight", hp.n_embd)
    t.weight(f"{blk}.ffn_gate.weight", hp.n_embd, hp.n_ff)
    t.weight(f"{blk}.ffn_up.weight", hp.n_embd, hp.n_ff)
    t.weight(f"{blk}.ffn_down.weight", hp.n_ff, hp.n_embd, std=mix / np.sqrt(hp.n_ff))
    # eh_proj [2E, E] over concat(enorm(embedding), hnorm(hidden)): identity on the embedding, `mix` noise on h
    noise = t.rng.standard_normal((hp.n_embd, hp.n_embd), dtype=np.float32) * np.float32(mix / np.sqrt(hp.n_embd))
    t.vector(f"{blk}.nextn.eh_proj.weight", np.concatenate([np.eye(hp.n_embd, dtype=np.float32), noise], axis=1))
    t.ones(f"{blk}.nextn.enorm.weight", hp.n_embd)
    t.ones(f"{blk}.nextn.hnorm.weight", hp.n_embd)
    t.ones(f"{blk}.nextn.shared_head_norm.weight", hp.n_embd)


def _mamba2(hp: Hparams, w: gguf.GGUFWriter, t: _Tensors) -> None:
    bc_dim = 2 * hp.ssm_group * hp.ssm_state
    conv_dim = hp.ssm_inner + bc_dim
    n_heads = hp.ssm_dt_rank
    w.add_layer_norm_rms_eps(1e-5)
    w.add_ssm_conv_kernel(hp.ssm_conv)
    w.add_ssm_inner_size(hp.ssm_inner)
    w.add_ssm_state_size(hp.ssm_state)
    w.add_ssm_time_step_rank(n_heads)
    w.add_ssm_group_count(hp.ssm_group)
    for i in range(hp.n_layer):
        blk = f"blk.{i}"
        dt = np.exp(t.rng.uniform(np.log(1e-3), np.log(1e-1), n_heads))
        t.ones(f"{blk}.attn_norm.weight", hp.n_embd)
        t.weight(f"{blk}.ssm_in.weight", hp.n_embd, hp.ssm_inner + conv_dim + n_heads)  # z | xBC | dt
        t.vector(f"{blk}.ssm_conv1d.weight", t.rng.standard_normal((conv_dim, hp.ssm_conv)) / np.sqrt(hp.ssm_conv))
        t.vector(f"{blk}.ssm_conv1d.bias", np.zeros(conv_dim))
        t.vector(f"{blk}.ssm_dt.bias", dt + np.log(-np.expm1(-dt)))  # inverse softplus
        t.vector(f"{blk}.ssm_a", -t.rng.uniform(1.0, 16.0, (n_heads, 1)))
        t.ones(f"{blk}.ssm_d", n_heads, 1)
        t.ones(f"{blk}.ssm_norm.weight", hp.ssm_group, hp.ssm_inner // hp.ssm_group)
        t.weight(f"{blk}.ssm_out.weight", hp.ssm_inner, hp.n_embd)


_ARCH_WRITERS: dict[str, Callable[[Hparams, gguf.GGUFWriter, _Tensors], None]] = {
    "llama": _llama,
    "qwen35": _qwen35,
    "mamba2": _mamba2,
}


class _NoWriter:
    """Stands in for a GGUFWriter where only the tensors are wanted (a head draft reads its target's)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _build(recipe: Recipe, writer: Any) -> _Tensors:
    """Every key (into `writer`) and tensor of a target or noisy-draft recipe, in writing order."""
    base = RECIPES[recipe.draft_of] if recipe.draft_of else recipe
    hp = base.hparams
    tensors = _Tensors(np.random.default_rng(base.seed))
    writer.add_name(recipe.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(hp.n_embd)
    writer.add_block_count(hp.n_layer + (1 if base.mtp else 0))
    for key, value, vtype, sub_type in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    tensors.weight("token_embd.weight", hp.n_embd, _vocab_size(), std=1.0)
    _ARCH_WRITERS[base.arch](hp, writer, tensors)
    if base.trunk_gain != 1.0:
        for name in tensors.matmul:
            if name.endswith(("attn_output.weight", "ssm_out.weight", "ffn_down.weight")):
                tensors.arrays[name] *= np.float32(base.trunk_gain)
    if base.mtp:
        _qwen35_mtp(hp, writer, tensors, base.mtp)
    tensors.ones("output_norm.weight", hp.n_embd)
    tensors.weight("output.weight", hp.n_embd, _vocab_size(), std=2 / np.sqrt(hp.n_embd))  # logit std ~2
    if base.focus:
        rows = np.random.default_rng(base.seed).choice(np.arange(256, _vocab_size()), base.focus, replace=False)
        tensors.arrays["output.weight"][np.sort(rows)] *= np.float32(base.focus_gain)
    if recipe.draft_of:
        tensors.add_noise(recipe.noise, np.random.default_rng(recipe.seed))
    return tensors


HEAD_GAIN = 0.1
"""A head's layer outputs (attention out, FFN down) and feature projection `fc` are scaled by this: its residual
stream stays close to the current token's embedding, so through the target's own output matrix it predicts what
the `trunk_gain`-damped target mostly predicts from that token (the MTP block's recipe, for the other heads)."""


def _write_head(recipe: Recipe, writer: gguf.GGUFWriter) -> dict[str, np.ndarray]:
    """The keys (into `writer`) and tensors of a one-layer draft head for `recipe.head_of`, a qwen35 target, as
    src/models/eagle3.cpp and dflash.cpp load them. All read the target's layer inputs 1..3 (`target_layers`) and
    take the embedding and output matrix from the target (no `token_embd` / `output` of their own). EAGLE3's
    attention looks at its own position (Q = K = 2 x the normed embedding) and V copies it, so the decoder passes
    the token's embedding through: it predicts the target's likely next token. DSpark drafts blocks of 4 (the
    anchor and 3 mask tokens, id 0) with a random decoder, whose logits its output norm (`decoder_gain`) flattens,
    and a Markov head whose bias is the target's bigram logits (w1 = the normed embeddings, w2 = the output
    matrix) of the previous token. DFlash reads its draft at the mask slot, which attends to the anchor
    (`_dflash_anchor_reader`)."""
    target = RECIPES[recipe.head_of]
    hp = target.hparams
    tt = _build(target, _NoWriter()).arrays
    e, ff = hp.n_embd, hp.n_ff
    rng = np.random.default_rng(recipe.seed)

    def w(ne0: int, ne1: int, std: float) -> np.ndarray:
        return rng.standard_normal((ne1, ne0), dtype=np.float32) * np.float32(std / np.sqrt(ne0))

    arch = file_arch(recipe)
    # DFlash's anchor reader: two query heads over one KV head as wide as the embedding (see its docstring)
    n_head, n_head_kv, head_dim = (2, 1, e) if recipe.reads_anchor else (hp.n_head, hp.n_head_kv, e // hp.n_head)
    writer.add_name(recipe.name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(hp.n_ctx)
    writer.add_embedding_length(e)
    writer.add_block_count(1)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(n_head)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array(f"{arch}.target_layers", list(range(hp.n_layer - 3, hp.n_layer)))
    for key, value, vtype, sub_type in _tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    t: dict[str, np.ndarray] = {"output_norm.weight": np.ones(e, dtype=np.float32)}
    if arch == "eagle3":
        eye = np.eye(e, dtype=np.float32)
        writer.add_head_count_kv(n_head)  # V as wide as the embedding: it carries the token's embedding
        writer.add_uint32("eagle3.target_hidden_size", e)
        t["fc.weight"] = w(3 * e, e, HEAD_GAIN)
        t["blk.0.attn_norm.weight"] = np.ones(e, dtype=np.float32)
        t["blk.0.attn_norm_2.weight"] = np.ones(e, dtype=np.float32)
        t["blk.0.attn_q.weight"] = np.concatenate([2 * eye + w(e, e, 0.3), w(e, e, 0.3)], axis=1)
        t["blk.0.attn_k.weight"] = np.concatenate([2 * eye + w(e, e, 0.3), w(e, e, 0.3)], axis=1)
        t["blk.0.attn_v.weight"] = np.concatenate([eye, w(e, e, HEAD_GAIN)], axis=1)
        t["blk.0.attn_output.weight"] = eye + w(e, e, HEAD_GAIN)
        t["blk.0.ffn_norm.weight"] = np.ones(e, dtype=np.float32)
    else:
        writer.add_head_count_kv(n_head_kv)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_uint32("dflash.block_size", 2 if recipe.reads_anchor else 4)
        writer.add_uint32("tokenizer.ggml.mask_token_id", MASK_TOKEN)
        t["enc.output_norm.weight"] = np.ones(e, dtype=np.float32)
        t["blk.0.attn_norm.weight"] = np.ones(e, dtype=np.float32)
        t["blk.0.ffn_norm.weight"] = np.ones(e, dtype=np.float32)
        if recipe.reads_anchor:
            t.update(_dflash_anchor_reader(tt, w(3 * e, e, 1.0), rng))
        else:
            t["fc.weight"] = w(3 * e, e, HEAD_GAIN)
            t["blk.0.attn_q.weight"] = w(e, n_head * head_dim, 1.0)
            t["blk.0.attn_k.weight"] = w(e, n_head_kv * head_dim, 1.0)
            t["blk.0.attn_v.weight"] = w(e, n_head_kv * head_dim, 1.0)
            t["blk.0.attn_output.weight"] = w(n_head * head_dim, e, HEAD_GAIN)
            t["blk.0.attn_q_norm.weight"] = np.ones(head_dim, dtype=np.float32)
            t["blk.0.attn_k_norm.weight"] = np.ones(head_dim, dtype=np.float32)
        if recipe.head == "dspark":
            t["output_norm.weight"] = np.full(e, recipe.decoder_gain, dtype=np.float32)
            emb = tt["token_embd.weight"]
            t["markov_w1.weight"] = emb / np.sqrt((emb * emb).mean(axis=1, keepdims=True) + np.float32(1e-6))
            t["markov_w2.weight"] = tt["output.weight"]
    t["blk.0.ffn_gate.weight"] = w(e, ff, 1.0)
    t["blk.0.ffn_up.weight"] = w(e, ff, 1.0)
    t["blk.0.ffn_down.weight"] = w(ff, e, HEAD_GAIN)
    if recipe.reads_anchor:
        t["blk.0.ffn_down.weight"] = np.zeros_like(t["blk.0.ffn_down.weight"])  # the FFN adds nothing
    return {name: t[name] for name in _HEAD_TENSORS if name in t}


_HEAD_TENSORS = (
    "fc.weight",
    "enc.output_norm.weight",
    "output_norm.weight",
    *(f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output")),
    *(f"blk.0.{n}.weight" for n in ("attn_q_norm", "attn_k_norm", "ffn_norm")),
    "markov_w1.weight",
    "markov_w2.weight",
    *(f"blk.0.{n}.weight" for n in ("ffn_gate", "ffn_up", "ffn_down")),
)
"""The order the heads' tensors are written in (their files' bytes depend on it)."""


MASK_TOKEN = 0
"""The DFlash / DSpark heads' `tokenizer.ggml.mask_token_id` (the vocab's <unk>)."""


def _dflash_anchor_reader(tt: dict[str, np.ndarray], features: np.ndarray, rng: np.random.Generator) -> dict:
    """The attention of a DFlash head whose mask slot reads the anchor (the last sampled token) and nothing else:
    its draft is the target's likely next token (the bigram of the `trunk_gain`-damped target, as EAGLE3's head).

    One KV head as wide as the embedding e, two query heads. With x the RMS-normed embedding and x0 the mask
    token's, K = (u . x) on the last head dim (u a unit vector orthogonal to x0), which the K norm makes
    +-sqrt(e) times 1.5: the anchor's key is +-k, the mask slots' keys are 0, and the injected target features'
    keys are 0 too (`fc`'s rows are orthogonal to u). The mask slot's query is +q in head 0 and -q in head 1, so
    whatever the anchor's sign, one head scores it 1.5^2 sqrt(e) (about 25 for e = 128: e^25 outweighs any
    context) and takes its V, and the other scores it -25 and averages the rest (V of the mask token: 0; of the
    features: a tenth, through `enc.output_norm`). V = x without its x0 part, so the two heads' sum, 4 times
    through `attn_output`, is the anchor's embedding plus a tenth of the context's features, the target's final
    norm then predicts from it. The last head dim sits in RoPE's slowest pair, so the anchor one position back
    scores as if it were at the slot's own position."""
    emb = tt["token_embd.weight"]
    e = emb.shape[1]
    x0 = emb[MASK_TOKEN] / np.linalg.norm(emb[MASK_TOKEN])
    u = rng.standard_normal(e).astype(np.float32)
    u -= (u @ x0) * x0
    u /= np.linalg.norm(u)
    last = np.zeros(e, dtype=np.float32)
    last[-1] = 1.0
    q = np.outer(last, x0)
    sharp = np.ones(e, dtype=np.float32)
    sharp[-1] = 1.5
    eye = np.eye(e, dtype=np.float32)
    return {
        "fc.weight": (eye - np.outer(u, u)) @ features,
        "enc.output_norm.weight": np.full(e, 0.1, dtype=np.float32),
        "output_norm.weight": tt["output_norm.weight"],
        "blk.0.attn_q.weight": np.concatenate([q, -q], axis=0),
        "blk.0.attn_k.weight": np.outer(last, u),
        "blk.0.attn_v.weight": eye - np.outer(x0, x0),
        "blk.0.attn_output.weight": 4 * np.concatenate([eye, eye], axis=1),
        "blk.0.attn_q_norm.weight": sharp,
        "blk.0.attn_k_norm.weight": sharp,
    }


def file_arch(recipe: Recipe) -> str:
    """The `general.architecture` of the file `recipe` writes (a head's: eagle3, or dflash for DFlash and DSpark)."""
    if recipe.head:
        return "eagle3" if recipe.head == "eagle3" else "dflash"
    return (RECIPES[recipe.draft_of] if recipe.draft_of else recipe).arch


def write_model(recipe: Recipe, path: Path) -> None:
    """Write `recipe` as a GGUF file at `path`; the same recipe always gives the same bytes."""
    writer = gguf.GGUFWriter(path, file_arch(recipe))
    try:
        arrays = _write_head(recipe, writer) if recipe.head else _build(recipe, writer).arrays
        for name, array in arrays.items():
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
