"""Speculative decoding for the scheduler: the drafter chain, match verification and rollback.

Semantics follow llama.cpp's `common/speculative.cpp` and llama-server: one verification batch per
step holds each slot's last sampled token plus its draft, every row an output; the slot's own sampler
samples each row and accepts its sample while it equals the draft token, then adds the bonus token.

With `--spec-draft-sampling probabilistic` (llama.cpp b11434) a request at temperature > 0 is verified by
rejection sampling instead when its draft came from a drafter that samples and keeps its candidates q
(draft-simple, draft-mtp: `draft_sampled`): each drafted token is accepted with probability min(1, p/q) or
redrawn from the residual (harness.engine.sampler.accept_or_redraw), with the slot sampler's own random stream,
and a replay after a checkpoint restore re-accepts the replayed tokens as they are (`server_accept_replay`).
The stream is llama.cpp's std::mt19937 read as libstdc++'s uniform_real_distribution<float>, seeded as
common_sampler_init seeds it, so the same seed gives the same tokens (and llama-server's draws where the logits
match, up to the order of candidates of equal probability). As in llama-server, a checkpoint restore rewinds the
stream with the rest of the sampler (common_sampler_copy) and the replay draws nothing from it, so the next
verification draws the uniforms that made the last one reject again: on targets rolled back by checkpoint
acceptance collapses and the output leaves the target's distribution (tests/test_engine_rejection.py)."""

import time
from dataclasses import dataclass, replace
from typing import Any

from harness.engine import rollback, work
from harness.engine.batch import Batch
from harness.engine.context import Context
from harness.engine.drafters.base import Drafter, DraftRequest
from harness.engine.sampler import DraftCheck
from harness.engine.spec_config import SpecConfig, build_drafters
from harness.llama.ubatch import Geometry, split_rollback


@dataclass
class StepPlan:
    """A generating slot's part of one verification batch."""

    base: int
    """Position of the slot's pending token (the first row)."""
    tokens: list[int]
    """[pending] + draft (or + replay)."""
    replay: bool = False
    checkpoint: bytes | None = None
    sampler_backup: Any = None
    q: list | None = None
    """The draft's candidates per drafted token (harness.engine.sampler.Dist) when it is verified by rejection
    sampling (llama-server's `spec_draft_q`); None: verified by match."""

    @property
    def draft(self) -> list[int]:
        return self.tokens[1:]


COUNTERS = (
    "draft_n",
    "draft_n_accepted",
    "spec_cycles",
    "spec_empty",
    "spec_skip",
    "ckpt_created",
    "ckpt_restored",
    "n_redecoded",
    "draft_dropped",
    "draft_ms",
)
"""Per-request speculative counters (`Result.spec_stats`); `draft_dropped` counts draft tokens dropped
because their step's decode failed (the KV cache was full) before the step was retried without them.
Beside them two lists per draft position k (0-based), over the verification steps that had a draft
(replays not counted): `drafted_per_pos[k]`, the steps whose draft had a token at k, and
`accepted_per_pos[k]`, the steps whose token at k was accepted (llama-server's `n_accepted_per_pos`). And
`token_strata`, one letter per returned token: its place in the step that emitted it, a function of what came
before the token, never of whether it was accepted (the `distribution` check's strata, harness.checks.distribution):
`u` a step without a draft (the first token after the prompt among them), `d` a position that had a drafted token
(the draft accepted there, or the draw after its rejection), `b` the token after a wholly accepted draft."""


