"""KV-cache scanner: list the cells of llama.cpp state blobs and files; find duplicates, orphans and holes.

Formats read (see the shared reference ../shared/reference/llama-internals.md §1): whole-context state
(`llama_state_get_data`), per-sequence state
(`llama_state_seq_get_data(_ext)`, any flags), `.ggsq` files (`llama_state_seq_save_file`, also the
llama-server slot files, whose token list is a packed blob), and `.ggsn` session files. Memory classes: plain
KV, iSWA, recurrent, hybrid and hybrid-iSWA. Only the metadata is read; tensor payloads are skipped by the sizes
in their own headers, so scanning a blob costs time in proportion to its cell count, not its byte count.

The blob does not say which memory class wrote it, whether KV cells carry the 12-byte M-RoPE extension, whether
V is stored (MLA) or how many recurrent layers there are. A `Layout` supplies what is known (for instance from
the GGUF, see `layout_from_model`); every unknown is tried, and a parse counts only if it consumes exactly all
bytes. Parses that fit but disagree on the cells are reported as an ambiguity error.

The health rules assume a text model (§2.5): each sequence holds every position of [pos_min, pos_max] once
in every KV part, has at most one recurrent cell, and no position at or past its known length.
"""

from __future__ import annotations

import itertools
import re
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np

from harness.errors import HarnessError
from harness.llama.gguf import read_metadata

SEQ_MAGIC = 0xAF143CD8
GGSQ_MAGIC, GGSN_MAGIC = 0x67677371, 0x6767736E
GGSQ_VERSIONS = {3: False, 4: True}
"""`LLAMA_STATE_SEQ_VERSION` -> whether a KV section's data header carries the K and V rotation sizes after `v_trans`
and the layer count (version 4, llama.cpp b11434 and newer: `n_rot_k`, `n_rot_v`, two u32)."""
GGSN_VERSIONS = {10: False, 11: True}
"""`LLAMA_SESSION_VERSION` -> the same (version 11 came with the same change)."""
SLOT_TOKENS_VERSION = 1
KINDS = ("auto", "context", "seq", "ggsq", "ggsn")


class OtherFormatVersion(HarnessError):
    """A state file whose format version is not the one this scanner reads (written by another llama.cpp)."""


MEMORIES = {
    # memory class: (part names with flags 0, part names with PARTIAL_ONLY), in blob order (§1.4)
    "kv": (("kv",), ("kv",)),
    "iswa": (("kv-base", "kv-swa"), ("kv-swa",)),
    "recurrent": (("rs",), ("rs",)),
    "hybrid": (("kv", "rs"), ("rs",)),
    "hybrid-iswa": (("kv-base", "kv-swa", "rs"), ("kv-swa", "rs")),
}

