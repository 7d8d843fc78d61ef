"""Logit logging: what the model thought at every generated position.

For each emitted token the in-process engine records the top-k candidates of the row it was sampled
from (ids and raw logits, float32), plus a digest of the full logit vector and its first and last
three values, so two runs can be compared without storing whole vocabularies.
"""

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass
class PositionLogits:
    """The logits behind one generated token."""

    top_ids: np.ndarray
    """int32[k], best first."""
    top_logits: np.ndarray
    """float32[k], best first (raw logits in-process; log-probabilities from llama-server)."""
    digest: str = ""
    """sha1 of the full float32 logit vector ("" when not known, e.g. from llama-server)."""
    head: tuple[float, ...] = ()
    tail: tuple[float, ...] = ()


def capture(row: np.ndarray, k: int) -> PositionLogits:
    """Top-k of one logit row (a view into llama.cpp's buffer; copied here) with its digest."""
    k = min(k, row.shape[0])
    top = np.argpartition(row, -k)[-k:]
    order = top[np.lexsort((top, -row[top]))]
    return PositionLogits(
        top_ids=order.astype(np.int32),
        top_logits=row[order].astype(np.float32),
        digest=hashlib.sha1(row.tobytes()).hexdigest(),
        head=tuple(float(x) for x in row[:3]),
        tail=tuple(float(x) for x in row[-3:]),
    )
