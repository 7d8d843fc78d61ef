"""The batches llama-server decoded, read back from its log, and where a request's rollbacks sat in them.

llama-server (tools/server/server-context.cpp at 0c1e570, `update_slots`) puts every generating slot's sampled token
and drafts into one batch, slot by slot, then the prompt tokens of the slots reading a prompt, and decodes it; at
`-lv 5` (server_work.VERBOSITY) each entry logs one line of its slot (`generate_draft: ... #draft=N`: 1 + N
tokens; `slot decode token`: 1; `main/do_checkpoint = .., pos_min = .., pos_max = P`: the prompt tokens from
position P + 1, as many as the slot's next prompt batch starts later or its task's `task.n_tokens` ends), and the
decode logs `n_batch (effective) = .., off = O` once per chunk of n_batch tokens. After the decode each verifying
slot logs `add accepted tokens: sampled=.., ids.size=K, n_draft=N` (K - 1 drafts kept; fewer than N: the rest are
rolled back by `seq_rm`, which for a recurrent memory with snapshots only records the plane to continue from) or,
where the state needs a checkpoint, `restoring speculative checkpoint`.

`split_rollbacks` names, for one request, each step that rolled drafts back after verifying them in a micro-batch
ahead of another micro-batch of the same decode (harness.llama.ubatch): the step where known failure
`server-par-partial-rollback-diverges`'s cell move can happen (its reason in suites/known-failures.yaml). The
model's memory geometry (n_ubatch, unified or per-slot KV, n_rs_seq) comes from the log's start-up lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from harness.backends.server_work import _ACCEPTED, _PROMPT_BATCH, _SLOT, TaskLog
from harness.backends.server_work import _DRAFT_BATCH as _DRAFT
from harness.llama.ubatch import Geometry, split_rollback

_NEW_PROMPT = re.compile(r"new prompt, n_ctx_slot = \d+, n_keep = -?\d+, task\.n_tokens = (\d+)")
_CHUNK = re.compile(r"n_batch \(effective\) = \d+, off = (\d+)")
_N_UBATCH = re.compile(r"llama_context: n_ubatch\s+= (\d+)")
_KV_UNIFIED = re.compile(r"llama_context: kv_unified\s+= (true|false)")
_KV_CACHE = re.compile(r"llama_kv_cache: size = ")
_RECURRENT = re.compile(r"llama_memory_recurrent: size = .*?\s(\d+) seqs\s+(\d+) rs_seq")
HEAD_BYTES = 256 * 1024
"""How much of the log's start holds the target context's start-up lines (up to the second `n_ubatch` line: the
draft context is made after the target's)."""


def geometry(log_path: Path) -> Geometry | None:
    """The target's split geometry from the log's start-up lines; None where the model keeps no recurrent state
    with snapshots (nothing to roll back into) or the lines are not there."""
    try:
        with open(log_path, "rb") as f:
            head = f.read(HEAD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    contexts = list(_N_UBATCH.finditer(head))
    if len(contexts) > 1:  # the target's lines end where the next context (the draft's) starts
        head = head[: contexts[1].start()]
    n_ubatch, unified, recurrent = _N_UBATCH.search(head), _KV_UNIFIED.search(head), _RECURRENT.search(head)
    if not (n_ubatch and unified and recurrent) or int(recurrent.group(2)) == 0:
        return None
    return Geometry(
        n_ubatch=int(n_ubatch.group(1)),
        unified=unified.group(1) == "true",
        n_rs_seq=int(recurrent.group(2)),
        hybrid=_KV_CACHE.search(head) is not None,  # attention layers beside the recurrent ones
    )


@dataclass
class _Entry:
    slot: int
    task: int
    kind: str  # verify | decode | prompt
    n_tokens: int | None
    pos_max: int | None = None


@dataclass
class _Decode:
    entries: list[_Entry] = field(default_factory=list)
    chunks: int = 0

    def composition(self) -> list[tuple[int, int]] | None:
        """`(slot, n_tokens)` in batch order; None where a count is unknown or the batch went in several chunks."""
        if self.chunks != 1 or any(e.n_tokens is None for e in self.entries):
            return None
        return [(e.slot, e.n_tokens) for e in self.entries]


def _decodes(messages: list[str]) -> list[_Decode]:
    """The decodes of the log's messages in order, each with its entries; prompt entries counted from the slot's
    next prompt batch or its task's prompt length."""
    decodes, pending = [], _Decode()
    prompt_len: dict[int, int] = {}  # slot -> its task's prompt tokens (`new prompt`)
    open_prompt: dict[int, _Entry] = {}  # slot -> its last prompt entry, whose count the next one or the end gives
    for message in messages:
        chunk = _CHUNK.search(message)
        if chunk:
            if int(chunk.group(1)) == 0 or not decodes:
                pending.chunks = 1
                decodes.append(pending)
                pending = _Decode()
            else:
                decodes[-1].chunks += 1
            continue
        m = _SLOT.search(message)
        if not m:
            continue
        slot, task, text = int(m.group(1)), int(m.group(2)), m.group(3)
        if found := _NEW_PROMPT.match(text):
            prompt_len[slot] = int(found.group(1))
            open_prompt.pop(slot, None)
        elif found := _PROMPT_BATCH.match(text):
            entry = _Entry(slot, task, "prompt", None, int(found.group(1)))
            if (before := open_prompt.get(slot)) is not None:
                before.n_tokens = entry.pos_max - before.pos_max
            if slot in prompt_len:  # the prompt's end bounds this batch until a next one says otherwise
                entry.n_tokens = prompt_len[slot] - (entry.pos_max + 1)
            open_prompt[slot] = entry
            pending.entries.append(entry)
        elif found := _DRAFT.match(text):
            open_prompt.pop(slot, None)
            pending.entries.append(_Entry(slot, task, "verify", 1 + int(found.group(1))))
        elif text.startswith("slot decode token"):
            open_prompt.pop(slot, None)
            pending.entries.append(_Entry(slot, task, "decode", 1))
    return decodes


def split_rollbacks(messages: list[str], slot: int, task: int, geo: Geometry) -> list[dict]:
    """The steps of task `task` (slot `slot`) that rolled drafts back by `seq_rm` after verifying them in a
    micro-batch ahead of another of the same decode: `{"token": the first token generated from the rolled-back
    state, "slot", "step": the verification's number (0-based), "n_draft", "accepted", "plane": the snapshot plane
    the next decode reads (src/llama-memory-recurrent.cpp `seq_rm`: rs_idx = the positions rolled back), "ubatch":
    its micro-batch (1-based), "ubatches": how many, "batch": [[slot, n_tokens], ...]}`. A step whose decode
    cannot be replayed (a count missing, several chunks) is left out: it names nothing."""
    where = {}  # id(entry of ours) -> ((ubatch, ubatches), composition)
    ours = []
    for decode in _decodes(messages):
        mine = [e for e in decode.entries if e.slot == slot and e.task == task and e.kind == "verify"]
        if not mine:
            continue
        ours.append(mine[0])
        seqs = decode.composition()
        if seqs is None:
            continue
        where[id(mine[0])] = (geo.placement(seqs)[slot], seqs)
    return _rolled_back(messages, slot, task, ours, where)


def _rolled_back(messages: list[str], slot: int, task: int, ours: list[_Entry], where: dict) -> list[dict]:
    """Each of our verifications' outcome (`add accepted tokens` / a restore) in order, kept where it rolled drafts
    back by seq_rm from a micro-batch ahead of another."""
    found, step, n_gen = [], -1, 1  # token 0 comes from the prompt
    for message in messages:
        m = _SLOT.search(message)
        if not m or int(m.group(1)) != slot or int(m.group(2)) != task:
            continue
        text = m.group(3)
        if text.startswith("generate_draft:"):
            step += 1
        elif text.startswith("slot decode token"):
            n_gen += 1
        elif text.startswith("restoring speculative checkpoint") and 0 <= step < len(ours):
            where.pop(id(ours[step]), None)  # a checkpoint restore, not a seq_rm rollback
        elif (accepted := _ACCEPTED.match(text)) and 0 <= step < len(ours):
            k, n_draft = int(accepted.group(1)), int(accepted.group(2))
            n_gen += k
            placed = where.get(id(ours[step]))
            if placed and (record := split_rollback(n_gen, slot, step, n_draft, k - 1, *placed)):
                found.append(record)
    return found


def of_request(logged: TaskLog | None, geo: Geometry | None, slot: int) -> list[dict] | None:
    """`split_rollbacks` of the request whose slot is `slot`, from its log (server_work.task_log); None where the
    log or the model's geometry (`geometry`) is not there, or the task's lines are not."""
    if logged is None or slot < 0 or geo is None or logged.task is None or not logged.ended:
        return None
    return split_rollbacks(logged.messages, slot, logged.task, geo)


def places(logged: TaskLog | None, slot: int) -> list[dict] | None:
    """Where each batch of the request whose slot is `slot` (from its log: server_work.task_log) sat in its
    decode, in order: `{"kind": prompt | verify | decode, "n_tokens", "index": its entry's place in the decode,
    "batch": [[slot, n_tokens, 1 where it asks logits of every row (a step), 0 of its last only (a prompt batch)],
    ...] in batch order}`, `batch` None where the decode cannot be told (a count missing, several chunks). What
    re-scoring a position replays (harness.backends.server_rescore): in `par` a slot's rows share one batch with the
    other slots', and the kernels a row takes depend on the rows around it. None where the log or the task's lines
    are not there."""
    if logged is None or slot < 0 or logged.task is None or not logged.ended:
        return None
    task, out = logged.task, []
    for decode in _decodes(logged.messages):
        known = decode.composition() is not None
        for i, entry in enumerate(decode.entries):
            if entry.slot == slot and entry.task == task:
                batch = [[e.slot, e.n_tokens, int(e.kind != "prompt")] for e in decode.entries] if known else None
                out.append({"kind": entry.kind, "n_tokens": entry.n_tokens, "index": i, "batch": batch})
    return out
