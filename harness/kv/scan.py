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
in every KV part, has at most one recurrent cell, and no position at or past its known length."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from harness.errors import HarnessError
from harness.kv.parse import _own_sequence, _parse, _read_framing
from harness.kv.report import Layout, ScanReport
from harness.llama.gguf import read_metadata

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
