"""The llama.cpp sources a build compiles, and their identity: the tree vendored in llama-cpp-python's sdist
(downloaded and extracted once), or any checkout (its commit, dirty state and a digest of its source files)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.backends.build.entry import _locked, _replace_dir
from harness.errors import HarnessError
from harness.paths import cache_dir

SOURCE_SUFFIXES = frozenset(
    ".c .cc .cpp .cxx .h .hh .hpp .inc .cu .cuh .m .mm .metal .comp .glsl .wgsl .cl .cmake .in .s .S".split()
)
SKIP_DIRS = frozenset({".git", "models", "node_modules", "__pycache__"})
SOURCE_MARKER = ".specharness-source.json"
"""Written into a tree extracted from the llama-cpp-python sdist: records the vendored llama.cpp commit."""


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
    """The upstream tag (bN) recorded in an extracted tree's marker (harness/backends/build/tags.py), or None."""
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


def extracted_source(version: str) -> Path | None:
    """The vendored tree of llama-cpp-python `version` when it is already extracted in the cache, else None."""
    tree = cache_dir() / "src" / f"llama.cpp-{version}"
    return tree if _valid_marker(tree) else None
