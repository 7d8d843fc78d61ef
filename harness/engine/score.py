"""The probability the target gives each token of a sampled output, under the request's own sampler chain:
what the `distribution` check (harness/checks/distribution.py) tests the returned tokens against.

One decode of prompt + output (without speculation) gives every position's logits; at each position the
chain's transforms are applied exactly as the slot's sampler applies them (harness.engine.sampler: the same
llama.cpp samplers, built by the same `_chain`, fed the prompt and then each output token, so penalties and
DRY see the history a non-speculative run has), and the final `dist` draw's softmax (llama_sampler_dist_apply)
gives the token's probability. A grammar (not in the chain, `grammar_first = false`) makes a position's law a
mixture, as common_sampler_sample draws: the chain's token when the grammar allows it, else a second draw
with the grammar applied first, so P(t) = p_chain(t)·allowed(t) + R·p_grammar_chain(t), R the chain's mass on
tokens the grammar rejects.

The output holds no end-of-generation token (a request stops on one without returning it), so each position's
law is taken conditioned on "not an end-of-generation token": under that law each returned token is a draw, and
the one draw that stopped the request is the one not returned.

A returned token outside the chain's support (p = 0: a truncation sampler cut it) is either a fault or numerics:
the scorer's one decode of prompt + output computes its logits in other batches than the run did, which moves
them in the last bits. For each such token the scorer also returns its `lift`: the smallest raise of its logit
(nats, the other logits unchanged) that puts it back inside the chain's support, found by bisection to LIFT_STEPS
halvings of [0, LIFT_CAP] (inf beyond the cap); the check compares it with the calibrated near-tie floor.

Per position the scorer returns (p, below): the conditioned probability of the returned token and the
probability of the tokens ranked before it (descending probability, ties by lower id): a randomised probability
integral transform below + V·p (V uniform) is then uniform on [0, 1) under the null.
"""

import ctypes
import math

import llama_cpp
import numpy as np

from harness.engine.context import Context
from harness.engine.model import Model
from harness.engine.sampler import _CANDIDATE, _chain, free_chain_and_grammar, grammar_text
from harness.result.logits import PositionLogits, capture
from harness.suites.request import Sampling

SCORES_DTYPE = np.float64
LIFT_CAP = 64.0
"""The largest logit raise (nats) `lift` searches: a token that needs more is reported at inf."""
LIFT_STEPS = 24
"""Bisection halvings of [0, LIFT_CAP] (a resolution of 4e-6 nats)."""


def unscorable(sampling: Sampling) -> str | None:
    """Why the chain's law at a position cannot be computed from its logits alone (None: it can): a greedy
    request has no law to test; mirostat and adaptive-p learn from what they drew; XTC draws its own
    random number inside the chain."""
    if sampling.temperature <= 0:
        return "the request is greedy (temperature 0)"
    if sampling.mirostat:
        return "mirostat's law depends on its own earlier draws"
    if "adaptive_p" in sampling.samplers:
        return "adaptive-p's law depends on its own earlier draws"
    if "xtc" in sampling.samplers and sampling.xtc_probability > 0:
        return "XTC draws a random number inside the chain"
    if "temperature" not in sampling.samplers:
        return "the chain has no temperature sampler (its draw is not a softmax of the logits)"
    return None


class _Array:
    """A candidate array (llama_token_data_array) over given ids and logits."""

    def __init__(self, ids: np.ndarray, logits: np.ndarray):
        self.buffer = np.zeros(len(ids), dtype=_CANDIDATE)
        self.buffer["id"] = ids
        self.buffer["logit"] = logits
        ptr = self.buffer.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
        self.struct = llama_cpp.llama_token_data_array(ptr, len(ids), -1, False)

    def apply(self, *samplers) -> "_Array":
        for smpl in samplers:
            llama_cpp.llama_sampler_apply(smpl, ctypes.byref(self.struct))
        return self

    def left(self) -> tuple[np.ndarray, np.ndarray]:
        """The candidates the samplers left (ids, logits): the array's first `size` entries."""
        address = ctypes.addressof(self.struct.data.contents)
        view = np.frombuffer((llama_cpp.llama_token_data * self.struct.size).from_address(address), dtype=_CANDIDATE)
        return view["id"].copy(), view["logit"].astype(np.float64)


def _softmax(ids: np.ndarray, logits: np.ndarray, n_vocab: int) -> np.ndarray:
    """llama_sampler_dist_apply's probabilities over the candidates, as a dense vector over the vocabulary."""
    out = np.zeros(n_vocab, dtype=SCORES_DTYPE)
    finite = np.isfinite(logits)
    if finite.any():
        e = np.exp(logits[finite] - logits[finite].max())
        out[ids[finite]] = e / e.sum()
    return out


