"""A slot's sampler chain, built from a request's Sampling the way llama-server orders its samplers."""

import json

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from harness.engine.context import Context
from harness.request import Sampling


def grammar_text(sampling: Sampling) -> str | None:
    """The GBNF grammar of a request: its `grammar`, else its `json_schema` converted, else None."""
    if sampling.grammar is not None:
        return sampling.grammar
    if sampling.json_schema is not None:
        return json_schema_to_gbnf(json.dumps(sampling.json_schema))
    return None


class Sampler:
    """One llama_sampler chain per request; `clone` lets a rollback restore it."""

    def __init__(self, ptr, argmax: bool = False):
        self.ptr = ptr
        self.argmax = argmax
        """Plain greedy (no grammar): the chain has no state, so sampling is the logits' argmax (first on
        ties, as llama.cpp's greedy sampler), without building a candidate array over the whole vocabulary."""

    @classmethod
    def for_request(cls, sampling: Sampling, default_seed: int, vocab) -> "Sampler":
        """[grammar →] greedy when temperature <= 0, else top_k → top_p → min_p → temperature → dist(seed)."""
        seed = default_seed if sampling.seed is None else sampling.seed
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        grammar = grammar_text(sampling)
        if grammar is not None:
            constraint = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not constraint:
                llama_cpp.llama_sampler_free(chain)
                raise ValueError("llama.cpp could not parse the grammar")
            llama_cpp.llama_sampler_chain_add(chain, constraint)
        if sampling.greedy:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        else:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(sampling.top_k))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(sampling.min_p, 1))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_temp(sampling.temperature))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return cls(chain, argmax=sampling.greedy and grammar is None)

    def sample(self, ctx: Context, index: int, logits: np.ndarray | None = None) -> int:
        """Sample from output row `index` of the last decode and accept the token into the chain;
        `logits` is that row's view (`ctx.logits(index)`) when the caller already holds it."""
        if self.argmax:
            return int(np.argmax(ctx.logits(index) if logits is None else logits))
        return llama_cpp.llama_sampler_sample(self.ptr, ctx.ptr, index)

    def clone(self) -> "Sampler":
        """A deep copy (RNG state included)."""
        return Sampler(llama_cpp.llama_sampler_clone(self.ptr), self.argmax)

    def free(self) -> None:
        """Release the chain."""
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
