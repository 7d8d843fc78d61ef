"""How much a verification batch moves a model's logits: the rows of an n-token batch decoded with logits on every
row (as a speculative verification step decodes them) against the same tokens decoded one at a time, through
llama.cpp's low-level API (the CPU stand-in for GPU numerics: docs/near-tie-policy.md#cpu-stand-in).

`python -m harness.models.numerics MODEL... [--n 2,3,4,5] [--threads 1] [--no-repack]` prints a JSON line per model.
Only used to choose and test the `numerics` suite's models; harness.engine is the real inference layer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np

from harness.llama.defaults import default_repack

PROMPTS = (
    *(
        f"Write a quicksort demo in {lang}. Please, write just code. Do not write any extra comments."
        for lang in ("C", "Java", "Python", "Go", "Rust")
    ),
    "Once upon a time, in a small village by the sea,",
    "The capital of France is",
    "Explain how a hash table handles collisions.",
)


@dataclass
class BatchShift:
    """What an n-token batch changed, over every row of every measured batch (`n` tokens each)."""

    n: int
    rows: int = 0
    max_abs_last: float = 0.0
    """max |Δlogit| over the vocabulary at the batch's last row, the largest over the batches."""
    max_abs: float = 0.0
    """max |Δlogit| over every row."""
    moved: int = 0
    """Rows whose logits differ at all."""
    gap_shifts: list[float] = field(default_factory=list)
    """Per row: how much the batch moved the single-token decodes' top1 − top2 margin (of the same two tokens)."""
    flips: int = 0
    """Rows whose argmax differs between the batch and the single-token decodes."""
    flip_margins: list[float] = field(default_factory=list)
    """The single-token decodes' top1 − top2 margin (nats) at each flipped row."""


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):
    pass


def _decode(ctx, tokens: Sequence[int], pos: int, all_logits: bool) -> None:
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
    finally:
        llama_cpp.llama_batch_free(batch)


def _row(ctx, index: int, n_vocab: int) -> np.ndarray:
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, index), shape=(n_vocab,)).copy()


def _state(ctx) -> bytes:
    size = llama_cpp.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    return ctypes.string_at(buf, llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0))


def _restore(ctx, state: bytes) -> None:
    data = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    if llama_cpp.llama_state_seq_set_data(ctx, data, len(state), 0) == 0:
        raise RuntimeError("llama_state_seq_set_data failed")


def _margin(logits: np.ndarray) -> float:
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])


def batch_vs_single(
    path: Path,
    ns: Sequence[int] = (2, 3, 4, 5),
    *,
    threads: int = 1,
    repack: bool | None = None,
    prompts: Sequence[str] = PROMPTS,
    n_gen: int = 48,
    stride: int = 1,
) -> dict[int, BatchShift]:
    """For each n in `ns`: every `stride`-th position of each prompt's greedy continuation (`n_gen` tokens decoded
    one at a time), the next n tokens of that continuation decoded as one batch with logits on every row, against
    the single-token decodes of the same tokens after the same state (saved and restored). `repack` None: as the
    suites serve (harness.llama.defaults.default_repack: off on a CPU whose AMX path crashes llama.cpp)."""
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_quiet, None)
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = default_repack() if repack is None else repack
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 512, 512, 512
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.flash_attn_type = 0  # off, as the suites serve (ServeConfig.flash_attn)
    cparams.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    shifts = {n: BatchShift(n) for n in ns}
    try:
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {path}")
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        for prompt in prompts:
            data = prompt.encode()
            out = (llama_cpp.llama_token * (len(data) + 2))()
            tokens = list(out[: llama_cpp.llama_tokenize(vocab, data, len(data), out, len(out), True, False)])
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            _decode(ctx, tokens, 0, False)
            # the greedy continuation, one token at a time, and the single-token logits that predict each
            states, singles, gen = [], [], []
            logits = _row(ctx, -1, n_vocab)
            for _ in range(n_gen + max(ns)):
                token = int(np.argmax(logits))
                states.append(_state(ctx))
                gen.append(token)
                _decode(ctx, [token], len(tokens) + len(gen) - 1, False)
                logits = _row(ctx, -1, n_vocab)
                singles.append(logits)
            for start in range(0, n_gen, stride):
                for n in ns:
                    _restore(ctx, states[start])
                    _decode(ctx, gen[start : start + n], len(tokens) + start, True)
                    shift = shifts[n]
                    for i in range(n):
                        batch, single = _row(ctx, i, n_vocab), singles[start + i]
                        delta = float(np.max(np.abs(batch - single)))
                        shift.rows += 1
                        shift.moved += delta > 0
                        top2 = np.argsort(single)[-2:]
                        gap_single = single[top2[1]] - single[top2[0]]
                        shift.gap_shifts.append(float(abs(batch[top2[1]] - batch[top2[0]] - gap_single)))
                        shift.max_abs = max(shift.max_abs, delta)
                        if i == n - 1:
                            shift.max_abs_last = max(shift.max_abs_last, delta)
                        if int(np.argmax(batch)) != int(np.argmax(single)):
                            shift.flips += 1
                            shift.flip_margins.append(_margin(single))
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return shifts


def summary(shift: BatchShift) -> dict:
    """A BatchShift without its per-row lists: rows, moved, flips, the largest |Δ|, the margin shift's p90 and
    largest, and the flipped rows' margins."""
    gaps = np.array(shift.gap_shifts or [0.0])
    return {
        "n": shift.n,
        "rows": shift.rows,
        "moved": shift.moved,
        "max_abs_last": shift.max_abs_last,
        "max_abs": shift.max_abs,
        "gap_shift_p90": float(np.percentile(gaps, 90)),
        "gap_shift_max": float(gaps.max()),
        "flips": shift.flips,
        "flip_margins": [round(m, 5) for m in shift.flip_margins],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.models.numerics", description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="registry names or .gguf paths")
    parser.add_argument("--n", default="2,3,4,5", help="batch sizes (default 2,3,4,5)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (default 1)")
    parser.add_argument(
        "--no-repack",
        action="store_true",
        help="load the weights without repacking them (default: repacked, but on a CPU with AMX)",
    )
    parser.add_argument("--json", action="store_true", help="a JSON line per model instead of the table")
    args = parser.parse_args(argv)
    from harness.models.registry import resolve

    if not args.json:
        print("model  threads  repack  n  rows  moved  max|Δ|last  max|Δ|  margin-shift p90/max  flips (their margins)")
    for name in args.models:
        shifts = batch_vs_single(
            resolve(name).path,
            [int(n) for n in args.n.split(",")],
            threads=args.threads,
            repack=False if args.no_repack else None,
        )
        rows = [summary(s) for s in shifts.values()]
        if args.json:
            repack = not args.no_repack and default_repack()
            print(json.dumps({"model": name, "threads": args.threads, "repack": repack, "shifts": rows}))
            continue
        repack = "on" if not args.no_repack and default_repack() else "off"
        for r in rows:
            print(
                f"{name}  {args.threads}  {repack}  {r['n']}  {r['rows']}  {r['moved']}  "
                f"{r['max_abs_last']:.2g}  {r['max_abs']:.2g}  {r['gap_shift_p90']:.2g}/{r['gap_shift_max']:.2g}  "
                f"{r['flips']} {r['flip_margins'] or ''}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
