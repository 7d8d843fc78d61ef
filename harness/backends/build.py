"""Build llama-server (and llama-quantize) from a llama.cpp source tree, cached by source identity.

A build lives in `cache_dir()/builds/<key>/` with `bin/llama-server`, `bin/llama-quantize`,
`build-info.json` and `build.log`; the key hashes (source identity, backend, CMake arguments).
Entries are assembled in a temporary sibling directory that is renamed into place only when complete,
under a file lock `<key>.lock` beside the entry, so parallel processes (`pytest -n auto`) build each key
once. An entry whose `build-info.json` cannot be read is treated as missing: rebuilt and replaced.

Compiling happens in a persistent build tree per (source directory, backend, options) with ccache as
the compiler launcher when it is installed, so a new commit of a checkout recompiles only the files it
changed and a copy of a tree built before costs little (see "persistent build trees" below).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from harness import interrupt
from harness.backends.flags import server_version
from harness.backends.wheel_link import (
    LINK_FORMAT,
    WheelLibraries,
    copy_libraries,
    installed_libraries,
    library_digest,
    link_plan,
    relinked,
)
from harness.errors import HarnessError
from harness.paths import cache_dir

BACKENDS = ("cpu", "cuda", "metal")
TARGETS = ("llama-server", "llama-quantize")
SOURCE_SUFFIXES = frozenset(
    ".c .cc .cpp .cxx .h .hh .hpp .inc .cu .cuh .m .mm .metal .comp .glsl .wgsl .cl .cmake .in .s .S".split()
)
SKIP_DIRS = frozenset({".git", "models", "node_modules", "__pycache__"})
SOURCE_MARKER = ".specharness-source.json"
"""Written into a tree extracted from the llama-cpp-python sdist: records the vendored llama.cpp commit."""
LOG_TAIL_LINES = 40


@dataclass
class BuildInfo:
    """A usable llama-server binary and where it came from (the content of `build-info.json`)."""

    server_bin: Path
    quantize_bin: Path | None
    commit: str
    dirty: bool
    backend: str
    cmake_args: list[str]
    compiler: str
    built_at: str
    source: str
    source_identity: str
    build_seconds: float = 0.0
    linked_libraries: str = ""
    """The llama-cpp-python libraries the binaries link (in the entry's lib/), or '' when compiled in."""
    tag: str = ""
    """The upstream build tag (bN) of the tree, when it is a tag's tree (`specharness build --tag`), else ''."""
    cached: bool = False
    """True when this call reused an existing build (not stored in build-info.json)."""

    def to_json(self) -> dict:
        """The `build-info.json` content (paths as strings, without `cached`)."""
        data = asdict(self)
        data.pop("cached")
        data["server_bin"] = str(self.server_bin)
        data["quantize_bin"] = str(self.quantize_bin) if self.quantize_bin else None
        return data

    @classmethod
    def from_json(cls, data: dict, root: Path) -> BuildInfo:
        """Load `build-info.json` of the build in `root`; binary paths are resolved inside `root`."""
        data = dict(data, cached=True)
        data["server_bin"] = root / "bin" / "llama-server"
        data["quantize_bin"] = root / "bin" / "llama-quantize"
        return cls(**data)


def cmake_options(backend: str, extra: list[str] = ()) -> list[str]:
    """The CMake cache options for `backend` (cpu, cuda, metal) followed by the user's `extra` ones.

    Self-contained Release binary, no network access at configure or build time (no curl, no openssl,
    no web UI download), no tests or examples. `extra` comes last so it can override anything.
    """
    if backend not in BACKENDS:
        raise HarnessError(f"unknown build backend '{backend}' (use one of: {', '.join(BACKENDS)})")
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        f"-DGGML_CUDA={'ON' if backend == 'cuda' else 'OFF'}",
        f"-DGGML_METAL={'ON' if backend == 'metal' else 'OFF'}",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        *extra,
    ]


def check_platform(backend: str, system: str | None = None) -> None:
    """Refuse backends that cannot be built on `system` (default: this one); Metal needs macOS."""
    system = system or platform.system()
    if backend == "metal" and system != "Darwin":
        raise HarnessError(f"the metal backend needs macOS, this is {system}; use --backend cpu or cuda")


# ---------------------------------------------------------------------------------------- sources


