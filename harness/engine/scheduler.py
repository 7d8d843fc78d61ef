"""Continuous batching over N slots: every step is ONE llama_batch and ONE llama_decode.

A step holds each generating slot's pending token (plus its draft when speculating) and then as many
prompt tokens of the slots still reading their prompt as fit (llama-server's order). The step is
planned first and committed to the slots only after a successful decode, so a failed decode can be
retried with another plan. Requests wait in a FIFO queue for a free slot.
"""

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from harness.engine import slot_state, work
from harness.engine.context import Context
from harness.engine.ctxshift import needs_shift, shift_span
from harness.engine.kvcheck import KvChecker
from harness.engine.slot import Phase, Slot
from harness.engine.spec_config import SpecConfig
from harness.engine.speculative import Speculation, StepPlan
from harness.llama.defaults import INVALID_BATCH, invalid_batch
from harness.result import Result
from harness.suites.request import Request

DECODE_ERRORS = {
    1: "context_full: no free KV cells for this step (raise n_ctx or lower parallel)",
    2: "the decode was aborted",
    -1: INVALID_BATCH,
}


CONTEXT_SHIFT_OFF = "ctx_shift is not supported by this context, it will be disabled"
"""llama-server's start-up warning (and what the engine does) when the memory cannot shift positions."""


def decode_error(status: int) -> str:
    """A one-line reason for a non-zero llama_decode status."""
    return DECODE_ERRORS.get(status, f"llama_decode failed with status {status} (compute error)")


def prompt_breaks(ctx: Context) -> tuple[int, ...]:
    """Where llama-server ends prompt batches to take context checkpoints, as tokens before the prompt's
    end: for models whose memory cannot drop a suffix (hybrid, recurrent) or that use sliding-window
    attention (the server runs without --swa-full), 4 + n_ubatch (at most n_batch) and 4."""
    if ctx.model.kind == "dense" and ctx.model.n_swa == 0:
        return ()
    return (min(ctx.n_batch, 4 + ctx.params.n_ubatch), 4)


@dataclass
class Part:
    """One slot's tokens in a step: a prompt chunk, or a generation step (`spec` set when speculating)."""

    slot: Slot
    tokens: list[int]
    pos0: int
    outputs: list[bool]
    spec: StepPlan | None = None


