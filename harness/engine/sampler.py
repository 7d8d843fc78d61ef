"""A slot's sampler, built the way llama-server builds its `common_sampler` (common/sampling.cpp), from
llama.cpp's own samplers:

- the chain: logit bias (the request's `logit_bias`, the vocabulary's end-of-generation tokens at -inf
  when `ignore_eos`, the model's suppressed tokens), then the request's `samplers` in order (penalties,
  DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature with dynamic range, infill), then
  `dist(seed)` (or adaptive-p); with `mirostat` 1 or 2: logit bias, temperature, mirostat;
- the grammar is not in the chain (`grammar_first = false`): the chain samples, the grammar checks the
  one sampled token, and only a rejected token is sampled again with the grammar applied first (a
  second random draw);
- the prompt is fed to the chain before the first token (llama-server's `init_sampler`): penalties and
  DRY see the prompt, the grammar does not;
- `clone` copies the whole state (penalty history, DRY history, grammar stacks, every random number
  generator), which a checkpoint rollback restores.

Plain greedy sampling (no sampler that can move the top logit, no grammar, no bias) is the logits'
argmax, without building the candidate array over the whole vocabulary.
"""

import ctypes
import json
import math
import re

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from harness.engine.context import Context
from harness.engine.model import Model
from harness.request import UINT32, Sampling

_CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""llama_token_data, field for field."""
assert _CANDIDATE.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
_STRTOL_WHOLE = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")


def grammar_text(sampling: Sampling) -> str | None:
    """The GBNF grammar of a request: its `grammar`, else its `json_schema` converted, else None."""
    if sampling.grammar is not None:
        return sampling.grammar
    if sampling.json_schema is not None:
        return json_schema_to_gbnf(json.dumps(sampling.json_schema))
    return None


def _bias(value) -> float | None:
    """A `logit_bias` value: a number, or `false` for -inf (anything else is ignored, as by llama-server)."""
    if isinstance(value, bool):
        return None if value else -math.inf
    return float(value) if isinstance(value, (int, float)) else None


def _bias_tokens(key, model: Model, from_mapping: bool) -> list[int]:
    """The tokens a `logit_bias` key stands for: an id inside the vocabulary, or every token of a text.
    A mapping's keys are text that counts as an id when strtol reads it whole (server-schema.cpp)."""
    if from_mapping and isinstance(key, str):
        if _STRTOL_WHOLE.fullmatch(key):
            key = int(key)
        elif key == "":
            key = 0
    if isinstance(key, bool):
        return []
    if isinstance(key, int):
        return [key] if 0 <= key < model.n_vocab else []
    return model.tokenize(key, add_special=False, parse_special=False) if isinstance(key, str) else []


def logit_biases(sampling: Sampling, model: Model) -> list[tuple[int, float]]:
    """(token, bias) pairs in llama-server's order: the request's `logit_bias`, the end-of-generation
    tokens at -inf when `ignore_eos`, the model's suppressed tokens at -inf."""
    lb = sampling.logit_bias
    pairs = lb.items() if isinstance(lb, dict) else [e for e in lb if isinstance(e, (list, tuple)) and len(e) == 2]
    out = []
    for key, value in pairs:
        bias = _bias(value)
        if bias is not None:
            out += [(t, bias) for t in _bias_tokens(key, model, isinstance(lb, dict))]
    if sampling.ignore_eos:
        out += [(t, -math.inf) for t in model.vocabulary.eog_tokens]
    out += [(t, -math.inf) for t in model.vocabulary.suppress_tokens]
    return out


def plain_greedy(sampling: Sampling, model: Model) -> bool:
    """Whether the server's chain reduces to the argmax of the logits: `Sampling.picks_argmax`, and no
    logit bias from the request or the model."""
    return sampling.picks_argmax and not logit_biases(sampling, model)


