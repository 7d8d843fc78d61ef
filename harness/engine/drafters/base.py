"""The interface every drafter implements, mirroring llama.cpp's `common_speculative_impl`."""

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class DraftRequest:
    """What a drafter sees for one slot at one step.

    `history` holds every token decoded into the target for this slot (prompt, then accepted output),
    at positions 0..len(history)-1; `id_last` is the last sampled token, not yet decoded, which will sit
    at position len(history); `n_max` caps this step's draft.
    """

    seq_id: int
    history: list[int]
    id_last: int
    n_max: int


class Drafter(ABC):
    """One drafter. The engine calls `begin` once per request after the prompt, `draft` at each step,
    `accept` after each verification of a step that had a draft (`is_other`: another drafter of the
    chain produced it), `process` after every target decode, `truncate` after every rollback, `shift_context`
    after a context shift and `end` when the request ends (only draft models need `process`, `truncate`
    and `end`)."""

    name: str = ""
    scans: bool = False
    """The engine scans KV state (`kv_scan` on): a drafter with a context of its own scans it where it stops
    following a sequence (`scan`)."""
    n_max: int = 16
    """The longest draft this drafter proposes (sizes recurrent snapshots for `--rollback partial`)."""

    @abstractmethod
    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """A request starts on `seq_id` with this prompt."""

    @abstractmethod
    def draft(self, req: DraftRequest) -> list[int]:
        """Proposed tokens to follow `req.id_last` (may be empty: no draft this step)."""

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """The target accepted `n_accepted` tokens of the last draft of `seq_id`."""

    def process(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """The target decoded these (token, pos, seq_id, logits) entries."""

    def truncate(self, seq_id: int, n_keep: int) -> None:
        """The target rolled `seq_id` back to its first `n_keep` positions."""

    def shift_context(self, seq_id: int, n_keep: int, n_discard: int, history: list[int]) -> None:
        """A context shift: the target discarded positions [n_keep, n_keep + n_discard) of `seq_id` and
        moved the rest down; `history` is what it holds now. By default the drafter begins again on it
        (what llama.cpp PR #21815 adds to llama-server; at 0c1e570 it does not, and ngram-map aborts)."""
        self.begin(seq_id, history)

    def scan(self, seq_id: int, n_past: int) -> dict | None:
        """The KV scanner's brief verdict on this drafter's own context for `seq_id`, which mirrors the target's
        positions 0..n_past-1; None when the drafter has no context (or stopped following the sequence)."""
        return None

    def end(self, seq_id: int) -> None:
        """The request on `seq_id` ended; its positions are gone from the target."""

    # A drafter with a context of its own that follows the target (a `mirror`: draft models, the MTP head) saves
    # and restores its copy of a slot with the target's (harness.engine.slot_state, slot save / restore).

    def save_seq(self, seq_id: int) -> object:
        """This drafter's state of `seq_id`, for `load_seq` (mirrors only)."""
        raise NotImplementedError(f"{self.name} keeps no state of a slot to save")

    def load_seq(self, seq_id: int, state: object) -> bool:
        """Replace `seq_id`'s state with a `save_seq` one; False when llama.cpp refused (the sequence is empty)."""
        raise NotImplementedError(f"{self.name} keeps no state of a slot to restore")

    def keep_seq(self, seq_id: int, n_keep: int) -> bool:
        """Keep positions 0..n_keep-1 of `seq_id` (0: none), as the target does when its next request reuses a
        restored prefix; False where this drafter's memory cannot drop a suffix exactly (nothing is dropped)."""
        raise NotImplementedError(f"{self.name} keeps no state of a slot")