class ChainLaw:
    """The law of a slot's next token under a request's sampler chain and grammar, fed the history as it grows."""

    def __init__(self, sampling: Sampling, model: Model):
        self.model = model
        self.chain = _chain(sampling, 0, model)  # the seed moves the draw only, never the law
        n = llama_cpp.llama_sampler_chain_n(self.chain)
        last = llama_cpp.llama_sampler_chain_get(self.chain, n - 1)
        if llama_cpp.llama_sampler_name(last) != b"dist":
            raise ValueError(f"the chain ends in {llama_cpp.llama_sampler_name(last).decode()}, not dist")
        self.transforms = [llama_cpp.llama_sampler_chain_get(self.chain, i) for i in range(n - 1)]
        self.grammar = None
        text = grammar_text(sampling)
        if text is not None:
            self.grammar = llama_cpp.llama_sampler_init_grammar(model.vocab, text.encode(), b"root")
            if not self.grammar:
                raise ValueError("llama.cpp could not parse the grammar")
        self.all_ids = np.arange(model.n_vocab, dtype=np.int32)
        self.eog = np.array(sorted(set(model.vocabulary.eog_tokens)), dtype=np.int64)

    def accept_prompt(self, tokens: list[int]) -> None:
        """Penalties and DRY see the prompt; the grammar does not (llama-server's init_sampler)."""
        for token in tokens:
            llama_cpp.llama_sampler_accept(self.chain, token)

    def law(self, logits: np.ndarray) -> np.ndarray:
        """The next token's probabilities over the vocabulary, conditioned on it not being end-of-generation."""
        n_vocab = self.model.n_vocab
        ids, left = _Array(self.all_ids, logits).apply(*self.transforms).left()
        p = _softmax(ids, left, n_vocab)
        if self.grammar is not None:
            support = np.flatnonzero(p > 0).astype(np.int32)
            masked_ids, masked = _Array(support, np.zeros(len(support), np.float32)).apply(self.grammar).left()
            rejected = masked_ids[~np.isfinite(masked)]
            refused = p[rejected].sum()
            p[rejected] = 0.0
            if refused > 0:
                ids2, left2 = _Array(self.all_ids, logits).apply(self.grammar, *self.transforms).left()
                p += refused * _softmax(ids2, left2, n_vocab)
        if len(self.eog):
            p[self.eog] = 0.0
        total = p.sum()
        return p / total if total > 0 else p

    def accept(self, token: int) -> None:
        """The token joins the history (chain and grammar), as the slot's sampler accepts it."""
        if self.grammar is not None:
            llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)

    def free(self) -> None:
        free_chain_and_grammar(self)


def rank_mass(p: np.ndarray, token: int) -> tuple[float, float]:
    """(p[token], the mass of the tokens ranked before it): descending probability, ties by the lower id."""
    pt = float(p[token])
    before = p > pt
    before[:token] |= p[:token] == pt
    return pt, float(p[before].sum())


def _logit_rows(ctx: Context, prompt: list[int], tokens: list[int], seq_id: int = 0):
    """Yield, for each output position i, the target's logits after prompt + tokens[:i] (one decode of the
    sequence, in chunks of the context's batch size; the sequence is cleared first and after)."""
    ctx.seq_rm(seq_id)
    sequence = [*prompt, *tokens[:-1]]
    first_out = len(prompt) - 1
    batch = ctx.new_batch()
    try:
        for start in range(0, len(sequence), batch.capacity):
            batch.clear()
            rows = {}
            for pos in range(start, min(start + batch.capacity, len(sequence))):
                want = pos >= first_out
                row = batch.add(sequence[pos], pos, seq_id, want)
                if want:
                    rows[pos] = row
            status = ctx.decode(batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status} while scoring")
            for row in rows.values():
                yield ctx.logits(row)
    finally:
        batch.free()
        ctx.seq_rm(seq_id)


