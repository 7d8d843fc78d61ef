"""The KV scanner on real state blobs written by llama.cpp for the tiny models (and Gemma 3 270M when installed)."""

import ctypes
import json
import struct

import llama_cpp
import pytest
from skips import require_model

from harness import cli
from harness.backends.base import default_repack
from harness.engine.logging import set_llama_verbose
from harness.errors import HarnessError
from harness.kv.scan import Layout, layout_from_model, scan_bytes, scan_file

PARTIAL_ONLY = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
ON_DEVICE = llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
FLASH_OFF, FLASH_AUTO = 0, -1


class Blobs:
    """A raw llama.cpp context on a model: decodes hand-positioned batches and returns real state blobs."""

    def __init__(self, model, path, n_seq=2, unified=True, flash=FLASH_AUTO, n_ctx=256):
        self.path = path
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = n_seq
        params.kv_unified = unified
        params.flash_attn_type = flash
        params.n_threads = params.n_threads_batch = 1
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        assert self.ctx, "llama.cpp could not create the context"
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, n_seq)

    def decode(self, seq, positions):
        """Decode token 10+pos at each position for `seq` (one batch, last row outputs)."""
        b = self.batch
        for i, pos in enumerate(positions):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = 10 + pos, pos, 1, i == len(positions) - 1
            b.seq_id[i][0] = seq
        b.n_tokens = len(positions)
        assert llama_cpp.llama_decode(self.ctx, b) == 0

    def state(self):
        size = llama_cpp.llama_state_get_size(self.ctx)
        buf = (ctypes.c_uint8 * size)()
        return bytes(buf[: llama_cpp.llama_state_get_data(self.ctx, buf, size)])

    def seq_state(self, seq, flags=0):
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        buf = (ctypes.c_uint8 * size)()
        return bytes(buf[: llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, flags)])

    def save_seq_file(self, path, seq, words):
        arr = (llama_cpp.llama_token * len(words))(*words)
        assert llama_cpp.llama_state_seq_save_file(self.ctx, str(path).encode(), seq, arr, len(words)) > 0
        return path

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


@pytest.fixture(scope="module")
def load():
    """name → loaded llama_model pointer, each model loaded once for the module."""
    set_llama_verbose(False)
    llama_cpp.llama_backend_init()
    loaded = {}

    def get(name):
        if name not in loaded:
            path = require_model(name).path  # a skip only when the model is unavailable, not on any harness error
            params = llama_cpp.llama_model_default_params()
            params.use_extra_bufts = default_repack()  # off on a CPU whose AMX path crashes (known failure)
            loaded[name] = (llama_cpp.llama_model_load_from_file(str(path).encode(), params), path)
            assert loaded[name][0], f"could not load {path}"
        return loaded[name]

    yield get
    for model, _ in loaded.values():
        llama_cpp.llama_model_free(model)


@pytest.fixture
def blobs(load):
    """Factory: a Blobs context on a named model, freed after the test."""
    made = []

    def make(name, **kw):
        made.append(Blobs(*load(name), **kw))
        return made[-1]

    yield make
    for b in made:
        b.close()


def seqs(part):
    return {s: (v["cells"], v["pos_min"], v["pos_max"]) for s, v in part.sequences().items()}


@pytest.mark.parametrize("unified", (True, False))
@pytest.mark.parametrize("flash,v_trans", ((FLASH_OFF, 1), (FLASH_AUTO, 0)))
def test_dense_whole_context_two_sequences(blobs, unified, flash, v_trans):
    b = blobs("tiny-dense", unified=unified, flash=flash)
    b.decode(0, range(10))
    b.decode(1, range(7))
    for layout in (None, layout_from_model(b.path)):
        r = scan_bytes(b.state(), layout=layout, expected_len={0: 10, 1: 7})
        assert (r.framing, r.arch, [p.name for p in r.parts]) == ("context", "llama", ["kv"])
        kv = r.parts[0]
        assert (kv.n_stream, kv.v_trans) == (1 if unified else 2, v_trans)
        assert seqs(kv) == {0: (10, 0, 9), 1: (7, 0, 6)}
        assert set(kv.stream.tolist()) == ({0} if unified else {0, 1})
        assert r.totals["cells"] == 17 and r.healthy


