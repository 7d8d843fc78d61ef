"""Link llama-server against llama-cpp-python's own libllama, libggml and libmtmd, when they were compiled from the
very library sources of the tree being built.

Installing llama-cpp-python compiles the llama.cpp vendored in its sdist (src/, ggml/, tools/mtmd/) into shared
libraries; building llama-server from that same tree compiled all of it a second time (about half of a cold
build's compile time: docs/benchmarks.md). A tree whose library sources are byte for byte the wheel's (the
vendored tree itself, and the copies that change only tools/server or common, such as the seeded fixtures and
the bisect history of the tests) now compiles only llama-server's own code, common and the HTTP library: the
final link takes the wheel's shared libraries in place of the static archives of the same sources. Any other
tree, backend or extra CMake option builds everything from source as before.

The compile commands are those of the static build (same persistent tree, same configure), so the compiler
cache serves both; only the link differs. The libraries are copied into the build entry (`lib/`, found through
the binary's `$ORIGIN/../lib` run path), so a later reinstall of llama-cpp-python cannot change a cached build;
the build key hashes them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError

LIBRARY_SOURCES = ("CMakeLists.txt", "cmake", "include", "src", "ggml", "tools/mtmd", "vendor")
"""What the wheel's shared libraries are compiled from (relative to the llama.cpp root): llama.cpp's top-level
CMake and its flags, the public headers, libllama, ggml and mtmd, and the vendored code they include."""

ARCHIVES = {
    "src/libllama.a": "libllama.so",
    "ggml/src/libggml.a": "libggml.so",
    "ggml/src/libggml-base.a": "libggml-base.so",
    "ggml/src/libggml-cpu.a": "libggml-cpu.so",
    "tools/mtmd/libmtmd.a": "libmtmd.so",
}
"""Static archive of the build tree -> the wheel's shared library of the same target."""

RUN_PATH = "-Wl,-rpath,$ORIGIN/../lib"

LINK_FORMAT = 2
"""Part of the build key of a linked build: raised when the way it links changes (2: the entry's own lib/ as a
second run path, so copies of the binary run)."""


@dataclass(frozen=True)
class WheelLibraries:
    """The shared libraries of the installed llama-cpp-python."""

    lib_dir: Path
    version: str
    digest: str
    """sha256 over the libraries' names and bytes: part of the build key."""

    def describe(self) -> str:
        names = ", ".join(name.removesuffix(".so") for name in ARCHIVES.values())
        return f"llama-cpp-python {self.version}'s {names} (sha256 {self.digest[:12]})"


