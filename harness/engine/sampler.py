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
  generator), which a checkpoint rollback restores;
- rejection sampling (`--spec-draft-sampling probabilistic`, llama.cpp b11434): a `DraftCheck` set before a
  verification row makes `sample` accept the drafted token with probability min(1, p/q) or redraw from the
  residual (`accept_or_redraw`), with the sampler's own `RejectionRng`; `DraftSampler` samples the drafts.

Plain greedy sampling (no sampler that can move the top logit, no grammar, no bias) is the logits'
argmax, without building the candidate array over the whole vocabulary.
"""

import ctypes
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from harness.engine.context import Context
from harness.engine.faults import strength
from harness.engine.model import Model
from harness.suites.request import UINT32, Sampling

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
        left = self._left()
        p = left["p"]
        k = min(n, len(left))
        cut = np.argpartition(-p, k - 1)[:k] if 0 < k < len(left) else np.arange(k)
        order = cut[np.lexsort((left["id"][cut], -p[cut]))]
        order = order[p[order] > 0]
        return left["id"][order].astype(np.int32), p[order].astype(np.float32)

    def _left(self) -> np.ndarray:
        """The last `apply`'s candidate list as the chain left it (a view of the buffer)."""
        array = self.last
        address = ctypes.addressof(array.data.contents)
        return np.frombuffer((llama_cpp.llama_token_data * array.size).from_address(address), dtype=_CANDIDATE)

    def distribution(self) -> "Dist":
        """The last `apply`'s candidates and probabilities, sorted by probability as
        `common_sampler_get_candidates(gsmpl, true)` sorts them (a copy; ties keep the chain's order, where
        llama.cpp's std::sort may swap them: the chain's top-k already leaves them sorted)."""
        left = self._left()
        order = np.argsort(-left["p"], kind="stable")
        return Dist(left["id"][order].astype(np.int32), left["p"][order].astype(np.float32))


@dataclass
class Dist:
    """A candidate distribution: token ids (int32) and their probabilities (float32), most probable first.
    Tokens outside it have probability 0."""

    ids: np.ndarray
    p: np.ndarray

    def prob(self, token: int) -> np.float32:
        """The probability of `token` (common/sampling.cpp `prob_of`)."""
        hit = np.flatnonzero(self.ids == token)
        return self.p[hit[0]] if len(hit) else np.float32(0.0)

    def probs_of(self, ids: np.ndarray) -> np.ndarray:
        """The probabilities of `ids`, one each (float32)."""
        if not len(self.ids):
            return np.zeros(len(ids), dtype=np.float32)
        order = np.argsort(self.ids, kind="stable")
        known = self.ids[order]
        at = np.minimum(np.searchsorted(known, ids), len(known) - 1)
        return np.where(known[at] == ids, self.p[order][at], np.float32(0.0)).astype(np.float32)


def mask_by_grammar(p: Dist, allowed: np.ndarray) -> Dist:
    """p with the tokens the grammar rejects at 0 and the rest renormalised in float32 (the `masked` branch
    of common/sampling.cpp `common_sampler_sample_and_accept_n_rejection` at b11434: "masking drops probability
    mass, so rescale what is left or the residual is over-weighted"; all masked: left unscaled)."""
    raw = np.where(allowed, p.p, np.float32(0.0)).astype(np.float32)
    total = np.add.accumulate(raw)[-1] if len(raw) else np.float32(0.0)  # summed in order, as the C++ loop
    norm = np.float32(1.0) / total if total > 0 else np.float32(1.0)
    return Dist(p.ids, (raw * norm).astype(np.float32))


def residual_draw(p: Dist, q: Dist, fallback: int, uniform: Callable[[], float], normalised: bool = True) -> int:
    """After a rejection, a token from norm(max(0, p - q)) (tokens outside q's support keep all of p), walked in
    p's order with one uniform u scaled by the residual's sum; `fallback` (the target's own sample) when the
    residual is empty, without a draw (common_sampler_sample_and_accept_n_rejection, b11434). Float32
    throughout, as the C++. `normalised` False is fault `residual-unnormalised`: u is not scaled by the sum
    (a u past the residual's mass falls off the end onto its last token)."""
    r = (p.p - q.probs_of(p.ids)).astype(np.float32)
    keep = r > 0
    ids, r = p.ids[keep], r[keep]
    if not len(ids):
        return fallback
    total = np.add.accumulate(r)[-1]
    u = np.float32(uniform()) * (total if normalised else np.float32(1.0))
    left = np.subtract.accumulate(np.concatenate((np.array([u], dtype=np.float32), r)))[1:]  # u -= e.p, in order
    hit = np.flatnonzero(left <= 0)
    return int(ids[hit[0]] if len(hit) else ids[-1])


