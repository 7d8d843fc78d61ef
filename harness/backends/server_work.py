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
- `target_decoded`: `prompt_read`, then one token per `slot decode token` line (a step without a draft) and
  1 + #draft per `generate_draft: ... #draft=N` line (a verification batch: the sampled token and N drafts, a replay
  after a restore included); every generation step's batch logs one of the two (`handle_last_sampled_token`);
- `Work.steps` (not counters: what the `work` check compares like with like, harness.checks.work; `batches` is
  what re-scoring a position through llama-server needs, harness.backends.server_rescore): each
  verification batch in order, `[n_draft, n_accepted, speculative checkpoints created before it, their bytes,
  checkpoints restored after it, their bytes]` (n_accepted -1 where it was restored; a restored verification's
  replay follows it), the one-token decodes, the position each batch of the prompt started at
  (`main/do_checkpoint = ..., pos_max = P`: one line per batch that holds the slot's prompt tokens), the prompt
  checkpoints restored and their bytes, and every generation batch in order (`batches`: `[rows, tokens it emitted]`,
  a one-token decode `[1, 1]`, a verification `[1 + #draft, ids.size]`, a restored one `[1 + #draft, 0]`: the
  replay batch after it emits its tokens);
- Not to be had from llama-server (None): `draft_decoded` (the draft context's decodes are not logged per
  request: common/speculative.cpp logs candidates, not decodes, and without the task).

A request's lines are those of its task (`slot ... id S | task T | ...`): T is the task its slot S started
(`processing task`) after the request was sent; its `stop processing` line ends them (the log is written by a
thread of its own: it is awaited a moment after the response).
"""

import re
import time
from dataclasses import dataclass
from pathlib import Path

from harness.backends.flags import server_flags
from harness.llama import log as llama_log
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
_DRAFT_BATCH = re.compile(r"generate_draft: id=-?\d+, #tokens=\d+, #draft=(\d+)")
_PROMPT_BATCH = re.compile(r"main/do_checkpoint = \w+, pos_min = -?\d+, pos_max = (-?\d+)")
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
    """The messages of the log's lines from byte `start` on (harness.llama.log: undecodable token bytes replaced)."""
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
    """The checkpoint and rollback counters of one task's log messages, each created checkpoint's size, the
    target's decoded generation tokens (`target_decoded` less the prompt) and the steps (`Work.steps`)."""
    c = Work(target_decoded=0, ckpt_restored=0, ckpt_restored_bytes=0, partial_rollbacks=0)
    c.ckpt_created, c.ckpt_created_bytes, c.ckpt_sizes = 0, 0, []
    verifications, decodes, prompt_batches, prompt_restored = [], 0, [], [0, 0]
    batches: list[list] = []  # every generation batch in order: [rows, tokens emitted] (emitted None until known)
    pending = [0, 0]  # speculative checkpoints created since the last batch, and their bytes
    for message in messages:
        if message.startswith(("created context checkpoint", "created speculative checkpoint")):
            size, n_tokens = _SIZE_MIB.search(message), _N_TOKENS.search(message)
            kind = "prompt" if message.startswith("created context") else "speculative"
            c.checkpoint(kind, int(n_tokens.group(1)) if n_tokens else -1, _mib(size))
            if kind == "speculative":
                pending[0], pending[1] = pending[0] + 1, pending[1] + _mib(size)
        elif message.startswith("restored context checkpoint"):
            c.add("ckpt_restored", 1)
            c.add("ckpt_restored_bytes", _mib(_SIZE_MIB.search(message)))
            prompt_restored[0], prompt_restored[1] = (
                prompt_restored[0] + 1,
                prompt_restored[1] + _mib(_SIZE_MIB.search(message)),
            )
        elif message.startswith("restoring speculative checkpoint"):
            c.add("ckpt_restored", 1)
            size = _SIZE_BYTES.search(message)
            nbytes = int(size.group(1)) if size else 0
            c.add("ckpt_restored_bytes", nbytes)
            if verifications:
                v = verifications[-1]
                v[1], v[4], v[5] = -1, v[4] + 1, v[5] + nbytes
            if batches and batches[-1][1] is None:
                batches[-1][1] = 0  # restored: the replay batch after it emits the step's tokens
        elif message.startswith("slot decode token"):
            decodes += 1
            batches.append([1, 1])
            c.add("target_decoded", 1)
        elif message.startswith("generate_draft:"):
            n_draft = int(m.group(1)) if (m := _DRAFT_BATCH.match(message)) else 0
            verifications.append([n_draft, None, *pending, 0, 0])
            batches.append([1 + n_draft, None])
            pending = [0, 0]
            c.add("target_decoded", 1 + n_draft)
        elif message.startswith("main/do_checkpoint"):
            if m := _PROMPT_BATCH.match(message):
                prompt_batches.append(int(m.group(1)) + 1)
        else:
            accepted = _ACCEPTED.match(message)
            if accepted:
                k, n = int(accepted.group(1)), int(accepted.group(2))
                if k - 1 < n:
                    c.add("partial_rollbacks", 1)
                if verifications and verifications[-1][1] is None:
                    verifications[-1][1] = k - 1
                if batches and batches[-1][1] is None:
                    batches[-1][1] = k
    c.steps = {
        "verifications": verifications,
        "decodes": decodes,
        "prompt_batches": prompt_batches,
        "prompt_restored": prompt_restored,
        "batches": batches,
    }
    if pending[0]:  # checkpoints no batch followed (the request ended or was cut): kept, as a step of their own
        c.steps["verifications"].append([0, None, *pending, 0, 0])
    return c


def _mib(size: re.Match | None) -> int:
    """Bytes of a `size = X MiB` match (0 where the line has none)."""
    return round(float(size.group(1)) * MIB) if size else 0


@dataclass(frozen=True)
class TaskLog:
    """A request's log as read once after its answer (`task_log`): the messages from the request's start on, the
    task its slot started there, that task's messages, and whether it ended there."""

    messages: list[str]
    task: int | None
    lines: list[str]
    ended: bool


def task_log(result: Result, log_path: Path | None, start: int, verbosity: int | None = VERBOSITY) -> TaskLog | None:
    """The log's messages from byte `start` on, read once the request's task has ended in them (or after
    LOG_WAIT_S): what `work_of`, server_batches.of_request and server_batches.places read, read once. None where
    the log does not print the task's lines (no log, below `VERBOSITY`, no slot) or cannot be read."""
    if log_path is None or verbosity is None or verbosity < VERBOSITY or result.slot_id < 0:
        return None
    until = time.monotonic() + LOG_WAIT_S
    while True:
        try:
            messages = _read(Path(log_path), start)
        except OSError:
            return None
        task, lines, ended = task_lines(messages, result.slot_id)
        if ended or time.monotonic() >= until:
            return TaskLog(messages, task, lines, ended)
        time.sleep(0.02)


def work_of(result: Result, logged: TaskLog | None) -> Work:
    """The request's Work: its timings, and its task's lines (`task_log`) where the log printed them."""
    work = Work(prompt_read=result.timings.prompt_n, prompt_reused=result.timings.cache_n)
    if logged is None or logged.task is None:  # the task's lines are not in the log: not counted
        return work
    counted = count(logged.lines)
    for name in ("ckpt_created", "ckpt_created_bytes", "ckpt_restored", "ckpt_restored_bytes", "partial_rollbacks"):
        setattr(work, name, getattr(counted, name))
    if logged.ended and work.prompt_read is not None:  # every step's line is there: the target's decoded tokens
        work.target_decoded = work.prompt_read + counted.target_decoded
    work.ckpt_sizes = counted.ckpt_sizes
    work.steps = counted.steps if logged.ended else None  # a task whose lines did not all come: steps not known
    return work