class Scheduler:
    """Runs requests on `ctx` with `ctx.params.parallel` slots, speculating when `spec` is enabled,
    logging the top `logit_top_k` logits of every generated position when it is > 0, and scanning each
    slot's KV state after every request (`kv_scan="request"`) or also after every speculative step (`"step"`).
    With `ctx.params.context_shift` (and a memory that can shift) a generating slot whose sequence is full
    shifts its context before the next step, as llama-server does; otherwise it ends at the context end."""

    def __init__(self, ctx: Context, spec: SpecConfig | None = None, logit_top_k: int = 0, kv_scan: str = "off"):
        self.ctx = ctx
        self.kv = KvChecker(ctx) if kv_scan != "off" else None
        self.scan_steps = kv_scan == "step"
        breaks = prompt_breaks(ctx)
        self.context_shift = ctx.params.context_shift and ctx.can_shift
        if ctx.params.context_shift and not ctx.can_shift:
            print(f"warning: {CONTEXT_SHIFT_OFF}", file=sys.stderr)
        self.slots = [
            Slot(i, ctx.model, ctx.n_ctx_seq, ctx.params.seed, logit_top_k, breaks, self.context_shift)
            for i in range(ctx.params.parallel)
        ]
        self.batch = ctx.new_batch()
        self.spec = Speculation(spec, ctx, scans=self.kv is not None) if spec is not None and spec.enabled else None
        self.keep_states = False
        """Capture each finished request's slot (harness.engine.slot_state) for a later `Engine.save_slot`."""
        self.saved: dict[int, slot_state.SavedSlot] = {}
        self.restored: dict[int, slot_state.SavedSlot] = {}
        """slot → the state `Engine.restore_slot` put into it, which the slot's next request reuses."""

    def run(
        self,
        requests: list[Request],
        on_result: Callable[[int, Result], None] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list[Result]:
        """Serve all requests (concurrently up to the number of slots); Results in request order.
        `on_result(index, result)` is called as each request finishes (the worker process streams them);
        `on_step(prompt_tokens)` before every step, with the prompt lengths of the slots that have not yet
        generated two tokens (the prompt and a draft model's first read of it may come first): the progress
        the worker reports for the stall window."""
        results: list[Result | None] = [None] * len(requests)

        def finished(index: int, result: Result) -> None:
            results[index] = result
            if on_result is not None:
                on_result(index, result)

        queue = deque(enumerate(requests))
        while queue or self._active():
            for slot in self.slots:
                while slot.phase is Phase.IDLE and queue:
                    index, request = queue.popleft()
                    failed = slot.start(index, request)
                    if failed is not None:
                        finished(index, failed)
                    else:
                        work.begin(slot, self.spec)
                        if slot.id in self.restored:
                            reused = slot_state.reuse(self.ctx, self.spec, slot, self.restored.pop(slot.id))
                            slot.result.work.add("prompt_reused", reused)
            if on_step is not None:
                on_step(sum(len(s.prompt) for s in self._active() if len(s.result.tokens) < 2))
            for slot, result in self.step():
                if self.kv and result.ok:
                    self._scan(slot)
                    if self.spec:
                        self._scan_draft(slot)
                if self.keep_states and result.ok:
                    self.saved[slot.id] = slot_state.capture(self.ctx, self.spec, slot)
                if self.spec:
                    self.spec.end(slot)
                work.finish(slot, self.spec)
                self.ctx.seq_rm(slot.id)
                finished(slot.request_index, result)
        return results

    def _scan(self, slot: Slot) -> None:
        """Scan the slot's sequence; the first unhealthy verdict of a request is the one kept."""
        verdict = self.kv.scan(slot.id, slot.n_past)
        if slot.result.kv_scan is None or slot.result.kv_scan["healthy"]:
            slot.result.kv_scan = verdict

    def _scan_draft(self, slot: Slot) -> None:
        """Scan the draft context's copy of the slot's sequence at the request's end, kept under the request's
        verdict as `draft` (its own `healthy`: the target's verdict stays the target's)."""
        verdict = self.spec.scan(slot)
        if verdict is not None and slot.result.kv_scan is not None:
            slot.result.kv_scan["draft"] = verdict

    def _active(self) -> list[Slot]:
        return [s for s in self.slots if s.phase is not Phase.IDLE]

    def _plan(self, speculate: bool) -> list[Part]:
        """The step's parts: each generating slot's pending token (and draft, within the room left after one
        token for each generating slot after it), then prompt chunks in the room left. A batch smaller than the
        generating slots (n_batch < parallel) takes as many as fit; the others generate in a later step."""
        parts: list[Part] = []
        room = self.batch.capacity
        generating = [slot for slot in self._active() if slot.phase is Phase.GENERATE]
        if speculate and self.spec:
            self.spec.prepare(generating, room)
        for i, slot in enumerate(generating):
            if room == 0:
                break
            own = room - min(len(generating) - i - 1, room - 1)
            if speculate and self.spec:
                plan = self.spec.plan(slot, own)
                tokens = plan.tokens
            else:
                plan, tokens = None, [slot.pending]
            parts.append(Part(slot, tokens, slot.n_past, [True] * len(tokens), plan))
            room -= len(tokens)
        for slot in self._active():
            if slot.phase is Phase.PROMPT and room > 0:
                chunk = slot.prompt_chunk(room)
                last = len(chunk) == slot.prompt_left
                parts.append(Part(slot, chunk, slot.n_past, [last and i == len(chunk) - 1 for i in range(len(chunk))]))
                room -= len(chunk)
        return parts

    def _decode(self, parts: list[Part]) -> tuple[int, list[list[int]]]:
        """Fill the batch with `parts` and decode; returns the status and each part's output rows."""
        self.batch.clear()
        rows = []
        for part in parts:
            part_rows = []
            for i, (token, output) in enumerate(zip(part.tokens, part.outputs, strict=False)):
                row = self.batch.add(token, part.pos0 + i, part.slot.id, output)
                if output:
                    part_rows.append(row)
            rows.append(part_rows)
        if self.spec:
            self.spec.decoding([(part.slot.id, len(part.tokens)) for part in parts])
        return self.ctx.decode(self.batch), rows

    def step(self) -> list[tuple[Slot, Result]]:
        """Shift full contexts (context shift on), plan, decode, sample / verify; returns the slots that
        finished with their Results."""
        failed = self._shift_contexts() if self.context_shift else []
        return failed + self._step()

    def _shift_contexts(self) -> list[tuple[Slot, Result]]:
        """llama-server's context shift (server-context.cpp, pre_decode) for every generating slot whose
        sequence is full: keep `n_keep` positions, discard the `n_discard` after them, move the rest down
        (harness.engine.ctxshift), and let the drafters follow. Returns the slots whose shift llama.cpp
        refused (llama-server aborts there), ended with an error."""
        failed = []
        for slot in self._active():
            if slot.phase is not Phase.GENERATE or not needs_shift(slot.n_past, slot.n_ctx_seq):
                continue
            sampling = slot.request.sampling
            n_keep, n_discard = shift_span(
                slot.n_past,
                len(slot.prompt),
                slot.n_ctx_seq,
                sampling.n_keep,
                sampling.n_discard,
                self.ctx.model.add_bos,
            )
            if not self.ctx.seq_rm(slot.id, n_keep, n_keep + n_discard):
                why = (
                    f"llama.cpp refused to remove positions {n_keep}..{n_keep + n_discard - 1} of sequence "
                    f"{slot.id} for a context shift (llama-server aborts there)"
                )
                failed.append((slot, slot.fail(why)))
                continue
            self.ctx.seq_add(slot.id, n_keep + n_discard, slot.n_past, -n_discard)
            slot.shift(n_keep, n_discard)
            if self.spec:
                self.spec.shift(slot, n_keep, n_discard)
        return failed

    def _step(self) -> list[tuple[Slot, Result]]:
        parts = self._plan(speculate=True)
        if not parts:
            return []
        status, rows = self._decode(parts)
        if status == 1 and any(p.spec and len(p.tokens) > 1 for p in parts):
            parts = self._drop_drafts(parts)
            status, rows = self._decode(parts)
        if status == 1 and len(parts) > 1:
            return self._evict_until_fit(parts)
        if status != 0:
            return self._fail(parts, status)
        return self._finish_step(parts, rows)

    def _fail(self, parts: list[Part], status: int) -> list[tuple[Slot, Result]]:
        """End every part's request with the decode's error; a refused batch (-1) names a sequence whose
        positions do not follow what the memory holds, as llama.cpp's log does (nothing was decoded): one that
        starts at a position the memory already holds, else one that skips positions (M-RoPE allows that)."""
        error = decode_error(status)
        if status == -1:
            last = {p.slot.id: self.ctx.seq_pos_max(p.slot.id) for p in parts}
            wrong = next((p for p in parts if last[p.slot.id] >= p.pos0), None) or next(
                (p for p in parts if 0 <= last[p.slot.id] < p.pos0 - 1), None
            )
            if wrong is not None:
                error = invalid_batch(wrong.slot.id, last[wrong.slot.id], wrong.pos0)
        return [(p.slot, p.slot.fail(error)) for p in parts]

    def _drop_drafts(self, parts: list[Part]) -> list[Part]:
        """A speculative step did not fit: forget its drafts and plan a plain step instead."""
        for part in parts:
            if part.spec:
                self.spec.drop(part.slot, part.spec)
                if self.spec.fault == "keep-drafts-on-decode-failure":
                    part.slot.n_past = part.pos0 + len(part.tokens)
        return self._plan(speculate=False)

    def _evict_until_fit(self, parts: list[Part]) -> list[tuple[Slot, Result]]:
        """The KV cache has no room for the step: end the last part's request (a prompt still being read,
        else the highest slot) with a context_full error, free its cells, and retry with the rest."""
        finished = []
        while True:
            victim = parts.pop()
            finished.append((victim.slot, victim.slot.fail(decode_error(1))))
            self.ctx.seq_rm(victim.slot.id)
            if self.spec:  # its draft contexts' cells too: the retried step is mirrored there (draft-mtp)
                self.spec.evicted(victim.slot)
            status, rows = self._decode(parts)
            if status == 0:
                return finished + self._finish_step(parts, rows)
            if status != 1 or len(parts) == 1:
                return finished + self._fail(parts, status)

    def _finish_step(self, parts: list[Part], rows: list[list[int]]) -> list[tuple[Slot, Result]]:
        work.decoded(parts)
        refused = self.spec.processed(self.batch) if self.spec else None
        finished = []
        for part, part_rows in zip(parts, rows, strict=False):
            slot = part.slot
            if refused is not None:  # a draft context refused the batch: llama-server fails its speculative batch
                finished.append((slot, slot.fail(refused)))
                continue
            if part.spec is not None and len(part.tokens) > 1:
                done = self.spec.verify(slot, part.spec, part_rows)
                if self.scan_steps and not done:
                    self._scan(slot)
            else:
                slot.n_past = part.pos0 + len(part.tokens)
                if not part_rows:
                    continue
                was_prompt = slot.phase is Phase.PROMPT
                done = slot.emit(*slot.sample(self.ctx, part_rows[0]))
                if was_prompt and self.spec and not done:
                    self.spec.begin(slot)
            if done:
                finished.append((slot, slot.result))
        return finished
