"""GGUF facts with no model registry (and no llama.cpp build) behind them, for the KV scanner and the registry:

- `read_metadata`: a GGUF file's metadata without loading tensors or building the vocabulary in Python
  (gguf.GGUFReader turns every vocabulary entry into Python objects: seconds per tiny model, tens of seconds for
  Gemma 3's 262k tokens; this walks the key/value header of a memory-mapped file only);
- `read_fields`: some keys whole (the tokenizer's, which the model generator copies), with their GGUF types;
- `kind_of_arch`: llama.cpp's memory kind of an architecture (dense, hybrid, recurrent).
"""

import functools
import mmap
import os
import struct
from pathlib import Path

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_U32 = struct.Struct("<I")


def read_metadata(path: Path) -> dict:
    """A GGUF file's key/values: scalars, strings and short numeric arrays (long or string arrays are None).
    Read once per file version (path, size, modification time); the caller gets its own copy.

    Raises ValueError for a file that is not GGUF or whose header is cut short."""
    stat = os.stat(path)
    return dict(_read_metadata(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _read_metadata(path: str, size: int, mtime_ns: int) -> dict:
    return {key: value for key, value, _, _ in _entries(path, whole=None)}


def read_fields(path: Path, prefix: str) -> tuple[tuple[str, object, int, int | None], ...]:
    """The key/values of a GGUF file whose key starts with `prefix`, whole (long and string arrays included), as
    (key, value, GGUF value type, array element type or None): the values and types `gguf.GGUFReader`'s
    `field.contents()` and `field.types` give, without building the reader's array views of every entry (over a
    second for a 32000-token vocabulary). Raises ValueError for a file that is not GGUF or is cut short."""
    return tuple(entry for entry in _entries(path, whole=prefix) if entry[0].startswith(prefix))


def _entries(path: str | Path, whole: str | None) -> list[tuple[str, object, int, int | None]]:
    """Every header key/value of a memory-mapped GGUF file, in order, as (key, value, type, array element type or
    None): the values of keys starting with `whole` read whole (`_whole`), the others as `_value` reads them."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        try:
            n_kv = struct.unpack_from("<Q", buf, 16)[0]
            off, out = 24, []
            for _ in range(n_kv):
                key, off = _value(buf, off, _GGUF_STRING)
                vtype = _U32.unpack_from(buf, off)[0]
                etype = _U32.unpack_from(buf, off + 4)[0] if vtype == _GGUF_ARRAY else None
                read = _whole if whole is not None and key.startswith(whole) else _value
                value, off = read(buf, off + 4, vtype)
                out.append((key, value, vtype, etype))
        except struct.error as err:
            raise ValueError(f"truncated GGUF header ({err})") from err
    return out


def _whole(buf, off: int, vtype: int):
    """(value, end offset) of one GGUF value, arrays whole; strings decoded strictly, as gguf.GGUFReader does."""
    if vtype == _GGUF_STRING:
        length = struct.unpack_from("<Q", buf, off)[0]
        return bytes(buf[off + 8 : off + 8 + length]).decode("utf-8"), off + 8 + length
    if vtype != _GGUF_ARRAY:
        return _value(buf, off, vtype)
    etype, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype in _GGUF_SCALARS:
        code = _GGUF_SCALARS[etype]
        return list(struct.unpack_from(f"<{count}{code}", buf, off)), off + count * struct.calcsize(code)
    items = []
    for _ in range(count):
        item, off = _whole(buf, off, etype)
        items.append(item)
    return items, off


def _value(buf, off: int, vtype: int):
    """(value or None when skipped, end offset) of one GGUF value of type `vtype` at `off`."""
    if vtype in _GGUF_SCALARS:
        code = struct.Struct("<" + _GGUF_SCALARS[vtype])
        return code.unpack_from(buf, off)[0], off + code.size
    if vtype == _GGUF_STRING:
        length = struct.unpack_from("<Q", buf, off)[0]
        return bytes(buf[off + 8 : off + 8 + length]).decode("utf-8", "replace"), off + 8 + length
    if vtype != _GGUF_ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype} at byte {off}")
    etype, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if etype in _GGUF_SCALARS:
        code = _GGUF_SCALARS[etype]
        end = off + count * struct.calcsize(code)
        return (list(struct.unpack_from(f"<{count}{code}", buf, off)) if count <= 4096 else None), end
    for _ in range(count):
        if etype == _GGUF_STRING:
            off += 8 + struct.unpack_from("<Q", buf, off)[0]
        else:
            off = _value(buf, off, etype)[1]
    return None, off


# Mirrors llm_arch_is_recurrent / llm_arch_is_hybrid in llama.cpp's src/llama-arch.cpp.
_RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
_HYBRID_ARCHS = frozenset(
    {
        "jamba",
        "falcon-h1",
        "plamo2",
        "granitehybrid",
        "lfm2",
        "lfm2moe",
        "nemotron_h",
        "nemotron_h_moe",
        "qwen3next",
        "kimi-linear",
        "bailingmoe3",
        "kimi-k3",
        "glm5-next",
        "qwen35",
        "qwen35moe",
        "qwen4exp",
        "deepseek4",
        "minimax-01",
    }
)


def kind_of_arch(arch: str) -> str:
    """llama.cpp's memory kind of an architecture: "recurrent", "hybrid" or "dense"."""
    if arch in _RECURRENT_ARCHS:
        return "recurrent"
    return "hybrid" if arch in _HYBRID_ARCHS else "dense"
