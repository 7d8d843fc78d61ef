"""A small real llama.cpp history for the bisect tests, made from the vendored tree.

Twelve commits on top of the llama.cpp vendored in llama-cpp-python: one (#6) brings back a real
speculative-decoding bug class of llama-server (ggml-org/llama.cpp #20925: after restoring the
speculative checkpoint of a hybrid model, the rejected drafts' attention cells are not removed), one
(#4) does not compile (fixed by #5), one (#9) aborts every request past its 8th token (reverted by #10), one
(#11) aborts llama-server while it loads the model, before it serves anything; the others change documentation
and comments. #9 and #11 are bad on any model and configuration; #6 only where a checkpoint is restored.
Author, committer and dates are fixed, so the commit hashes are the same on every machine: the build cache then
serves every step of a second run without compiling anything. The repository is made once under a lock in
the specharness cache; `history_repo()` returns it clean, on `main`, with no bisect in progress.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from filelock import FileLock

from harness.backends.build import SOURCE_MARKER, read_marker, vendored_source
from harness.paths import cache_dir

RECIPE = 2
"""Bump when the commits below change (the cached repository is then made again)."""
REGRESSION = 6
BROKEN = 4
REGRESSION_TIP = 8
"""The last commit of the regression's history (the tip before the crash commits were added)."""
MID_REQUEST_CRASH = 9
STARTUP_ABORT = 11
SEQ_RM_AFTER_RESTORE = "                        slot.mem.seq_rm(slot.id, ckpt.pos_max + 1, -1);\n"
SERVER_CONTEXT = "tools/server/server-context.cpp"
PROCESS_TOKEN = "    bool process_token(completion_token_output & result, server_slot & slot) {\n"
CRASH_PAST_8 = '        GGML_ASSERT(slot.stats.n_gen < 8 && "fixture: a request past its 8th token");\n'
LOAD_MODEL = "        const bool is_resume = sleeping;\n"
ABORT_IN_LOAD = '        GGML_ASSERT(is_resume && "fixture: abort while loading the model");\n'


def _replace(path: str, old: str, new: str):
    def edit(tree: Path) -> None:
        text = (tree / path).read_text()
        assert text.count(old) == 1, f"{path}: expected exactly one {old!r}"
        (tree / path).write_text(text.replace(old, new))

    return edit


def _append(path: str, text: str):
    def edit(tree: Path) -> None:
        with open(tree / path, "a") as f:
            f.write(text)

    return edit


COMMITS = [
    (
        "docs: note how the server restores speculative checkpoints",
        _append(
            "tools/server/README.md", "\nSpeculative checkpoints of hybrid models are restored before replaying.\n"
        ),
    ),
    (
        "server: reword a comment of the HTTP layer",
        _replace("tools/server/server-http.cpp", "#include <thread>\n", "#include <thread> // worker threads\n"),
    ),
    (
        "server: start moving task bookkeeping into the queue (WIP)",
        _append("tools/server/server-queue.cpp", "\nstatic int server_queue_wip = ;\n"),
    ),
    (
        "server: finish moving task bookkeeping",
        _replace("tools/server/server-queue.cpp", "\nstatic int server_queue_wip = ;\n", ""),
    ),
    (
        "server: drop the seq_rm after restoring a speculative checkpoint",
        _replace("tools/server/server-context.cpp", SEQ_RM_AFTER_RESTORE, ""),
    ),
    (
        "common: reword a comment of the speculative helpers",
        _replace("common/speculative.cpp", "#include <cstring>\n", "#include <cstring> // memcpy\n"),
    ),
    (
        "docs: speculative decoding notes",
        _append("docs/speculative.md", "\nDraft models and n-gram drafters share the verification path.\n"),
    ),
    (
        "server: check the generation budget while processing a token",
        _replace(SERVER_CONTEXT, PROCESS_TOKEN, PROCESS_TOKEN + CRASH_PAST_8),
    ),
    (
        "server: revert the generation budget check",
        _replace(SERVER_CONTEXT, PROCESS_TOKEN + CRASH_PAST_8, PROCESS_TOKEN),
    ),
    (
        "server: only resume a sleeping model in load_model",
        _replace(SERVER_CONTEXT, LOAD_MODEL, LOAD_MODEL + ABORT_IN_LOAD),
    ),
    (
        "docs: how the server loads its models",
        _append("tools/server/README.md", "\nThe server loads its models once, at start-up.\n"),
    ),
]


def _git(repo: Path, *args: str, date: str = "2026-01-01T12:00:00+00:00") -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="specharness fixture",
        GIT_AUTHOR_EMAIL="fixture@specharness.invalid",
        GIT_COMMITTER_NAME="specharness fixture",
        GIT_COMMITTER_EMAIL="fixture@specharness.invalid",
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
    )
    proc = subprocess.run(["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True)
    return proc.stdout.strip()


def _make(repo: Path) -> None:
    vendored = vendored_source()
    top_only = {"models", SOURCE_MARKER}  # the vocabulary files of models/ are not build inputs
    shutil.copytree(vendored, repo, ignore=lambda d, names: top_only & set(names) if Path(d) == vendored else ())
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", f"import llama.cpp {read_marker(vendored / SOURCE_MARKER)[:10]}")
    for i, (subject, edit) in enumerate(COMMITS, start=2):
        edit(repo)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", subject, date=f"2026-01-{i:02d}T12:00:00+00:00")


def history_repo() -> Path:
    """The fixture repository (made on first use), clean, on `main`, not bisecting."""
    repo = cache_dir() / "fixtures" / f"bisect-history-v{RECIPE}"
    repo.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(repo) + ".lock"):
        if not (repo / ".git" / "specharness-complete").exists():
            shutil.rmtree(repo, ignore_errors=True)
            tmp = repo.with_name(repo.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _make(tmp)
            (tmp / ".git" / "specharness-complete").touch()
            tmp.rename(repo)
        for lock in (repo / ".git").rglob("*.lock"):  # left by a git a killed test killed (index.lock, HEAD.lock)
            lock.unlink(missing_ok=True)
        if (repo / ".git" / "BISECT_START").exists():  # left by a killed test
            _git(repo, "bisect", "reset")
        _git(repo, "checkout", "-q", "-f", "main")
    return repo


def commits(repo: Path) -> list[str]:
    """The fixture's commit hashes, oldest first (commit #n is index n-1)."""
    return _git(repo, "rev-list", "--reverse", "main").split()


def fixture_lock() -> FileLock:
    """The lock a test holds while it checks out commits of the fixture repository (one test at a time)."""
    lock = cache_dir() / "fixtures" / "bisect-history.test.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(lock))


def builds_at(*numbers: int) -> list:
    """llama-server built at commits #n of the history (from the build cache after the first time; the bisect
    tests build the same commits), the repository left clean on `main`."""
    from harness.backends.build import ensure_server

    with fixture_lock():
        repo = history_repo()
        shas = commits(repo)
        try:
            out = []
            for n in numbers:
                _git(repo, "checkout", "-q", shas[n - 1])
                out.append(ensure_server(repo))
            return out
        finally:
            _git(repo, "checkout", "-q", "-f", "main")
