"""A deterministic drafter for tests: proposes tokens from a script of the target's expected output."""

import functools
from collections.abc import Callable

from harness.engine.drafters.base import Drafter, DraftRequest

WrongAt = set[int] | Callable[[int, int, int], bool]


def _lookup(script: dict[tuple[int, ...], list[int]], prompt: list[int]) -> list[int]:
    return script.get(tuple(prompt), [])


def by_prompt(script: dict[tuple[int, ...], list[int]]) -> Callable[[list[int]], list[int]]:
    """A `continuation` that looks each request's prompt up in `script` (picklable: the in-process
    engine runs in a worker process)."""
    return functools.partial(_lookup, script)


def _at_position(k: int, seq_id: int, offset: int, pos: int) -> bool:
    return pos == k


def at_draft_position(k: int) -> WrongAt:
    """A `wrong_at` that corrupts position `k` of every draft (picklable)."""
    return functools.partial(_at_position, k)


SCRIPTS = {"accept-all": {}, "reject-all": {"reject_all": True}, "wrong-at-2": {"wrong_at": at_draft_position(2)}}
"""The scripted presets (`scripted-accept`, `scripted-reject`, `scripted-wrong-at-2`): Scripted's options."""


def from_script(kind: str, outputs: dict[tuple[int, ...], list[int]]) -> "Scripted":
    """The drafter of a scripted preset, proposing each prompt's expected output (`outputs`: prompt tokens →
    output tokens) as is or corrupted as `kind` says."""
    return Scripted(by_prompt(outputs), **SCRIPTS[kind])


class Scripted(Drafter):
    """Propose the next tokens of a script, optionally corrupted at chosen places.

    `continuation` is what the target is expected to generate after the prompt (output token 0 is the first
    sampled token): one list for every sequence, a dict seq_id → list, or a function of the request's
    prompt tokens (called at `begin`) returning the list; None never drafts. With
    o = len(history) - len(prompt) output tokens decoded so far, `id_last` is output token o and the draft
    is continuation[o+1 : o+1+n_max] (capped at `req.n_max`, shorter or empty at the end of the script).

    A proposed token t is replaced by a wrong one — t-1, or 1 for token 0: always a valid id, whatever the
    vocabulary's size — when `wrong_at` says so: a set of output offsets (indices into the continuation),
    or a callable (seq_id, output offset, draft position) → bool. `reject_all=True` makes every draft's
    first token wrong. So: no corruption → every draft is accepted in full (if the target follows the script);
    `wrong_at=lambda s, j, k: k == 2` → each draft is rejected at its position 2; `reject_all` → nothing
    is ever accepted.
    """

    name = "scripted"

    def __init__(
        self,
        continuation: dict[int, list[int]] | list[int] | Callable[[list[int]], list[int]] | None = None,
        n_max: int = 4,
        wrong_at: WrongAt | None = None,
        reject_all: bool = False,
    ):
        self.continuation = continuation
        self.n_max = n_max
        self.wrong_at = wrong_at
        self.reject_all = reject_all
        self._prompt_len: dict[int, int] = {}
        self._by_prompt: dict[int, list[int]] = {}

    def begin(self, seq_id: int, prompt: list[int]) -> None:
        """Remember where the output of `seq_id` starts (and look its script up when keyed by prompt)."""
        self._prompt_len[seq_id] = len(prompt)
        if callable(self.continuation):
            self._by_prompt[seq_id] = self.continuation(prompt)

    def shift_context(self, seq_id: int, n_keep: int, n_discard: int, history: list[int]) -> None:
        """A context shift: the history is `n_discard` tokens shorter, the script's position unchanged."""
        self._prompt_len[seq_id] -= n_discard

    def _script(self, seq_id: int) -> list[int]:
        if callable(self.continuation):
            return self._by_prompt.get(seq_id, [])
        if isinstance(self.continuation, dict):
            return self.continuation.get(seq_id, [])
        return self.continuation or []

    def _is_wrong(self, seq_id: int, offset: int, pos: int) -> bool:
        if self.reject_all and pos == 0:
            return True
        if callable(self.wrong_at):
            return self.wrong_at(seq_id, offset, pos)
        return self.wrong_at is not None and offset in self.wrong_at

    def wrong(self, token: int) -> int:
        """The deterministic wrong token planted instead of `token` (a valid id other than `token`)."""
        return token - 1 if token > 0 else token + 1

    def draft(self, req: DraftRequest) -> list[int]:
        """The next scripted tokens after `req.id_last`, corrupted where asked."""
        start = len(req.history) - self._prompt_len[req.seq_id] + 1
        stop = start + max(min(self.n_max, req.n_max), 0)
        return [
            self.wrong(t) if self._is_wrong(req.seq_id, start + k, k) else t
            for k, t in enumerate(self._script(req.seq_id)[start:stop])
        ]
