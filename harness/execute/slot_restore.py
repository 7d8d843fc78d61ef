"""Slot save / restore rounds (`run_order: [..., restore, restore-fresh]`, `restore: {after_turn: N}`).

A restore round serves its requests one at a time, as `seq` does, and interrupts each chat after turn N: the
slot that served the turn is saved (llama-server's `POST /slots/{id}?action=save`, with `--slot-save-path`),
then
- `restore`: erased (`action=erase`, which clears the slot's sequence in the target and the draft context) and
  restored into the same session (`action=restore`);
- `restore-fresh`: restored into a fresh session of the same cell (a new llama-server, the saved file copied
  into its --slot-save-path), where the chat goes on; the fresh session closes at the round's end;
- `restore-over`: the same slot first serves another conversation, longer than the saved state (`detour`: a
  completion of DETOUR, `ignore_eos`, as many tokens generated as the slot held when saved), then gets the
  saved state back WITHOUT an erase (`action=restore` over what the slot holds), as a server with one slot and
  several users does. llama-server (0c1e570) loads the target context only and leaves the draft context
  holding the other conversation (ggml-org/llama.cpp#28619): a dense draft then drafts from it, and a
  recurrent or hybrid draft, which cannot drop the other conversation's suffix, aborts llama-server at the
  next request (`common.cpp:1539: failed to remove sequence 0 with p0=N, p1=-1`).

The chat's later turns then reuse the restored state as they would have reused the uninterrupted one, and
`restore-identical` compares them with the same turns of the suite's uninterrupted round: output, drafted and
accepted tokens (a draft context the restore did not bring back drafts worse; ggml-org/llama.cpp#28619).

A session offers the operation with `save_slot(slot_id) -> dict` (`state` and the backend's answer, or `error`)
and `restore_slot(slot_id, state, erase) -> dict` (the answer, or `error`); a backend without them cannot serve a
restore round (a harness error naming it). A refused save or restore is the software's answer, not the
harness's: the chat's later turns end as errors saying so (`no-crash` fails on them).
"""

from collections.abc import Callable

from harness.errors import HarnessError
from harness.result import Result
from harness.suites import RESTORE_ROUNDS
from harness.suites.request import Request, Sampling

DETOUR = "Explain recursion to a child in three sentences, then give an example in Python."
"""The other conversation a `restore-over` round serves on the slot between the save and the restore."""


def detour(saved_len: int) -> Request:
    """The other conversation of a `restore-over` round, for a slot saved holding `saved_len` tokens (the saved
    turn's prompt and output): greedy, `ignore_eos`, `saved_len` tokens generated, so the slot then holds more
    positions than the saved state restores (repro bundles rebuild it from the same numbers)."""
    return Request(prompt=DETOUR, sampling=Sampling(n_predict=saved_len, temperature=0, ignore_eos=True), tag="detour")


class SlotRestore:
    """One round's slot saves and restores; `serve` sends each request (to the fresh session after a
    `restore-fresh` restore). A round of another kind just sends its requests to `session`."""

    def __init__(self, session, how: str, after_turn: int | None, open_fresh: Callable[[], object]):
        self.session = session
        self.how = how
        self.after_turn = after_turn
        self.open_fresh = open_fresh
        self.active = how in RESTORE_ROUNDS and after_turn is not None
        self.fresh = None
        self.saved: dict[str, tuple[int, dict]] = {}
        """case → (slot, save answer) once its turn `after_turn` was served."""
        self.saved_len: dict[str, int] = {}
        """case → the tokens of the saved turn (prompt and output): the length of a `restore-over` detour."""
        self.serving: dict[str, object] = {}
        """case → the session its chat goes on in after the restore."""
        self.refused: dict[str, str] = {}
        """case → why its slot could not be saved or restored (its later turns end with this error)."""

    def serve(self, case: str, step: int, request: Request) -> Result:
        """Serve `request`, turn `step + 1` of `case`, restoring the case's slot first when it is the first turn
        after `after_turn`, and saving the slot after turn `after_turn`."""
        if not self.active:
            return self.session.run([request])[0]
        if step == self.after_turn and case in self.saved:
            self._restore(case)
        if case in self.refused and step >= self.after_turn:
            return Result(stop_reason="error", error=self.refused[case])
        result = self.serving.get(case, self.session).run([request])[0]
        if step == self.after_turn - 1 and result.ok:
            self.saved_len[case] = len(result.prompt_tokens) + len(result.tokens)
            self._save(case, result.slot_id if result.slot_id >= 0 else 0)
        return result

    def _save(self, case: str, slot: int) -> None:
        save = getattr(self.session, "save_slot", None)
        if save is None:
            raise HarnessError(f"{type(self.session).__name__} cannot save a slot: a {self.how} round needs it")
        answer = save(slot)
        if "error" in answer:
            self.refused[case] = f"slot save refused: {answer['error']}"
        else:
            self.saved[case] = (slot, answer)

    def _restore(self, case: str) -> None:
        slot, saved = self.saved.pop(case)
        if self.how == "restore-over":
            other = self.session.run([detour(self.saved_len[case])])[0]
            if not other.ok:
                self.refused[case] = f"the other conversation before the restore ({self.how}) failed: {other.error}"
                return
        if self.how in ("restore", "restore-over"):
            target = self.session
        else:
            if self.fresh is None:
                self.fresh = self.open_fresh()
            target = self.fresh
        answer = target.restore_slot(slot, saved["state"], erase=self.how == "restore")
        if "error" in answer:
            self.refused[case] = f"slot restore refused ({self.how}): {answer['error']}"
        else:
            self.serving[case] = target

    def close(self) -> None:
        """Close the fresh session, if one was opened."""
        if self.fresh is not None:
            self.fresh.close()
            self.fresh = None
