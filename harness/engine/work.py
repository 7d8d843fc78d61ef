"""The work each request's steps do (`Result.work`, harness.result.WORK_COUNTERS), counted in one place.

The scheduler and the speculation call these at the events they count:
- `begin` when a slot takes a request, `finish` when it ends (the draft contexts' decodes for its sequence);
- `decoded` after every successful target decode (a failed one decodes nothing: it is retried or fails);
- `checkpoint_created` / `checkpoint_restored` with the state's bytes, `partial_rollback` for a rejection rolled
  back with `seq_rm` alone.
A draft model's context counts its own decodes per sequence (`DecodeMeter`, switched on by `meter_drafts`): the
drafters are not edited for it, and every decode into their context is counted whatever made it. The MTP drafter
decodes through llama_process on a batch of its own, and counts into the meter it is given.
"""

from collections import Counter

from harness.engine.context import Context
from harness.engine.slot import Phase
from harness.result import Work


class DecodeMeter:
    """Tokens a context decoded per sequence id (`Context.decode` counts each successful decode here)."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def count(self, batch) -> None:
        s = batch.struct
        self.add([s.seq_id[i][0] for i in range(batch.n_tokens)])

    def add(self, seq_ids: list[int]) -> None:
        """One decoded batch whose tokens belong to these sequences (one id per token)."""
        self.counts.update(seq_ids)

    def take(self, seq_id: int) -> int:
        """The tokens counted for `seq_id` since the last take (and start again from 0)."""
        return self.counts.pop(seq_id, 0)


def meter_drafts(drafters: list, target: Context) -> list:
    """Switch on the decode meter of every drafter's own context (a draft model's, or the MTP drafter's); returns
    the objects whose `meter` counts."""
    metered = []
    for d in drafters:
        ctx = getattr(d, "ctx", None)
        if isinstance(ctx, Context) and ctx is not target and ctx not in metered:
            ctx.meter = DecodeMeter()
            metered.append(ctx)
        elif not isinstance(ctx, Context) and hasattr(d, "meter") and d not in metered:
            d.meter = DecodeMeter()
            metered.append(d)
    return metered


def _drafts(spec) -> list:
    return getattr(spec, "metered", []) if spec is not None else []


def begin(slot, spec=None) -> None:
    """The slot took a request: every counter starts at 0 (what the draft contexts counted before is dropped)."""
    slot.result.work = Work.zero()
    for ctx in _drafts(spec):
        ctx.meter.take(slot.id)


def finish(slot, spec=None) -> None:
    """The slot's request ended: add what the draft contexts decoded for its sequence."""
    work = slot.result.work
    if work.counted():
        for ctx in _drafts(spec):
            work.add("draft_decoded", ctx.meter.take(slot.id))


def decoded(parts: list) -> None:
    """The target decoded these scheduler parts (prompt chunks and generation steps) successfully."""
    for part in parts:
        work = part.slot.result.work
        n = len(part.tokens)
        work.add("target_decoded", n)
        if part.spec is None and part.slot.phase is Phase.PROMPT:
            work.add("prompt_read", n)


def checkpoint_created(slot, state: bytes) -> None:
    """A checkpoint of the slot's sequence before a verification, at its `n_past` positions."""
    slot.result.work.checkpoint("speculative", slot.n_past, len(state))


def checkpoint_restored(slot, state: bytes) -> None:
    slot.result.work.add("ckpt_restored", 1)
    slot.result.work.add("ckpt_restored_bytes", len(state))


def partial_rollback(slot) -> None:
    slot.result.work.add("partial_rollbacks", 1)