def installed_libraries() -> WheelLibraries | None:
    """The installed llama-cpp-python's shared libraries, or None when it is not installed or lacks one of them
    (found without importing llama_cpp, which would load them)."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
        spec = importlib.util.find_spec("llama_cpp")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = Path(next(iter(spec.submodule_search_locations))) / "lib"
    digest = hashlib.sha256()
    for name in sorted(ARCHIVES.values()):
        path = lib_dir / name
        if not path.is_file():
            return None
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return WheelLibraries(lib_dir=lib_dir, version=version, digest=digest.hexdigest())


def library_digest(tree: Path, digest_files) -> str:
    """sha256 over the LIBRARY_SOURCES of `tree`; `digest_files(tree, paths)` hashes the files (build.py's)."""
    return digest_files(tree, [p for p in LIBRARY_SOURCES if (tree / p).exists()])


@dataclass
class LinkPlan:
    """How to make TARGETS of a configured Ninja tree without compiling the libraries the wheel has.

    Ninja cannot be asked for the other archives: CMake makes every static library wait for the archives of
    its link dependencies (order-only), libllama's among them. So ninja compiles only the objects, the archive
    commands CMake generated run after it, and the links take the wheel's libraries."""

    objects: list[str]
    """Object files ninja compiles (the targets' own and the members of the archives they link)."""
    archives: dict[str, str]
    """Archive of the build tree -> the shell command CMake generated to make it from its objects."""
    links: dict[str, list[str]]
    """Target -> the argv of its final link, as CMake generated it (still naming the static ARCHIVES)."""


def link_plan(build_dir: Path, targets: tuple[str, ...]) -> LinkPlan:
    """The LinkPlan of `targets` in the Ninja tree `build_dir`; HarnessError when a link command is not one plain
    compiler call that links libllama (and, for llama-server, every archive of ARCHIVES)."""
    links = {target: link_command(build_dir, target) for target in targets}
    inputs = sorted({i for argv in links.values() for i in link_inputs(argv)})
    objects = [i for i in inputs if i.endswith(".o")]
    archives = {}
    for archive in (i for i in inputs if i.endswith(".a")):
        objects += _explicit_inputs(build_dir, archive)
        archives[archive] = _ninja_tool(build_dir, "commands", "-s", archive)
    return LinkPlan(objects=sorted(set(objects)), archives=archives, links=links)


def link_command(build_dir: Path, target: str) -> list[str]:
    argv = shlex.split(_ninja_tool(build_dir, "commands", "-s", f"bin/{target}"))
    if argv[:2] == [":", "&&"] and argv[-2:] == ["&&", ":"]:
        argv = argv[2:-2]
    if not argv or "&&" in argv or ";" in argv or "-o" not in argv:
        raise HarnessError(f"no plain link command for bin/{target} in {build_dir}")
    wanted = ARCHIVES if target == "llama-server" else ["src/libllama.a"]  # llama-quantize links no mtmd
    missing = [a for a in wanted if a not in argv]
    if missing:
        raise HarnessError(f"the link of bin/{target} takes no {', '.join(missing)}")
    return argv


def _explicit_inputs(build_dir: Path, output: str) -> list[str]:
    """The explicit inputs of `output`'s build statement (`ninja -t query`; `|` and `||` lines are implicit and
    order-only)."""
    text = _ninja_tool(build_dir, "query", output)
    block = text.split("  input:", 1)[-1].split("  outputs:", 1)[0].splitlines()[1:]
    found = [line.strip() for line in block if line.strip() and not line.strip().startswith("|")]
    if not found:
        raise HarnessError(f"ninja names no inputs of {output} in {build_dir}")
    return found


def _ninja_tool(build_dir: Path, *args: str) -> str:
    proc = subprocess.run(["ninja", "-C", str(build_dir), "-t", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessError(f"ninja -t {' '.join(args)} failed in {build_dir}: {proc.stderr.strip()[:200]}")
    return proc.stdout.strip()


def link_inputs(argv: list[str]) -> list[str]:
    """The files of the build tree a link command reads (objects and archives), but the ARCHIVES the wheel
    replaces: what ninja must build first."""
    out = argv[argv.index("-o") + 1]
    built = (a for a in argv[1:] if a.endswith((".o", ".a")) and not a.startswith("/"))
    return [a for a in built if a not in ARCHIVES and a != out]


def relinked(argv: list[str], lib_dir: Path, output: Path, final_lib_dir: Path | None = None) -> list[str]:
    """The link command with the wheel's libraries (in `lib_dir`) for the archives, `output` for its `-o` and the
    run path `$ORIGIN/../lib`, then `final_lib_dir` (where `lib_dir` will be once the build entry is in place), so
    a copy of the binary elsewhere (`--server-bin`, a bisect step command) still finds them."""
    new = [str(lib_dir / ARCHIVES[a]) if a in ARCHIVES else a for a in argv]
    new[new.index("-o") + 1] = str(output)
    return [*new, RUN_PATH + (f":{final_lib_dir}" if final_lib_dir else "")]


def copy_libraries(libs: WheelLibraries, dest: Path) -> None:
    """Copy the wheel's shared libraries, their versioned names (symlinks kept) included, into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(libs.lib_dir.iterdir()):
        if path.name.startswith("lib") and ".so" in path.name:
            shutil.copy2(path, dest / path.name, follow_symlinks=False)
