"""llama-server built against llama-cpp-python's own libllama, libggml and libmtmd
(harness/backends/build/wheel_link.py): only for a CPU tree whose library sources are the wheel's, never for another
tree, backend or CMake option."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.backends.build import SOURCE_MARKER, build_tree_dir, cmake_options, ensure_server, vendored_source
from harness.backends.build.cmake import TARGETS
from harness.backends.build.ensure import linkable_libraries
from harness.backends.build.wheel_link import ARCHIVES, RUN_PATH, installed_libraries, link_inputs, link_plan, relinked
from harness.backends.flags import server_version

LINK = (
    ": && /usr/bin/c++ -O3 -DNDEBUG  tools/server/CMakeFiles/llama-server.dir/main.cpp.o -o bin/llama-server  "
    "tools/server/libllama-server-impl.a  tools/server/libserver-context.a  common/libllama-common.a  "
    "common/libllama-common-base.a  tools/mtmd/libmtmd.a  src/libllama.a  ggml/src/libggml.a  -ldl  "
    "ggml/src/libggml-cpu.a  ggml/src/libggml-base.a  -lm  /usr/lib/gcc/x86_64-linux-gnu/12/libgomp.so  "
    "/usr/lib/x86_64-linux-gnu/libpthread.a  vendor/hash/libvendor-hash.a  tools/ui/libllama-ui.a  "
    "vendor/cpp-httplib/libcpp-httplib.a && :"
)
"""llama-server's final link as CMake generates it for the vendored tree (`ninja -t commands -s bin/llama-server`)."""


def test_the_link_builds_the_servers_own_code_and_takes_the_wheels_five_libraries_for_the_archives(tmp_path):
    argv = shlex.split(LINK)[2:-2]
    inputs = link_inputs(argv)
    assert inputs[0] == "tools/server/CMakeFiles/llama-server.dir/main.cpp.o"
    assert "common/libllama-common.a" in inputs and "vendor/cpp-httplib/libcpp-httplib.a" in inputs
    assert not set(inputs) & set(ARCHIVES) and "bin/llama-server" not in inputs
    assert not [i for i in inputs if i.startswith("/")]  # system libraries are not ninja's to build
    new = relinked(argv, tmp_path / "lib", tmp_path / "bin" / "llama-server")
    assert [a for a in new if a in ARCHIVES] == []
    assert sum(a.startswith(str(tmp_path / "lib")) for a in new) == 5
    assert new[new.index("-o") + 1] == str(tmp_path / "bin" / "llama-server") and new[-1] == RUN_PATH
    assert relinked(argv, tmp_path / "lib", tmp_path / "out", tmp_path / "final")[-1] == f"{RUN_PATH}:{tmp_path}/final"


@pytest.fixture
def fake_vendored(tmp_path, monkeypatch):
    """A cache whose extracted vendored tree (for the installed llama-cpp-python's version) is a small fake one."""
    libraries = installed_libraries()
    if libraries is None:
        pytest.skip("llama-cpp-python with its shared libraries is not installed")
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    vendored = tmp_path / "cache" / "src" / f"llama.cpp-{libraries.version}"
    for rel, text in {
        "CMakeLists.txt": "project(llama.cpp)\n",
        "src/llama.cpp": "int llama;\n",
        "ggml/src/ggml.c": "int ggml;\n",
        "tools/server/server-context.cpp": "int server;\n",
        "common/speculative.cpp": "int speculative;\n",
    }.items():
        (vendored / rel).parent.mkdir(parents=True, exist_ok=True)
        (vendored / rel).write_text(text)
    (vendored / SOURCE_MARKER).write_text(json.dumps({"commit": "0c1e5709", "origin": "test"}) + "\n")
    copy = tmp_path / "copy"
    shutil.copytree(vendored, copy)
    return libraries, vendored, copy


@pytest.mark.skipif(shutil.which("ninja") is None, reason="the linked build needs Ninja (apt-get install ninja-build)")
def test_only_a_cpu_tree_with_the_wheels_library_sources_and_no_extra_options_links_the_wheel(fake_vendored):
    libraries, vendored, copy = fake_vendored
    assert linkable_libraries(vendored, "cpu", []) == libraries
    (copy / "tools/server/server-context.cpp").write_text("int seeded_bug;\n")
    (copy / "common/speculative.cpp").write_text("int changed;\n")
    assert linkable_libraries(copy, "cpu", []) == libraries  # server and common are compiled: the wheel still fits
    assert linkable_libraries(copy, "cuda", []) is None
    assert linkable_libraries(copy, "cpu", ["-DBUILD_SHARED_LIBS=OFF"]) is None
    (copy / "src/llama.cpp").write_text("int llama_changed;\n")
    assert linkable_libraries(copy, "cpu", []) is None  # another libllama: compiled from the tree
    (copy / "src/llama.cpp").write_text("int llama;\n")
    (copy / "ggml/src/ggml-new.c").write_text("int added;\n")
    assert linkable_libraries(copy, "cpu", []) is None


def test_the_vendored_llama_server_links_the_wheels_libraries_from_its_own_lib_directory():
    build = ensure_server()
    if shutil.which("ninja") is None:
        assert build.linked_libraries == ""
        return
    libraries = installed_libraries()
    assert build.linked_libraries == libraries.describe()
    root = build.server_bin.parent.parent
    assert json.loads((root / "build-info.json").read_text())["linked_libraries"] == libraries.describe()
    assert (root / "lib" / "libllama.so").is_file() and (root / "lib" / "libmtmd.so").is_file()
    ldd = subprocess.run(["ldd", str(build.server_bin)], capture_output=True, text=True).stdout.splitlines()
    loaded = {line.split()[0]: line.split()[2] for line in ldd if " => " in line}
    for name in ("libllama.so.0", "libggml-cpu.so.0", "libmtmd.so.0"):  # its own copies, not the installed wheel's
        assert Path(loaded[name]).resolve() == (root / "lib" / name).resolve()
    assert "0.5.0-dev" in server_version(build.server_bin)


def test_a_copy_of_the_linked_llama_server_elsewhere_still_runs(tmp_path):
    build = ensure_server()
    copy = tmp_path / "llama-server"
    shutil.copy2(build.server_bin, copy)
    assert server_version(copy) == server_version(build.server_bin)


@pytest.mark.skipif(shutil.which("ninja") is None, reason="the linked build needs Ninja (apt-get install ninja-build)")
def test_the_plan_for_the_vendored_tree_compiles_no_object_of_libllama_ggml_or_mtmd():
    ensure_server()  # configures the vendored tree's persistent build tree
    plan = link_plan(build_tree_dir(vendored_source().resolve(), "cpu", cmake_options("cpu")) / "build", TARGETS)
    assert [o for o in plan.objects if o.startswith(("src/", "ggml/", "tools/mtmd/"))] == []
    assert "tools/server/CMakeFiles/server-context.dir/server-context.cpp.o" in plan.objects
    assert "common/CMakeFiles/llama-common.dir/speculative.cpp.o" in plan.objects
    assert {"common/libllama-common.a", "tools/server/libserver-context.a"} <= set(plan.archives)
    assert not set(plan.archives) & set(ARCHIVES)
    assert all(" ar " in command or "/ar " in command for command in plan.archives.values())
