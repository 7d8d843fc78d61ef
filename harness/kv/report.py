"""What a scan finds: the `Layout` a blob was read with, its `Part`s (one KV or recurrent section, cell by
cell) and the `ScanReport` (duplicates, orphans, holes, totals, health)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from harness.errors import HarnessError

MEMORIES = {
    # memory class: (part names with flags 0, part names with PARTIAL_ONLY), in blob order (§1.4)
    "kv": (("kv",), ("kv",)),
    "iswa": (("kv-base", "kv-swa"), ("kv-swa",)),
    "recurrent": (("rs",), ("rs",)),
    "hybrid": (("kv", "rs"), ("rs",)),
    "hybrid-iswa": (("kv-base", "kv-swa", "rs"), ("kv-swa", "rs")),
}


@dataclass(frozen=True)
class Layout:
    """Facts about a blob that it does not store; None means unknown (the scanner tries every value)."""

    memory: str | None = None
    """One of MEMORIES: kv, iswa, recurrent, hybrid, hybrid-iswa."""
    cell_ext: bool | None = None
    """KV cells carry x, y, tok (M-RoPE / IMROPE models)."""
    mla: bool | None = None
    """KV caches store K only (MLA models)."""
    n_recurrent_layers: int | None = None
    partial_only: bool | None = None
    """Seq blob written with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY."""
    on_device: bool | None = None
    """Seq blob written with LLAMA_STATE_SEQ_FLAGS_ON_DEVICE (metadata only, no tensor bytes)."""

    def __post_init__(self) -> None:
        if self.memory is not None and self.memory not in MEMORIES:
            raise HarnessError(f"unknown memory class '{self.memory}' (use one of: {', '.join(MEMORIES)})")

    def describe(self) -> str:
        """The known facts as `name=value` pairs, unknown ones left out."""
        known = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None]
        return ", ".join(known) or "nothing known"


@dataclass
class Part:
    """One memory part of a blob (a KV cache or a recurrent-state section) and its cells.

    Cells are numpy arrays indexed by cell (`stream`, `pos`); sequence membership is a list of
    (cell index, seq id) pairs (`cell_of` ascending, `seq_of`) because a cell may belong to several sequences.
    """

    name: str
    kind: str
    n_stream: int
    n_layer: int
    """Layers in the data header (for a recurrent part: the model's trunk layer count)."""
    v_trans: int | None
    n_recurrent_layers: int | None
    stream: np.ndarray
    pos: np.ndarray
    cell_of: np.ndarray
    seq_of: np.ndarray
    tensor_bytes: int

    @property
    def n_cells(self) -> int:
        """Number of cells written for this part."""
        return len(self.pos)

    def cells(self) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """Each cell as (stream, pos, seq ids), in blob order."""
        groups = np.split(self.seq_of, np.searchsorted(self.cell_of, np.arange(1, self.n_cells)))
        for i in range(self.n_cells):
            yield int(self.stream[i]), int(self.pos[i]), tuple(int(s) for s in groups[i])

    def sequences(self) -> dict[int, dict]:
        """Per sequence: how many cells it has and their position range."""
        pos = self.pos[self.cell_of]
        out = {}
        for seq in np.unique(self.seq_of):
            p = pos[self.seq_of == seq]
            out[int(seq)] = {"cells": int(len(p)), "pos_min": int(p.min()), "pos_max": int(p.max())}
        return out

    def summary(self, cells: bool = False) -> dict:
        """JSON-able description of the part; `cells=True` adds every cell."""
        out = {
            "name": self.name,
            "kind": self.kind,
            "n_stream": self.n_stream,
            "n_layer": self.n_layer,
            "v_trans": self.v_trans,
            "n_recurrent_layers": self.n_recurrent_layers,
            "cells": self.n_cells,
            "tensor_bytes": self.tensor_bytes,
            "sequences": {str(s): v for s, v in self.sequences().items()},
        }
        if cells:
            out["cell_list"] = [{"stream": s, "pos": p, "seq_ids": list(q)} for s, p, q in self.cells()]
        return out


@dataclass
class ScanReport:
    """What a blob holds and what is wrong with it. `seq -1` stands for a blob's own, unstored sequence id."""

    source: str
    framing: str
    """context, seq, ggsq, ggsq-slot (a llama-server slot file) or ggsn."""
    size: int
    layout: Layout
    parts: list[Part]
    arch: str | None = None
    seq_id: int | None = None
    tokens: int | None = None
    token_ids: list[int] | None = None
    """The token ids a ggsq file caches (a llama-server slot file: the slot's tokens, from its packed blob)."""
    expected_len: dict[int, int] = field(default_factory=dict)
    duplicates: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    """(part, stream, seq_id, pos, count) for every position a sequence holds more than once in a KV part."""
    orphans: list[tuple[str, int, int, int]] = field(default_factory=list)
    """(part, stream, seq_id, pos) for every cell at or past the sequence's expected length."""
    holes: list[tuple[str, int, int, int, int]] = field(default_factory=list)
    """(part, stream, seq_id, first, last): positions first..last missing inside a KV part's range."""
    recurrent_cells_per_seq: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def duplicate_tails(self) -> dict[int, int]:
        """Sequences holding more than one recurrent cell, with their counts."""
        return {s: n for s, n in self.recurrent_cells_per_seq.items() if n > 1}

    @property
    def totals(self) -> dict:
        """Counts over all parts."""
        kv = sum(p.n_cells for p in self.parts if p.kind == "kv")
        rs = sum(p.n_cells for p in self.parts if p.kind == "rs")
        seqs = set(itertools.chain.from_iterable(p.seq_of.tolist() for p in self.parts))
        return {
            "bytes": self.size,
            "tensor_bytes": sum(p.tensor_bytes for p in self.parts),
            "cells": kv + rs,
            "kv_cells": kv,
            "rs_cells": rs,
            "sequences": len(seqs),
            "duplicate_cells": sum(d[4] - 1 for d in self.duplicates),
            "orphans": len(self.orphans),
            "missing_positions": sum(h[4] - h[3] + 1 for h in self.holes),
            "duplicate_tails": len(self.duplicate_tails),
        }

    @property
    def healthy(self) -> bool:
        """No duplicates, orphans, holes or duplicate recurrent tails."""
        return not (self.duplicates or self.orphans or self.holes or self.duplicate_tails)

    @property
    def pos_max(self) -> dict[int, int]:
        """Per sequence, the highest position any part holds for it (a recurrent part: its tail cell's)."""
        out: dict[int, int] = {}
        for part in self.parts:
            for seq, info in part.sequences().items():
                out[seq] = max(out.get(seq, -1), info["pos_max"])
        return out

    def brief(self, limit: int = 5) -> dict:
        """A compact verdict for a Result: healthy, totals, each sequence's highest position and the first few
        problems (the entries of `to_dict`, built straight from the report's lists: this runs after every step
        with `--kv-scan step`)."""
        return {
            "healthy": self.healthy,
            "totals": self.totals,
            "pos_max": {str(s): p for s, p in self.pos_max.items()},
            "duplicates": [
                dict(zip(("part", "stream", "seq_id", "pos", "count"), d, strict=False))
                for d in self.duplicates[:limit]
            ],
            "orphans": [dict(zip(("part", "stream", "seq_id", "pos"), o, strict=False)) for o in self.orphans[:limit]],
            "holes": [
                dict(zip(("part", "stream", "seq_id", "first", "last"), h, strict=False)) for h in self.holes[:limit]
            ],
            "duplicate_tails": {str(s): n for s, n in self.duplicate_tails.items()},
        }

    def to_dict(self, cells: bool = False) -> dict:
        """JSON-able form of the report; `cells=True` lists every cell of every part."""
        return {
            "source": self.source,
            "framing": self.framing,
            "arch": self.arch,
            "seq_id": self.seq_id,
            "tokens": self.tokens,
            "layout": asdict(self.layout),
            "expected_len": {str(s): n for s, n in self.expected_len.items()},
            "parts": [p.summary(cells) for p in self.parts],
            "duplicates": [
                dict(zip(("part", "stream", "seq_id", "pos", "count"), d, strict=False)) for d in self.duplicates
            ],
            "orphans": [dict(zip(("part", "stream", "seq_id", "pos"), o, strict=False)) for o in self.orphans],
            "holes": [dict(zip(("part", "stream", "seq_id", "first", "last"), h, strict=False)) for h in self.holes],
            "recurrent_cells_per_seq": {str(s): n for s, n in self.recurrent_cells_per_seq.items()},
            "duplicate_tails": {str(s): n for s, n in self.duplicate_tails.items()},
            "totals": self.totals,
            "notes": self.notes,
            "healthy": self.healthy,
        }
