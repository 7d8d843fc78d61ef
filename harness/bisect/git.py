"""The git commands a bisect needs, on one checkout, each failing with a one-line HarnessError."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str
    date: str
    """Author date, ISO 8601."""

    def to_json(self) -> dict:
        return {"commit": self.sha, "subject": self.subject, "date": self.date}


class Git:
    """`git -C <checkout> ...` for a llama.cpp checkout (the top of its own repository)."""

    def __init__(self, checkout: Path):
        self.dir = Path(checkout).resolve()

    def __call__(self, *args: str, check: bool = True) -> str:
        """stdout of `git args` (without trailing whitespace); HarnessError with git's last line when it fails
        and `check`."""
        try:
            proc = subprocess.run(
                ["git", "-C", str(self.dir), *args], capture_output=True, text=True, stdin=subprocess.DEVNULL
            )
        except OSError as err:
            raise HarnessError(f"cannot run git: {err}") from None
        if check and proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise HarnessError(f"git {' '.join(args)} failed in {self.dir}: {last}")
        return proc.stdout.rstrip()

    def require_checkout(self) -> None:
        """A git checkout whose top is this directory (a subdirectory would bisect someone else's tree)."""
        if not self.dir.is_dir():
            raise HarnessError(f"{self.dir} does not exist")
        top = self("rev-parse", "--show-toplevel", check=False)
        if not top or Path(top).resolve() != self.dir:
            raise HarnessError(
                f"{self.dir} is not the top of a git checkout (give the llama.cpp checkout with --source)"
            )

    def require_clean(self) -> None:
        """Refuse uncommitted changes to tracked files: a bisect checks out other commits over them."""
        changed = self("status", "--porcelain", "--untracked-files=no").splitlines()
        if changed:
            raise HarnessError(
                f"{self.dir} has uncommitted changes ({len(changed)} files, e.g. {changed[0][3:]}): "
                "commit or stash them first"
            )

    def bisecting(self) -> bool:
        """Whether a `git bisect` is in progress in this checkout."""
        return (self.git_dir() / "BISECT_START").exists()

    def git_dir(self) -> Path:
        path = Path(self("rev-parse", "--git-dir"))
        return path if path.is_absolute() else self.dir / path

    def resolve(self, rev: str) -> str:
        """The full hash of `rev`; a one-line error naming it when it is not a commit here."""
        sha = self("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
        if not sha:
            raise HarnessError(f"unknown revision '{rev}' in {self.dir}")
        return sha

    def head(self) -> str:
        """The branch HEAD is on (refs/heads/...), or the commit when HEAD is detached."""
        return self("symbolic-ref", "-q", "HEAD", check=False) or self("rev-parse", "HEAD")

    def commit(self, rev: str) -> Commit:
        sha, date, subject = self("log", "-1", "--format=%H%n%aI%n%s", rev).split("\n", 2)
        return Commit(sha, subject, date)

    def is_ancestor(self, old: str, new: str) -> bool:
        return (
            subprocess.run(
                ["git", "-C", str(self.dir), "merge-base", "--is-ancestor", old, new], capture_output=True
            ).returncode
            == 0
        )

    def checkout(self, rev: str) -> None:
        self("checkout", "-q", "--detach", rev)