class Speculation:
    """Drafts, verifies and rolls back for every generating slot of one target context."""

    def __init__(self, config: SpecConfig, target: Context, scans: bool = False):
        self.config = config
        self.ctx = target
        requested = config.rollback
        if requested == "auto" and config.rs_rollback and target.model.kind == "hybrid" and target.n_rs_seq > 0:
            requested = "partial"  # as llama-server rolls back a hybrid target under draft-mtp
        self.strategy = rollback.choose_strategy(requested, target.model.kind, target.model.arch)
        if self.strategy == "partial":
            rollback.check_partial(target)
        self.flags = rollback.CHECKPOINT_FLAGS["full" if config.fault == "full-checkpoint" else config.checkpoint_flags]
        self.geometry = (
            Geometry(
                min(target.params.n_ubatch, target.params.n_batch),
                target.params.kv_unified,
                target.n_rs_seq,
                target.model.kind == "hybrid",
            )
            if self.strategy == "partial"
            else None
        )
        """How libllama splits this target's decodes (harness.llama.ubatch), where rejected drafts roll back by seq_rm
        inside the recurrent snapshots: each request's `Result.split_rollbacks` names the steps that did so from a
        micro-batch ahead of another (known failure `server-par-partial-rollback-diverges`'s step, a libllama
        defect the engine meets too)."""
        self.placed: dict[int, tuple[tuple[int, int], list]] = {}
        self.fault = config.fault
        self.drafters = build_drafters(config, target)
        self.metered = work.meter_drafts(self.drafters, target)
        """The drafters' own contexts, whose decodes count as the requests' `draft_decoded` (harness.engine.work)."""
        self.mirrors = [d for d in self.drafters if type(d).process is not Drafter.process]
        """The drafters that follow the target's decodes (draft models); the others ignore `process`."""
        for d in self.mirrors:
            d.scans = scans  # the KV scan is on: keep what a draft context held when it stopped following
        self.replays: dict[int, list[int]] = {}
        self.strata: dict[int, str] = {}
        """slot → the strata of its last verification's sampled tokens (`token_strata`; a replay emits them)."""
        self.prepared: dict[int, tuple[list[int], float]] = {}
        """slot → its draft of this step drafted with the other slots' (`prepare`) and its share of the time."""
        self.attempts: dict[int, int] = {}
        self.producer: dict[int, int] = {}
        self.owner: dict[int, int] = {}
        """`shared-drafter-state` only: drafter index → the slot that last drafted with the shared state (a
        state last used by another slot is begun again from this slot's history, as a drafter that tolerates
        the mismatch would: its drafts degrade, nothing aborts)."""

    def begin(self, slot) -> None:
        """A slot finished its prompt: drafters index it; counters start at zero."""
        slot.result.spec_stats = {name: 0 for name in COUNTERS}
        slot.result.spec_stats.update(draft_ms=0.0, drafted_per_pos=[], accepted_per_pos=[])
        if self.geometry is not None:
            slot.result.split_rollbacks = []
        self.replays.pop(slot.id, None)
        self.strata.pop(slot.id, None)
        self.attempts[slot.id] = 0
        for index, d in enumerate(self.drafters):
            d.begin(self._seq(slot.id, d), list(slot.prompt))
            if self._shared(d):
                self.owner[index] = slot.id

    def evicted(self, slot) -> None:
        """The KV cache had no room for a step and the slot's request ended to make some: its sequence leaves
        the drafters' contexts now, before the retried step is mirrored into them (`end` follows as usual)."""
        for d in self.drafters:
            d.end(self._seq(slot.id, d))

    def end(self, slot) -> None:
        """The slot's request ended."""
        self.replays.pop(slot.id, None)
        for d in self.drafters:
            d.end(self._seq(slot.id, d))
        stats = slot.result.spec_stats
        if "draft_ms" in stats:
            stats["draft_ms"] = round(stats["draft_ms"], 3)
            # the tokens of one-token steps (no draft: the scheduler samples them without `verify`)
            stats["token_strata"] = stats.get("token_strata", "").ljust(len(slot.result.tokens), "u")

    def scan(self, slot) -> dict | None:
        """The KV scanner's verdict on the draft context's copy of the slot's sequence (the first draft model's
        that still follows it; None without one), which must hold the target's positions 0..n_past-1."""
        return next(
            (v for v in (d.scan(self._seq(slot.id, d), slot.n_past) for d in self.mirrors) if v is not None), None
        )

    def shift(self, slot, n_keep: int, n_discard: int) -> None:
        """The slot's sequence was shifted (positions [n_keep, n_keep + n_discard) discarded): every drafter
        follows (`Drafter.shift_context`) with the history the slot holds now."""
        for d in self.drafters:
            d.shift_context(self._seq(slot.id, d), n_keep, n_discard, list(slot.history))

    def prepare(self, slots: list, room: int) -> None:
        """Draft for every generating slot of the step in one batch where the chain is one drafter that drafts for
        several sequences at once (the heads' `draft_many`), as llama-server's `common_speculative_draft` drafts
        all its slots together; `plan` then takes each slot's draft from here. Other chains draft slot by slot."""
        self.prepared = {}
        if len(self.drafters) != 1 or not hasattr(self.drafters[0], "draft_many"):
            return
        reqs = []
        for slot in slots:
            if slot.id in self.replays or self.attempts[slot.id] > self.config.checkpoint_attempts:
                continue
            n_max = self._n_max(slot, room - (len(slots) - 1))
            if n_max > 0:
                reqs.append(DraftRequest(slot.id, slot.history, slot.pending, n_max))
        if not reqs:
            return
        t0 = time.perf_counter()
        drafts = self.drafters[0].draft_many(reqs)
        share = 1000.0 * (time.perf_counter() - t0) / len(reqs)
        for req in reqs:
            self.prepared[req.seq_id] = (drafts.get(req.seq_id, []), share)

    def _n_max(self, slot, room: int) -> int:
        """The longest draft the slot may verify this step (llama-server's `get_n_draft_max`, within the batch's
        room and, rolling back inside the recurrent snapshots, their number)."""
        n_max = min(room - 1, slot.n_ctx_seq - slot.n_past - 2)
        if slot.n_remaining > 0:
            n_max = min(n_max, slot.n_remaining - 1)
        if self.strategy == "partial":
            n_max = min(n_max, self.ctx.n_rs_seq)
        return n_max

    def plan(self, slot, room: int) -> StepPlan:
        """The slot's tokens for this step: pending + replay, or pending + a fresh draft (maybe empty)."""
        base = slot.n_past
        replay = self.replays.pop(slot.id, None)
        if replay is not None and self.attempts[slot.id] <= self.config.checkpoint_attempts:
            return self._guard(slot, StepPlan(base, [slot.pending] + replay[: room - 1], replay=True))
        n_max = self._n_max(slot, room)
        draft: list[int] = []
        q = None
        prepared = self.prepared.pop(slot.id, None)
        if prepared is not None and n_max > 0:
            draft = prepared[0][:n_max]
            slot.result.spec_stats["draft_ms"] += prepared[1]
            if draft:
                self.producer[slot.id] = 0
            else:
                slot.result.spec_stats["spec_empty"] += 1
        elif n_max > 0 and self.attempts[slot.id] <= self.config.checkpoint_attempts:
            t0 = time.perf_counter()
            req = DraftRequest(slot.id, slot.history, slot.pending, n_max)
            for index, drafter in enumerate(self.drafters):
                seq = self._seq(slot.id, drafter)
                if self._shared(drafter) and self.owner.setdefault(index, slot.id) != slot.id:
                    drafter.begin(seq, list(slot.history))  # slot 0's state, last used by another slot
                    self.owner[index] = slot.id
                draft, q = self._draft(slot, drafter, req if seq == slot.id else replace(req, seq_id=seq))
                if draft:
                    self.producer[slot.id] = index
                    break
            stats = slot.result.spec_stats
            stats["draft_ms"] += 1000.0 * (time.perf_counter() - t0)
            if not draft:
                stats["spec_empty"] += 1
        return self._guard(slot, StepPlan(base, [slot.pending] + draft, q=q))

    def _draft(self, slot, drafter: Drafter, req: DraftRequest) -> tuple[list[int], list | None]:
        """One drafter's draft, cut to `req.n_max`, and its candidates per token when the slot verifies by
        rejection and the drafter samples (llama-server passes `result_q` at temperature > 0; draft-simple and
        draft-mtp fill it with probabilistic drafting; b11393 and newer cut q with the draft only where it was
        filled). None: the draft is verified by match."""
        sampled = getattr(drafter, "draft_sampled", None)
        if sampled is None or not self._rejects(slot):
            return drafter.draft(req)[: req.n_max], None
        draft, q = sampled(req, slot.request.sampling.temperature, slot.sampler.seed)
        draft = draft[: req.n_max]
        return draft, q[: len(draft)] if draft and len(q) >= len(draft) else None

    def _rejects(self, slot) -> bool:
        """Rejection sampling applies to the slot's request: probabilistic drafting and llama-server's
        `use_spec_rejection()` (temperature > 0: "at temp 0 both p and q are point masses, so rejection is the same
        as sample-and-match")."""
        return self.config.spec_draft_sampling == "probabilistic" and slot.request.sampling.temperature > 0

    def _guard(self, slot, plan: StepPlan) -> StepPlan:
        """Take a checkpoint (state + sampler) before a multi-token verification when rolling back by checkpoint."""
        if len(plan.tokens) > 1 and self.strategy == "checkpoint":
            plan.checkpoint = self.ctx.state_seq(slot.id, self.flags)
            plan.sampler_backup = slot.sampler.clone()
            slot.result.spec_stats["ckpt_created"] += 1
            work.checkpoint_created(slot, plan.checkpoint)
        return plan

    def drop(self, slot, plan: StepPlan) -> None:
        """A failed decode: forget the plan's draft (the memory holds none of it)."""
        if plan.sampler_backup is not None:
            plan.sampler_backup.free()
        if plan.replay:
            self.replays[slot.id] = plan.draft  # replayed again at the next step
        else:
            slot.result.spec_stats["draft_dropped"] += len(plan.draft)

    def decoding(self, seqs: list[tuple[int, int]]) -> None:
        """The target decodes a batch of `(slot, n_tokens)` in this order: where each slot's tokens sit in its
        micro-batches (only where rollbacks go inside the recurrent snapshots)."""
        self.placed = {}
        if self.geometry is None:
            return
        try:
            placement = self.geometry.placement(seqs)
        except ValueError:  # n_ubatch <= n_keep_tail: libllama aborts this decode itself (split-equal-keep-tail-...)
            return
        self.placed = {seq: (placement[seq], seqs) for seq, n in seqs if n > 0}

    def processed(self, batch: Batch) -> str | None:
        """The target decoded `batch`: draft models mirror it (its entries are read only for them). Returns why a
        drafter's context refused it (every request of the batch fails with it, as llama-server throws "failed to
        process speculative batch"), else None."""
        if self.mirrors:
            entries = batch.entries()
            for d in self.mirrors:
                try:
                    d.process(entries)
                except rollback.LlamaRefused as err:
                    return str(err)
        return None

    def verify(self, slot, plan: StepPlan, rows: list[int]) -> bool:
        """Sample every row, accept while the sample equals the draft, roll back the rest. A draft with
        candidates (`plan.q`) is accepted by rejection sampling instead (common/sampling.cpp
        `common_sampler_sample_and_accept_n_rejection`, b11434): the row's token is then the drafted one or the
        residual's redraw; a replay at temperature > 0 with probabilistic drafting keeps the replayed tokens,
        each row still sampled (tools/server/server-context.cpp `server_accept_replay`).

        Returns True when the request is done."""
        stats = slot.result.spec_stats
        sampled: list[int] = []
        logits = []
        draft = plan.draft
        k = len(draft)
        n_match = 0
        is_eog = slot.model.is_eog
        replay = plan.replay and self._rejects(slot)
        for i, row in enumerate(rows):
            if i < k and (replay or plan.q):
                slot.sampler.check = DraftCheck(draft[i], None if replay else plan.q[i], self.fault)
            if i == k and k > 0 and self.fault == "bonus-wrong-row":
                row = rows[i - 1]  # the bonus drawn from the last drafted token's row
            token, row_logits = slot.sample(self.ctx, row)
            accepted = slot.sampler.accepted
            if slot.sampler.fault_tv is not None:  # the graded fault's bias at this drafted position (bench)
                stats["fault_tv"] = stats.get("fault_tv", 0.0) + slot.sampler.fault_tv
                stats["fault_tv_n"] = stats.get("fault_tv_n", 0) + 1
                slot.sampler.fault_tv = None
            sampled.append(token)
            logits.append(row_logits)
            # an end-of-generation token ends the step as its sampled token, even where the draft has it too:
            # never counted as accepted, never kept in the sequence (a request without speculation never
            # decodes it either; ggml-org/llama.cpp#28049)
            if i == k or is_eog(token) or not (token == draft[i] if accepted is None else accepted):
                if self.fault == "extra-draw-after-reject" and accepted is None and i < k and token != draft[i]:
                    slot.sampler.draw_again(self.ctx, row)  # a mismatch: one more draw of the chain's generator
                break
            n_match += 1
        if plan.replay:
            stats["n_redecoded"] += k
        else:
            self.strata[slot.id] = "d" * min(k, len(sampled)) + "b" * (len(sampled) > k)
            stats["spec_cycles"] += 1
            stats["draft_n"] += k
            stats["draft_n_accepted"] += n_match
            stats["spec_skip"] += n_match == 0
            for counts, n in ((stats["drafted_per_pos"], k), (stats["accepted_per_pos"], n_match)):
                counts.extend([0] * (n - len(counts)))
                for i in range(n):
                    counts[i] += 1
        replaying = n_match < k and self.strategy == "checkpoint"
        if not replaying:
            # llama-server tells the drafters after the replay, not before it (counting the replayed tokens)
            for index, d in enumerate(self.drafters):
                d.accept(self._seq(slot.id, d), n_match, index != self.producer.get(slot.id))
        if n_match == k:
            self.attempts[slot.id] = 0
            return self._commit(slot, plan, sampled, logits, n_match)
        try:
            return self._roll_back(slot, plan, sampled, logits, n_match)
        except rollback.LlamaRefused as err:
            slot.fail(str(err))
            return True

    def _commit(self, slot, plan: StepPlan, sampled: list[int], logits: list, n_match: int) -> bool:
        if plan.sampler_backup is not None:
            plan.sampler_backup.free()
        slot.n_past = plan.base + 1 + n_match
        before = len(slot.result.tokens)
        done = slot.emit_all(sampled, logits)
        stats = slot.result.spec_stats
        strata = stats.get("token_strata", "").ljust(before, "u")  # tokens of one-token steps, the first among them
        stats["token_strata"] = (strata + self.strata.get(slot.id, "")).ljust(len(slot.result.tokens), "u")[
            : len(slot.result.tokens)
        ]
        return done

    def _roll_back(self, slot, plan: StepPlan, sampled: list[int], logits: list, n_match: int) -> bool:
        base, keep = plan.base, plan.base + 1 + n_match
        off_by_one = 1 if self.fault == "rollback-off-by-one" else 0
        if self.strategy in ("seq-rm", "partial"):
            stale = (
                self.fault == "stale-partial-rollback"
                and self.strategy == "partial"
                and n_match > 0  # the plane one token back was written by this verification batch
                and rollback.stale_partial(self.ctx, slot.id, keep)
            )
            if not stale and not self.ctx.seq_rm(slot.id, keep + off_by_one, -1):
                raise rollback.LlamaRefused(f"llama.cpp refused to remove positions {keep}.. of sequence {slot.id}")
            work.partial_rollback(slot)
            self._truncate_drafters(slot.id, keep)
            done = self._commit(slot, plan, sampled, logits, n_match)
            self._record_split_rollback(slot, plan, n_match)
            return done
        slot.result.spec_stats["ckpt_restored"] += 1
        work.checkpoint_restored(slot, plan.checkpoint)
        if self.fault == "partial-checkpoint-only":
            rollback.restore(self.ctx, slot.id, plan.checkpoint, self.flags, base, trim=False)
            self._truncate_drafters(slot.id, keep)
            return self._commit(slot, plan, sampled, logits, n_match)
        rollback.restore(
            self.ctx,
            slot.id,
            plan.checkpoint,
            self.flags,
            base + off_by_one,
            trim=self.fault != "skip-seq-rm-after-restore",
        )
        self._truncate_drafters(slot.id, base)
        if self.fault == "no-sampler-restore":
            plan.sampler_backup.free()
        else:
            if self.fault == "no-penalty-restore":
                plan.sampler_backup.keep_penalties_of(slot.sampler)
            if self.fault != "rejection-rng-rewound":
                plan.sampler_backup.keep_rejection_stream_of(slot.sampler)
            slot.sampler.free()
            slot.sampler = plan.sampler_backup
        slot.n_past = base
        # the replay decodes the sampled tokens again, less an end-of-generation token (it is sampled again after
        # them; with nothing before it, the replay is a plain step)
        self.replays[slot.id] = sampled[:-1] if slot.model.is_eog(sampled[-1]) else sampled
        self.attempts[slot.id] += 1
        return False

    def _record_split_rollback(self, slot, plan: StepPlan, n_match: int) -> None:
        """A partial rollback just committed: recorded in `Result.split_rollbacks` where its drafts were verified in a
        micro-batch ahead of another of the same decode (harness.llama.ubatch.split_rollback)."""
        placed = self.placed.get(slot.id)
        if placed is None or slot.result.split_rollbacks is None:
            return
        step = slot.result.spec_stats["spec_cycles"] - 1
        record = split_rollback(len(slot.result.tokens), slot.id, step, len(plan.draft), n_match, *placed)
        if record is not None:
            slot.result.split_rollbacks.append(record)

    def _truncate_drafters(self, seq_id: int, n_keep: int) -> None:
        for d in self.drafters:
            d.truncate(self._seq(seq_id, d), n_keep)

    def _shared(self, drafter: Drafter) -> bool:
        """Whether the `shared-drafter-state` fault keys this drafter's state by slot 0 for every slot (the
        n-gram drafters with a state per slot; ngram-mod's table is shared by design)."""
        return self.fault == "shared-drafter-state" and drafter.name in ("ngram-map-k", "ngram-map-k4v")

    def _seq(self, seq_id: int, drafter: Drafter) -> int:
        """The drafter state a slot's calls go to: its own, but slot 0's where the fault shares it."""
        return 0 if self._shared(drafter) else seq_id

    def close(self) -> None:
        """Free drafter resources (draft contexts)."""
        for d in self.drafters:
            close = getattr(d, "close", None)
            if close:
                close()
