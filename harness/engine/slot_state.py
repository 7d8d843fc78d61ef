"""Slot save / restore in the engine, as llama-server's `POST /slots/{id}?action=save|restore` but whole: the
target's sequence and every draft model's copy of it (llama_state_seq_get_data / set_data, full state).

With `Engine(keep_slot_states=True)` the scheduler captures each finished request's slot (`capture`, before it
clears the sequence) so that a later `save` can hand it out; `restore` writes a saved state back into a slot's
sequences, and the slot's next request reuses the longest prefix of its prompt the restored tokens hold (`reuse`,
llama-server's prompt cache: the rest of the prompt is read after them). A model whose memory cannot drop a suffix
(hybrid, recurrent) reuses the restored state only when it is a prefix of the prompt, else reads the prompt
from the start (llama-server would look for a context checkpoint; a slot file carries none).
"""

from dataclasses import dataclass, field

from harness.engine import rollback
from harness.engine.slot import Slot


@dataclass
class SavedSlot:
    """A slot's state: its tokens (positions 0..n-1), the target's sequence and the draft contexts' copies."""

    tokens: list[int]
    target: bytes
    drafts: list[bytes] = field(default_factory=list)


def _mirrors(spec) -> list:
    """The drafters with a context of their own that follows the target (draft models), in order."""
    return list(spec.mirrors) if spec is not None else []


def capture(ctx, spec, slot: Slot) -> SavedSlot:
    """The state of a slot whose request just ended (called before its sequences are cleared)."""
    drafts = [d.ctx.state_seq(spec._seq(slot.id, d)) for d in _mirrors(spec)]
    return SavedSlot(list(slot.history), ctx.state_seq(slot.id), drafts)


def restore(ctx, spec, slot_id: int, saved: SavedSlot) -> str | None:
    """Write `saved` into the slot's sequences; None, or why llama.cpp refused (the sequences are then empty)."""
    ctx.seq_rm(slot_id)
    if not ctx.set_state_seq(slot_id, saved.target):
        return f"llama_state_seq_set_data_ext refused the target state of slot {slot_id} ({len(saved.target)} bytes)"
    mirrors = _mirrors(spec)
    if len(mirrors) != len(saved.drafts):
        ctx.seq_rm(slot_id)
        return f"the saved state has {len(saved.drafts)} draft contexts, this engine {len(mirrors)}"
    for d, state in zip(mirrors, saved.drafts, strict=True):
        seq = spec._seq(slot_id, d)
        d.ctx.seq_rm(seq)
        if not d.ctx.set_state_seq(seq, state):
            ctx.seq_rm(slot_id)
            return f"llama_state_seq_set_data_ext refused the draft context's state of slot {slot_id}"
    return None


def reuse(ctx, spec, slot: Slot, saved: SavedSlot) -> int:
    """Start `slot`'s new request after a restore: keep the longest common prefix of the restored tokens and the
    prompt (at least one prompt token is left to read), dropping the rest; returns the tokens kept (0: the
    sequences were cleared and the prompt is read from the start)."""
    n = 0
    limit = min(len(saved.tokens), len(slot.prompt) - 1)
    while n < limit and saved.tokens[n] == slot.prompt[n]:
        n += 1
    contexts = [ctx] + [d.ctx for d in _mirrors(spec)]
    if n < len(saved.tokens) and not all(rollback.can_seq_rm(c) for c in contexts):
        n = 0
    if n == 0:
        ctx.seq_rm(slot.id)
        for d in _mirrors(spec):
            d.ctx.seq_rm(spec._seq(slot.id, d))
        return 0
    ctx.seq_rm(slot.id, n, -1)
    for d in _mirrors(spec):
        d.ctx.seq_rm(spec._seq(slot.id, d), n, -1)
    slot.n_past = n
    slot.result.timings.prompt_n = len(slot.prompt) - n
    slot.result.timings.cache_n = n
    return n
