"""The llama-server backend, with a real build of the vendored llama.cpp and the real tiny models.

The first run builds llama-server from source (many minutes on a small machine); later runs reuse
the cached build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from filelock import FileLock
from helpers import kill_when_busy, quicksort

from harness.backends.base import ServeConfig
from harness.backends.build import (
    SOURCE_MARKER,
    cmake_options,
    ensure_server,
    prebuilt_server,
    source_identity,
    vendored_source,
)
from harness.backends.build import sources as build_module
from harness.backends.build.cmake import check_platform
from harness.backends.build.ensure import build_key
from harness.backends.build.sources import tree_digest
from harness.backends.client import LlamaClient
from harness.backends.server import LlamaServer
from harness.backends.server_backend import ServerBackend
from harness.errors import HarnessError
from harness.models import resolve
from harness.suites.request import Request, Sampling

LANGS = ("C", "Java", "Python")
MODES = ("seq", "par", "no-kv-unified")
REPEATS = 3


@pytest.fixture(scope="session")
def build():
    return ensure_server(None, "cpu", [], jobs=None)


@pytest.fixture(scope="session")
def model(tiny_models) -> Path:
    return tiny_models["tiny-dense"].path


def quicksort_requests() -> list[Request]:
    return [quicksort(lang, n_predict=128) for lang in LANGS]


def config(model: Path, mode: str, **kw) -> ServeConfig:
    return ServeConfig(model=model, mode=mode, parallel=len(LANGS), flash_attn="off", **kw)


@pytest.fixture(scope="module")
def mode_results(build, model, tmp_path_factory):
    """{mode: [results of the three prompts] * REPEATS}, each mode served by one session."""
    out = {}
    for mode in MODES:
        backend = ServerBackend(build, run_dir=tmp_path_factory.mktemp(mode))
        with backend.open(config(model, mode)) as session:
            out[mode] = [session.run(quicksort_requests()) for _ in range(REPEATS)]
    return out


# ------------------------------------------------------------------------------------ modes


@pytest.mark.parametrize("mode", MODES)
def test_mode_returns_complete_greedy_results(mode_results, mode):
    for result in mode_results[mode][0]:
        assert result.ok, result.error
        assert result.prompt_tokens and result.tokens and result.text
        assert result.timings.predicted_n == len(result.tokens)
        assert result.timings.prompt_n > 0
        assert (result.stop_reason, len(result.tokens)) == ("limit", 128) or result.stop_reason == "eos"
        assert 0 <= result.slot_id < (1 if mode == "seq" else len(LANGS))


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_identical_over_repeats(mode_results, mode):
    first = [r.tokens for r in mode_results[mode][0]]
    for repeat in mode_results[mode][1:]:
        assert [r.tokens for r in repeat] == first


def test_seq_equals_no_kv_unified_without_flash_attention(mode_results):
    assert [r.tokens for r in mode_results["seq"][0]] == [r.tokens for r in mode_results["no-kv-unified"][0]]


def test_chat_request_yields_token_ids(build, model, tmp_path):
    chat = Request(messages=[{"role": "user", "content": "Say hi."}], sampling=Sampling(n_predict=16))
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq")) as session:
        [result] = session.run([chat])
    assert result.ok, result.error
    assert result.prompt_tokens and len(result.tokens) == result.timings.predicted_n > 0


def test_speculative_counters_and_lossless_output(build, model, tmp_path):
    draft = resolve("tiny-dense-draft").path
    spec = {"spec-type": "draft-simple", "spec-draft-n-max": 4}
    reqs = quicksort_requests()[:1]
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq")) as session:
        [plain] = session.run(reqs)
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq", draft_model=draft, spec=spec)) as session:
        [specced] = session.run(reqs)
    assert plain.spec_stats["draft_n"] == 0
    stats = specced.spec_stats
    assert stats["draft_n"] > 0 and 0 <= stats["draft_n_accepted"] <= stats["draft_n"]
    assert "draft-simple" in stats["types"]
    assert specced.tokens == plain.tokens


def test_logit_top_k_fills_log_probabilities(build, model, tmp_path):
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq", logit_top_k=3)) as session:
        [result] = session.run(quicksort_requests()[:1])
    assert len(result.logits) == len(result.tokens)
    for token, position in zip(result.tokens, result.logits, strict=True):
        assert len(position.top_ids) == 3 and position.top_ids[0] == token  # greedy picks the top candidate
        assert position.top_logits[0] >= position.top_logits[1] >= position.top_logits[2]


# ------------------------------------------------------------------------------------ crashes


def test_killed_server_turns_case_into_crash_and_next_case_completes(build, model, tmp_path):
    long_case = quicksort("C", n_predict=4000)
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq", n_ctx=4096)) as session:
        done = threading.Event()
        killer = threading.Thread(target=kill_when_busy, args=(session.server, signal.SIGKILL, done))
        killer.start()
        try:
            crashed = session.run([long_case])[0]
        finally:
            done.set()
            killer.join()
        after = session.run(quicksort_requests()[:1])[0]
        assert session.starts == 2
    assert crashed.stop_reason == "crashed"
    assert "SIGKILL" in crashed.error and "llama-server" in crashed.error
    assert after.ok and after.stop_reason in ("limit", "eos") and after.tokens


def test_abort_in_par_mode_fails_in_flight_cases_and_restarts_once(build, model, tmp_path):
    long_cases = [quicksort(lang, n_predict=3000) for lang in LANGS]
    with ServerBackend(build, run_dir=tmp_path).open(config(model, "par")) as session:
        done = threading.Event()
        killer = threading.Thread(target=kill_when_busy, args=(session.server, signal.SIGABRT, done))
        killer.start()
        try:
            results = session.run(long_cases + quicksort_requests())
        finally:
            done.set()
            killer.join()
        assert session.starts == 2
    assert any(r.stop_reason == "crashed" and "SIGABRT" in r.error for r in results[:3])
    assert all(r.ok and r.stop_reason == "limit" for r in results[3:])


# ------------------------------------------------------------------------------------ build cache


def test_second_ensure_server_is_a_cache_hit(build):
    started = time.monotonic()
    again = ensure_server(None, "cpu", [], jobs=None)
    elapsed = time.monotonic() - started
    assert again.cached and again.server_bin == build.server_bin
    assert elapsed < 2.0, f"cache hit took {elapsed:.2f} s"
    assert os.access(again.server_bin, os.X_OK) and again.quantize_bin.is_file()


@pytest.mark.parametrize("cached_only", [False, True], ids=["build", "cached-only"])
def test_specharness_build_prints_only_the_binary_path_on_stdout(build, cached_only):
    """`--server-bin "$(specharness build ...)"` is the binary: stdout is its path and nothing else, what it was
    built from goes to stderr."""
    argv = [sys.executable, "-m", "harness.cli", "build", *(["--cached-only"] if cached_only else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{build.server_bin}\n" and os.access(proc.stdout.strip(), os.X_OK)
    assert f"llama-server of {build.source_identity} (cpu, cached" in proc.stderr


def test_vendored_tree_hashes_fast_and_stably():
    tree = vendored_source()
    started = time.monotonic()
    digest = tree_digest(tree)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, f"hashing the vendored tree took {elapsed:.2f} s"
    assert tree_digest(tree) == digest


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def plain_tree(tmp_path) -> Path:
    tree = tmp_path / "llama.cpp"
    _write(tree / "CMakeLists.txt", "project(x)\n")
    _write(tree / "src" / "llama.cpp", "int x = 1;\n")
    _write(tree / "README.md", "readme\n")
    _write(tree / "models" / "ggml-vocab.gguf", "weights\n")
    _write(tree / "build" / "obj.cpp", "generated\n")
    return tree


def test_plain_tree_identity_follows_source_files_only(plain_tree):
    before = source_identity(plain_tree)
    assert before.commit == "unknown"
    _write(plain_tree / "README.md", "edited\n")
    _write(plain_tree / "models" / "ggml-vocab.gguf", "other weights\n")
    _write(plain_tree / "build" / "obj.cpp", "regenerated\n")
    assert source_identity(plain_tree) == before
    _write(plain_tree / "src" / "llama.cpp", "int x = 2;\n")
    after = source_identity(plain_tree)
    assert after.digest != before.digest
    args = cmake_options("cpu")
    assert build_key(after, "cpu", args) != build_key(before, "cpu", args)


def test_git_checkout_identity_is_commit_plus_uncommitted_changes(plain_tree):
    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(plain_tree), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("add", "CMakeLists.txt", "src")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    head = git("rev-parse", "HEAD").strip()
    clean = source_identity(plain_tree)
    assert (clean.commit, clean.dirty, str(clean)) == (head, False, head)
    _write(plain_tree / "src" / "new.cpp", "int y;\n")  # untracked source file
    untracked = source_identity(plain_tree)
    assert untracked.dirty and untracked.digest != clean.digest
    _write(plain_tree / "src" / "llama.cpp", "int x = 3;\n")
    modified = source_identity(plain_tree)
    assert modified.dirty and modified.digest not in (clean.digest, untracked.digest)
    assert str(modified).startswith(head + "+")


FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(llama-server main.c)
add_executable(llama-quantize main.c)
"""