def _chain(sampling: Sampling, seed: int, model: Model):
    """common_sampler_init's chain for the request (without the grammar)."""
    s, vocab, n_vocab = sampling, model.vocab, model.n_vocab
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(smpl) -> None:
        llama_cpp.llama_sampler_chain_add(chain, smpl)

    biases = logit_biases(s, model)
    if biases:
        array = (llama_cpp.llama_logit_bias * len(biases))(*[llama_cpp.llama_logit_bias(t, b) for t, b in biases])
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(biases), array))
    if s.mirostat == 0:
        breakers = [b.encode() for b in s.dry_sequence_breakers]
        c_breakers = (ctypes.c_char_p * len(breakers))(*breakers)
        make = {
            "penalties": lambda: llama_cpp.llama_sampler_init_penalties(
                n_vocab, s.repeat_last_n, s.repeat_penalty, s.frequency_penalty, s.presence_penalty
            ),
            "dry": lambda: llama_cpp.llama_sampler_init_dry(
                vocab,
                s.dry_multiplier,
                s.dry_base,
                s.dry_allowed_length,
                s.dry_penalty_last_n,
                c_breakers,
                len(breakers),
            ),
            "top_n_sigma": lambda: llama_cpp.llama_sampler_init_top_n_sigma(s.top_n_sigma),
            "top_k": lambda: llama_cpp.llama_sampler_init_top_k(s.top_k),
            "typ_p": lambda: llama_cpp.llama_sampler_init_typical(s.typical_p, s.min_keep),
            "top_p": lambda: llama_cpp.llama_sampler_init_top_p(s.top_p, s.min_keep),
            "min_p": lambda: llama_cpp.llama_sampler_init_min_p(s.min_p, s.min_keep),
            "xtc": lambda: llama_cpp.llama_sampler_init_xtc(s.xtc_probability, s.xtc_threshold, s.min_keep, seed),
            "temperature": lambda: llama_cpp.llama_sampler_init_temp_ext(
                s.temperature, s.dynatemp_range, s.dynatemp_exponent
            ),
            "infill": lambda: llama_cpp.llama_sampler_init_infill(vocab),
        }
        for name in s.samplers:
            if name != "adaptive_p":
                add(make[name]())
        if "adaptive_p" in s.samplers:
            add(llama_cpp.llama_sampler_init_adaptive_p(s.adaptive_target, s.adaptive_decay, seed))
        else:
            add(llama_cpp.llama_sampler_init_dist(seed))
    else:
        add(llama_cpp.llama_sampler_init_temp(s.temperature))
        if s.mirostat == 1:
            add(llama_cpp.llama_sampler_init_mirostat(n_vocab, seed, s.mirostat_tau, s.mirostat_eta, 100))
        else:
            add(llama_cpp.llama_sampler_init_mirostat_v2(seed, s.mirostat_tau, s.mirostat_eta))
    return chain


