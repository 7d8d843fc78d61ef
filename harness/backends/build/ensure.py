"""A llama-server for (source, backend, CMake arguments), cached by source identity: `ensure_server` builds it
once (the key hashes source identity, backend and CMake arguments), `cached_server` finds it, `prebuilt_server`
takes a binary built elsewhere."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from harness import interrupt
from harness.backends.build.cmake import _build_into, check_platform, cmake_options
from harness.backends.build.entry import (
    BuildInfo,
    _locked,
    _remove_stale_temps,
    _replace_dir,
    load_build,
    mark_used,
    require_executable,
)
from harness.backends.build.replay_build import replay_digest
from harness.backends.build.sources import (
    SourceIdentity,
    extracted_source,
    source_identity,
    tree_digest,
    vendored_source,
)
from harness.backends.build.wheel_link import (
    LINK_FORMAT,
    WheelLibraries,
    installed_libraries,
    library_digest,
)
from harness.backends.flags import server_version
from harness.paths import cache_dir


def build_key(identity: SourceIdentity, backend: str, args: list[str], libraries: WheelLibraries | None = None) -> str:
    """The cache directory name of a build: backend, short commit and a hash of everything that matters (the
    source of the `llama-replay` built beside it, and the shared libraries it links, when it links
    llama-cpp-python's)."""
    data = {"source": [identity.commit, identity.digest], "backend": backend, "cmake": args, "replay": replay_digest()}
    if libraries is not None:
        data["link"] = [LINK_FORMAT, libraries.digest]
    blob = json.dumps(data)
    return f"{backend}-{identity.commit[:8]}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def ensure_server(
    source: Path | None = None,
    backend: str = "cpu",
    cmake_args: list[str] | None = None,
    jobs: int | None = None,
    server_bin: Path | None = None,
) -> BuildInfo:
    """A llama-server for (source, backend, extra CMake args): cached if built before, else built now.

    `source` None means the tree vendored in the installed llama-cpp-python; `cmake_args` are
    appended to `cmake_options(backend)`; `jobs` None uses every core. `server_bin` skips building
    and only validates that binary. Raises HarnessError with a one-line reason (a failed build also
    carries the last lines of its log).
    """
    interrupt.phase("building")
    if server_bin is not None:
        return prebuilt_server(server_bin)
    source, identity, args, libraries, root = _entry(source, backend, cmake_args)
    cached = load_build(root)
    if cached is not None:
        return mark_used(cached)
    root.parent.mkdir(parents=True, exist_ok=True)
    with _locked(root, f"llama-server {identity} ({backend})"):
        cached = load_build(root)  # built by another process while we waited for the lock
        if cached is not None:
            return mark_used(cached)
        return mark_used(_build(source, identity, backend, args, root, jobs or os.cpu_count() or 1, libraries))


def cached_server(source: Path, backend: str = "cpu", cmake_args: list[str] | None = None) -> BuildInfo | None:
    """The cached llama-server of (source, backend, CMake args), or None when it would have to be built."""
    return load_build(_entry(source, backend, cmake_args)[-1])


def _entry(source: Path | None, backend: str, cmake_args: list[str] | None):
    """(source, identity, CMake args, linked libraries, cache entry) of a build of `source` (None: vendored)."""
    check_platform(backend)
    args = cmake_options(backend, list(cmake_args or []))
    source = (source or vendored_source()).resolve()
    identity = source_identity(source)
    libraries = linkable_libraries(source, backend, list(cmake_args or []))
    return source, identity, args, libraries, cache_dir() / "builds" / build_key(identity, backend, args, libraries)


def linkable_libraries(source: Path, backend: str, extra: list[str]) -> WheelLibraries | None:
    """The installed llama-cpp-python's shared libraries when a build of `source` may link them instead of
    compiling libllama, ggml and mtmd again (harness/backends/build/wheel_link.py): a CPU build without extra CMake
    options, with Ninja, whose library sources equal those of the vendored tree the wheel was compiled from
    (already extracted: deciding never downloads). None otherwise: everything is compiled."""
    if backend != "cpu" or extra or not shutil.which("ninja"):
        return None
    libraries = installed_libraries()
    if libraries is None:
        return None
    vendored = extracted_source(libraries.version)
    if vendored is None:
        return None
    same = source == vendored.resolve() or library_digest(source, tree_digest) == _vendored_library_digest(vendored)
    return libraries if same else None


@functools.lru_cache(maxsize=4)
def _vendored_library_digest(vendored: Path) -> str:
    """The library digest of an extracted vendored tree (written once, never edited by the harness): once a process."""
    return library_digest(vendored, tree_digest)


def prebuilt_server(server_bin: Path) -> BuildInfo:
    """BuildInfo for an existing llama-server binary (commit from `--version`); validates it runs.

    A tree without git (the vendored sdist) builds a binary whose `--version` says `commit unknown`: when the
    binary is one of this harness's builds (`<build>/bin/llama-server` beside its `build-info.json`), that
    build's record is used instead, which knows the commit."""
    server_bin = require_executable(Path(server_bin).expanduser().resolve())
    version = server_version(server_bin)
    commit = re.search(r"(?:commit |\()(\w+)\)", version)  # "(build N, commit X)" or "(X)"
    if not commit or commit.group(1) == "unknown":
        built = load_build(server_bin.parent.parent)
        if built is not None and built.server_bin.resolve() == server_bin:
            return mark_used(built)
    quantize = server_bin.with_name("llama-quantize")
    return BuildInfo(
        server_bin=server_bin,
        quantize_bin=quantize if quantize.is_file() else None,
        replay_bin=replay if (replay := server_bin.with_name("llama-replay")).is_file() else None,
        commit=commit.group(1) if commit else "unknown",
        dirty=False,
        backend=_device_kind(server_bin),
        cmake_args=[],
        compiler="unknown",
        built_at="unknown",
        source="unknown",
        source_identity=version,
        cached=True,
    )


def _device_kind(server_bin: Path) -> str:
    """cpu, cuda, metal or gpu: the first device `--list-devices` shows (none = cpu)."""
    try:
        out = subprocess.run([str(server_bin), "--list-devices"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    devices = [line.strip() for line in out.splitlines()[1:] if line.strip() and line.strip() != "(none)"]
    if not devices:
        return "cpu"
    return next((kind for prefix, kind in (("CUDA", "cuda"), ("MTL", "metal")) if devices[0].startswith(prefix)), "gpu")


def _build(
    source: Path,
    identity: SourceIdentity,
    backend: str,
    args: list[str],
    root: Path,
    jobs: int,
    libraries: WheelLibraries | None = None,
) -> BuildInfo:
    """Configure and build into `<root>.tmp-<pid>`, keep bin/ (and lib/) + info + log, move to `root` (called
    under the key's lock; an unusable entry already in `root` is replaced)."""
    _remove_stale_temps(root)
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = _build_into(tmp, source, identity, backend, args, root, jobs, libraries)
        _replace_dir(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info