@pytest.fixture
def fake_tree(tmp_path, monkeypatch) -> Path:
    """A two-target CMake project standing in for llama.cpp, with the cache in tmp_path."""
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    tree = tmp_path / "fake"
    _write(tree / "CMakeLists.txt", FAKE_CMAKE)
    _write(tree / "main.c", "int main(void) { return 0; }\n")
    return tree


def test_build_is_cached_and_rebuilt_when_a_source_changes(fake_tree, tmp_path):
    first = ensure_server(fake_tree, "cpu", [], jobs=2)
    assert not first.cached and os.access(first.server_bin, os.X_OK) and first.quantize_bin.is_file()
    root = first.server_bin.parent.parent
    assert json.loads((root / "build-info.json").read_text())["cmake_args"] == cmake_options("cpu")
    assert (root / "build.log").is_file() and not (root / "cmake").exists()
    assert ensure_server(fake_tree, "cpu", [], jobs=2).cached
    _write(fake_tree / "main.c", "int main(void) { return 1; }\n")
    second = ensure_server(fake_tree, "cpu", [], jobs=2)
    assert not second.cached and second.server_bin != first.server_bin
    assert _entries(tmp_path) == sorted([root.name, second.server_bin.parent.parent.name])  # nothing half-built


def test_build_cached_only_says_in_one_line_that_a_build_is_missing_and_compiles_nothing(fake_tree, tmp_path, capsys):
    from harness.cli import main

    assert main(["build", "--source", str(fake_tree), "--cached-only"]) == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1
    assert said.err.startswith(f"no cached llama-server of {fake_tree} (cpu): build it with")
    assert not (tmp_path / "cache" / "builds").exists() or _entries(tmp_path) == []
    assert main(["build", "--release", "0.0.1", "--cached-only"]) == 1  # never extracted: nothing fetched
    assert "no cached llama-server of llama-cpp-python 0.0.1's llama.cpp" in capsys.readouterr().err
    assert not (tmp_path / "cache" / "downloads").exists()
    built = ensure_server(fake_tree, "cpu", [], jobs=2)
    assert main(["build", "--source", str(fake_tree), "--cached-only"]) == 0
    assert capsys.readouterr().out == f"{built.server_bin}\n"


