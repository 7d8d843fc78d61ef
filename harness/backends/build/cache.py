"""The build cache as tags accumulate: tag builds, and `specharness build --list` / `--prune N`.

Every cached llama-server is an entry `builds/<key>/` (harness/backends/build/entry.py). A tag's build also leaves its
extracted tree `src/llama.cpp-bN/` and its sdist in `downloads/`; its persistent CMake tree is deleted right after
the build, since the compiler cache (ccache, bounded by its own size limit) is what makes the next tag's build
incremental: the files a neighbouring tag did not change compile from it. `--prune N` keeps the N builds used most
recently (`last-used` in an entry: any command that asked for it), and removes the others with their persistent
trees, and a tag's sources once no kept build is of that tag.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from harness.backends.build.cmake import build_tree_dir, cmake_options
from harness.backends.build.ensure import ensure_server
from harness.backends.build.entry import LAST_USED, BuildInfo, _locked, load_build
from harness.backends.build.tags import resolve_tag, sdist_path, tag_cmake_args, tag_number, tag_source
from harness.errors import HarnessError
from harness.paths import cache_dir


def build_tag(tag: str, backend: str = "cpu", cmake_args: list[str] = (), jobs: int | None = None) -> BuildInfo:
    """llama-server of upstream tag `tag` (bN, or 'newest'): cached, or fetched and built now."""
    tag = resolve_tag(tag)
    source = tag_source(tag)
    extra = [*tag_cmake_args(tag), *cmake_args]
    info = ensure_server(source, backend, extra, jobs)
    if not info.cached:  # the next tag compiles its unchanged files from ccache, not from this tree
        with _locked(cache_dir() / "work", "the build work tree (one build at a time)"):
            shutil.rmtree(build_tree_dir(source, backend, cmake_options(backend, extra)), ignore_errors=True)
    return info


@dataclass
class CachedBuild:
    """One entry of the build cache, as `--list` shows it."""

    root: Path
    info: BuildInfo
    size: int
    """Bytes of the entry, plus a tag's extracted sources and sdist (what pruning it frees)."""
    last_used: float

    @property
    def what(self) -> str:
        if self.info.tag:
            return f"tag {self.info.tag}"
        return f"{self.info.commit[:12]}{' (modified)' if self.info.dirty else ''}"


def cached_builds() -> list[CachedBuild]:
    """Every usable build in the cache, most recently used first."""
    builds = []
    root = cache_dir() / "builds"
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if not entry.is_dir() or "." in entry.name:  # .tmp-PID, .old-PID, .lock, .failed.log
            continue
        info = load_build(entry)
        if info is None:
            continue
        size = _size(entry) + (_tag_sources_size(info.tag) if info.tag else 0)
        used = entry / LAST_USED
        last = (used if used.exists() else entry / "build-info.json").stat().st_mtime
        builds.append(CachedBuild(entry, info, size, last))
    return sorted(builds, key=lambda b: b.last_used, reverse=True)


def _tag_sources(tag: str) -> list[Path]:
    return [cache_dir() / "src" / f"llama.cpp-{tag}", sdist_path(tag_number(tag))]


def _tag_sources_size(tag: str) -> int:
    return sum(_size(p) for p in _tag_sources(tag))


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def list_lines(builds: list[CachedBuild]) -> list[str]:
    """`--list`'s table: what, backend, size, last use, and the entry's folder name."""
    if not builds:
        return [f"no cached llama-server builds in {cache_dir() / 'builds'}"]
    lines = [f"{'build':<24} {'backend':<7} {'size':>10}  {'last used':<16}  entry"]
    for b in builds:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(b.last_used))
        lines.append(f"{b.what:<24} {b.info.backend:<7} {human_size(b.size):>10}  {when:<16}  {b.root.name}")
    total = sum(b.size for b in builds)
    lines.append(f"{len(builds)} builds, {human_size(total)} (ccache: {cache_dir() / 'ccache'}, bounded by ccache)")
    return lines


def prune(keep: int) -> tuple[list[CachedBuild], list[str]]:
    """Remove every build but the `keep` most recently used; returns (removed, lines saying what was skipped). A
    build another process holds (its lock taken: it is being built or replaced) is left in place."""
    if keep < 0:
        raise HarnessError(f"--prune takes the number of builds to keep (0 or more), not {keep}")
    builds = cached_builds()
    kept_tags = {b.info.tag for b in builds[:keep] if b.info.tag}
    removed, skipped = [], []
    for b in builds[keep:]:
        lock = FileLock(str(b.root) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            skipped.append(f"kept {b.what} ({b.root.name}): another process holds it")
            continue
        try:
            aside = b.root.with_name(f"{b.root.name}.old-{os.getpid()}")
            b.root.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
            shutil.rmtree(build_tree_dir(Path(b.info.source), b.info.backend, b.info.cmake_args), ignore_errors=True)
        finally:
            lock.release()
            Path(lock.lock_file).unlink(missing_ok=True)
        removed.append(b)
    for tag in {b.info.tag for b in removed if b.info.tag} - kept_tags:
        if any(b.info.tag == tag for b in builds[keep:] if b not in removed):
            continue
        for path in _tag_sources(tag):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return removed, skipped
