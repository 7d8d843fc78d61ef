"""Slot save / restore in the engine, as llama-server's `POST /slots/{id}?action=save|restore` but whole: the
target's sequence and every mirror drafter's copy of it (llama_state_seq_get_data / set_data, full state: a draft
model's context; the MTP head's context and the target row that waits for its next token).

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
    """A slot's state: its tokens (positions 0..n-1), the target's sequence and the mirror drafters' copies."""

    tokens: list[int]
    target: bytes
    drafts: list[object] = field(default_factory=list)

    @property
    def n_bytes(self) -> int:
        """The bytes of state it carries (llama-server's `n_written` / `n_read`)."""
        return len(self.target) + sum(_n_bytes(d) for d in self.drafts)


def _n_bytes(state: object) -> int:
    """The bytes of one drafter's saved state: llama.cpp's serialized sequence, and the arrays beside it."""
    if state is None:
        return 0
    if isinstance(state, (bytes, bytearray)):
        return len(state)
    if isinstance(state, tuple):
        return sum(_n_bytes(part) for part in state)
    if isinstance(state, int):
        return 4  # a llama_pos (EAGLE3's boundary position, as llama-server's `get_state` writes it)
    return int(state.nbytes)  # a numpy array


def _mirrors(spec) -> list:
    """The drafters with a context of their own that follows the target (draft models, the MTP head), in order."""
    return list(spec.mirrors) if spec is not None else []


def capture(ctx, spec, slot: Slot) -> SavedSlot:
    """The state of a slot whose request just ended (called before its sequences are cleared)."""
    drafts = [d.save_seq(spec._seq(slot.id, d)) for d in _mirrors(spec)]
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
        if not d.load_seq(spec._seq(slot_id, d), state):
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
    if n < len(saved.tokens) and not rollback.can_seq_rm(ctx):
        n = 0
    mirrors = _mirrors(spec)
    if n and not all(d.keep_seq(spec._seq(slot.id, d), n) for d in mirrors):
        n = 0  # a draft model whose memory cannot drop the suffix: read the prompt from the start
    if n == 0:
        ctx.seq_rm(slot.id)
        for d in mirrors:
            d.keep_seq(spec._seq(slot.id, d), 0)
        return 0
    ctx.seq_rm(slot.id, n, -1)
    slot.n_past = n
    slot.result.timings.prompt_n = len(slot.prompt) - n
    slot.result.timings.cache_n = n
    return n
