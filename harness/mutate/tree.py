"""The tree mutants are written into: a copy of the llama.cpp source in the cache, never the user's own tree.

One mutant at a time is written into the copy and taken out again (`applied`), whatever happens: a build failure,
an error, Ctrl-C. A journal file names the file a mutant is in while it is there, so a process killed outright
(SIGKILL, a power cut) leaves the copy to be restored by the next campaign before it builds anything. Builds of the
copy go through the build cache's persistent CMake tree of the copy (harness.backends.build): a mutant recompiles the
one file it changes and relinks.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from harness.backends.build import SOURCE_MARKER, source_identity
from harness.backends.build.sources import tree_digest
from harness.errors import HarnessError
from harness.mutate.generate import Mutant
from harness.paths import cache_dir

JOURNAL = ".specharness-mutant"
"""In the copy while a mutant is written into it: {"id", "file"}."""


def _not_copied(top: Path):
    """copytree's filter for a copy of `top`: VCS data anywhere, and build directories at the top of the tree."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        at_top = Path(directory) == top
        return {n for n in names if n == ".git" or (at_top and n.startswith("build") and Path(directory, n).is_dir())}

    return ignore


COPY_MARKER = ".specharness-mutate-copy"
COPY_FORMAT = 2
"""Bumped when what a copy holds changes: an older copy is made again."""


class MutationTree:
    """The cache's copy of `source` (`<cache>/src/<source's name>-mutate-<digest of its path>`), locked for one
    campaign at a time."""

    def __init__(self, source: Path):
        self.source = Path(source).resolve()
        if not (self.source / "CMakeLists.txt").is_file():
            raise HarnessError(f"{self.source} is not a llama.cpp source tree (no CMakeLists.txt): give --source DIR")
        tag = hashlib.sha256(str(self.source).encode()).hexdigest()[:8]
        self.path = cache_dir() / "src" / f"{self.source.name}-mutate-{tag}"
        self._lock = FileLock(str(self.path) + ".lock")

    @contextmanager
    def held(self):
        """The copy, made or brought back to the source's state, held by this process until the block ends (and
        restored on the way out)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            raise HarnessError(
                f"another campaign is mutating {self.path} (lock {self._lock.lock_file}); wait for it to end"
            ) from None
        try:
            self._prepare()
            yield self
        finally:
            try:
                self.restore()
            finally:
                self._lock.release()

    def _prepare(self) -> None:
        self.restore()
        want = {"format": COPY_FORMAT, "source": tree_digest(self.source)}
        try:
            if json.loads((self.path / COPY_MARKER).read_text()) == want:
                return
        except (OSError, ValueError):
            pass
        staging = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(self.source, staging, symlinks=True, ignore=_not_copied(self.source))
        if not (staging / SOURCE_MARKER).is_file():  # a git checkout: the copy says its commit
            commit = source_identity(self.source).commit
            (staging / SOURCE_MARKER).write_text(json.dumps({"commit": commit, "origin": "specharness mutate"}) + "\n")
        (staging / COPY_MARKER).write_text(json.dumps(want) + "\n")
        shutil.rmtree(self.path, ignore_errors=True)
        staging.rename(self.path)

    def restore(self) -> list[str]:
        """Put back the file a mutant was left in (the journal), if any; the files put back."""
        journal = self.path / JOURNAL
        try:
            file = json.loads(journal.read_text())["file"]
        except (OSError, ValueError, KeyError):
            journal.unlink(missing_ok=True)
            return []
        self._put_back(file)
        journal.unlink()
        return [file]

    def _put_back(self, file: str) -> None:
        original = (self.source / file).read_bytes()
        target = self.path / file
        if not target.is_file() or target.read_bytes() != original:
            target.write_bytes(original)

    def is_clean(self, files: list[str]) -> bool:
        """Whether each of `files` in the copy equals the source's and no mutant is recorded in it."""
        return not (self.path / JOURNAL).exists() and all(
            (self.path / f).read_bytes() == (self.source / f).read_bytes() for f in files
        )

    @contextmanager
    def applied(self, mutant: Mutant):
        """The copy with `mutant` written into it for the block; the original file is back afterwards."""
        target = self.path / mutant.file
        mutated = mutant.apply((self.source / mutant.file).read_text(errors="surrogateescape"))
        (self.path / JOURNAL).write_text(json.dumps({"id": mutant.id, "file": mutant.file}) + "\n")
        try:
            target.write_text(mutated, errors="surrogateescape")
            yield self.path
        finally:
            self.restore()
