"""`draft-simple`: a separate draft model with its own context mirroring the target's positions."""

import ctypes
import ctypes.util
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from harness.engine import rollback
from harness.engine.context import Context
from harness.engine.drafters.base import Drafter, DraftRequest
from harness.engine.kvcheck import KvChecker
from harness.engine.model import Model
from harness.engine.sampler import Dist, DraftSamplers
from harness.errors import HarnessError

PARTIAL_ONLY = rollback.CHECKPOINT_FLAGS["partial"]


_libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_expf = _libm.expf
_expf.argtypes, _expf.restype = [ctypes.c_float], ctypes.c_float


def top10_best(logits: np.ndarray) -> tuple[int, float]:
    """The argmax token and its probability renormalised over the 10 best candidates (llama.cpp's p_min rule).

    The probability is computed as llama.cpp's `dist` sampler does after top-k 10 (src/llama-sampler.cpp): each
    candidate's `expf(logit - max)` in float, in descending order, summed in double, the best's 1 / sum stored as a
    float; compared with `f32(p_min)`, a draft stops exactly where llama-server's does, also at p = 0.200 against
    `--spec-draft-p-min 0.2` (quicksort Python, draft-eagle3: a sum in float64 of numpy's exp put it below).
    Of several ids tied at the maximum the lowest is taken, as `greedy_token` (and llama.cpp's greedy
    sampler) does, so the drafted token does not depend on p_min."""
    best = greedy_token(logits)
    top = np.argpartition(logits, -10)[-10:] if len(logits) > 10 else np.arange(len(logits))
    values = np.sort(logits[top].astype(np.float32))[::-1]
    high = np.float32(logits[best])
    total = 0.0
    for value in values:
        total += _expf(float(np.float32(value - high)))
    return best, float(np.float32(1.0 / total))


def f32(value: float) -> float:
    """`value` as llama.cpp holds it in a float (`--spec-draft-p-min`), for comparisons with `top10_best`'s p."""
    return float(np.float32(value))


def greedy_token(logits: np.ndarray) -> int:
    """The argmax token (the lowest id of several tied at the maximum): the draft token when p_min ≤ 0,
    where its probability cannot stop drafting and is not computed."""
    return int(np.argmax(logits))


@dataclass
class _Mirrored:
    """What the draft context last took in for one sequence, so it can roll back to any position in it."""

    pos0: int
    tokens: list[int]
    state: bytes


