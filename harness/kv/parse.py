"""Reading a state blob's bytes: its framing (whole-context state, a sequence's state, a slot or session file),
then the KV and recurrent sections of each hypothesis of its layout; a parse counts only if it consumes exactly
all bytes."""

from __future__ import annotations

import itertools
import re
import struct
from dataclasses import dataclass, fields, replace

import numpy as np

from harness.errors import HarnessError
from harness.kv.report import MEMORIES, Layout, Part

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


_MAX_SEQ = 256  # LLAMA_MAX_SEQ
_MAX_LAYERS = 4096
_MAX_ROT = 1 << 14  # a rotation matrix's side: 0 (none) or a power of two up to the head size
_MAX_GGML_TYPE = 64
_ARCH_NAME = re.compile(rb"[A-Za-z0-9_.\-]{1,64}")

_U32 = struct.Struct("<I")
_HEADER3 = struct.Struct("<III")
_TYPE_ROW = struct.Struct("<iQ")
_TYPE_ELEM_N = struct.Struct("<iII")


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