class Candidates:
    """The candidate array (llama_token_data_array over the whole vocabulary) one slot's samplers fill
    from a row of logits; shared by a sampler and its clones (they sample one after another)."""

    def __init__(self, n_vocab: int):
        fresh = np.zeros(n_vocab, dtype=_CANDIDATE)
        fresh["id"] = np.arange(n_vocab, dtype=np.int32)
        self.buffer = fresh.copy()
        self.ptr = self.buffer.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        # plain float32 views: copying through them is ~15x faster than through the structured fields
        self._fresh = fresh.view(np.float32).reshape(n_vocab, 3)
        self._rows = self.buffer.view(np.float32).reshape(n_vocab, 3)

    def apply(self, logits: np.ndarray, *samplers) -> int:
        """Fill the array from `logits`, apply the samplers in order and return the selected token."""
        np.copyto(self._rows, self._fresh)
        self._rows[:, 1] = logits
        array = llama_cpp.llama_token_data_array(self.ptr, len(self.buffer), -1, False)
        for smpl in samplers:
            llama_cpp.llama_sampler_apply(smpl, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise RuntimeError("the sampler chain selected no token (check the sampling configuration)")
        self.last = array
        return array.data[array.selected].id

    def top_probs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The last `apply`'s candidates as llama-server reports them with `post_sampling_probs`
        (`populate_token_probs`): the chain's candidate list sorted by probability, its first `n`, ending
        at the first zero probability; (ids int32, probabilities float32), ties by the lower id."""
        array = self.last
        address = ctypes.addressof(array.data.contents)
        left = np.frombuffer((llama_cpp.llama_token_data * array.size).from_address(address), dtype=_CANDIDATE)
        p = left["p"]
        k = min(n, len(left))
        cut = np.argpartition(-p, k - 1)[:k] if 0 < k < len(left) else np.arange(k)
        order = cut[np.lexsort((left["id"][cut], -p[cut]))]
        order = order[p[order] > 0]
        return left["id"][order].astype(np.int32), p[order].astype(np.float32)


def _allows(grammar, token: int) -> bool:
    """Whether the grammar accepts `token` next (common_sampler_sample's single-token check)."""
    single = llama_cpp.llama_token_data(token, 1.0, 0.0)
    array = llama_cpp.llama_token_data_array(ctypes.pointer(single), 1, -1, False)
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
    return array.data[0].logit != -math.inf


class Sampler:
    """One request's sampler: the chain and the grammar (both llama.cpp samplers), or plain argmax."""

    def __init__(self, chain, grammar, candidates: Candidates | None):
        self.chain = chain
        self.grammar = grammar
        self.candidates = candidates
        self.argmax = chain is None
        """Plain greedy: the chain has no state, so sampling is the logits' argmax (first on ties, as
        llama.cpp's greedy selection), without a candidate array over the whole vocabulary."""

    @classmethod
    def for_request(cls, sampling: Sampling, default_seed: int, model: Model) -> "Sampler":
        """The request's sampler; ValueError (one line) when llama.cpp cannot parse its grammar. Plain
        greedy requests get the chain too when they ask for `post_sampling_probs`: those are the chain's
        candidates after sampling (`Candidates.top_probs`)."""
        if plain_greedy(sampling, model) and not sampling.post_sampling_probs:
            return cls(None, None, None)
        seed = (default_seed if sampling.seed is None else sampling.seed) & UINT32
        grammar = None
        text = grammar_text(sampling)
        if text is not None:
            grammar = llama_cpp.llama_sampler_init_grammar(model.vocab, text.encode(), b"root")
            if not grammar:
                raise ValueError("llama.cpp could not parse the grammar")
        return cls(_chain(sampling, seed, model), grammar, Candidates(model.n_vocab))

    def accept_prompt(self, tokens: list[int]) -> None:
        """Feed the prompt to the chain (penalties, DRY), not to the grammar, as llama-server does when
        a slot's prompt is done."""
        if self.chain is not None:
            for token in tokens:
                llama_cpp.llama_sampler_accept(self.chain, token)

    def sample(self, ctx: Context, index: int, logits: np.ndarray | None = None) -> int:
        """Sample from output row `index` of the last decode and accept the token (chain and grammar);
        `logits` is that row's view (`ctx.logits(index)`) when the caller already holds it."""
        row = ctx.logits(index) if logits is None else logits
        if self.argmax:
            return int(np.argmax(row))
        token = self.candidates.apply(row, self.chain)
        if self.grammar is not None:
            if not _allows(self.grammar, token):
                token = self.candidates.apply(row, self.grammar, self.chain)
            llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def clone(self) -> "Sampler":
        """A deep copy: penalty and DRY histories, grammar stacks, random number generators."""
        if self.argmax:
            return Sampler(None, None, None)
        grammar = llama_cpp.llama_sampler_clone(self.grammar) if self.grammar is not None else None
        return Sampler(llama_cpp.llama_sampler_clone(self.chain), grammar, self.candidates)

    def keep_penalties_of(self, other: "Sampler") -> None:
        """Fault `no-penalty-restore`: take the penalty sampler's state (its token history) from
        `other` (the sampler that accepted the rejected drafts) instead of keeping this one's."""
        if self.argmax:
            return
        for i in range(llama_cpp.llama_sampler_chain_n(self.chain)):
            mine = llama_cpp.llama_sampler_chain_get(self.chain, i)
            if llama_cpp.llama_sampler_name(mine) == b"penalties":
                llama_cpp.llama_sampler_copy(llama_cpp.llama_sampler_chain_get(other.chain, i), mine)

    def free(self) -> None:
        """Release the chain and the grammar."""
        for name in ("chain", "grammar"):
            ptr = getattr(self, name)
            if ptr:
                llama_cpp.llama_sampler_free(ptr)
                setattr(self, name, None)
