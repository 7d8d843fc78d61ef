"""The work a llama-server request did (`Result.work`), from its timings and its log.

- `prompt_read` / `prompt_reused`: the response's `timings.prompt_n` / `timings.cache_n`.
- `ckpt_created` / `ckpt_restored` and their bytes, `partial_rollbacks`: the log lines of the request's task
  (tools/server/server-context.cpp at 0c1e570), printed at verbosity 5 (`-lv 5`, LOG_DBG; the prompt checkpoints
  are LOG_TRC, 4), which the harness starts llama-server with (`VERBOSITY`):
  - `created context checkpoint N of M (pos_min = .., pos_max = .., n_tokens = .., size = X MiB)` and
    `restored context checkpoint (... size = X MiB)`: the prompt checkpoints (bytes from MiB printed with 3
    decimals: about 1 kB precision);
  - `created speculative checkpoint (..., size = X MiB, draft = Y MiB)` (MiB again) and `restoring speculative
    checkpoint (pos_min = .., pos_max = .., size = N)` (bytes, exact): the checkpoint before a verification and its
    restore after a rejection; their sizes hold the target's state, the draft context's and the drafter's;
  - each created checkpoint's kind (prompt or speculative), `n_tokens` and size also go to `Work.ckpt_sizes`, whose
    sizes the `work` check compares with each other;
  - `add accepted tokens: sampled=.., ids.size=K, n_draft=N` with K - 1 < N: a rejection rolled back by
    `seq_rm` alone (a restored step returns before that line), the engine's `partial_rollbacks`.
- Not to be had from llama-server (None): `target_decoded` (no timing or line counts the target's decoded tokens
  of a request: draft and replay batches are not logged with their sizes at any verbosity) and `draft_decoded`
  (the draft context's decodes are not logged per request).

A request's lines are those of its task (`slot ... id S | task T | ...`): T is the task its slot S started
(`processing task`) after the request was sent; its `stop processing` line ends them (the log is written by a
thread of its own: it is awaited a moment after the response).
"""

import re
import time
from pathlib import Path

from harness import llama_log
from harness.backends.flags import server_flags
from harness.result import Result, Work

VERBOSITY = 5
"""llama-server's `-lv` for the lines above (LOG_LEVEL_DEBUG; `-v` would also add `__verbose` to responses)."""
LOG_WAIT_S = 2.0
"""How long to wait for the task's `stop processing` line after the response."""

_SLOT = re.compile(r"id\s+(\d+) \| task (-?\d+) \| (.*)")
_SIZE_MIB = re.compile(r"size = ([\d.]+) MiB")
_SIZE_BYTES = re.compile(r"size = (\d+)\)")
_N_TOKENS = re.compile(r"n_tokens = (\d+)")
_ACCEPTED = re.compile(r"add accepted tokens: sampled=-?\d+, ids\.size=(\d+), n_draft=(\d+)")
MIB = 1024 * 1024


def verbosity_of(server) -> int | None:
    """The `-lv` a LlamaServer runs at (None where its build has no `-lv`: it was left out, its default holds)."""
    return server.verbosity if server.verbosity is not None and "-lv" in server_flags(server.server_bin) else None


def mark(log_path: Path | None) -> int:
    """Where the log ends now (read this before sending a request)."""
    try:
        return Path(log_path).stat().st_size if log_path else 0
    except OSError:
        return 0


def _read(log_path: Path, start: int) -> list[str]:
    """The messages of the log's lines from byte `start` on (harness.llama_log: undecodable token bytes replaced)."""
    return llama_log.messages(llama_log.read(log_path, start))


def task_lines(lines: list[str], slot_id: int) -> tuple[int | None, list[str], bool]:
    """The first task slot `slot_id` started in `lines`, the messages of its lines, and whether it ended there."""
    task, out, ended = None, [], False
    for line in lines:
        m = _SLOT.search(line)
        if not m or int(m.group(1)) != slot_id:
            continue
        t, message = int(m.group(2)), m.group(3)
        if task is None and message.startswith("processing task"):
            task = t
        if task is not None and t == task:
            out.append(message)
            if message.startswith("stop processing"):
                ended = True
                break
    return task, out, ended


def count(messages: list[str]) -> Work:
    """The checkpoint and rollback counters of one task's log messages, and each created checkpoint's size."""
    c = Work(ckpt_restored=0, ckpt_restored_bytes=0, partial_rollbacks=0)
    c.ckpt_created, c.ckpt_created_bytes, c.ckpt_sizes = 0, 0, []
    for message in messages:
        if message.startswith(("created context checkpoint", "created speculative checkpoint")):
            size, n_tokens = _SIZE_MIB.search(message), _N_TOKENS.search(message)
            kind = "prompt" if message.startswith("created context") else "speculative"
            c.checkpoint(kind, int(n_tokens.group(1)) if n_tokens else -1, _mib(size))
        elif message.startswith("restored context checkpoint"):
            c.add("ckpt_restored", 1)
            c.add("ckpt_restored_bytes", _mib(_SIZE_MIB.search(message)))
        elif message.startswith("restoring speculative checkpoint"):
            c.add("ckpt_restored", 1)
            size = _SIZE_BYTES.search(message)
            c.add("ckpt_restored_bytes", int(size.group(1)) if size else 0)
        else:
            accepted = _ACCEPTED.match(message)
            if accepted and int(accepted.group(1)) - 1 < int(accepted.group(2)):
                c.add("partial_rollbacks", 1)
    return c


def _mib(size: re.Match | None) -> int:
    """Bytes of a `size = X MiB` match (0 where the line has none)."""
    return round(float(size.group(1)) * MIB) if size else 0


def work_of(result: Result, log_path: Path | None, start: int, verbosity: int | None = VERBOSITY) -> Work:
    """The request's Work: its timings, and its task's log lines from `start` on where the log prints them."""
    work = Work(prompt_read=result.timings.prompt_n, prompt_reused=result.timings.cache_n)
    if log_path is None or verbosity is None or verbosity < VERBOSITY or result.slot_id < 0:
        return work
    until = time.monotonic() + LOG_WAIT_S
    while True:
        try:
            task, messages, ended = task_lines(_read(Path(log_path), start), result.slot_id)
        except OSError:
            return work
        if ended or time.monotonic() >= until:
            break
        time.sleep(0.02)
    if task is None:  # the task's lines are not in the log: not counted
        return work
    counted = count(messages)
    for name in ("ckpt_created", "ckpt_created_bytes", "ckpt_restored", "ckpt_restored_bytes", "partial_rollbacks"):
        setattr(work, name, getattr(counted, name))
    work.ckpt_sizes = counted.ckpt_sizes
    return work