def accept_or_redraw(
    p: Dist, q: Dist, draft_token: int, sampled: int, uniform: Callable[[], float], fault: str | None = None
) -> tuple[int, bool]:
    """Rejection sampling of one drafted token: (token, accepted). Accepted when q_x > 0 and (p_x >= q_x or
    u < p_x / q_x), one uniform drawn only in the second case; else redrawn (`residual_draw`) with `sampled`,
    the target chain's own sample, as the fallback. common/sampling.cpp
    `common_sampler_sample_and_accept_n_rejection` at b11434, per drafted token; `uniform` is the sampler's
    own stream (`RejectionRng.uniform`). The faults of this rule (harness.engine.faults):
    `lenient-accept` accepts any token with p_x > 0; `extra-draw-after-reject` draws one more uniform after a
    rejection; `residual-unnormalised` redraws without scaling by the residual's sum; the graded `over-accept=ε`
    accepts with probability min(1, (1 + ε) p_x / q_x) (the residual draw is left as it is)."""
    q_x, p_x = q.prob(draft_token), p.prob(draft_token)
    if fault == "lenient-accept" and p_x > 0:
        return draft_token, True
    over = strength(fault, "over-accept")
    if over is not None:  # the graded fault: accepted with probability min(1, (1 + ε) p/q)
        p_x = np.float32(p_x * (1.0 + over))
    if q_x > 0 and (p_x >= q_x or np.float32(uniform()) < p_x / q_x):
        return draft_token, True
    if fault == "extra-draw-after-reject":
        uniform()
    return residual_draw(p, q, sampled, uniform, normalised=fault != "residual-unnormalised"), False


def over_accept_tv(p: Dist, q: Dist, eps: float) -> float:
    """The total variation between the target's law p and the law rejection sampling draws a drafted position from
    under the graded fault `over-accept=eps` (a draft drawn from q, accepted with probability min(1, (1 + eps) p/q),
    else redrawn from the residual max(0, p - q) renormalised), given the context: 0 at eps 0, where the draw
    follows p exactly."""
    ids = np.union1d(p.ids, q.ids)
    px, qx = p.probs_of(ids).astype(np.float64), q.probs_of(ids).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        accept = np.where(qx > 0, np.minimum(1.0, (1.0 + eps) * px / qx), 0.0)
    kept = qx * accept
    residual = np.maximum(0.0, px - qx)
    total = residual.sum()
    law = kept + (1.0 - kept.sum()) * (residual / total if total > 0 else px)
    return float(0.5 * np.abs(law - px).sum())


_BELOW_ONE = np.nextafter(np.float32(1.0), np.float32(0.0))
REJECTION_SEED_MIX = 0x9E3779B9
"""common_sampler_init (b11434) seeds its rejection `rng` with the chain's seed xor this."""


class RejectionRng:
    """The rejection sampler's own random stream, bit for bit llama.cpp's: a `std::mt19937` seeded with
    `seed` (its init_genrand, as numpy's legacy seeding), read through libstdc++'s
    `std::uniform_real_distribution<float>(0, 1)` (`generate_canonical<float, 24>`: one 32-bit draw, converted to
    float, over 2^32, kept below 1)."""

    def __init__(self, seed: int | None = None):
        self.bits = np.random.MT19937(0)
        if seed is not None:
            key = np.random.RandomState(seed & UINT32).get_state()[1]
            self.bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624}}

    def uniform(self) -> np.float32:
        u = np.float32(int(self.bits.random_raw())) / np.float32(4294967296.0)
        return min(u, _BELOW_ONE)

    def clone(self) -> "RejectionRng":
        copy = RejectionRng()
        copy.bits.state = self.bits.state
        return copy


@dataclass
class DraftCheck:
    """What `Sampler.sample` does with its next row instead of keeping its own sample: rejection sampling of
    `token` against the draft's distribution `q`, or (q None) accepting `token` as it is, the chain still
    sampling the row (llama-server's `server_accept_replay` after a checkpoint restore at temperature > 0)."""

    token: int
    q: Dist | None
    fault: str | None = None


def _allows(grammar, token: int) -> bool:
    """Whether the grammar accepts `token` next (common_sampler_sample's single-token check)."""
    single = llama_cpp.llama_token_data(token, 1.0, 0.0)
    array = llama_cpp.llama_token_data_array(ctypes.pointer(single), 1, -1, False)
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
    return array.data[0].logit != -math.inf