def vendored_source(version: str | None = None) -> Path:
    """The llama.cpp tree vendored in llama-cpp-python `version` (default: the installed one), fetched
    and extracted once.

    Downloads the matching sdist with pip into the cache and extracts only `vendor/llama.cpp` into
    `cache_dir()/src/llama.cpp-<version>/`, recording the submodule commit the sdist carries.
    """
    version = version or installed_version()
    dest = cache_dir() / "src" / f"llama.cpp-{version}"
    if _valid_marker(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest, f"the llama.cpp {version} sources"):  # one download and extraction at a time
        if _valid_marker(dest):  # extracted by another process while we waited
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".extract-") as tmp:
            tree = Path(tmp) / "llama.cpp"
            commit = _extract_sdist(version, tree)
            (tree / SOURCE_MARKER).write_text(
                json.dumps({"commit": commit, "origin": f"llama-cpp-python {version} sdist"}) + "\n"
            )
            _replace_dir(tree, dest)  # dest may hold an earlier extraction with a bad or missing marker
    return dest


def installed_version() -> str:
    """The installed llama-cpp-python's version; HarnessError when it is not installed."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        raise HarnessError("llama-cpp-python is not installed; install it or pass --source DIR") from None


def _valid_marker(tree: Path) -> bool:
    """Whether `tree` has a readable extraction marker (a missing or corrupt one means: extract again)."""
    try:
        read_marker(tree / SOURCE_MARKER)
    except HarnessError:
        return False
    return True


def tag_of(tree: Path) -> str | None:
    """The upstream tag (bN) recorded in an extracted tree's marker (harness/backends/tags.py), or None."""
    try:
        tag = json.loads((Path(tree) / SOURCE_MARKER).read_text()).get("tag")
    except (OSError, ValueError, AttributeError):
        return None
    return tag if isinstance(tag, str) and re.fullmatch(r"b\d+", tag) else None


def read_marker(marker: Path) -> str:
    """The commit recorded in an extraction marker; a one-line HarnessError if it is missing or corrupt."""
    try:
        data = json.loads(marker.read_text())
        commit = data.get("commit", "unknown")
        if not isinstance(commit, str) or not commit:
            raise ValueError(f"bad commit {commit!r}")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as err:
        reason = " ".join(str(err).split())
        raise HarnessError(f"unreadable source marker {marker} ({reason}); delete it and run again") from None
    return commit


def _extract_sdist(version: str, tree: Path) -> str:
    """Extract the vendored tree of llama-cpp-python `version`'s sdist into `tree` (harness: extract_fetched)."""
    return extract_fetched(lambda: _download_sdist(version), _extract_vendored, tree)


def extract_fetched(fetch: Callable[[], Path], extract: Callable[[Path, Path], str], tree: Path) -> str:
    """`extract(fetch(), tree)`; a corrupt download is deleted and fetched again once."""
    retries = 1
    while True:
        sdist = fetch()
        try:
            return extract(sdist, tree)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as err:  # truncated or garbled archive
            shutil.rmtree(tree, ignore_errors=True)
            sdist.unlink(missing_ok=True)
            if not retries:
                reason = " ".join(str(err).split())
                raise HarnessError(f"cannot extract {sdist} (deleted; run again): {reason}") from None
            retries -= 1


def _download_sdist(version: str) -> Path:
    """The llama-cpp-python sdist of `version` in `cache_dir()/downloads`, fetched with pip if missing."""
    return pip_sdist("llama-cpp-python", version, f"llama_cpp_python-{version}.tar.gz", ":all:")


class NotInIndex(HarnessError):
    """pip found no such version of the package in the package index."""


def pip_sdist(package: str, version: str, filename: str, no_binary: str) -> Path:
    """`package==version`'s sdist `filename` in `cache_dir()/downloads`, fetched with pip when missing (into a
    scratch folder first: a cut download never lands in the cache). `no_binary` is pip's `--no-binary` (the
    package, to let its build requirements come as wheels, or `:all:`)."""
    target = cache_dir() / "downloads" / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", no_binary]
        proc = subprocess.run([*cmd, "--dest", scratch, f"{package}=={version}"], capture_output=True, text=True)
        fetched = Path(scratch) / filename
        if proc.returncode != 0 or not fetched.is_file():
            text = proc.stderr + proc.stdout
            last = ([ln for ln in text.strip().splitlines() if not ln.startswith("WARNING")] or ["no output"])[-1]
            missing = "No matching distribution" in text or "Could not find a version" in text
            raise (NotInIndex if missing else HarnessError)(
                f"could not download the {package} {version} sdist with pip: {last}"
            )
        fetched.replace(target)
    return target


