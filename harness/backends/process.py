"""How a child process that runs llama.cpp ended: shared by the llama-server process and the in-process
engine's worker, so a crash reads the same from both backends (how it ended, the abort line, the log tail);
and why llama.cpp refused a batch, from llama-server's log (worded as the engine words it: base.invalid_batch);
where a session's logs go when no run directory is given (LogDir)."""

import itertools
import re
import shutil
import signal
import tempfile
from pathlib import Path

from harness.backends.base import invalid_batch
from harness.llama import log as llama_log

LOG_TAIL_LINES = 20
ABORT_LINES = tuple(
    re.compile(p) for p in (r"GGML_ASSERT|GGML_ABORT", r"what\(\):|terminate called", r"\.(?:cpp|c|h):\d+: ")
)
"""What llama.cpp prints when it aborts, most telling first: `<file>:<line>: GGML_ASSERT(...) failed`, an
uncaught C++ exception (`terminate called after throwing ...` / `what(): ...`), a fatal `<file>:<line>: ...`."""


INVALID_BATCH_LOG = re.compile(
    r"tokens of sequence (\d+) in the input batch have inconsistent sequence positions:\s*"
    r"- the last position stored in the memory module .*? is X = (-?\d+)\s*"
    r"- the tokens for sequence \d+ in the input batch have a starting position of Y = (-?\d+)"
)
"""llama.cpp's log lines for a batch whose positions do not follow the sequence's (llama-batch.cpp)."""
INVALID_BATCH_LOG_LINES = 5000
"""How far back in a log `invalid_batch_in_log` looks (llama-server logs a few lines per request at its default
verbosity; at `-lv 5` a few per drafted token: the other slots of a par batch go on logging meanwhile)."""


def invalid_batch_in_log(path: Path | None) -> str | None:
    """`invalid_batch` for the last batch llama.cpp's log at `path` says it refused, None if it says none."""
    found = list(INVALID_BATCH_LOG.finditer(log_tail(path, INVALID_BATCH_LOG_LINES)))
    return invalid_batch(*map(int, found[-1].groups())) if found else None


def describe_exit(returncode: int | None) -> str:
    """'exited with code 1' / 'was killed by SIGABRT' / 'is still running'."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file as written ("" when it cannot be read; undecodable bytes replaced)."""
    try:
        text = llama_log.read(path)
    except (OSError, TypeError):
        return ""
    return "\n".join(text.splitlines()[-lines:])


def abort_line(text: str) -> str:
    """The message of the line of `text` that says why llama.cpp aborted, without the log's prefix ("" when none
    does): the same line whether or not the logger's thread wrote another line's prefix before it."""
    lines = llama_log.messages(text)
    for pattern in ABORT_LINES:
        found = next((line.strip() for line in lines if pattern.search(line)), None)
        if found:
            return found
    return ""


def crash_report(who: str, returncode: int | None, log_path: Path | None) -> str:
    """`<who> was killed by SIGABRT: <abort line>` and the end of its log, for a `crashed` Result."""
    try:
        whole = llama_log.read(log_path) if log_path else ""
    except OSError:
        whole = ""
    reason = abort_line(whole)
    head = f"{who} {describe_exit(returncode)}" + (f": {reason}" if reason else "")
    return f"{head}; log {log_path} ends with:\n{log_tail(log_path)}"


def free_log_name(run_dir: Path, stem: str) -> Path:
    """Claim `run_dir/<stem>-<n>.log` for the smallest n not taken yet (one log file per process start)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = run_dir / f"{stem}-{n}.log"
        try:
            path.open("x").close()
            return path
        except FileExistsError:
            continue


class LogDir:
    """Where one session's process logs (and llama-server's slot files) go. A run directory given by the caller
    is the caller's and is never removed. Without one the session makes a temp dir `<prefix>XXXX` and `close()`
    removes it, unless a message cited a file in it (`cite`: a crash's log, a slot file kept as evidence, a start
    that failed): that dir stays for the reader, so the shared machine keeps only what somebody was pointed to."""

    def __init__(self, run_dir: Path | None, prefix: str):
        self.owned = run_dir is None
        self.path = Path(tempfile.mkdtemp(prefix=prefix)) if self.owned else Path(run_dir)
        self.kept = not self.owned

    def cite(self, path=None):
        """Keep the dir (a message names `path`, a file in it); returns `path` to fit inside the message."""
        self.kept = True
        return path

    def close(self) -> None:
        """Remove the temp dir unless it was cited; safe to call repeatedly."""
        if not self.kept:
            shutil.rmtree(self.path, ignore_errors=True)