def replay_row(ctx: Context, decodes: list[dict], row: int, top_k: int) -> PositionLogits:
    """Row `row` of the last of `decodes` (harness.backends.server_rescore.Replay): each decoded as one batch, the
    request's rows (`tokens` from `start` in sequence `seq`, logits on every row or on the last only) between the
    stand-in rows of the other slots that shared its decode (`before`, `after`: `[slot, n_tokens, every row]`, each at
    positions 0.. of its own sequence, cleared again after the decode), then the request's sequence cut back to
    `keep` positions (the recurrent state to its snapshot of that row). The batches a request was computed in set the
    kernels of every row (a repacked matrix multiplies 4 rows at a time from 4 rows on) and, on a recurrent model,
    the state each row starts from. Every sequence used is cleared before and after."""
    used = {d["seq"] for d in decodes} | {e[0] for d in decodes for e in (*d["before"], *d["after"])}
    for seq in used:
        ctx.seq_rm(seq)
    batch = ctx.new_batch()
    try:
        indices: list[int] = []
        for n, d in enumerate(decodes, start=1):
            batch.clear()
            for other in d["before"]:
                _stand_in(batch, other, d["tokens"][0])
            tokens, start = d["tokens"], d["start"]
            last = len(tokens) - 1
            indices = [batch.add(t, start + i, d["seq"], d["every_row"] or i == last) for i, t in enumerate(tokens)]
            for other in d["after"]:
                _stand_in(batch, other, d["tokens"][0])
            if ctx.decode(batch) != 0:
                raise RuntimeError(f"llama_decode failed replaying the batch at position {start}")
            for other in (*d["before"], *d["after"]):
                ctx.seq_rm(other[0])
            if n < len(decodes) and d["keep"] < start + len(tokens) and not ctx.seq_rm(d["seq"], d["keep"], -1):
                raise RuntimeError(f"the replay could not cut the sequence back to {d['keep']} positions")
        return capture(ctx.logits(indices[row]), top_k)
    finally:
        batch.free()
        for seq in used:
            ctx.seq_rm(seq)


def _stand_in(batch, entry: list, token: int) -> None:
    """Another slot's entry of a shared decode: as many rows of `token` in its own sequence, logits as it asked (a
    step on every row, a prompt batch on its last)."""
    seq, n, every_row = entry
    for i in range(n):
        batch.add(token, i, seq, bool(every_row) or i == n - 1)


def score(model: Model, ctx: Context, sampling: Sampling, prompt: list[int], tokens: list[int]) -> dict:
    """Each returned token's (p, below) under the chain (see the module docstring), as
    {"scores": [[p, below], ...]} (with {"lift": [[i, nats], ...]} for the tokens outside the chain's support);
    scoring stops at a token the grammar forbids ({"impossible_at": i}); or {"unscorable": why}."""
    why = unscorable(sampling)
    if why is not None:
        return {"unscorable": why}
    if not tokens or not prompt:
        return {"scores": []}
    if len(prompt) + len(tokens) > ctx.n_ctx_seq:
        return {"unscorable": f"prompt + output ({len(prompt) + len(tokens)}) exceed the context ({ctx.n_ctx_seq})"}
    law = ChainLaw(sampling, model)
    out: list[list[float]] = []
    lifts: list[list[float]] = []
    try:
        law.accept_prompt(prompt)
        for i, logits in enumerate(_logit_rows(ctx, prompt, tokens)):
            row = np.asarray(logits, dtype=np.float32)
            p = law.law(row)
            pt, below = rank_mass(p, tokens[i])
            if pt == 0.0 and law.grammar is not None and not math.isfinite(_grammar_logit(law, tokens[i])):
                return {"scores": out, "impossible_at": i, **({"lift": lifts} if lifts else {})}
            if pt == 0.0:
                lifts.append([i, lift(law, row, tokens[i])])
            out.append([pt, below])
            law.accept(tokens[i])
    finally:
        law.free()
    return {"scores": out, **({"lift": lifts} if lifts else {})}


def lift(law: ChainLaw, logits: np.ndarray, token: int) -> float:
    """The smallest raise of `token`'s logit (nats, every other logit unchanged) that gives it probability > 0 under
    `law` at this position: bisection over [0, LIFT_CAP] (inf where even the cap leaves it out). The chain's
    truncations keep a token more readily as its own logit rises (top-k by rank, min-p against the top, top-p by the
    mass before it), so inside-or-not is monotone in the raise."""

    def inside(raise_by: float) -> bool:
        raised = logits.copy()
        raised[token] += np.float32(raise_by)
        return bool(law.law(raised)[token] > 0)

    if not inside(LIFT_CAP):
        return math.inf
    low, high = 0.0, LIFT_CAP
    for _ in range(LIFT_STEPS):
        mid = (low + high) / 2
        low, high = (low, mid) if inside(mid) else (mid, high)
    return high


def _grammar_logit(law: ChainLaw, token: int) -> float:
    """The grammar's verdict on one token next: 0 allowed, -inf forbidden."""
    ids, logits = _Array(np.array([token], np.int32), np.zeros(1, np.float32)).apply(law.grammar).left()
    return float(logits[0])