@pytest.mark.parametrize("unified", (True, False))
def test_dense_seq_blob_and_ggsq_file(blobs, tmp_path, unified):
    b = blobs("tiny-dense", unified=unified)
    b.decode(0, range(4))
    b.decode(1, range(7))
    r = scan_bytes(b.seq_state(1), layout=layout_from_model(b.path))
    assert (r.framing, r.seq_id, r.layout.memory, r.layout.cell_ext) == ("seq", 1, "kv", False)
    assert seqs(r.parts[0]) == {1: (7, 0, 6)} and r.healthy
    assert (r.parts[0].n_stream, set(r.parts[0].stream.tolist())) == ((1, {0}) if unified else (2, {1}))
    path = b.save_seq_file(tmp_path / "s1.ggsq", 1, [10 + i for i in range(7)])
    r = scan_file(path, model=b.path, expected_len={1: 7})
    assert (r.framing, r.tokens, r.seq_id) == ("ggsq", 7, None)
    assert seqs(r.parts[0]) == {1: (7, 0, 6)} and r.healthy


def test_slot_file_and_session_file(blobs, tmp_path):
    b = blobs("tiny-dense", n_seq=1)
    b.decode(0, range(5))
    tokens = [10 + i for i in range(5)]
    packed = [-1, 1, len(tokens), *tokens, 0]  # llama-server's server_tokens::serialize layout (§1.8)
    r = scan_file(b.save_seq_file(tmp_path / "slot0.bin", 0, packed))
    assert (r.framing, r.tokens) == ("ggsq-slot", 5)
    assert seqs(r.parts[0]) == {0: (5, 0, 4)}
    session = tmp_path / "session.ggsn"
    arr = (llama_cpp.llama_token * 5)(*tokens)
    assert llama_cpp.llama_state_save_file(b.ctx, str(session).encode(), arr, 5)
    r = scan_file(session)
    assert (r.framing, r.arch, r.tokens) == ("ggsn", "llama", 5)
    assert seqs(r.parts[0]) == {0: (5, 0, 4)}


