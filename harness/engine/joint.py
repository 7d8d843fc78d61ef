"""The exact law of a request's first k sampled tokens after one prompt (the exact fixed-prefix test,
harness.checks.exact_law).

At each prefix (the prompt and the tokens drawn so far) the target's logits come from one decode without
speculation, and the next token's law is the request's sampler chain applied to them exactly as the scorer applies
it (harness.engine.score.ChainLaw: the same llama.cpp samplers, conditioned on "not end-of-generation"). The law of
the sequence is the product along the path. The tree is expanded down to `min_mass`: a prefix less probable than
that is not expanded (its sequences are left to the caller's `other`, whose mass is one minus the leaves'), so the
number of decodes is at most k / min_mass and in practice the chain's support size to the power k, cut there.
"""

import numpy as np

from harness.engine.context import Context
from harness.engine.model import Model
from harness.engine.score import ChainLaw, _logit_rows, unscorable
from harness.suites.request import Sampling


def joint_law(model: Model, ctx: Context, sampling: Sampling, prompt: list[int], k: int, min_mass: float) -> dict:
    """{"leaves": [[tokens, probability], ...]} for every k-token sequence at least `min_mass` probable (and every
    prefix on its way), {"unscorable": why} where the chain has no law computable from the logits alone."""
    why = unscorable(sampling)
    if why is not None:
        return {"unscorable": why}
    if not prompt or k < 1:
        return {"unscorable": "an exact law needs a prompt and at least one token"}
    if len(prompt) + k > ctx.n_ctx_seq:
        return {"unscorable": f"prompt + {k} tokens exceed the context ({ctx.n_ctx_seq})"}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    decodes = 0
    for _ in range(k):
        grown = []
        for path, mass in frontier:
            p = _law_after(model, ctx, sampling, prompt, path)
            decodes += 1
            for token in np.flatnonzero(p * mass >= min_mass):
                grown.append(((*path, int(token)), mass * float(p[token])))
        frontier = grown
    return {"leaves": [[list(path), mass] for path, mass in frontier], "decodes": decodes}


def _law_after(model: Model, ctx: Context, sampling: Sampling, prompt: list[int], path: tuple[int, ...]) -> np.ndarray:
    """The next token's law after prompt + path (a fresh chain fed the prompt and the path, as a slot's is)."""
    rows = [np.array(r, dtype=np.float32, copy=True) for r in _logit_rows(ctx, prompt, [*path, 0])]
    law = ChainLaw(sampling, model)
    try:
        law.accept_prompt(prompt)
        for token in path:
            law.accept(token)
        return law.law(rows[-1])
    finally:
        law.free()