def _grammar_allows(grammar, ids: np.ndarray) -> np.ndarray:
    """Which of `ids` the grammar accepts next: the grammar applied to a copy of the candidates."""
    cand = np.zeros(len(ids), dtype=_CANDIDATE)
    cand["id"] = ids
    array = llama_cpp.llama_token_data_array(
        cand.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), len(ids), -1, False
    )
    llama_cpp.llama_sampler_apply(grammar, ctypes.byref(array))
    return cand["logit"] != -np.inf


def free_chain_and_grammar(owner) -> None:
    """Release `owner.chain` and `owner.grammar` (llama.cpp samplers; None once released): a Sampler's, or the
    scorer's ChainLaw's."""
    for name in ("chain", "grammar"):
        ptr = getattr(owner, name)
        if ptr:
            llama_cpp.llama_sampler_free(ptr)
            setattr(owner, name, None)


class Sampler:
    """One request's sampler: the chain and the grammar (both llama.cpp samplers), or plain argmax."""

    def __init__(self, chain, grammar, candidates: Candidates | None, seed: int = UINT32):
        self.chain = chain
        self.grammar = grammar
        self.candidates = candidates
        self.argmax = chain is None
        """Plain greedy: the chain has no state, so sampling is the logits' argmax (first on ties, as
        llama.cpp's greedy selection), without a candidate array over the whole vocabulary."""
        self.seed = seed
        """The request's seed (what llama-server passes a drafter that samples: `DraftSampler`)."""
        self.rng: RejectionRng | None = None
        """The rejection sampler's stream, made at its first draw (`_uniform`), cloned with the sampler."""
        self.check: DraftCheck | None = None
        """Set by the verifier before a drafted row: what the next `sample` does with it (then cleared)."""
        self.accepted: bool | None = None
        """After a `sample` with a check: whether it accepted the drafted token; None without a check."""
        self.fault_tv: float | None = None
        """Under the graded fault `over-accept=ε`: the total variation of the last verified draw's law from p."""

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
        return cls(_chain(sampling, seed, model), grammar, Candidates(model.n_vocab), seed)

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
        check, self.check, self.accepted = self.check, None, None
        if self.argmax:
            return int(np.argmax(row))
        token = self.candidates.apply(row, self.chain)
        if self.grammar is not None and not _allows(self.grammar, token):
            token = self.candidates.apply(row, self.grammar, self.chain)
        if check is not None:
            token, self.accepted = self._verify(check, token)
        if self.grammar is not None:
            llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def draw_again(self, ctx: Context, index: int) -> None:
        """Fault `extra-draw-after-reject` under sample-and-match: apply the chain once more to output row `index`
        without accepting anything, which spends one draw of its random number generator (`dist`); plain argmax has
        no generator and draws nothing."""
        if not self.argmax:
            self.candidates.apply(ctx.logits(index), self.chain)

    def _verify(self, check: DraftCheck, sampled: int) -> tuple[int, bool]:
        """The token to keep for a drafted row the chain just sampled as `sampled`: the drafted one on a replay,
        else rejection sampling against the target's distribution p (the chain's candidates, masked by the
        grammar and renormalised when there is one; with no reasoning budget the grammar always applies)."""
        if check.q is None:
            return check.token, True
        p = self.candidates.distribution()
        if self.grammar is not None:
            p = mask_by_grammar(p, _grammar_allows(self.grammar, p.ids))
        eps = strength(check.fault, "over-accept")
        self.fault_tv = None if eps is None else over_accept_tv(p, check.q, eps)  # the bias this draw carries
        return accept_or_redraw(p, check.q, check.token, sampled, self._uniform, check.fault)

    def _uniform(self) -> np.float32:
        """The next uniform of the rejection stream, seeded as common_sampler_init seeds `rng` (b11434):
        `llama_sampler_get_seed(chain) ^ 0x9e3779b9`."""
        if self.rng is None:
            self.rng = RejectionRng(llama_cpp.llama_sampler_get_seed(self.chain) ^ REJECTION_SEED_MIX)
        return self.rng.uniform()

    def clone(self) -> "Sampler":
        """A deep copy: penalty and DRY histories, grammar stacks, random number generators."""
        if self.argmax:
            return Sampler(None, None, None, self.seed)
        grammar = llama_cpp.llama_sampler_clone(self.grammar) if self.grammar is not None else None
        copy = Sampler(llama_cpp.llama_sampler_clone(self.chain), grammar, self.candidates, self.seed)
        copy.rng = None if self.rng is None else self.rng.clone()
        return copy

    def keep_rejection_stream_of(self, other: "Sampler") -> None:
        """After a checkpoint restore, keep the rejection stream where the verification left it (`other`, the sampler
        that verified): its uniforms decided the rolled-back step, and the replay draws none, so a rewound stream
        would hand the next verification the same uniforms again and the output would not keep the target's
        distribution. llama-server (b11434) rewinds it (common_sampler_copy copies `rng`; the known failure
        server-rejection-rng-rewound-on-checkpoint-restore); the engine keeps it running, the fault
        `rejection-rng-rewound` rewinds it as llama-server does."""
        if other.rng is not None:
            self.rng = other.rng.clone()

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
        free_chain_and_grammar(self)


