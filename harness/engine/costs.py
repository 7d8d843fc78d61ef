"""What the in-process engine's own bookkeeping costs: sequence-state copies during checkpoint rollback and
logit logging per generated token. Plain functions returning dicts, for `specharness bench`."""

import statistics
import time
from dataclasses import replace
from typing import Union

import numpy as np

from harness.engine.context import Context
from harness.engine.engine import Engine
from harness.engine.model import Vocab
from harness.errors import HarnessError
from harness.logits import capture


def state_copy_share(model_name: str, spec: str, n_predict: int) -> dict:
    """One `seq`-mode greedy request of the quicksort suite's first case (C), speculating with the matrix
    preset `spec` (e.g. `draft-simple`, `ngram-mod`) under the default rollback (`checkpoint` for hybrid and
    recurrent models): the share of its wall time spent in `Context.state_seq` and `Context.set_state_seq`,
    on every context (a draft model's too). A short request first warms the engine up, untimed.

    Returns `model`, `spec`, `wall_s`, `copy_s`, `copy_share_pct`, `copies` (state_seq calls), `restores`
    (set_state_seq calls) and `bytes` (moved by both)."""
    from harness.backends.base import ServeConfig
    from harness.backends.inproc import context_params, spec_config
    from harness.matrix import spec_preset
    from harness.models import draft_for, resolve
    from harness.suites import load_suite

    preset = spec_preset(spec)
    draft = draft_for(model_name) if "draft-simple" in spec else None
    if "draft-simple" in spec and draft is None:
        raise HarnessError(f"state_copy_share: {model_name} has no draft model for draft-simple")
    config = ServeConfig(model=resolve(model_name).path, mode="seq", spec=dict(preset.options),
                         draft_model=resolve(draft).path if draft else None)
    suite = load_suite("quicksort")
    case = suite.cell_case(suite.cases[0], model_name)
    request = case.request()
    request = replace(request, sampling=replace(request.sampling, n_predict=n_predict))
    warm_up = replace(request, sampling=replace(request.sampling, n_predict=8))

    spent = {"copy_s": 0.0, "copies": 0, "restores": 0, "bytes": 0}
    get, put = Context.state_seq, Context.set_state_seq

    def timed_get(self, seq_id, flags=0):
        t0 = time.perf_counter()
        data = get(self, seq_id, flags)
        spent["copy_s"] += time.perf_counter() - t0
        spent["copies"] += 1
        spent["bytes"] += len(data)
        return data

    def timed_put(self, seq_id, data, flags=0):
        t0 = time.perf_counter()
        ok = put(self, seq_id, data, flags)
        spent["copy_s"] += time.perf_counter() - t0
        spent["restores"] += 1
        spent["bytes"] += len(data)
        return ok

    Context.state_seq, Context.set_state_seq = timed_get, timed_put
    try:
        with Engine(config.model, context_params(config), spec_config(config)) as engine:
            engine.run([warm_up])
            spent.update(copy_s=0.0, copies=0, restores=0, bytes=0)
            t0 = time.perf_counter()
            result = engine.run([request])[0]
            wall = time.perf_counter() - t0
    finally:
        Context.state_seq, Context.set_state_seq = get, put
    if result.error:
        raise RuntimeError(f"state_copy_share: the request failed: {result.error}")
    return {"model": model_name, "spec": spec, "wall_s": round(wall, 4), "copy_s": round(spent["copy_s"], 4),
            "copy_share_pct": round(100 * spent["copy_s"] / wall, 3), "copies": spent["copies"],
            "restores": spent["restores"], "bytes": spent["bytes"]}


def capture_cost(vocab_size_or_model: Union[int, str], k: int = 10, repeats: int = 200) -> dict:
    """The median time of one `logits.capture` (top-k, digest, log-normaliser) on a float32 row of random
    normal logits as long as the vocabulary (an int, or a model name / .gguf path whose vocabulary is read
    without its weights). Returns `vocab`, `k`, `repeats`, `median_ms`, `min_ms`."""
    if isinstance(vocab_size_or_model, int):
        n_vocab = vocab_size_or_model
    else:
        from harness.models import resolve

        vocab = Vocab.load(resolve(vocab_size_or_model).path)
        if vocab is None:
            raise HarnessError(f"capture_cost: llama.cpp cannot read the vocabulary of {vocab_size_or_model}")
        n_vocab = vocab.n_tokens
        vocab.close()
    row = (np.random.default_rng(0).standard_normal(n_vocab, dtype=np.float32) * 3).astype(np.float32)
    capture(row, k)  # warm-up (scratch buffer)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        capture(row, k)
        times.append(time.perf_counter() - t0)
    return {"vocab": n_vocab, "k": k, "repeats": repeats, "median_ms": round(1000 * statistics.median(times), 4),
            "min_ms": round(1000 * min(times), 4)}