# Architecture facts from the vendored llama.cpp (llama-model.cpp llama_model_rope_type/create_memory,
# models/*.cpp reading `attention.sliding_window`); recurrent/hybrid come from harness.llama.gguf.kind_of_arch.
_UNSUPPORTED_ARCHS = {"deepseek4", "glm5-next", "qwen4exp", "glm-dsa", "deepseek32", "dots3note", "minimax-m3"}
_MROPE_ARCHS = {"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "qwen3tts"}
_MROPE_IF_SECTIONS_ARCHS = {"bailingmoe3", "glm4", "glm4moe", "hunyuan_vl", "dflash"}
_SWA_ARCHS = {
    "gemma2",
    "gemma3",
    "gemma3n",
    "gemma4",
    "gemma4-assistant",
    "gemma-embedding",
    "cohere2",
    "cohere2moe",
    "exaone4",
    "exaone-moe",
    "olmo2",
    "plamo3",
    "step35",
    "lfm2",
    "openai-moe",
    "afmoe",
    "laguna",
    "granite-swa",
    "mellum",
    "mimo2",
    "smallthinker",
    "maple",
    "spark2-5",
    "muse-glimmer",
}
_RECURRENT_INTERVAL_ARCHS = {"qwen3next", "qwen35", "qwen35moe"}

_MAX_SEQ = 256  # LLAMA_MAX_SEQ
_MAX_LAYERS = 4096
_MAX_ROT = 1 << 14  # a rotation matrix's side: 0 (none) or a power of two up to the head size
_MAX_GGML_TYPE = 64
_ARCH_NAME = re.compile(rb"[A-Za-z0-9_.\-]{1,64}")

_U32 = struct.Struct("<I")
_HEADER3 = struct.Struct("<III")
_TYPE_ROW = struct.Struct("<iQ")
_TYPE_ELEM_N = struct.Struct("<iII")


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


class _Mismatch(Exception):
    """A hypothesis does not fit the bytes at `offset`."""

    def __init__(self, offset: int, reason: str):
        super().__init__(reason)
        self.offset = offset
        self.reason = reason


class _Parser:
    """Reads memory sections of one blob; section parses are memoized because hypotheses share prefixes."""

    def __init__(self, data, kv_rot: bool = False):
        self.data = data
        self.n = len(data)
        self.memo: dict = {}
        self.kv_rot = kv_rot
        """The KV data header carries the rotation sizes (a version-4 state)."""

    def need(self, off: int, size: int, what: str) -> None:
        if off + size > self.n:
            raise _Mismatch(off, f"{what} needs {size} bytes, {self.n - off} left")

    def u32(self, off: int, what: str) -> int:
        self.need(off, 4, what)
        return _U32.unpack_from(self.data, off)[0]

    def meta(self, off: int, count: int, ext: bool, kv: bool):
        """`count` cell records → (pos, cell_of, seq_of, end offset).

        Records are read in runs with the same number of seq ids, each run as one strided numpy view; the
        probe window grows while runs continue, so both long runs and garbage hypotheses stay cheap.
        """
        skip = 3 if ext else 0
        runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        done, window = 0, 64
        while done < count:
            n_seq = self.u32(off + 4, "cell record")
            if n_seq > _MAX_SEQ or (kv and n_seq == 0):
                raise _Mismatch(off, f"cell with {n_seq} sequence ids")
            words = 2 + skip + n_seq
            rows = min(count - done, window, (self.n - off) // (4 * words))
            if rows == 0:
                raise _Mismatch(off, "cell records run past the end")
            rec = np.frombuffer(self.data, dtype="<i4", count=rows * words, offset=off).reshape(rows, words)
            other = np.flatnonzero(rec[:, 1] != n_seq)
            run = int(other[0]) if len(other) else rows
            rec = rec[:run]
            pos, seq_of = rec[:, 0], rec[:, 2 + skip :].reshape(-1)
            if pos.min() < (0 if kv else -1) or (n_seq and not 0 <= seq_of.min() <= seq_of.max() < _MAX_SEQ):
                raise _Mismatch(off, "cell position or sequence id out of range")
            runs.append((pos, np.repeat(np.arange(done, done + run, dtype=np.int32), n_seq), seq_of))
            done, off = done + run, off + 4 * words * run
            window = window * 4 if run == window else 64
        if not runs:
            empty = np.zeros(0, dtype=np.int32)
            return empty, empty, empty, off
        pos, cell_of, seq_of = (np.concatenate(c).astype(np.int32) for c in zip(*runs, strict=False))
        return pos, cell_of, seq_of, off

    def block(self, off: int, cells: int, transposed: bool, dev: bool) -> int:
        """Skip one tensor block (type, row or element header, payload); returns its end offset."""
        if transposed:
            self.need(off, _TYPE_ELEM_N.size, "V block header")
            ggml_type, elem, n_embd = _TYPE_ELEM_N.unpack_from(self.data, off)
            row, off = elem * n_embd, off + _TYPE_ELEM_N.size
        else:
            self.need(off, _TYPE_ROW.size, "tensor block header")
            ggml_type, row = _TYPE_ROW.unpack_from(self.data, off)
            off += _TYPE_ROW.size
        if row == 0 or not 0 <= ggml_type < _MAX_GGML_TYPE:
            raise _Mismatch(off, f"implausible tensor block header (type {ggml_type}, {row} bytes per cell)")
        if dev:
            return off
        self.need(off, row * cells, "tensor data")
        return off + row * cells

    def memoized(self, key: tuple, parse, *args):
        """`parse(*args)`, computed once per key; a mismatch is remembered and raised again."""
        if key not in self.memo:
            try:
                self.memo[key] = parse(*args)
            except _Mismatch as err:
                self.memo[key] = err
        hit = self.memo[key]
        if isinstance(hit, _Mismatch):
            raise hit
        return hit

    def kv(self, off: int, ext: bool, mla: bool, dev: bool) -> tuple[Part, int]:
        """A KV section (§1.5) → (Part, end offset)."""
        return self.memoized(("kv", off, ext, mla, dev), self._kv, off, ext, mla, dev)

    def _kv(self, off: int, ext: bool, mla: bool, dev: bool) -> tuple[Part, int]:
        n_stream = self.u32(off, "stream count")
        if not 1 <= n_stream <= _MAX_SEQ:
            raise _Mismatch(off, f"stream count {n_stream}")
        off += 4
        header, tensor_bytes, n_before = None, 0, 0
        cols: list[list[np.ndarray]] = [[], [], [], []]
        for s in range(n_stream):
            count = self.u32(off, "cell count")
            off += 4
            if count == 0:
                continue
            pos, cell_of, seq_of, off = self.meta(off, count, ext, kv=True)
            v_trans, n_layer = self.u32(off, "v_trans"), self.u32(off + 4, "layer count")
            if v_trans > 1 or not 1 <= n_layer <= _MAX_LAYERS or header not in (None, (v_trans, n_layer)):
                raise _Mismatch(off, f"implausible KV data header (v_trans {v_trans}, {n_layer} layers)")
            off += 8
            if self.kv_rot:
                n_rot_k, n_rot_v = self.u32(off, "n_rot_k"), self.u32(off + 4, "n_rot_v")
                if any(n & (n - 1) or n > _MAX_ROT for n in (n_rot_k, n_rot_v)):
                    raise _Mismatch(off, f"implausible KV rotation sizes ({n_rot_k}, {n_rot_v})")
                off += 8
            header, start = (v_trans, n_layer), off
            for _ in range(n_layer):
                off = self.block(off, count, False, dev)
            for _ in range(0 if mla else n_layer):
                off = self.block(off, count, v_trans == 1, dev)
            tensor_bytes += off - start
            for col, arr in zip(cols, (np.full(count, s, np.int32), pos, cell_of + n_before, seq_of), strict=False):
                col.append(arr)
            n_before += count
        stream, pos, cell_of, seq_of = (np.concatenate(c) if c else np.zeros(0, np.int32) for c in cols)
        v_trans, n_layer = header or (None, 0)
        return Part("", "kv", n_stream, n_layer, v_trans, None, stream, pos, cell_of, seq_of, tensor_bytes), off

    def rs(self, off: int, n_recurrent: int | None, dev: bool) -> list[tuple[Part, int]]:
        """A recurrent section (§1.6) → (Part, end offset) for every recurrent-layer count that fits."""
        part, data_off = self.memoized(("rs", off), self._rs_head, off)
        ends = self.memoized(("rs-blocks", data_off, dev), self._block_ends, data_off, part, dev)
        counts = [n_recurrent] if n_recurrent else range(1, part.n_layer + 1)
        fits = [
            (replace(part, n_recurrent_layers=k, tensor_bytes=ends[2 * k - 1] - data_off), ends[2 * k - 1])
            for k in counts
            if 2 * k <= len(ends)
        ]
        if not fits:
            raise _Mismatch(data_off, f"fewer than {2 * min(counts, default=1)} recurrent tensor blocks")
        return fits

    def _rs_head(self, off: int) -> tuple[Part, int]:
        count = self.u32(off, "recurrent cell count")
        pos, cell_of, seq_of, off = self.meta(off + 4, count, False, kv=False)
        s_trans, n_layer = self.u32(off, "s_trans"), self.u32(off + 4, "layer count")
        if s_trans != 0 or not 1 <= n_layer <= _MAX_LAYERS:
            raise _Mismatch(off, f"implausible recurrent data header (s_trans {s_trans}, {n_layer} layers)")
        part = Part("", "rs", 1, n_layer, None, None, np.zeros(count, np.int32), pos, cell_of, seq_of, 0)
        return part, off + 8

    def _block_ends(self, off: int, part: Part, dev: bool) -> list[int]:
        """End offsets of the consecutive R/S blocks (at most two per layer) that parse."""
        ends = []
        try:
            while len(ends) < 2 * part.n_layer:
                off = self.block(off, part.n_cells, False, dev)
                ends.append(off)
        except _Mismatch:
            pass
        return ends


def _chain(p: _Parser, off: int, names: tuple[str, ...], hyp: Layout) -> list[Part]:
    """Parse the sections `names` from `off`; the last one must end exactly at the end of the blob."""
    if not names:
        if off != p.n:
            raise _Mismatch(off, f"{p.n - off} bytes left over")
        return []
    name, rest = names[0], names[1:]
    if name.startswith("kv"):
        part, end = p.kv(off, bool(hyp.cell_ext), bool(hyp.mla), bool(hyp.on_device))
        return [replace(part, name=name), *_chain(p, end, rest, hyp)]
    best = None
    for part, end in p.rs(off, hyp.n_recurrent_layers, bool(hyp.on_device)):
        try:
            return [replace(part, name=name), *_chain(p, end, rest, hyp)]
        except _Mismatch as err:
            best = err if best is None or err.offset > best.offset else best
    raise best


def _arch_at(data, off: int) -> tuple[str, int] | None:
    """The arch-name string at `off` as (name, end offset), or None if there is none."""
    if off + 4 > len(data):
        return None
    length = _U32.unpack_from(data, off)[0]
    raw = bytes(data[off + 4 : off + 4 + min(length, 65)])
    if len(raw) != length or not _ARCH_NAME.fullmatch(raw):
        return None
    return raw.decode(), off + 4 + length


@dataclass
class _Framing:
    framing: str
    body: int
    arch: str | None = None
    seq_id: int | None = None
    tokens: int | None = None
    token_ids: list[int] | None = None
    kv_rot: bool = False
    """A version-4 state (GGSQ_VERSIONS): the KV data header carries the rotation sizes."""


def _read_framing(data, kind: str, name: str) -> _Framing:
    """Identify the container (magic, version, token list, arch string) and where the memory section starts."""
    if kind not in KINDS:
        raise HarnessError(f"unknown blob kind '{kind}' (use one of: {', '.join(KINDS)})")
    size = len(data)
    if size < 4:
        raise HarnessError(f"{name}: {size} bytes is too short for a llama.cpp state")
    magic = _U32.unpack_from(data, 0)[0]
    found = {SEQ_MAGIC: "seq", GGSQ_MAGIC: "ggsq", GGSN_MAGIC: "ggsn"}.get(magic)
    if found is None and _arch_at(data, 0):
        found = "context"
    if found is None:
        raise HarnessError(
            f"{name}: unknown magic 0x{magic:08X} (not a llama.cpp seq blob 0x{SEQ_MAGIC:08X}, "
            f"'ggsq' or 'ggsn' file, or whole-context state starting with an arch name)"
        )
    if kind not in ("auto", found):
        raise HarnessError(f"{name}: expected a {kind} state, found a {found} state (magic 0x{magic:08X})")
    if found == "context":
        arch, body = _arch_at(data, 0)
        return _Framing("context", body, arch=arch)
    if found == "seq":
        if size < 8:
            raise HarnessError(f"{name}: truncated seq blob header ({size} of 8 bytes)")
        return _Framing("seq", 8, seq_id=struct.unpack_from("<i", data, 4)[0])
    if size < 12:
        raise HarnessError(f"{name}: truncated {found} header ({size} of 12 bytes)")
    _, version, n_tokens = _HEADER3.unpack_from(data, 0)
    versions = GGSQ_VERSIONS if found == "ggsq" else GGSN_VERSIONS
    if version not in versions:
        known = " and ".join(map(str, versions))
        raise OtherFormatVersion(f"{name}: {found} version {version}; this scanner reads versions {known}")
    kv_rot = versions[version]
    body = 12 + 4 * n_tokens
    if body > size:
        raise HarnessError(f"{name}: truncated: header announces {n_tokens} tokens, file has {size} bytes")
    if found == "ggsn":
        arch = _arch_at(data, body)
        if arch is None:
            raise HarnessError(f"{name}: no architecture name after the {n_tokens} session tokens")
        return _Framing("ggsn", arch[1], arch=arch[0], tokens=n_tokens, kv_rot=kv_rot)
    words = np.frombuffer(data, dtype="<u4", count=n_tokens, offset=12)
    if n_tokens == 0 or words[0] != 0xFFFFFFFF:
        return _Framing("ggsq", body, tokens=n_tokens, token_ids=words.astype(np.int32).tolist(), kv_rot=kv_rot)
    if n_tokens < 3 or words[1] != SLOT_TOKENS_VERSION or 3 + int(words[2]) > n_tokens:
        raise OtherFormatVersion(
            f"{name}: llama-server slot token blob with version {words[1] if n_tokens > 1 else '?'} "
            f"or bad length; this scanner reads version {SLOT_TOKENS_VERSION}"
        )
    n_slot_tokens = int(words[2])
    ids = words[3 : 3 + n_slot_tokens].astype(np.int32).tolist()
    return _Framing("ggsq-slot", body, tokens=n_slot_tokens, token_ids=ids, kv_rot=kv_rot)


def _hypotheses(layout: Layout, framing: str, name: str) -> list[Layout]:
    """Every complete layout compatible with the hint (flags exist only for seq blobs)."""
    seq = framing == "seq"
    if not seq and (layout.partial_only or layout.on_device):
        raise HarnessError(f"{name}: PARTIAL_ONLY / ON_DEVICE apply to seq blobs, not to a {framing} state")

    def options(value, choices):
        return [value] if value is not None else choices

    return [
        Layout(memory, ext, mla, layout.n_recurrent_layers, partial, dev)
        for memory, partial, dev, ext, mla in itertools.product(
            options(layout.memory, list(MEMORIES)),
            options(layout.partial_only, [False, True] if seq else [False]),
            options(layout.on_device, [False, True] if seq else [False]),
            options(layout.cell_ext, [False, True]),
            options(layout.mla, [False, True]),
        )
    ]


def _cells_signature(parts: list[Part]) -> tuple:
    return tuple((q.kind, q.stream.tobytes(), q.pos.tobytes(), q.cell_of.tobytes(), q.seq_of.tobytes()) for q in parts)


def _parse(data, fr: _Framing, layout: Layout, name: str) -> tuple[Layout, list[Part], list[str]]:
    """Try every hypothesis; keep the parse that consumes exactly all bytes → (agreed layout, parts, notes)."""
    parser = _Parser(data, fr.kv_rot)
    fits, furthest = [], None
    for hyp in _hypotheses(layout, fr.framing, name):
        names = MEMORIES[hyp.memory][1 if hyp.partial_only else 0]
        try:
            parts = _chain(parser, fr.body, names, hyp)
        except _Mismatch as err:
            furthest = err if furthest is None or err.offset > furthest.offset else furthest
            continue
        rs = [q.n_recurrent_layers for q in parts if q.kind == "rs"]
        fits.append((replace(hyp, n_recurrent_layers=rs[0] if rs else None), parts))
    hint = f" with {layout.describe()}" if layout != Layout() else ""
    if not fits:
        raise HarnessError(
            f"{name}: no {fr.framing} layout{hint} consumes exactly its {len(data)} bytes; the "
            f"furthest parse stopped at byte {furthest.offset}: {furthest.reason} (truncated, or "
            f"a memory format this scanner does not know)"
        )
    distinct = {}
    for hyp, parts in fits:
        distinct.setdefault(_cells_signature(parts), hyp)
    if len(distinct) > 1:
        raise HarnessError(
            f"{name}: ambiguous: {len(distinct)} layouts fit all {len(data)} bytes with different "
            f"cells ({'; '.join(h.describe() for h in distinct.values())}); give the model"
        )
    agreed = {f.name: {getattr(h, f.name) for h, _ in fits} for f in fields(Layout)}
    chosen = Layout(**{k: next(iter(v)) if len(v) == 1 else None for k, v in agreed.items()})
    notes = []
    if chosen.memory is None:
        notes.append(
            f"memory class undetermined ({', '.join(sorted(agreed['memory']))}); part names follow {fits[0][0].memory}"
        )
    return chosen, fits[0][1], notes


def _own_sequence(parts: list[Part], fr: _Framing) -> int:
    """The sequence a single-sequence blob belongs to: from its header, else from its KV cells, else -1."""
    if fr.seq_id is not None:
        return fr.seq_id
    seqs = np.unique(np.concatenate([q.seq_of for q in parts if q.kind == "kv"] or [np.zeros(0, np.int32)]))
    return int(seqs[0]) if len(seqs) == 1 else -1


def _analyse(report: ScanReport) -> None:
    """Fill duplicates, holes, orphans and recurrent cell counts from the parts."""
    for part in report.parts:
        stream = part.stream[part.cell_of].astype(np.int64)
        pos = part.pos[part.cell_of].astype(np.int64)
        seq = part.seq_of.astype(np.int64)
        if part.kind == "rs":
            for s, n in zip(*np.unique(seq, return_counts=True), strict=False):
                report.recurrent_cells_per_seq[int(s)] = report.recurrent_cells_per_seq.get(int(s), 0) + int(n)
        else:
            keys, counts = np.unique(((stream * 512 + seq + 1) << 32) | pos, return_counts=True)
            group, kpos = keys >> 32, keys & 0xFFFFFFFF
            kstream, kseq = group // 512, group % 512 - 1
            for i in np.nonzero(counts > 1)[0]:
                report.duplicates.append((part.name, int(kstream[i]), int(kseq[i]), int(kpos[i]), int(counts[i])))
            for i in np.nonzero((group[1:] == group[:-1]) & (kpos[1:] - kpos[:-1] > 1))[0]:
                report.holes.append((part.name, int(kstream[i]), int(kseq[i]), int(kpos[i]) + 1, int(kpos[i + 1]) - 1))
        for s, length in report.expected_len.items():
            for i in np.nonzero((seq == s) & (pos >= length))[0]:
                report.orphans.append((part.name, int(stream[i]), s, int(pos[i])))


def scan_bytes(
    data,
    kind: str = "auto",
    layout: Layout | None = None,
    expected_len: dict[int, int] | None = None,
    name: str = "state blob",
) -> ScanReport:
    """Parse a state blob or file image and check its cells; `expected_len` maps seq id → cached token count."""
    fr = _read_framing(data, kind, name)
    chosen, parts, notes = _parse(data, fr, layout or Layout(), name)
    if fr.framing in ("seq", "ggsq", "ggsq-slot"):
        own = _own_sequence(parts, fr)
        parts = [
            replace(q, cell_of=np.arange(q.n_cells, dtype=np.int32), seq_of=np.full(q.n_cells, own, np.int32))
            if q.kind == "rs" and len(q.seq_of) == 0
            else q
            for q in parts
        ]
    if expected_len is None and fr.tokens is not None and fr.framing in ("ggsq", "ggsq-slot"):
        expected_len = {_own_sequence(parts, fr): fr.tokens}  # a file says how many tokens it caches
    report = ScanReport(
        name,
        fr.framing,
        len(data),
        chosen,
        parts,
        arch=fr.arch,
        seq_id=fr.seq_id,
        tokens=fr.tokens,
        token_ids=fr.token_ids,
        expected_len=dict(expected_len or {}),
        notes=notes,
    )
    _analyse(report)
    return report


def scan_file(
    path: Path,
    model: Path | None = None,
    kind: str = "auto",
    layout: Layout | None = None,
    expected_len: dict[int, int] | None = None,
) -> ScanReport:
    """`scan_bytes` on a file; `model` (a GGUF) supplies the layout facts the blob does not store."""
    path = Path(path)
    if model is not None and layout is not None:
        raise HarnessError("give either a model or a layout, not both")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise HarnessError(f"{path}: cannot read ({err.strerror})") from None
    if model is not None:
        layout = layout_from_model(model)
    return scan_bytes(data, kind, layout, expected_len, name=str(path))


def damaged(brief: dict | None) -> bool:
    """Whether a request's scan verdict (`ScanReport.brief`; the in-process engine adds the draft model's context
    under `draft`) found damage in the target's cache or in the draft context."""
    return bool(brief) and not (brief.get("healthy", True) and (brief.get("draft") or {}).get("healthy", True))


def layout_from_model(model: Path) -> Layout:
    """The layout facts of a GGUF model (memory class, cell ext, MLA, recurrent layer count) from its metadata."""
    from harness.llama.gguf import kind_of_arch

    try:
        meta = read_metadata(model)
    except (OSError, ValueError) as err:
        raise HarnessError(f"{model}: cannot read GGUF metadata ({err})") from None
    get = meta.get
    arch = get("general.architecture")
    if arch is None:
        raise HarnessError(f"{model}: no general.architecture in the GGUF metadata")
    if arch in _UNSUPPORTED_ARCHS:
        raise HarnessError(f"{model}: the memory format of arch '{arch}' is not supported by the KV scanner")
    n_layer = get(f"{arch}.block_count", 0) - get(f"{arch}.nextn_predict_layers", 0)
    sections = get(f"{arch}.rope.dimension_sections") or [0, 0]
    cell_ext = arch in _MROPE_ARCHS or (arch in _MROPE_IF_SECTIONS_ARCHS and sections[0] > 0 and sections[1] > 0)
    window = get(f"{arch}.attention.sliding_window")
    swa = (window or 0) > 0 if arch in _SWA_ARCHS else (arch == "llama4" and window != 0)
    mla = bool(get(f"{arch}.attention.key_length_mla")) and bool(get(f"{arch}.attention.value_length_mla"))
    n_recurrent, kind = None, kind_of_arch(arch)
    if kind == "recurrent":
        memory, n_recurrent = "recurrent", n_layer
    elif kind == "hybrid":
        memory = "hybrid-iswa" if swa else "hybrid"
        if arch == "falcon-h1":
            n_recurrent = n_layer
        elif arch in _RECURRENT_INTERVAL_ARCHS:
            flags = get(f"{arch}.attention.recurrent_layers")
            interval = get(f"{arch}.full_attention_interval", 4)
            if flags is None:
                flags = [(i + 1) % interval != 0 for i in range(n_layer)]
            n_recurrent = sum(map(bool, flags[:n_layer])) if isinstance(flags, list) else n_layer * bool(flags)
    else:
        memory = "iswa" if swa else "kv"
    return Layout(memory=memory, cell_ext=cell_ext, mla=mla, n_recurrent_layers=n_recurrent)