class DraftSimple(Drafter):
    """Greedy drafting with a small model: decode `id_last`, then take the argmax while its top-10
    probability stays at or above `p_min`, up to `n_max` tokens; drafts shorter than `n_min` are dropped.

    `stale` is the `stale-draft-context` fault: `truncate` leaves the rejected tokens in the draft context
    and the sequence runs on after them (its positions shifted by the tokens left behind, so llama.cpp
    still accepts every decode): the target never sees it, only the drafts degrade.

    `draft_sampled` drafts as `--spec-draft-sampling probabilistic` does at temperature > 0 (b11434): each token
    sampled by the sequence's `DraftSampler`, its candidates kept as q; `wrong_q` is fault `q-wrong-temperature`."""

    name = "draft-simple"

    def __init__(
        self,
        model_path: Path,
        target: Context,
        n_max: int = 3,
        n_min: int = 0,
        p_min: float = 0.0,
        stale: bool = False,
        cache_types: tuple[str, str] = ("f16", "f16"),
        wrong_q: bool = False,
    ):
        self.n_max, self.n_min, self.p_min = n_max, n_min, f32(p_min)
        self.stale = stale
        self.shift: dict[int, int] = {}
        """stale only: seq → rejected tokens left in the draft context (draft position = target position + shift)."""
        self.n_mirrored: dict[int, int] = {}
        """stale only: seq → the target position after the last one mirrored."""
        self.model = Model(model_path, target.params.repack)
        self.ctx = None
        try:
            self._check_vocab(target.model)
            # as llama-server sizes it (common_speculative_init_result): the target's n_ctx, slots and batch sizes,
            # no recurrent snapshots, its own KV cache types (`cache_types`: -ctkd / -ctvd)
            self.ctx = Context(
                self.model, replace(target.params, n_rs_seq=0, cache_type_k=cache_types[0], cache_type_v=cache_types[1])
            )
        except BaseException:
            self.close()
            raise
        self.batch = self.ctx.new_batch()
        self.samplers = DraftSamplers(self.model, self.model.n_vocab, wrong_q)
        self.exact_rm = rollback.can_seq_rm(self.ctx)
        self.mirrored: dict[int, _Mirrored] = {}
        self.at_checkpoint: dict[int, tuple[int, bytes]] = {}
        """seq → (n_past, state): the sequence is exactly this checkpoint (`draft` restored it and nothing was
        decoded into the sequence since), so `process` takes these bytes instead of serializing it again."""
        self.broken: set[int] = set()
        self.left: dict[int, dict] = {}
        """seq → the scan of its draft-context copy when a decode into the draft context failed and drafting
        stopped for it (`broken`): what the context held then, against the target's positions before the batch."""
        self.checker: KvChecker | None = None

    def _check_vocab(self, target: Model) -> None:
        if abs(self.model.n_vocab - target.n_vocab) > 128 or any(
            self.model.piece(t) != target.piece(t) for t in range(5, min(self.model.n_vocab, target.n_vocab), 997)
        ):
            raise HarnessError(
                f"draft model {self.model.path.name} does not share the vocabulary of {target.path.name}"
            )

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """The draft context already holds the prompt (it mirrored every prompt batch); the sequence's draft
        sampler starts again (llama.cpp's `begin` resets it: "reset here rather than per round, or two identical
        requests differ")."""
        self.samplers.reset(seq_id)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> int:
        self.batch.clear()
        for token, pos, seq_id, logits in entries:
            self.batch.add(token, pos, seq_id, logits)
        return self.ctx.decode(self.batch)

    def process(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode the target's batch into the draft context (checkpointing first where seq_rm is not exact)."""
        entries = [e for e in entries if e[2] not in self.broken]
        if not entries:
            return
        before = {}
        """seq → the target position of its first entry: the draft context should hold the positions before it."""
        for _, pos, seq_id, _ in entries:
            before.setdefault(seq_id, pos)
        if self.stale:
            for _, pos, seq_id, _ in entries:
                self.n_mirrored[seq_id] = max(self.n_mirrored.get(seq_id, 0), pos + 1)
            entries = [(t, p + self.shift.get(s, 0), s, o) for t, p, s, o in entries]
        if not self.exact_rm:
            for seq_id in {e[2] for e in entries}:
                mine = [e for e in entries if e[2] == seq_id]
                saved = self.at_checkpoint.pop(seq_id, None)
                if saved is not None and saved[0] == mine[0][1]:
                    state = saved[1]
                else:
                    state = self.ctx.state_seq(seq_id, PARTIAL_ONLY)
                self.mirrored[seq_id] = _Mirrored(mine[0][1], [e[0] for e in mine], state)
        last = len(entries) - 1
        if self._decode([(t, p, s, i == last) for i, (t, p, s, _) in enumerate(entries)]) != 0:
            # a failed decode leaves the memory as it was: scan what each sequence held when drafting stopped
            if self.scans:
                self.left.update((seq_id, self._scan(seq_id, n)) for seq_id, n in before.items())
            self.broken |= set(before)

    def draft(self, req: DraftRequest) -> list[int]:
        """Argmax drafting in the draft context; the drafted positions are removed again afterwards."""
        return self._draft(req, None)

    def draft_sampled(self, req: DraftRequest, temperature: float, seed: int) -> tuple[list[int], list[Dist]]:
        """Probabilistic drafting (common/speculative.cpp draft-simple `draft` with `result_q` set, b11434): each
        token sampled at the target's `temperature` with the sequence's draft sampler (top-k 10, `seed`), p_min
        compared with its top candidate's probability; (draft, q per drafted token)."""
        q: list[Dist] = []
        return self._draft(req, (temperature, seed, q)), q

    def _next(self, seq: int, sampled: tuple | None) -> tuple[int, float | None]:
        """The next draft token from the draft context's last row and the probability p_min is compared with
        (None: not computed); a sampled draft's q is appended to `sampled`'s list."""
        logits = self.ctx.logits(0)
        if sampled is not None:
            temperature, seed, q = sampled
            token, top, dist = self.samplers.get(seq, temperature, seed).sample(logits)
            if top >= self.p_min:
                q.append(dist)
            return token, top
        if self.p_min > 0:
            return top10_best(logits)
        return greedy_token(logits), None

    def _draft(self, req: DraftRequest, sampled: tuple | None) -> list[int]:
        if req.seq_id in self.broken:
            return []
        seq, pos0 = req.seq_id, len(req.history) + self.shift.get(req.seq_id, 0)
        self.at_checkpoint.pop(seq, None)
        state = None if self.exact_rm else self.ctx.state_seq(seq, PARTIAL_ONLY)
        out: list[int] = []
        token = req.id_last
        while True:
            if self._decode([(token, pos0 + len(out), seq, True)]) != 0:
                break
            token, p = self._next(seq, sampled)
            if p is not None and p < self.p_min:
                break
            out.append(token)
            if len(out) >= min(self.n_max, req.n_max):
                break
        if state is None:
            self.ctx.seq_rm(seq, pos0, -1)
        elif not self._restore(seq, state, pos0):
            out = []
        else:
            self.at_checkpoint[seq] = (pos0, state)
        if len(out) < self.n_min or not out:
            out = []
            if sampled is not None:
                sampled[2].clear()
        return out

    def _restore(self, seq_id: int, state: bytes, n_keep: int) -> bool:
        """Restore a draft-context checkpoint; a sequence llama.cpp refuses to restore stops drafting."""
        try:
            rollback.restore(self.ctx, seq_id, state, PARTIAL_ONLY, n_keep)
        except rollback.LlamaRefused:
            self.broken.add(seq_id)
            return False
        return True

    def truncate(self, seq_id: int, n_keep: int) -> None:
        """Drop the draft context's positions from `n_keep` on (restore and re-decode where seq_rm is not exact)."""
        if seq_id in self.broken:
            return
        if self.stale:
            self.shift[seq_id] = self.shift.get(seq_id, 0) + max(0, self.n_mirrored.get(seq_id, 0) - n_keep)
            self.n_mirrored[seq_id] = min(self.n_mirrored.get(seq_id, 0), n_keep)
            return
        if self.exact_rm:
            self.ctx.seq_rm(seq_id, n_keep, -1)
            return
        self.at_checkpoint.pop(seq_id, None)
        m = self.mirrored.get(seq_id)
        if m is None or n_keep >= m.pos0 + len(m.tokens):
            return
        if not self._restore(seq_id, m.state, m.pos0):
            return
        redo = m.tokens[: max(0, n_keep - m.pos0)]
        if redo and self._decode([(t, m.pos0 + i, seq_id, i == len(redo) - 1) for i, t in enumerate(redo)]) != 0:
            self.broken.add(seq_id)

    def save_seq(self, seq_id: int) -> bytes:
        return self.ctx.state_seq(seq_id)

    def load_seq(self, seq_id: int, state: bytes) -> bool:
        self.ctx.seq_rm(seq_id)
        return self.ctx.set_state_seq(seq_id, state)

    def keep_seq(self, seq_id: int, n_keep: int) -> bool:
        if n_keep == 0:
            return self.ctx.seq_rm(seq_id)
        if self.ctx.seq_pos_max(seq_id) < n_keep:  # nothing past it
            return True
        return self.exact_rm and self.ctx.seq_rm(seq_id, n_keep, -1)

    def shift_context(self, seq_id: int, n_keep: int, n_discard: int, history: list[int]) -> None:
        """The draft context shifts with the target, as llama-server's common_memory does it for both: positions
        [n_keep, n_keep + n_discard) removed, the rest moved down (a refused removal stops drafting)."""
        if seq_id in self.broken:
            return
        self.mirrored.pop(seq_id, None)  # its positions are gone; the next `process` records a new one
        self.at_checkpoint.pop(seq_id, None)
        if not self.ctx.seq_rm(seq_id, n_keep, n_keep + n_discard):
            self.broken.add(seq_id)
            return
        self.ctx.seq_add(seq_id, n_keep + n_discard, -1, -n_discard)
        if seq_id in self.n_mirrored:
            self.n_mirrored[seq_id] -= n_discard

    def scan(self, seq_id: int, n_past: int) -> dict | None:
        """Scan the draft context's sequence, which must hold what the target holds. Where drafting stopped for
        the sequence (`broken`) its context is no longer followed: the scan taken when a decode into it failed
        (a draft context that keeps what it should have dropped fills before the target's), else None."""
        if seq_id in self.broken:
            return self.left.get(seq_id)
        return self._scan(seq_id, n_past)

    def _scan(self, seq_id: int, n_past: int) -> dict:
        if self.checker is None:
            self.checker = KvChecker(self.ctx)
        return self.checker.scan(seq_id, n_past)

    def end(self, seq_id: int) -> None:
        """Clear the sequence from the draft context."""
        if self.ctx is not None:
            self.ctx.seq_rm(seq_id)
        self.mirrored.pop(seq_id, None)
        self.at_checkpoint.pop(seq_id, None)
        self.broken.discard(seq_id)
        self.left.pop(seq_id, None)
        self.shift.pop(seq_id, None)
        self.n_mirrored.pop(seq_id, None)
        self.samplers.reset(seq_id)

    def close(self) -> None:
        """Free the draft context and model."""
        if getattr(self, "samplers", None) is not None:
            self.samplers.close()
        if getattr(self, "batch", None) is not None:
            self.batch.free()
            self.batch = None
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        self.model.close()