DRAFT_SEED_MIX = 0x85EBCA6B
"""common/speculative.cpp `spec_retune` (b11434) seeds the draft's chain with the target's seed xor this."""
DRAFT_TOP_K = 10


class DraftSampler:
    """A probabilistic drafter's sampler for one sequence, as common/speculative.cpp `spec_retune` builds it at
    b11434 (common_sampler_init with top-k 10 and the target's temperature: the draft model's suppressed tokens
    at -inf, top-k 10, temperature, `dist` seeded with the request's seed xor 0x85ebca6b, the default seed as
    it is). `sample` returns the sampled token, the top candidate's probability (what `--spec-draft-p-min`
    compares) and q, the candidates kept for the verifier (`result_q`). `wrong_q` is fault
    `q-wrong-temperature`: q is the same candidates' distribution at temperature 1."""

    def __init__(self, model: Model, temperature: float, seed: int, candidates: Candidates, wrong_q: bool = False):
        self.temperature, self.seed, self.wrong_q = temperature, seed, wrong_q
        self.candidates = candidates
        self.chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        suppress = model.vocabulary.suppress_tokens
        if suppress:
            biases = (llama_cpp.llama_logit_bias * len(suppress))(
                *[llama_cpp.llama_logit_bias(t, -math.inf) for t in suppress]
            )
            self._add(llama_cpp.llama_sampler_init_logit_bias(model.n_vocab, len(suppress), biases))
        self._add(llama_cpp.llama_sampler_init_top_k(DRAFT_TOP_K))
        self._add(llama_cpp.llama_sampler_init_temp_ext(temperature, 0.0, 1.0))
        self._add(llama_cpp.llama_sampler_init_dist(seed if seed == UINT32 else seed ^ DRAFT_SEED_MIX))

    def _add(self, smpl) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, smpl)

    def sample(self, logits: np.ndarray) -> tuple[int, float, Dist]:
        """Sample the draft's next token from its logits. Accepting it into the chain (llama.cpp does, after
        the p_min check) changes nothing: logit bias, top-k, temperature and dist keep no history."""
        token = self.candidates.apply(logits, self.chain)
        q = self.candidates.distribution()
        top = float(q.p[0])
        if self.wrong_q:
            x = logits[q.ids].astype(np.float64)
            e = np.exp(x - x.max())
            q = Dist(q.ids, (e / e.sum()).astype(np.float32))
        return token, top, q

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


class DraftSamplers:
    """A drafter's `DraftSampler` per sequence (llama.cpp's `smpls` with `spec_retune`'s cache by temperature and
    seed): made at a sequence's first probabilistic draft, kept across its request's steps (its stream goes on;
    a checkpoint restore does not rewind it) and dropped at the next request's `begin` (llama.cpp resets it
    there, which reseeds it: the same as a new one)."""

    def __init__(self, model: Model, n_vocab: int, wrong_q: bool = False):
        self.model, self.n_vocab, self.wrong_q = model, n_vocab, wrong_q
        self.candidates: Candidates | None = None
        self.by_seq: dict[int, DraftSampler] = {}

    def get(self, seq_id: int, temperature: float, seed: int) -> DraftSampler:
        sampler = self.by_seq.get(seq_id)
        if sampler is None or (sampler.temperature, sampler.seed) != (temperature, seed):
            self.reset(seq_id)
            if self.candidates is None:
                self.candidates = Candidates(self.n_vocab)
            sampler = DraftSampler(self.model, temperature, seed, self.candidates, self.wrong_q)
            self.by_seq[seq_id] = sampler
        return sampler

    def reset(self, seq_id: int) -> None:
        sampler = self.by_seq.pop(seq_id, None)
        if sampler is not None:
            sampler.free()

    def close(self) -> None:
        for seq_id in list(self.by_seq):
            self.reset(seq_id)