def _extract_vendored(sdist: Path, tree: Path) -> str:
    """Extract `<top>/vendor/llama.cpp/` of `sdist` into `tree`; return the submodule commit or 'unknown'."""
    commit = "unknown"
    with tarfile.open(sdist) as tar:
        for member in tar:
            rest = member.name.partition("/")[2]
            if rest == ".git/modules/vendor/llama.cpp/HEAD":
                commit = tar.extractfile(member).read().decode().strip() or commit
            elif rest.startswith("vendor/llama.cpp/") and rest != "vendor/llama.cpp/.git":
                # the `.git` gitlink points into the sdist's own .git, which is not extracted
                member.name = rest[len("vendor/llama.cpp/") :]
                tar.extract(member, tree, filter="data")
    if not (tree / "CMakeLists.txt").is_file():
        raise HarnessError(f"{sdist.name} has no vendor/llama.cpp tree")
    return commit


@dataclass(frozen=True)
class SourceIdentity:
    """What a source tree is: its commit (or 'unknown') and a digest that changes with any edit."""

    commit: str
    dirty: bool
    digest: str

    def __str__(self) -> str:
        return f"{self.commit}+{self.digest[:12]}" if self.dirty or self.commit == "unknown" else self.commit


def source_identity(source: Path) -> SourceIdentity:
    """Identity of a llama.cpp tree: git commit + hash of uncommitted changes, or a content hash.

    A git checkout (the tree is the top of its own repository) is identified by HEAD plus a sha256
    of `git diff HEAD` and of untracked source files. A plain tree is identified by a sha256 over
    its source-like files (see `tree_digest`); its commit is read from the extraction marker.
    """
    if not (source / "CMakeLists.txt").is_file():
        raise HarnessError(f"{source} is not a llama.cpp source tree (no CMakeLists.txt)")
    head = _git(source, "rev-parse", "--show-toplevel", "HEAD")
    if head and Path(head.splitlines()[0]).resolve() == source.resolve():
        return _git_identity(source, head.splitlines()[1])
    marker = source / SOURCE_MARKER
    commit = read_marker(marker) if marker.exists() else "unknown"
    return SourceIdentity(commit=commit, dirty=False, digest=tree_digest(source))


def _git(source: Path, *args: str) -> str | None:
    """Output of `git -C source args...`, or None when git is missing or the command fails."""
    try:
        proc = subprocess.run(["git", "-C", str(source), *args], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.decode(errors="replace").strip() if proc.returncode == 0 else None


def _git_identity(source: Path, commit: str) -> SourceIdentity:
    digest = hashlib.sha256()
    diff = subprocess.run(["git", "-C", str(source), "diff", "--binary", "HEAD"], capture_output=True, check=True)
    digest.update(diff.stdout)
    untracked = _git(source, "ls-files", "--others", "--exclude-standard", "-z") or ""
    paths = sorted(p for p in untracked.split("\0") if p and _is_source(p))
    for rel in paths:
        digest.update(rel.encode() + b"\0" + (source / rel).read_bytes())
    return SourceIdentity(commit=commit, dirty=bool(diff.stdout or paths), digest=digest.hexdigest())


def _skip_dir(name: str) -> bool:
    """Directories that hold no build input: VCS data, models, build outputs, hidden directories."""
    return name in SKIP_DIRS or name.startswith((".", "build"))


def _is_source(rel: str) -> bool:
    """Whether the file at relative path `rel` is a build input (by name, outside skipped directories)."""
    *dirs, base = rel.split("/")
    if any(_skip_dir(d) for d in dirs):
        return False
    return base == "CMakeLists.txt" or os.path.splitext(base)[1] in SOURCE_SUFFIXES


def tree_digest(source: Path, only: list[str] | None = None) -> str:
    """sha256 over the relative path and bytes of every source-like file under `source` (or only under its
    relative paths `only`, files or directories).

    Skips `.git`, `models/`, `node_modules/`, `build*` directories and hidden directories.
    """
    files: list[str] = [p for p in only or () if (source / p).is_file() and _is_source(p)]
    stack = [p for p in only if (source / p).is_dir()] if only is not None else [""]
    while stack:
        rel = stack.pop()
        with os.scandir(source / rel) as entries:
            for entry in entries:
                path = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if not _skip_dir(entry.name):
                        stack.append(path)
                elif entry.is_file() and _is_source(entry.name):
                    files.append(path)
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + (source / rel).read_bytes() + b"\0")
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------ builds


