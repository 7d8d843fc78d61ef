"""One entry of the build cache, `cache_dir()/builds/<key>/`: its record (`BuildInfo`, `build-info.json`), its
lock, its atomic replacement and its last use.

Entries are assembled in a temporary sibling directory that is renamed into place only when complete, under a file
lock `<key>.lock` beside the entry, so parallel processes (`pytest -n auto`) build each key once. An entry whose
`build-info.json` cannot be read is treated as missing: rebuilt and replaced."""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from harness.errors import HarnessError


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
    replay_bin: Path | None = None
    """`llama-replay` linked with the same libraries (harness/backends/build/replay_build.py), or None where the
    tree's llama.h does not compile it (or a binary not built here)."""
    cached: bool = False
    """True when this call reused an existing build (not stored in build-info.json)."""

    def to_json(self) -> dict:
        """The `build-info.json` content (paths as strings, without `cached`)."""
        data = asdict(self)
        data.pop("cached")
        data["server_bin"] = str(self.server_bin)
        data["quantize_bin"] = str(self.quantize_bin) if self.quantize_bin else None
        data["replay_bin"] = str(self.replay_bin) if self.replay_bin else None
        return data

    @classmethod
    def from_json(cls, data: dict, root: Path) -> BuildInfo:
        """Load `build-info.json` of the build in `root`; binary paths are resolved inside `root`."""
        data = dict(data, cached=True)
        data["server_bin"] = root / "bin" / "llama-server"
        data["quantize_bin"] = root / "bin" / "llama-quantize"
        replay = root / "bin" / "llama-replay"
        data["replay_bin"] = replay if data.get("replay_bin") and replay.is_file() else None
        return cls(**data)


LAST_USED = "last-used"
"""A file in a build entry whose modification time is when a command last asked for the build."""


def mark_used(info: BuildInfo) -> BuildInfo:
    """Record that `info`'s build was asked for now (`specharness build --list` and `--prune` read it)."""
    with suppress(OSError):
        (info.server_bin.parent.parent / LAST_USED).touch()
    return info


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


def require_executable(path: Path) -> Path:
    """`path` if it is an executable file, else HarnessError."""
    if not Path(path).is_file() or not os.access(path, os.X_OK):
        raise HarnessError(f"llama-server binary {path} does not exist or is not executable")
    return path


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
