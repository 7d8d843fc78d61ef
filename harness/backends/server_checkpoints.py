"""Which tokens each of a llama-server slot's context checkpoints was made from, and whether a request went on from
one that no longer matches its prompt (a stale checkpoint).

A hybrid or recurrent target cannot drop cells, so a request that shares only part of what its slot holds goes
on from a context checkpoint: the state after the checkpoint's `n_tokens` tokens, made while an earlier request
read its prompt. That state is right only when those tokens are this prompt's first `n_tokens`. llama-server
checks the positions of the checkpoints it keeps against the shared prefix (`pos_max > pos_next` erases), not the
tokens they were made from, so a checkpoint whose last position is the first one a later prompt changed survives
and is restored by a request after it (known failure server-stale-context-checkpoint).

`Ledger` follows the checkpoint lines of each request's task (at `-lv 5`, tools/server/server-context.cpp at
0c1e570 and b11434): "created context checkpoint i of n (..., n_tokens = N, ...)" records the request's first N
prompt tokens; the erasing and superseding lines drop N; "restored context checkpoint (..., n_tokens = N, ...)"
compares the record with the prompt. A slot whose checkpoints came from elsewhere (the host-RAM prompt cache, a
slot restore) is forgotten, and nothing is claimed about a checkpoint not seen made.
"""

from __future__ import annotations

import re

CREATED = re.compile(r"created context checkpoint \d+ of \d+ \(.*?n_tokens = (\d+)")
RESTORED = re.compile(r"restored context checkpoint \(.*?n_tokens = (\d+)")
DROPPED = re.compile(
    r"(?:erasing old context checkpoint|erasing context checkpoint too close to an earlier one|"
    r"erased invalidated context checkpoint) \(.*?n_tokens = (\d+)|superseding context checkpoint at n_tokens = (\d+)"
)
ELSEWHERE = re.compile(r"found better prompt|clearing prompt with")
"""Lines after which a slot holds checkpoints this ledger did not see made, or none (a state loaded from the host-RAM
prompt cache, a slot cleared); a slot restore is forgotten by the session (ServerSession.restore_slot)."""


def stale_line(n_tokens: int, made: tuple[int, ...], prompt: list[int]) -> str | None:
    """The stale checkpoint's words when `made` (its tokens) is not `prompt`'s first `n_tokens`, else None."""
    if tuple(prompt[:n_tokens]) == made:
        return None
    at = next((i for i, (a, b) in enumerate(zip(made, prompt, strict=False)) if a != b), min(len(made), len(prompt)))
    theirs = made[at] if at < len(made) else "none"
    mine = prompt[at] if at < len(prompt) else "none"
    return (
        f"prompt went on from a stale context checkpoint (n_tokens {n_tokens}, made from a prompt whose token {at} "
        f"is {theirs}, this prompt's {mine})"
    )


class Ledger:
    """Per slot of one llama-server process: n_tokens → the prompt tokens its checkpoint was made from."""

    def __init__(self) -> None:
        self.slots: dict[int, dict[int, tuple[int, ...]]] = {}

    def forget(self, slot: int | None = None) -> None:
        """Forget one slot's checkpoints (None: every slot's, a new server)."""
        if slot is None:
            self.slots.clear()
        else:
            self.slots.pop(slot, None)

    def follow(self, slot: int, prompt: list[int], messages: list[str], lines: list[str]) -> str | None:
        """Learn from one request's log (`messages` from its start; `lines`, its task's, in order); the stale restore
        it made, in words, or None."""
        known = self.slots.setdefault(slot, {})
        if any(ELSEWHERE.search(m) for m in messages):  # the prompt cache loaded a state into a slot
            known.clear()
        stale = None
        for line in lines:
            if found := RESTORED.search(line):
                n = int(found.group(1))
                if n in known and stale is None:
                    stale = stale_line(n, known[n], prompt)
            elif found := DROPPED.search(line):
                known.pop(int(found.group(1) or found.group(2)), None)
            elif found := CREATED.search(line):
                n = int(found.group(1))
                if n <= len(prompt):
                    known[n] = tuple(prompt[:n])
                else:  # made past the prompt: not from its tokens alone
                    known.pop(n, None)
        return stale