def test_duplicate_from_batch_repeating_a_position(blobs, tmp_path, capsys):
    b = blobs("tiny-dense")
    b.decode(0, [0, 1, 2, 3, 3, 4])  # accepted silently by llama_decode (§2.4 item 1)
    for data in (b.seq_state(0), b.state()):
        r = scan_bytes(data)
        assert r.duplicates == [("kv", 0, 0, 3, 2)]
        assert not r.healthy and r.totals["duplicate_cells"] == 1
    path = tmp_path / "dup.bin"
    path.write_bytes(b.seq_state(0))
    assert cli.main(["scan", str(path)]) == 1
    assert "duplicate: kv stream 0 seq 0 pos 3 x2" in capsys.readouterr().out
    assert cli.main(["scan", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["duplicates"] == [{"part": "kv", "stream": 0, "seq_id": 0, "pos": 3, "count": 2}]


def test_duplicate_from_seq_cp_into_non_empty_destination(blobs):
    b = blobs("tiny-dense")
    b.decode(0, range(8))
    b.decode(1, range(5))
    llama_cpp.llama_memory_seq_cp(b.memory, 0, 1, 0, 5)
    r = scan_bytes(b.state())
    assert r.duplicates == [("kv", 0, 1, p, 2) for p in range(5)]
    assert seqs(r.parts[0])[0] == (8, 0, 7)


def test_duplicate_from_seq_add_onto_occupied_range(blobs):
    b = blobs("tiny-dense")
    b.decode(0, range(8))
    llama_cpp.llama_memory_seq_add(b.memory, 0, 6, -1, -2)  # 6, 7 → 4, 5 without removing 4, 5
    r = scan_bytes(b.seq_state(0))
    assert r.duplicates == [("kv", 0, 0, 4, 2), ("kv", 0, 0, 5, 2)]


def test_orphans_and_holes(blobs, tmp_path, capsys):
    b = blobs("tiny-dense")
    b.decode(0, range(10))
    path = tmp_path / "s0.bin"
    path.write_bytes(b.seq_state(0))
    r = scan_file(path, expected_len={0: 8})
    assert r.orphans == [("kv", 0, 0, 8), ("kv", 0, 0, 9)] and not r.healthy
    assert cli.main(["scan", str(path), "--expect", "0=8", "--model", "tiny-dense"]) == 1
    assert "orphan: kv stream 0 seq 0 pos 9 (expected < 8)" in capsys.readouterr().out
    assert cli.main(["scan", str(path), "--expect", "0=10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["healthy"]
    assert cli.main(["scan", str(path), "--expect", "zero=8"]) == 2
    assert llama_cpp.llama_memory_seq_rm(b.memory, 0, 3, 5)
    r = scan_bytes(b.seq_state(0))
    assert r.holes == [("kv", 0, 0, 3, 4)] and r.totals["missing_positions"] == 2 and not r.healthy


@pytest.mark.parametrize("slot_file", (False, True))
def test_scan_command_uses_a_sequence_files_own_token_count(blobs, tmp_path, capsys, slot_file):
    """Cells past a file's token list are the leak of llama.cpp PR #20925: without --expect the command
    takes the file's own count (a .ggsq file, or a llama-server slot file with its packed token list)."""
    b = blobs("tiny-dense")
    b.decode(0, range(12))
    tokens = [10 + i for i in range(7)]
    words = [-1, 1, len(tokens), *tokens, 0] if slot_file else tokens
    path = b.save_seq_file(tmp_path / "leak.ggsq", 0, words)
    assert cli.main(["scan", str(path)]) == 1
    out = capsys.readouterr().out
    assert [f"pos {p} (expected < 7)" in out for p in range(7, 12)] == [True] * 5
    assert cli.main(["scan", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["totals"]["orphans"] == 5
    assert cli.main(["scan", str(path), "--expect", "0=12"]) == 0  # --expect overrides the file's count


def test_hybrid_seq_blobs_and_whole_context(blobs, tmp_path):
    b = blobs("tiny-hybrid")
    b.decode(0, range(9))
    b.decode(1, range(4))
    hint = layout_from_model(b.path)
    assert (hint.memory, hint.cell_ext) == ("hybrid", True) and hint.n_recurrent_layers >= 1
    full = scan_bytes(b.seq_state(0))
    assert [p.name for p in full.parts] == ["kv", "rs"]
    assert full.layout.cell_ext is True and full.layout.n_recurrent_layers == hint.n_recurrent_layers
    assert seqs(full.parts[0]) == {0: (9, 0, 8)} and seqs(full.parts[1]) == {0: (1, 8, 8)}
    assert full.recurrent_cells_per_seq == {0: 1} and full.healthy
    partial = scan_bytes(b.seq_state(0, PARTIAL_ONLY), layout=hint)
    assert [p.name for p in partial.parts] == ["rs"] and partial.layout.partial_only is True
    assert partial.recurrent_cells_per_seq == {0: 1}
    whole = scan_bytes(b.state(), layout=hint, expected_len={0: 9, 1: 4})
    assert [p.name for p in whole.parts] == ["kv", "rs"] and whole.arch == "qwen35"
    assert whole.recurrent_cells_per_seq == {0: 1, 1: 1} and whole.healthy
    assert seqs(whole.parts[1]) == {0: (1, 8, 8), 1: (1, 3, 3)}
    r = scan_file(b.save_seq_file(tmp_path / "h.ggsq", 1, [10, 11, 12, 13]), model=b.path)
    assert r.recurrent_cells_per_seq == {1: 1} and seqs(r.parts[0]) == {1: (4, 0, 3)}


@pytest.mark.parametrize("name", ("tiny-dense", "tiny-hybrid"))
def test_on_device_blob_lists_the_same_cells_without_tensor_data(blobs, name):
    b = blobs(name)
    b.decode(0, range(6))
    host, device = scan_bytes(b.seq_state(0)), scan_bytes(b.seq_state(0, ON_DEVICE))
    assert (host.layout.on_device, device.layout.on_device) == (False, True)
    assert [seqs(p) for p in device.parts] == [seqs(p) for p in host.parts]
    assert device.size < host.size


def test_recurrent_state_only(blobs, tmp_path):
    b = blobs("tiny-recurrent")
    b.decode(0, range(6))
    b.decode(1, range(3))
    hint = layout_from_model(b.path)
    assert hint.memory == "recurrent"
    r = scan_bytes(b.seq_state(1))
    assert [p.name for p in r.parts] == ["rs"] and r.layout.n_recurrent_layers == hint.n_recurrent_layers
    assert seqs(r.parts[0]) == {1: (1, 2, 2)} and r.healthy
    whole = scan_bytes(b.state(), expected_len={0: 5})
    assert whole.recurrent_cells_per_seq == {0: 1, 1: 1}
    assert whole.orphans == [("rs", 0, 0, 5)]
    r = scan_file(b.save_seq_file(tmp_path / "r.ggsq", 0, list(range(6))))
    assert r.recurrent_cells_per_seq == {-1: 1}  # a ggsq file does not store its sequence id


def test_duplicate_recurrent_tail_in_a_patched_real_blob(blobs):
    b = blobs("tiny-recurrent")
    b.decode(0, range(3))
    b.decode(1, range(2))
    data = bytearray(b.state())
    first = 4 + len("mamba2") + 4 + 8  # arch string, cell count, pos and n_seq_id of cell 0 → its seq id
    seq0, seq1 = struct.unpack_from("<i", data, first)[0], struct.unpack_from("<i", data, first + 12)[0]
    assert {seq0, seq1} == {0, 1}
    struct.pack_into("<i", data, first + 12, seq0)  # both recurrent cells now claim the same sequence
    r = scan_bytes(bytes(data))
    assert r.recurrent_cells_per_seq == {seq0: 2} and r.duplicate_tails == {seq0: 2} and not r.healthy


def test_gemma3_iswa_seq_blob_lists_only_the_window(blobs):
    b = blobs("gemma3-270m", n_seq=1, n_ctx=640)
    hint = layout_from_model(b.path)
    assert hint.memory == "iswa"
    b.decode(0, range(600))  # n_swa is 512: a seq blob skips SWA-masked cells (§1.5)
    r = scan_bytes(b.seq_state(0), layout=hint, expected_len={0: 600})
    assert [p.name for p in r.parts] == ["kv-base", "kv-swa"] and r.healthy
    assert seqs(r.parts[0]) == {0: (600, 0, 599)} and seqs(r.parts[1]) == {0: (512, 88, 599)}
    assert scan_bytes(b.seq_state(0)).layout.memory == "iswa"
    partial = scan_bytes(b.seq_state(0, PARTIAL_ONLY), layout=hint)
    assert [p.name for p in partial.parts] == ["kv-swa"] and seqs(partial.parts[0]) == {0: (512, 88, 599)}
    whole = scan_bytes(b.state(), layout=hint)
    assert [seqs(p) for p in whole.parts] == [{0: (600, 0, 599)}] * 2  # swa_full keeps every cell


def test_bad_magic_and_truncation_are_one_line_errors(blobs):
    b = blobs("tiny-dense")
    b.decode(0, range(5))
    good = b.seq_state(0)
    cases = {
        b"\x01\x02\x03\x04" + good[4:]: "unknown magic 0x04030201",
        good[:-7]: "consumes exactly",
        good + b"\0": "consumes exactly",
        good[:6]: "truncated seq blob header",
        struct.pack("<III", 0x67677371, 2, 0): "ggsq version 2",
        struct.pack("<III", 0x67677371, 3, 100): "truncated",
    }
    for data, message in cases.items():
        with pytest.raises(HarnessError) as err:
            scan_bytes(data, name="x.bin")
        assert message in str(err.value) and str(err.value).startswith("x.bin: ") and "\n" not in str(err.value)
    with pytest.raises(HarnessError, match="expected a context state, found a seq state"):
        scan_bytes(good, kind="context")
    with pytest.raises(HarnessError, match="no seq layout with memory=recurrent consumes exactly"):
        scan_bytes(good, layout=Layout(memory="recurrent"))
    with pytest.raises(HarnessError, match="unknown memory class 'paged'"):
        Layout(memory="paged")


def _as_version_4(v3: bytes, n_tokens: int) -> bytes:
    """A version-3 ggsq file of one dense sequence rewritten as llama.cpp b11434 writes it (LLAMA_STATE_SEQ_VERSION
    4): the KV data header gains the K and V rotation sizes (`n_rot_k`, `n_rot_v`) after v_trans and the layer count."""
    from harness.kv.parse import _Parser

    body = 12 + 4 * n_tokens
    n_stream = struct.unpack_from("<I", v3, body)[0]
    assert n_stream == 1
    count = struct.unpack_from("<I", v3, body + 4)[0]
    *_, data = _Parser(v3).meta(body + 8, count, False, kv=True)
    head = struct.pack("<III", 0x67677371, 4, n_tokens) + v3[12:data]
    return head + v3[data : data + 8] + struct.pack("<II", 0, 64) + v3[data + 8 :]


def test_a_version_4_slot_file_has_rotation_sizes_in_its_kv_header(blobs, tmp_path):
    b = blobs("tiny-dense")
    b.decode(0, range(6))
    v3 = b.save_seq_file(tmp_path / "s.ggsq", 0, list(range(6))).read_bytes()
    v4 = _as_version_4(v3, 6)
    r = scan_bytes(v4, layout=layout_from_model(b.path), expected_len={0: 6})
    assert (r.framing, r.tokens) == ("ggsq", 6) and seqs(r.parts[0]) == {0: (6, 0, 5)} and r.healthy
    assert r.parts[0].tensor_bytes == scan_bytes(v3, layout=layout_from_model(b.path)).parts[0].tensor_bytes
    with pytest.raises(HarnessError, match="consumes exactly"):  # the same bytes read as version 3 do not fit
        scan_bytes(v3[:4] + v4[4:8].replace(b"\x04", b"\x03") + v4[8:], layout=layout_from_model(b.path))
    bad = v4.replace(struct.pack("<II", 0, 64), struct.pack("<II", 0, 65), 1)
    with pytest.raises(HarnessError, match="implausible KV rotation sizes"):
        scan_bytes(bad, layout=layout_from_model(b.path))