def build_key(identity: SourceIdentity, backend: str, args: list[str], libraries: WheelLibraries | None = None) -> str:
    """The cache directory name of a build: backend, short commit and a hash of everything that matters (with
    the shared libraries it links, when it links llama-cpp-python's)."""
    data = {"source": [identity.commit, identity.digest], "backend": backend, "cmake": args}
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


LAST_USED = "last-used"
"""A file in a build entry whose modification time is when a command last asked for the build."""


def mark_used(info: BuildInfo) -> BuildInfo:
    """Record that `info`'s build was asked for now (`specharness build --list` and `--prune` read it)."""
    with suppress(OSError):
        (info.server_bin.parent.parent / LAST_USED).touch()
    return info


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


def extracted_source(version: str) -> Path | None:
    """The vendored tree of llama-cpp-python `version` when it is already extracted in the cache, else None."""
    tree = cache_dir() / "src" / f"llama.cpp-{version}"
    return tree if _valid_marker(tree) else None


def linkable_libraries(source: Path, backend: str, extra: list[str]) -> WheelLibraries | None:
    """The installed llama-cpp-python's shared libraries when a build of `source` may link them instead of
    compiling libllama, ggml and mtmd again (harness/backends/wheel_link.py): a CPU build without extra CMake
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


def load_build(root: Path) -> BuildInfo | None:
    """The build cached in `root`, or None when there is none or it is unusable (unreadable or
    incomplete `build-info.json`, missing binary): such an entry is rebuilt and replaced."""
    try:
        if not (root / "bin" / "llama-server").is_file():
            return None
        data = json.loads((root / "build-info.json").read_text())
        if not isinstance(data, dict):
            return None
        info = BuildInfo.from_json(data, root)
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        return None
    wanted = {"commit": str, "dirty": bool, "backend": str, "cmake_args": list, "compiler": str, "source_identity": str}
    return info if all(isinstance(getattr(info, k), t) for k, t in wanted.items()) else None


@contextmanager
def _locked(target: Path, what: str):
    """Hold the file lock `<target>.lock`, saying so on stderr when another process holds it first."""
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting for another process preparing {what} (lock {lock.lock_file})", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


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


def require_executable(path: Path) -> Path:
    """`path` if it is an executable file, else HarnessError."""
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        raise HarnessError(f"llama-server binary {path} does not exist or is not executable")
    return path


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


def _replace_dir(new: Path, dest: Path) -> None:
    """Rename the complete tree `new` to `dest`; an existing `dest` is first renamed aside, then deleted.

    Each rename is atomic: `dest` is at any moment either the old tree, absent, or the new tree,
    never a half-written one. Callers hold the lock of `dest`.
    """
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
        _remove_path(old)
        dest.rename(old)
    new.rename(dest)
    if old is not None:
        _remove_path(old)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _build_into(
    tmp: Path,
    source: Path,
    identity: SourceIdentity,
    backend: str,
    args: list[str],
    root: Path,
    jobs: int,
    libraries: WheelLibraries | None,
) -> BuildInfo:
    """Build in the persistent tree of (source, backend, args), then put the binaries into `tmp/bin` (linked
    against `libraries`, copied into `tmp/lib`, when given and the link works; else compiled in)."""
    log_path = tmp / "build.log"
    tmp.mkdir(parents=True)
    started = time.monotonic()
    stats_log = tmp / "ccache-stats.log"
    env = compiler_cache_env(stats_log)
    with _mounted_tree(source, backend, args) as work, open(log_path, "w") as log:
        build_dir = work / "build"
        what = f"against {libraries.describe()}" if libraries else "with its libraries compiled in"
        print(
            f"building llama-server {identity} ({backend}) {what}, with {jobs} jobs in "
            f"{build_tree_dir(source, backend, args)}; log: {log_path}",
            file=sys.stderr,
        )
        if not _configured(build_dir):  # a configured tree re-runs CMake by itself when a CMakeLists.txt changes
            configure = ["cmake", "-S", str(work / "src"), "-B", str(build_dir), *_toolchain_args(backend), *args]
            _step(root, log_path, log, "configure", configure, env)
        (tmp / "bin").mkdir()
        linked = libraries is not None and _link_to_libraries(
            libraries, build_dir, tmp, root, jobs, log, env, lambda step: _fail(root, log_path, step)
        )
        if not linked:
            build = ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TARGETS]
            _step(root, log_path, log, "build", build, env)
            for target in TARGETS:
                shutil.copy2(build_dir / "bin" / target, tmp / "bin" / target)
        compiler = _compiler(build_dir)
    hits = compiler_cache_hits(stats_log)
    stats_log.unlink(missing_ok=True)
    info = BuildInfo(
        server_bin=root / "bin" / "llama-server",
        quantize_bin=root / "bin" / "llama-quantize",
        commit=identity.commit,
        dirty=identity.dirty,
        backend=backend,
        cmake_args=args,
        compiler=compiler,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        source=str(source),
        source_identity=str(identity),
        build_seconds=round(time.monotonic() - started, 1),
        linked_libraries=libraries.describe() if linked else "",
        tag=tag_of(source) or "",
    )
    with open(log_path, "a") as log:
        log.write(f"# compiler cache: {hits}\n" if hits else "# compiler cache: not used\n")
    (tmp / "build-info.json").write_text(json.dumps(info.to_json(), indent=2) + "\n")
    return info


def _step(root: Path, log_path: Path, log, step: str, cmd: list[str], env: dict) -> None:
    """Run one build step with its command line and output in the build log; a failure ends the build."""
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    if _run_logged(cmd, log, env) != 0:
        _fail(root, log_path, step)


def _link_to_libraries(
    libraries: WheelLibraries,
    build_dir: Path,
    tmp: Path,
    root: Path,
    jobs: int,
    log,
    env: dict,
    fail: Callable[[str], None],
) -> bool:
    """Compile what TARGETS need but the wheel's libraries (a compile error ends the build through `fail`), make
    their other archives, then link each into `tmp/bin` against copies of those libraries in `tmp/lib` (run path:
    beside the binary, then `root/lib`, where the entry will be). False
    (said in the log) when the tree's commands are not as expected or an archive or link step fails: the caller
    then compiles the libraries as well."""
    try:
        plan = link_plan(build_dir, TARGETS)
    except HarnessError as err:
        log.write(f"# not linking llama-cpp-python's libraries: {err}\n")
        return False
    compile_ = ["ninja", "-C", str(build_dir), "-j", str(jobs), *plan.objects]
    log.write("$ " + " ".join(compile_) + "\n")
    log.flush()
    if _run_logged(compile_, log, env) != 0:
        fail("build")
    copy_libraries(libraries, tmp / "lib")
    steps = [["/bin/sh", "-c", command] for command in plan.archives.values()]
    final = root / "lib"
    steps += [relinked(argv, tmp / "lib", tmp / "bin" / target, final) for target, argv in plan.links.items()]
    for cmd in steps:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        if _run_logged(cmd, log, env, cwd=build_dir) != 0:
            log.write("# linking llama-cpp-python's libraries failed; compiling them instead\n")
            shutil.rmtree(tmp / "lib", ignore_errors=True)
            return False
    return True


# --------------------------------------------------------------------------- persistent build trees
#
# Every build happens in one persistent CMake/Ninja tree per (source directory, backend, options), kept
# in `cache_dir()/trees/<name>/`: a later build of the same checkout at another commit recompiles only
# what changed (Ninja's own dependency tracking). While it builds, the tree is renamed to the fixed
# path `cache_dir()/work/`, whose `src` is a symlink to the source: every build of every source then
# runs the very same compiler command lines, so the compiler cache (ccache) also serves a different
# directory holding nearly the same tree, e.g. a copy of the vendored llama.cpp with one edit. One
# build at a time per cache (the work path is one); a tree left at the work path by a killed process
# is put back first.

TREE_MARKER = ".specharness-tree"


def build_tree_dir(source: Path, backend: str, args: list[str]) -> Path:
    """The persistent build tree of (source directory, backend, CMake arguments)."""
    blob = json.dumps({"source": str(Path(source).resolve()), "backend": backend, "cmake": args})
    return cache_dir() / "trees" / f"{backend}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


@contextmanager
def _mounted_tree(source: Path, backend: str, args: list[str]):
    """The tree of (source, backend, args) at the work path, under the work lock; put back afterwards."""
    work = cache_dir() / "work"
    home = build_tree_dir(source, backend, args)
    with _locked(work, "the build work tree (one build at a time)"):
        _unmount(work)
        home.parent.mkdir(parents=True, exist_ok=True)
        if home.is_dir():
            home.rename(work)
        else:
            (work / "build").mkdir(parents=True)
        try:
            (work / TREE_MARKER).write_text(home.name + "\n")
            link = work / "src"
            link.unlink(missing_ok=True)
            link.symlink_to(Path(source).resolve(), target_is_directory=True)
            yield work
        finally:
            _unmount(work)


def _unmount(work: Path) -> None:
    """Move the tree at the work path (if any) back to its home; one without a readable marker is deleted."""
    if not work.exists():
        return
    try:
        name = (work / TREE_MARKER).read_text().strip()
    except OSError:
        name = ""
    home = work.parent / "trees" / name
    if not name or "/" in name or home.exists():
        shutil.rmtree(work, ignore_errors=True)
    else:
        work.rename(home)


def _configured(build_dir: Path) -> bool:
    """Whether a configure step completed in `build_dir` (it wrote the generator's build file)."""
    return (build_dir / "build.ninja").is_file() or (build_dir / "Makefile").is_file()


def compiler_cache_env(stats_log: Path | None = None) -> dict:
    """The environment of a build: ccache keeps its cache in `cache_dir()/ccache` (unless CCACHE_DIR is
    set) and, with `stats_log`, records there the outcome of every compilation of this build."""
    env = dict(os.environ)
    env.setdefault("CCACHE_DIR", str(cache_dir() / "ccache"))
    if stats_log is not None:
        env["CCACHE_STATSLOG"] = str(stats_log)
    return env


def compiler_cache_hits(stats_log: Path) -> str:
    """'H of N compilations from the compiler cache' from a ccache stats log ('' when ccache was not used)."""
    try:
        lines = stats_log.read_text().split()
    except OSError:
        return ""
    hits = sum(1 for w in lines if w in ("direct_cache_hit", "preprocessed_cache_hit"))
    total = hits + sum(1 for w in lines if w == "cache_miss")
    return f"{hits} of {total} compilations from the compiler cache" if total else ""


def _toolchain_args(backend: str) -> list[str]:
    """Generator and compiler launcher options that do not change the binary (not part of the key)."""
    args = ["-G", "Ninja"] if shutil.which("ninja") else []
    if shutil.which("ccache"):
        langs = ("C", "CXX", "CUDA") if backend == "cuda" else ("C", "CXX")
        args += [f"-DCMAKE_{lang}_COMPILER_LAUNCHER=ccache" for lang in langs]
    return args


def _run_logged(cmd: list[str], log, env: dict | None = None, cwd: Path | None = None) -> int:
    """Run `cmd` with stdout and stderr appended to `log`, in a process group of its own; on Ctrl-C or
    SIGTERM kills the whole group (cmake, ninja and every compiler) and re-raises."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as err:
        raise HarnessError(f"cannot run {cmd[0]}: {err}") from None
    try:
        return proc.wait()
    except BaseException:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _fail(root: Path, log_path: Path, step: str) -> None:
    """Keep the log as `<root>.failed.log` and raise with its last lines."""
    kept = root.with_name(f"{root.name}.failed.log")
    log_path.replace(kept)
    tail = "\n".join(kept.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    raise HarnessError(f"llama.cpp {step} failed (full log: {kept}); last lines:\n{tail}")


def _remove_stale_temps(root: Path) -> None:
    """Delete `<root>.tmp-<pid>` and `<root>.old-<pid>` trees left by processes that no longer run."""
    for tmp in [*root.parent.glob(f"{root.name}.tmp-*"), *root.parent.glob(f"{root.name}.old-*")]:
        pid = tmp.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _compiler(cmake_dir: Path) -> str:
    """'<id> <version> (<path>)' of the C++ (and CUDA) compiler, read from the CMake cache/files."""
    cache = (cmake_dir / "CMakeCache.txt").read_text(errors="replace")
    parts = []
    for lang in ("CXX", "CUDA"):
        path = re.search(rf"^CMAKE_{lang}_COMPILER:\w+=(.+)$", cache, re.M)
        if not path or path.group(1).endswith("NOTFOUND"):
            continue
        desc = path.group(1)
        for spec in cmake_dir.glob(f"CMakeFiles/*/CMake{lang}Compiler.cmake"):
            text = spec.read_text(errors="replace")
            cid = re.search(rf'set\(CMAKE_{lang}_COMPILER_ID "([^"]*)"\)', text)
            ver = re.search(rf'set\(CMAKE_{lang}_COMPILER_VERSION "([^"]*)"\)', text)
            desc = f"{cid.group(1) if cid else '?'} {ver.group(1) if ver else '?'} ({desc})"
        parts.append(desc)
    return "; ".join(parts) or "unknown"