def _entries(tmp_path: Path) -> list[str]:
    """The build cache's entries, without the lock files beside them."""
    return sorted(p.name for p in (tmp_path / "cache" / "builds").iterdir() if p.suffix != ".lock")


def test_failed_build_leaves_no_cache_entry(fake_tree, tmp_path):
    _write(fake_tree / "CMakeLists.txt", FAKE_CMAKE + 'message(FATAL_ERROR "boom")\n')
    with pytest.raises(HarnessError, match="configure failed") as excinfo:
        ensure_server(fake_tree, "cpu", [], jobs=2)
    assert "boom" in str(excinfo.value)
    [log] = _entries(tmp_path)
    assert log.endswith(".failed.log")


@pytest.mark.parametrize("corrupt", ["truncated", "not-an-object", "schema-changed", "wrong-type", "no-binary"])
def test_unusable_cache_entry_is_rebuilt_and_replaced(fake_tree, tmp_path, corrupt, capsys):
    first = ensure_server(fake_tree, "cpu", [], jobs=2)
    root = first.server_bin.parent.parent
    info_file = root / "build-info.json"
    text = info_file.read_text()
    data = json.loads(text)
    if corrupt == "truncated":
        info_file.write_text(text[: len(text) // 2])
    elif corrupt == "not-an-object":
        info_file.write_text("[]\n")
    elif corrupt == "schema-changed":  # BuildInfo(**data) raises TypeError on unknown or missing fields
        data.pop("compiler")
        info_file.write_text(json.dumps(dict(data, new_field=1)))
    elif corrupt == "wrong-type":
        info_file.write_text(json.dumps(dict(data, cmake_args="-DX=Y")))
    else:
        (root / "bin" / "llama-server").unlink()
    (root / "stale-marker").touch()  # shows whether the entry was replaced as a whole
    from harness.cli import main

    assert main(["build", "--source", str(fake_tree), "--jobs", "2", "--json"]) == 0
    rebuilt = json.loads(capsys.readouterr().out)
    assert rebuilt["cached"] is False and rebuilt["server_bin"] == str(first.server_bin)
    assert not (root / "stale-marker").exists() and json.loads(info_file.read_text())["compiler"] != ""
    assert os.access(first.server_bin, os.X_OK)
    assert _entries(tmp_path) == [root.name]  # no temp or set-aside trees left
    assert ensure_server(fake_tree, "cpu", [], jobs=2).cached


def test_ensure_server_waits_for_the_build_lock_then_uses_the_finished_build(fake_tree):
    first = ensure_server(fake_tree, "cpu", [], jobs=2)
    root = first.server_bin.parent.parent
    aside = root.with_name("built-elsewhere")
    root.rename(aside)
    results = []
    with FileLock(str(root) + ".lock"):  # another process is building this key
        worker = threading.Thread(target=lambda: results.append(ensure_server(fake_tree, "cpu", [], jobs=2)))
        worker.start()
        time.sleep(1.0)
        assert worker.is_alive() and not list(root.parent.glob("*.tmp-*"))  # waiting, not building
        aside.rename(root)  # ... and finishes
    worker.join(60)
    [again] = results
    assert again.cached and again.server_bin == first.server_bin  # re-checked the cache after the lock


def test_corrupt_source_marker_in_a_given_tree_is_a_one_line_error(fake_tree):
    marker = fake_tree / SOURCE_MARKER
    marker.write_text('{"commit": "abc')
    with pytest.raises(HarnessError, match="unreadable source marker") as excinfo:
        ensure_server(fake_tree, "cpu", [], jobs=2)
    assert str(marker) in _one_line_error(excinfo) and "delete it" in str(excinfo.value)
    marker.write_text('{"commit": "abc"}\n')
    assert source_identity(fake_tree).commit == "abc"


def _fake_sdist(path: Path, commit: str = "c0ffee") -> Path:
    """A tiny stand-in for the llama-cpp-python sdist: a vendored tree and its submodule HEAD."""
    src = path.parent / "sdist-src" / "llama_cpp_python-x"
    _write(src / "vendor" / "llama.cpp" / "CMakeLists.txt", "project(x)\n")
    _write(src / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD", commit + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(src, arcname=src.name)
    return path


def test_vendored_tree_with_a_corrupt_marker_is_extracted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    sdist = _fake_sdist(tmp_path / "sdist.tar.gz")
    monkeypatch.setattr(build_module, "_download_sdist", lambda version: sdist)
    tree = vendored_source()
    assert json.loads((tree / SOURCE_MARKER).read_text())["commit"] == "c0ffee"
    (tree / SOURCE_MARKER).write_text("\x00garbage")
    (tree / "leftover.cpp").write_text("int stale;\n")
    assert vendored_source() == tree
    assert json.loads((tree / SOURCE_MARKER).read_text())["commit"] == "c0ffee"
    assert not (tree / "leftover.cpp").exists() and (tree / "CMakeLists.txt").is_file()
    assert sorted(p.name for p in tree.parent.iterdir() if p.suffix != ".lock") == [tree.name]


def test_corrupt_sdist_download_is_fetched_again_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    good = _fake_sdist(tmp_path / "good.tar.gz")
    truncated = tmp_path / "cache" / "downloads" / "truncated.tar.gz"
    truncated.parent.mkdir(parents=True)
    truncated.write_bytes(good.read_bytes()[:40])
    downloads = iter([truncated, good])
    monkeypatch.setattr(build_module, "_download_sdist", lambda version: next(downloads))
    assert source_identity(vendored_source()).commit == "c0ffee"
    assert not truncated.exists()  # the corrupt download was deleted

    def always_truncated(version: str) -> Path:
        truncated.write_bytes(good.read_bytes()[:40])
        return truncated

    shutil.rmtree(tmp_path / "cache" / "src")
    monkeypatch.setattr(build_module, "_download_sdist", always_truncated)
    with pytest.raises(HarnessError, match="cannot extract .*deleted; run again") as excinfo:
        vendored_source()
    _one_line_error(excinfo)


def test_cmake_arg_takes_a_separate_definition():
    from harness.cli import build_parser

    args = build_parser().parse_args(
        ["build", "--cmake-arg", "-DGGML_NATIVE=OFF", "--cmake-arg=-G", "--cmake-arg", "-UFOO", "--jobs", "2"]
    )
    assert args.cmake_arg == ["-DGGML_NATIVE=OFF", "-G", "-UFOO"] and args.jobs == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build", "-DGGML_NATIVE=OFF"])  # a definition without --cmake-arg


@pytest.mark.parametrize(
    "backend, on, off",
    [
        ("cpu", (), ("-DGGML_CUDA=OFF", "-DGGML_METAL=OFF")),
        ("cuda", ("-DGGML_CUDA=ON",), ("-DGGML_METAL=OFF",)),
        ("metal", ("-DGGML_METAL=ON",), ("-DGGML_CUDA=OFF",)),
    ],
)
def test_cmake_args_per_backend(backend, on, off):
    args = cmake_options(backend, ["-DGGML_NATIVE=OFF"])
    assert set(on) | set(off) <= set(args)
    assert {
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    } <= set(args)
    assert args[-1] == "-DGGML_NATIVE=OFF"  # user arguments come last, so they win


def test_unknown_backend_and_metal_off_macos_are_refused():
    with pytest.raises(HarnessError, match="unknown build backend"):
        cmake_options("vulkan")
    with pytest.raises(HarnessError, match="macOS"):
        check_platform("metal", "Linux")
    check_platform("metal", "Darwin")
    check_platform("cuda", "Linux")


@pytest.mark.skipif(os.uname().sysname == "Darwin", reason="Metal builds are allowed on macOS")
def test_ensure_server_refuses_metal_here():
    with pytest.raises(HarnessError, match="macOS"):
        ensure_server(None, "metal", [], jobs=1)


# ------------------------------------------------------------------------------------ bad input


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


def test_missing_or_non_executable_binary(tmp_path, model):
    missing = tmp_path / "llama-server"
    with pytest.raises(HarnessError, match="does not exist or is not executable") as excinfo:
        prebuilt_server(missing)
    _one_line_error(excinfo)
    missing.write_text("#!/bin/sh\n")
    with pytest.raises(HarnessError, match="not executable") as excinfo:
        LlamaServer(server_bin=missing, model=model).start()
    _one_line_error(excinfo)


def test_prebuilt_server_reads_version_and_device(build, tmp_path):
    info = prebuilt_server(build.server_bin)  # one of our builds: its record knows the commit `--version` does not
    assert info.server_bin == build.server_bin and info.commit == build.commit != "unknown"
    assert info.source_identity == build.source_identity and info.compiler == build.compiler
    copy = tmp_path / "llama-server"
    shutil.copy2(build.server_bin, copy)
    elsewhere = prebuilt_server(copy)  # no build record beside it: what `--version` says
    assert elsewhere.server_bin == copy and elsewhere.commit and elsewhere.source_identity.startswith("0.")
    assert elsewhere.backend == "cpu"  # --list-devices shows no GPU in a CPU build


def test_environment_names_device_and_commit(build):
    env = ServerBackend(build).environment()
    assert env["device"] == "cpu" and env["llama_cpp_commit"] == build.commit and env["compiler"] != "unknown"
    assert str(build.server_bin) not in json.dumps(env)  # machine-specific; environments go into baselines


def test_committed_server_baselines_hold_no_binary_path():
    baselines = sorted((Path(__file__).resolve().parent.parent / "fixtures" / "baselines").glob("*/*--server--*.json"))
    for path in baselines:
        assert "server_bin" not in json.loads(path.read_text())["environment"], path


def test_unknown_completion_fields_are_refused(build):
    with pytest.raises(HarnessError, match="unsupported /completion fields"):
        ServerBackend(build, fields={"cache_promt": False})


def test_bad_model_file_is_refused(build, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    server = LlamaServer(server_bin=build.server_bin, model=bad, log_path=tmp_path / "server.log")
    with pytest.raises(HarnessError, match="could not load model") as excinfo:
        server.start()
    _one_line_error(excinfo)
    assert not server.alive


def test_port_in_use(build, model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = LlamaServer(server_bin=build.server_bin, model=model, port=port, log_path=tmp_path / "server.log")
        with pytest.raises(HarnessError, match=f"port {port} .* in use") as excinfo:
            server.start()
    _one_line_error(excinfo)
    assert not server.alive


def test_health_timeout_stops_the_process(build, model, tmp_path):
    server = LlamaServer(server_bin=build.server_bin, model=model, start_timeout=0.05, log_path=tmp_path / "server.log")
    started = time.monotonic()
    with pytest.raises(HarnessError, match="not ready within") as excinfo:
        server.start()
    _one_line_error(excinfo)
    assert not server.alive and time.monotonic() - started < 15


def test_command_maps_config_one_to_one(build, model):
    par = LlamaServer.from_config(
        config(model, "par", spec={"spec-type": "ngram-simple", "spec-draft-n-max": 8}),
        build.server_bin,
        cache_prompt=False,
        metrics=True,
        warmup=False,
    )
    par.port = 1234
    cmd = par.command()
    pairs = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1)}
    assert pairs["-np"] == "3" and "--kv-unified" in cmd and "--no-kv-unified" not in cmd
    assert pairs["--spec-type"] == "ngram-simple" and pairs["--spec-draft-n-max"] == "8"
    assert pairs["--host"] == "127.0.0.1" and pairs["-fa"] == "off" and pairs["-fit"] == "off"
    assert {"--no-cache-prompt", "--metrics", "--no-warmup"} <= set(cmd)
    seq = LlamaServer.from_config(config(model, "seq"), build.server_bin)
    seq.port = 1234
    assert "--no-kv-unified" in seq.command() and seq.command()[seq.command().index("-np") + 1] == "1"
    from dataclasses import replace

    for repack in (True, False):  # --repack is llama-server's default: only its negation is passed
        server = LlamaServer.from_config(replace(config(model, "seq"), repack=repack), build.server_bin)
        server.port = 1234
        assert ("--no-repack" in server.command()) is not repack


def test_weight_repacking_is_off_exactly_on_a_cpu_whose_amx_path_crashes_llama_cpp():
    from harness.backends.base import AMX_DEFECT, cpu_flags, default_repack
    from harness.engine import ContextParams

    assert default_repack() is (AMX_DEFECT not in cpu_flags())
    assert ContextParams().repack is default_repack()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid", "tiny-recurrent"])
def test_slot_save_files_scan_healthy_and_a_planted_duplicate_is_found(build, tiny_models, tmp_path, name, capsys):
    """llama-server's own slot files, through `specharness scan`: healthy after a request; with one cell's
    position overwritten by its neighbour's, exactly that (seq, pos) pair is reported and the exit is 1."""
    from harness.cli import main

    backend = ServerBackend(build, run_dir=tmp_path)
    with backend.open(ServeConfig(model=tiny_models[name].path, mode="seq", kv_scan="request")) as session:
        result = session.run([quicksort("C", n_predict=16)])[0]
        assert (
            result.kv_scan["healthy"]
            and result.kv_scan["totals"]["kv_cells" if name != "tiny-recurrent" else "rs_cells"] > 0
        )
        LlamaClient(session.server.url).save_slot(0, "state.bin")
    path = tmp_path / "slots" / "state.bin"
    assert main(["scan", str(path), "--model", name]) == 0
    if name == "tiny-recurrent":
        return  # one recurrent cell per sequence: no positions to duplicate
    data = bytearray(path.read_bytes())
    _, _, n_words = struct.unpack_from("<III", data, 0)  # 'ggsq', version, token words
    meta = 12 + 4 * n_words + 8  # then the KV part: u32 n_stream (1 here), u32 cell_count, cell records
    stride = 24 if name == "tiny-hybrid" else 12  # pos, n_seq_id, [x, y, tok for IMROPE models], seq id
    assert struct.unpack_from("<ii", data, meta + 3 * stride) == (3, 1)
    struct.pack_into("<i", data, meta + 3 * stride, 2)  # the cell holding position 3 now claims position 2
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["scan", str(path), "--model", name, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["duplicates"]
    assert [(d["seq_id"], d["pos"], d["count"]) for d in found] == [(0, 2, 2)]


@pytest.mark.parametrize("save", ["refused", "timed-out", "died"])
def test_a_failed_slot_save_leaves_kv_healthy_not_run_unless_llama_server_died_in_it(
    build, model, tmp_path, monkeypatch, save
):
    """llama-server answered the completion; only the KV scan's `POST /slots/0?action=save` failed: refused (HTTP
    500 "Unable to save slot": its --slot-save-path is gone) or not answered in time. The request completed:
    no-crash passes, kv-healthy is not run, naming the save. A save the process died in is a crash, as before."""
    from test_checks import SEQ, context

    from harness.backends.client import RequestTimedOut
    from harness.checks import evaluate

    saved = LlamaClient.save_slot

    def failing(client, slot_id, filename):
        if save == "timed-out":
            raise RequestTimedOut(f"/slots/{slot_id}?action=save got no answer within 0.1 s")
        os.killpg(session.server.process.pid, signal.SIGKILL)
        return saved(client, slot_id, filename)

    with ServerBackend(build, run_dir=tmp_path).open(config(model, "seq", kv_scan="request")) as session:
        if save == "refused":
            shutil.rmtree(session.slots_dir)  # llama-server cannot open the slot file: it answers 500
        else:
            monkeypatch.setattr(LlamaClient, "save_slot", failing)
        [result] = session.run([quicksort("C", n_predict=8)])
        assert session.starts == (2 if save == "died" else 1)
    crash, kv = evaluate(context({SEQ: [result]}, SEQ), ["no-crash", "kv-healthy"])
    if save == "died":
        assert result.stop_reason == "crashed" and "SIGKILL" in result.error, result.error
        assert crash.status == "failed" and kv.status == "not run", (crash, kv)
        return
    assert result.ok, result.error
    assert crash.status == "passed", crash
    why = "HTTP 500: Unable to save slot" if save == "refused" else "got no answer within 0.1 s"
    assert kv.status == "not run" and "POST /slots/0?action=save: " in kv.not_run and why in kv.not_run, kv


def test_llama_server_context_errors_read_as_context_full_and_others_do_not():
    from harness.backends.client import KV_FULL_MESSAGE, ServerError

    assert str(ServerError(500, KV_FULL_MESSAGE, "server_error")).startswith("context_full: HTTP 500")
    too_long = ServerError(
        400, "request (600 tokens) exceeds the available context size (512 tokens)", "exceed_context_size_error"
    )
    assert str(too_long).startswith("context_full: HTTP 400")
    assert not str(ServerError(500, "Invalid input batch.", "server_error")).startswith("context_full")


def test_an_http_error_answer_looks_briefly_for_an_exit_and_a_dropped_connection_waits_the_crash_grace():
    """A 5xx with llama-server's error body came from a live process (a `context_full` of a filled KV cache, a
    failed task): a short look for an exit that raced it, not the dropped connection's grace, which every such
    answer used to wait under the session's lock (kv-fill: most of a cell's time)."""
    from harness.backends import server_backend
    from harness.backends.client import KV_FULL_MESSAGE, ConnectionLost, ServerError

    class Alive:
        log_path = None

        def __init__(self):
            self.waited = []

        def wait_exit(self, timeout):
            self.waited.append(timeout)
            return None

    session = object.__new__(server_backend.ServerSession)
    session._lock, session._stalls, session._killed = threading.Lock(), {}, {}
    session.config = SimpleNamespace(n_slots=1)  # one slot: an error answered there was served on slot 0
    server = Alive()
    answered = session._failed(server, ServerError(500, KV_FULL_MESSAGE), quicksort("C"))
    dropped = session._failed(server, ConnectionLost("/completion: connection reset"), quicksort("C"))
    assert server.waited == [server_backend.ANSWERED_GRACE_S, server_backend.CRASH_GRACE_S]
    assert server_backend.ANSWERED_GRACE_S < 1 < server_backend.CRASH_GRACE_S
    assert answered.stop_reason == dropped.stop_reason == "error"
    assert answered.error.startswith("context_full: HTTP 500")
    assert answered.slot_id == dropped.slot_id == 0  # a live server with one slot served the request on slot 0
