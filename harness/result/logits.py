"""Logit logging: what the model thought at every generated position, and how two runs' thoughts differ.

For each emitted token the in-process engine records the top-k candidates of the row it was sampled
from (ids and raw logits, float32), the row's log-normaliser (so the values convert to log-probabilities),
a digest of the full logit vector and its first and last three values. llama-server's `n_probs` output
converts to the same record (`from_server_probs`). Records go to Parquet (`save_parquet`) and are
compared position by position (`compare`, `check`).
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import cache
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class PositionLogits:
    """The logits behind one generated token."""

    top_ids: np.ndarray
    """int32[k], best first (empty where the backend returned none: llama-server at 0c1e570 for every token
    a speculative step emits; `probs-complete` counts them, re-scoring never fills them in)."""
    top_logits: np.ndarray
    """float32[k], best first (raw logits in-process; log-probabilities from llama-server; with
    `post_sampling_probs`, the log of the sampler chain's probabilities on both)."""
    digest: str = ""
    """CRC-32 (hex) of the full float32 logit vector ("" when not known, e.g. from llama-server)."""
    head: tuple[float, ...] = ()
    tail: tuple[float, ...] = ()
    log_z: float = 0.0
    """log Σ exp(row) over the whole vocabulary: `top_logits − log_z` are log-probabilities
    (0 when `top_logits` already are, as llama-server's are)."""
    how: str = field(default="", compare=False)
    """How a re-scored row was computed, against how the run computed it (harness.execute.Rescorer); "" for a row
    the run logged itself."""
    pending: Future | None = field(default=None, repr=False, compare=False)
    """`capture(..., deferred=True)`: the capture still being computed on the background thread (see `settle`)."""

    def settle(self) -> PositionLogits:
        """Wait for a deferred capture (a no-op otherwise); returns self."""
        if self.pending is not None:
            future, self.pending = self.pending, None
            done = future.result()
            self.top_ids, self.top_logits, self.digest = done.top_ids, done.top_logits, done.digest
            self.head, self.tail, self.log_z = done.head, done.tail, done.log_z
        return self

    def logprobs(self) -> np.ndarray:
        """The top-k values as float64 log-probabilities."""
        return self.top_logits.astype(np.float64) - self.log_z

    @property
    def margin(self) -> float | None:
        """top1 − top2 (nats), None with fewer than two candidates. llama-server's log-probabilities give
        the same number as raw logits: both rows differ by the constant log-normaliser."""
        return float(self.top_logits[0]) - float(self.top_logits[1]) if len(self.top_logits) >= 2 else None


SAMPLE_STRIDE = 64
"""`capture` finds its top-k candidates above the k-th largest of every 64th logit."""

_scratch = threading.local()


def _exp_buffer(row: np.ndarray) -> np.ndarray:
    """A per-thread scratch array shaped like `row` for the log-normaliser's exp (no 1 MB allocation and
    page faults per token)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.shape != row.shape or buf.dtype != row.dtype:
        buf = _scratch.buf = np.empty_like(row)
    return buf


def _top_k_full(row: np.ndarray, k: int) -> np.ndarray:
    """The top-k ids, best first, ties by id, from a partition of the whole row (rows with NaN or ±inf;
    which of several ids tied at the k-th value it keeps is numpy's choice)."""
    top = np.argpartition(row, -k)[-k:]
    return top[np.lexsort((top, -row[top]))]


def _top_k(row: np.ndarray, k: int) -> np.ndarray | None:
    """The k best ids, best first, ties broken by the lower id (also at the k-th value), in a few
    vectorised passes: the k-th largest of a strided sample bounds the row's k-th largest from below, so
    the ids at or above it (at least k) hold the top k; only those are partitioned. None when the row
    holds NaN where the bound or the partition sees it (the caller then partitions the whole row)."""
    n = row.shape[0]
    if n >= 4 * SAMPLE_STRIDE * k:
        sample = row[::SAMPLE_STRIDE]
        bound = np.partition(sample, sample.size - k)[sample.size - k]
        cand = np.flatnonzero(row >= bound)
    else:
        cand = np.arange(n)
    vals = row[cand]
    if cand.size > k:
        kth = np.partition(vals, cand.size - k)[cand.size - k]
        above = vals > kth
        n_above = int(np.count_nonzero(above))
        cand = np.concatenate((cand[above], cand[vals == kth][: k - n_above]))  # cand ascends: lowest tied ids
        vals = row[cand]
    if cand.size != k:
        return None
    return cand[np.lexsort((cand, -vals))]


def _normaliser(row: np.ndarray, peak: float, scratch: np.ndarray) -> float:
    """Σ exp(row − peak): float32 exp into `scratch`, float64 sum (NaN for a row holding NaN or +inf)."""
    with np.errstate(invalid="ignore"):
        return float(np.exp(np.subtract(row, np.float32(peak), out=scratch), out=scratch).sum(dtype=np.float64))


_worker: dict[int, ThreadPoolExecutor] = {}


def _pool() -> ThreadPoolExecutor:
    """One background thread per process (a forked worker gets its own)."""
    pid = os.getpid()
    if pid not in _worker:
        _worker[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logits")
    return _worker[pid]


def capture(row: np.ndarray, k: int, deferred: bool = False) -> PositionLogits:
    """Top-k of one logit row (a view into llama.cpp's buffer; copied here) with its digest and log-normaliser.

    Per token this is the cost of logging, so it is a few vectorised passes over the row (no partition of
    the whole vocabulary, see `_top_k`): the digest is a CRC-32 (2-3x cheaper than SHA-1 over a 262k
    vocabulary; it only has to tell two rows apart) and exp runs in float32, into a reused buffer, with a
    float64 sum. Ids tied at the k-th value are kept lowest first; a row holding NaN or +inf (whose
    normaliser is NaN) takes the whole-row partition instead.

    `deferred`: the row is copied (the generating thread's only cost) and captured on a background thread
    while the caller goes on (the next `llama_decode` releases the GIL); the record is empty until
    `settle()`, then holds exactly the values of an immediate capture."""
    if deferred:
        return PositionLogits(
            np.empty(0, np.int32), np.empty(0, np.float32), pending=_pool().submit(capture, row.copy(), k)
        )
    k = min(k, row.shape[0])
    order = _top_k(row, k) if k > 0 else None
    full = order is None
    if full:
        order = _top_k_full(row, k)
    peak = float(row[order[0]])
    record = PositionLogits(
        top_ids=order.astype(np.int32),
        top_logits=row[order].astype(np.float32),
        head=tuple(float(x) for x in row[:3]),
        tail=tuple(float(x) for x in row[-3:]),
    )
    scratch = _exp_buffer(row)
    total = _normaliser(row, peak, scratch)
    if math.isnan(total) and not full:
        order = _top_k_full(row, k)
        peak = float(row[order[0]])
        record.top_ids, record.top_logits = order.astype(np.int32), row[order].astype(np.float32)
        total = _normaliser(row, peak, scratch)
    record.digest = f"{zlib.crc32(memoryview(row)):08x}"
    record.log_z = peak + math.log(total)
    return record


# --- llama-server -------------------------------------------------------------------------------------


def from_server_probs(completion_probabilities: list[dict], tokens: list[int] | None = None) -> list[PositionLogits]:
    """llama-server's `completion_probabilities` (request field `n_probs`) → one record per token.

    Reads `top_logprobs`/`logprob`, or `top_probs`/`prob` (with `post_sampling_probs`, converted to logs;
    a zero probability becomes float32's lowest value, as the server reports a zero logprob). Tokens a
    speculative step emitted carry an empty top list: they become records with empty arrays, which
    `compare` skips and the `probs-complete` check counts.

    With `tokens` (the response's), entries are matched to tokens by their `id`: llama-server leaves out the
    entry of a token after which the text ends inside a UTF-8 character (server-context.cpp `process_token`
    adds it only when the text is complete), and every later entry would land on the token before its own. Such
    a token gets an empty record, as a withheld one."""
    entries = completion_probabilities if tokens is None else matched_entries(completion_probabilities, tokens)
    out = []
    for entry in entries:
        if entry is None:
            out.append(PositionLogits(np.empty(0, np.int32), np.empty(0, np.float32)))
            continue
        if "top_logprobs" in entry:
            top = [(c["id"], c["logprob"]) for c in entry["top_logprobs"]]
        else:
            lowest = float(np.finfo(np.float32).min)
            top = [(c["id"], math.log(c["prob"]) if c["prob"] > 0 else lowest) for c in entry.get("top_probs", [])]
        top.sort(key=lambda c: (-c[1], c[0]))
        out.append(
            PositionLogits(
                top_ids=np.array([i for i, _ in top], dtype=np.int32),
                top_logits=np.array([v for _, v in top], dtype=np.float32),
            )
        )
    return out


def matched_entries(entries: list[dict], tokens: list[int]) -> list[dict | None]:
    """Each token's `completion_probabilities` entry (None where llama-server left it out: see `from_server_probs`,
    which takes the result), in order, up to the last entry: tokens after it keep
    no record (the entries llama-server drops for the tokens that spell a stop string), entries past the tokens
    are kept. An entry without an `id` matches any token."""
    out, j = [], 0
    for token in tokens:
        if j < len(entries) and entries[j].get("id", token) == token:
            out.append(entries[j])
            j += 1
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return out + entries[j:]


# --- Parquet --------------------------------------------------------------------------------------------


@cache
def parquet_schema():
    """One row per generated position; `case` names the case (and request) the position belongs to. (pandas and
    pyarrow are imported where a frame or a file is made, not by every process that records logits: the engine's
    workers never do.)"""
    import pyarrow as pa

    return pa.schema(
        [
            ("case", pa.string()),
            ("position", pa.int32()),
            ("top_ids", pa.list_(pa.int32())),
            ("top_logits", pa.list_(pa.float32())),
            ("log_z", pa.float64()),
            ("digest", pa.string()),
            ("head", pa.list_(pa.float32())),
            ("tail", pa.list_(pa.float32())),
        ]
    )


def to_frame(logits: list[PositionLogits]) -> pd.DataFrame:
    """One row per position: `position`, list columns `top_ids` (int32) / `top_logits` (float32),
    `log_z`, `digest`, and `head` / `tail` (float32 lists)."""
    import pandas as pd

    return pd.DataFrame(
        {
            "position": np.arange(len(logits), dtype=np.int32),
            "top_ids": [np.asarray(p.top_ids, dtype=np.int32) for p in logits],
            "top_logits": [np.asarray(p.top_logits, dtype=np.float32) for p in logits],
            "log_z": np.array([p.log_z for p in logits], dtype=np.float64),
            "digest": [p.digest for p in logits],
            "head": [np.array(p.head, dtype=np.float32) for p in logits],
            "tail": [np.array(p.tail, dtype=np.float32) for p in logits],
        }
    )


def from_frame(df: pd.DataFrame) -> list[PositionLogits]:
    """The records of a `to_frame` / `load_parquet` frame, in position order."""
    return [
        PositionLogits(
            top_ids=np.asarray(row.top_ids, dtype=np.int32),
            top_logits=np.asarray(row.top_logits, dtype=np.float32),
            digest=row.digest,
            head=tuple(float(x) for x in row.head),
            tail=tuple(float(x) for x in row.tail),
            log_z=float(row.log_z),
        )
        for row in df.sort_values("position").itertuples(index=False)
    ]


FLOAT_COLUMNS = ("top_logits.list.element", "log_z", "head.list.element", "tail.list.element")


def save_parquet(path: Path, frames_by_case: dict[str, pd.DataFrame]) -> None:
    """Write the frames of a run into one Parquet file with a `case` column (zstd; floats byte-stream-split,
    which compresses them where dictionaries would grow them: about 16 kB per 128 positions at k = 10)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    frames = [frame.assign(case=case) for case, frame in frames_by_case.items() if len(frame)]
    table = (
        pa.Table.from_pandas(pd.concat(frames, ignore_index=True)[schema.names], schema=schema, preserve_index=False)
        if frames
        else schema.empty_table()
    )
    pq.write_table(
        table.replace_schema_metadata(None),
        Path(path),
        compression="zstd",
        use_dictionary=["case"],
        column_encoding=dict.fromkeys(FLOAT_COLUMNS, "BYTE_STREAM_SPLIT"),
    )


def load_parquet(path: Path) -> dict[str, pd.DataFrame]:
    """case → frame (as `to_frame` made it) from a `save_parquet` file, cases in file order (a case
    without positions has no rows, so it is absent)."""
    import pyarrow.parquet as pq

    df = pq.read_table(Path(path), schema=parquet_schema()).to_pandas()
    return {case: group.drop(columns="case").reset_index(drop=True) for case, group in df.groupby("case", sort=False)}


def load_case(path: Path, case: str) -> list[PositionLogits]:
    """One case's records from a `save_parquet` file, in position order ([] when the file has none): what
    `from_frame(load_parquet(path)[case])` gives, read with pyarrow alone (no pandas frames; a baseline's
    logits are read once per case and check run, about 2.5x faster so)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(Path(path), schema=parquet_schema())
    rows = table.filter(pc.equal(table["case"], case)).to_pydict()
    order = sorted(range(len(rows["position"])), key=rows["position"].__getitem__)
    return [
        PositionLogits(
            top_ids=np.asarray(rows["top_ids"][i], dtype=np.int32),
            top_logits=np.asarray(rows["top_logits"][i], dtype=np.float32),
            digest=rows["digest"][i],
            head=tuple(rows["head"][i]),
            tail=tuple(rows["tail"][i]),
            log_z=float(rows["log_z"][i]),
        )
        for i in order
    ]


# --- comparison -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerances:
    """How close two runs' logits must be, judged over all compared positions the way llama.cpp's
    test-backend-ops judges a tensor (an aggregate error, not the single worst element), so one outlier
    logit of a 262k vocabulary does not decide alone:

    - `top1_agreement`: the rate of positions whose top-1 candidate is the same;
    - `nmse`: Σ(a−b)² / Σa² pooled over every compared position (log-probabilities of the top-k ids);
    - `kl`: the mean over positions of KL(a‖b) (top-k plus a rest bucket);
    - `max_abs`: a bound on the `max_abs_quantile` quantile of the per-position max |Δ|.

    The defaults are the uncalibrated fallback (tiny models, flash attention on vs off: |Δ| ≤ 0.035, mostly
    < 0.005, NMSE ≤ 4e-6, KL ≤ 5e-5); `specharness calibrate` measures the real floor per model, backend
    and device (`fixtures/calibration/`).
    """

    top1_agreement: float = 1.0
    nmse: float = 1e-5
    kl: float = 1e-4
    max_abs: float = 0.025
    max_abs_quantile: float = 0.95
    windows: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Statistic (`nmse`, `kl`, `max_abs`) → its bound over a comparison of n = 1, 2, … consecutive compared
    positions (calibration: `window_largest`). The three values above bound a case's whole comparison as
    calibration measured them, over cases of some tens to hundreds of positions; a comparison of few positions
    (llama-server logs none of the tokens a verification step emits, and triage compares only the positions
    before a divergence) is a mean of few terms, with a far wider spread: `for_positions` applies the bound
    measured for that many. Empty: uncalibrated, or a file written before curves were measured."""

    def for_positions(self, n: int) -> Tolerances:
        """The tolerances of a comparison of `n` positions: each windowed statistic the larger of its
        whole-case value and its curve's bound for n positions (the curve's last, longest window beyond its
        length: `WINDOW_MAX`)."""
        if not self.windows or n < 1:
            return self
        bound = {k: max(getattr(self, k), curve[min(n, len(curve)) - 1]) for k, curve in self.windows.items() if curve}
        return replace(self, **bound, windows={})


WINDOW_MAX = 64
"""The longest window `window_largest` measures. A comparison of more positions is bounded by the 64-position
value (or the whole-case one where larger); docs/reference/calibration.md shows the curves flatten long before."""


def window_largest(comparison: LogitsComparison, q: float = 0.95, n_max: int = WINDOW_MAX) -> dict[str, list[float]]:
    """Per statistic, for n = 1 … min(n_max, positions compared): its largest value over every window of n
    consecutive compared positions, computed as `check` computes it over a whole comparison (NMSE pooled over the
    window, KL its mean, max |Δ| its `q`-quantile)."""
    df = comparison.per_position
    kl, mx = df["kl"].to_numpy(float), df["max_abs"].to_numpy(float)
    ce = np.concatenate([[0.0], np.cumsum(df["sq_err"].to_numpy(float))])
    cr = np.concatenate([[0.0], np.cumsum(df["sq_ref"].to_numpy(float))])
    ck = np.concatenate([[0.0], np.cumsum(kl)])
    out: dict[str, list[float]] = {"nmse": [], "kl": [], "max_abs": []}
    for n in range(1, min(n_max, len(df)) + 1):
        err, ref = ce[n:] - ce[:-n], cr[n:] - cr[:-n]
        pooled = np.divide(err, ref, out=np.where(err > 0, np.inf, 0.0), where=ref > 0)
        out["nmse"].append(float(pooled.max()))
        out["kl"].append(float(max(0.0, ((ck[n:] - ck[:-n]) / n).max())))
        out["max_abs"].append(float(np.quantile(np.lib.stride_tricks.sliding_window_view(mx, n), q, axis=1).max()))
    return out


def larger_curves(*curves: dict[str, list[float]]) -> dict[str, list[float]]:
    """Each statistic's curve, element by element the largest of `curves` (as long as the longest)."""
    out: dict[str, list[float]] = {}
    for curve in curves:
        for key, values in curve.items():
            mine = out.setdefault(key, [])
            out[key] = [max(x) for x in zip_longest(mine, values, fillvalue=0.0)]
    return out


@dataclass
class LogitsComparison:
    """Per-position differences between a reference `a` and another run `b`, and their aggregates."""

    per_position: pd.DataFrame
    """One row per compared position: `position`, `a_top1`, `b_top1`, `top1_agree`, `max_abs`,
    `max_abs_id` (the token id behind `max_abs`), `nmse`, `kl`, and NMSE's sums `sq_err` Σ(a−b)² and `sq_ref`
    Σa² (which pool over positions)."""
    n_a: int
    n_b: int
    n_skipped: int
    """Positions of the common length where a side has no candidates (llama-server's speculated tokens)."""
    top1_agreement: float
    max_abs: float
    nmse: float
    """Pooled over all compared positions: Σ(a−b)² / Σa²."""
    kl_mean: float
    kl_max: float

    @property
    def n_compared(self) -> int:
        return len(self.per_position)


def _position_diff(a: PositionLogits, b: PositionLogits, k: int) -> dict:
    """The metrics of one position (see `compare`) plus the NMSE sums that pool over positions."""
    if _identical(a, b, k):
        return _same_position(a, k)
    la, lb = a.logprobs()[:k], b.logprobs()[:k]
    ia, ib = a.top_ids[:k], b.top_ids[:k]
    va, vb = dict(zip(ia.tolist(), la, strict=False)), dict(zip(ib.tolist(), lb, strict=False))
    shared = [i for i in va if i in vb]
    # an id in one side's top-k only: the other side's value is at most its k-th, so |Δ| ≥ value − k-th
    deltas = {i: abs(va[i] - vb[i]) for i in shared}
    deltas.update({i: max(0.0, va[i] - lb[-1]) for i in va if i not in vb})
    deltas.update({i: max(0.0, vb[i] - la[-1]) for i in vb if i not in va})
    worst = max(deltas, key=lambda i: (deltas[i], -i))
    xa, xb = np.array([va[i] for i in shared]), np.array([vb[i] for i in shared])
    err, ref = float(np.sum((xa - xb) ** 2)), float(np.sum(xa**2))
    # KL over the shared ids plus one bucket holding each side's remaining mass
    p_a, p_b = np.exp(xa), np.exp(xb)
    p_a = np.append(p_a, max(1.0 - p_a.sum(), 0.0))
    p_b = np.maximum(np.append(p_b, max(1.0 - p_b.sum(), 0.0)), 1e-12)
    kl = float(np.sum(np.where(p_a > 0, p_a * np.log(np.maximum(p_a, 1e-300) / p_b), 0.0)))
    return {
        "a_top1": int(ia[0]),
        "b_top1": int(ib[0]),
        "top1_agree": bool(ia[0] == ib[0]),
        "max_abs": float(deltas[worst]),
        "max_abs_id": int(worst),
        "nmse": err / ref if ref > 0 else (0.0 if err == 0 else math.inf),
        "kl": max(kl, 0.0),
        "sq_err": err,
        "sq_ref": ref,
    }


def _identical(a: PositionLogits, b: PositionLogits, k: int) -> bool:
    """Both sides hold the same top-k ids and values (bit for bit) and the same normaliser."""
    return (
        a.log_z == b.log_z
        and np.array_equal(a.top_ids[:k], b.top_ids[:k])
        and np.array_equal(a.top_logits[:k], b.top_logits[:k])
    )


def _same_position(a: PositionLogits, k: int) -> dict:
    """`_position_diff` of a position against an identical one, without its general arithmetic (most compared
    positions are identical: a baseline against its own configuration, a cell against an equal one). The same
    numbers: every |Δ| is 0, so the worst id is the lowest; Σ(a−b)² is 0; each KL term is 0 or, where a
    probability is under the 1e-12 floor, negative, and KL is floored at 0."""
    la, ia = a.logprobs()[:k], a.top_ids[:k]
    return {
        "a_top1": int(ia[0]),
        "b_top1": int(ia[0]),
        "top1_agree": True,
        "max_abs": 0.0,
        "max_abs_id": int(ia.min()),
        "nmse": 0.0,
        "kl": 0.0,
        "sq_err": 0.0,
        "sq_ref": float(np.sum(la**2)),
    }


def compare(a: list[PositionLogits], b: list[PositionLogits], k: int = 10) -> LogitsComparison:
    """Compare two runs position by position over their common length, on log-probabilities.

    Positions where either side has no candidates are skipped. Per position, over each side's top-k:
    top-1 agreement; max |Δ| over the union of both id sets, where an id in only one side's top-k counts
    as (its value − the other side's k-th value, floored at 0), a lower bound of the true difference;
    NMSE Σ(a−b)²/Σa² (llama.cpp's test-backend-ops metric) over the ids in both top-k sets; and
    KL(a‖b) over the shared ids plus one "rest" bucket with each side's remaining probability mass, a
    lower bound of the full-vocabulary KL (data-processing inequality). So where the top-k sets differ,
    max |Δ| and KL understate rather than overstate: a breach of their tolerance is real.
    Compare only positions whose contexts agree (before the token streams diverge, see `harness.verdict.triage`),
    and llama-server's post-sampling probabilities only with their own kind (they are not the model's).
    """
    rows = []
    n_skipped = 0
    for pos, (x, y) in enumerate(zip(a, b, strict=False)):
        if len(x.top_ids) == 0 or len(y.top_ids) == 0:
            n_skipped += 1
            continue
        rows.append({"position": pos, **_position_diff(x, y, k)})
    import pandas as pd

    columns = ["position", "a_top1", "b_top1", "top1_agree", "max_abs", "max_abs_id", "nmse", "kl", "sq_err", "sq_ref"]
    df = pd.DataFrame(rows, columns=columns)
    err, ref = float(df["sq_err"].sum()), float(df["sq_ref"].sum())
    empty = df.empty
    return LogitsComparison(
        per_position=df[columns].reset_index(drop=True),
        n_a=len(a),
        n_b=len(b),
        n_skipped=n_skipped,
        top1_agreement=1.0 if empty else float(df["top1_agree"].mean()),
        max_abs=0.0 if empty else float(df["max_abs"].max()),
        nmse=err / ref if ref > 0 else (0.0 if err == 0 else math.inf),
        kl_mean=0.0 if empty else float(df["kl"].mean()),
        kl_max=0.0 if empty else float(df["kl"].max()),
    )


def max_abs_quantile(comparison: LogitsComparison, q: float) -> float:
    """The q-quantile of the per-position max |Δ| (0 without compared positions)."""
    df = comparison.per_position
    return 0.0 if df.empty else float(df["max_abs"].quantile(q, interpolation="higher"))


def check(comparison: LogitsComparison, tol: Tolerances) -> tuple[bool, str]:
    """Whether the comparison is within `tol` (its bounds for as many positions as it compares:
    `Tolerances.for_positions`), and a one-line message with the aggregates (and the worst position, to look at)."""
    c, df = comparison, comparison.per_position
    tol = tol.for_positions(c.n_compared)
    scope = f"{c.n_compared} positions ({c.n_skipped} skipped; lengths {c.n_a}/{c.n_b})"
    if df.empty:
        return False, f"no position has logits on both sides: {scope}"
    problems = []
    if c.top1_agreement < tol.top1_agreement:
        first = df[~df["top1_agree"]].iloc[0]
        problems.append(
            f"top-1 agreement {c.top1_agreement:.4f} < {tol.top1_agreement} (first disagreement at "
            f"position {int(first.position)}: id {int(first.a_top1)} vs {int(first.b_top1)})"
        )
    if c.nmse > tol.nmse:
        problems.append(f"NMSE {c.nmse:.3g} > {tol.nmse:.3g}")
    if c.kl_mean > tol.kl:
        problems.append(f"mean KL {c.kl_mean:.3g} > {tol.kl:.3g}")
    quantile = max_abs_quantile(c, tol.max_abs_quantile)
    if quantile > tol.max_abs:
        problems.append(f"p{100 * tol.max_abs_quantile:g} of max |Δ| {quantile:.3g} > {tol.max_abs:.3g}")
    worst = df.loc[df["max_abs"].idxmax()]
    at = f"max |Δ| {c.max_abs:.3g} at position {int(worst.position)} on id {int(worst.max_abs_id)}"
    if problems:
        return False, f"logits differ over {scope}: " + "; ".join(problems) + f" ({at})"
    return True, (
        f"logits close over {scope}: top-1 agreement {c.top1_agreement:.4f}, NMSE {c.nmse:.3g}, "
        f"mean KL {c.kl_mean:.3g}, p{100 * tol.max_abs_quantile:g} of max |Δ| {quantile:.3g} ({at})"
    )
