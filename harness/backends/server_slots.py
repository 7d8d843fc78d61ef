"""Which llama-server slot serves a request, and whether a saved slot is the request's own: a slot is lent to one
request at a time (`SlotPool`, choosing as llama-server does), and its saved token list must hold the request's
prompt and returned tokens (`slot_ownership`; in `seq`, fewer cells than those are `lost_cells`)."""

from __future__ import annotations

import itertools
import threading

from harness.result import Result

SLOT_PROMPT_SIMILARITY = 0.1
"""llama-server's default `--slot-prompt-similarity`: a free slot whose cached tokens share more than this
fraction of a new prompt is chosen for it, else the least recently used one (SlotPool does the same)."""


class SlotPool:
    """The slots of a llama-server serving several requests at a time, each lent to one request at a time: the
    request is pinned to it (`id_slot`) and it comes back only after the request ended and its state was saved,
    so no other request is given a slot before its save. The choice is llama-server's own when it picks a slot
    (`get_available_slot`): the free slot whose last tokens share the largest fraction (above
    SLOT_PROMPT_SIMILARITY) of the prompt, else the least recently used."""

    def __init__(self, n_slots: int):
        self._cond = threading.Condition()
        self._free = list(range(n_slots))
        self._tokens: dict[int, list[int]] = {}
        self._used: dict[int, int] = {}
        self._clock = itertools.count(1)

    def acquire(self, prompt: list[int]) -> int:
        """A free slot for a request with `prompt` (waits for one; there are as many clients as slots)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            best, best_sim = None, 0.0
            for slot in self._free:
                held = self._tokens.get(slot, [])
                if held and prompt:
                    sim = _common_prefix(held, prompt) / len(prompt)
                    if sim > best_sim and sim > SLOT_PROMPT_SIMILARITY:
                        best, best_sim = slot, sim
            if best is None:
                best = min(self._free, key=lambda s: self._used.get(s, 0))
            self._free.remove(best)
            return best

    def release(self, slot: int, tokens: list[int]) -> None:
        """`slot` is free again and holds `tokens` (what its request left there, as far as the harness knows)."""
        with self._cond:
            self._tokens[slot] = list(tokens)
            self._used[slot] = next(self._clock)
            self._free.append(slot)
            self._cond.notify()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def slot_ownership(held: list[int] | None, result: Result) -> str | None:
    """None when the tokens a saved slot holds (`held`, the slot file's token list) are the request's own: its
    prompt and returned tokens, save possibly the last (the token a request ends on is sampled, never decoded),
    and anything after them (tokens the slot kept past those it returned: `past_returned` judges those); for a
    request that reached the context end (`truncated`), also a context shift's kept prefix plus the rest up to
    the end. Else why the state cannot be the request's."""
    if held is None:
        return "the slot file carries no token list to compare with the request's"
    own = list(result.prompt_tokens) + list(result.tokens)
    common = _common_prefix(held, own)
    if common >= len(own) - 1:
        return None
    rest = held[common:]
    if (
        result.truncated
        and rest
        and any(end - len(rest) >= common and own[end - len(rest) : end] == rest for end in (len(own), len(own) - 1))
    ):
        return None  # a context shift: the first tokens kept, a run discarded after them, the rest up to the end
    expected = f"the request's {len(result.prompt_tokens)} prompt + {len(result.tokens)} returned tokens"
    if not held:
        return (
            f"the slot was empty when saved, not holding {expected} (cleared before its save: llama-server clears "
            "the idle slots of a unified KV cache when a task starts, --cache-idle-slots)"
        )
    return (
        f"the slot's {len(held)} saved tokens differ from {expected} at token {common}: the state of another request "
        "or a slot cleared before its save"
    )


def lost_cells(held: list[int], result: Result) -> dict | None:
    """For a slot saved right after its own request with nothing else on the server (`seq`: one slot, one request
    at a time, no unified cache whose idle slots llama-server clears): None when the slot holds at least the
    request's prompt and returned tokens save the last (sampled, never decoded), or when the request reached
    the context end (`truncated`: a context shift discards cells). Else the slot lost cells, KV damage: how
    many it holds, how many the request needs, and where its token list parts from the request's."""
    own = list(result.prompt_tokens) + list(result.tokens)
    needed = max(0, len(own) - 1)
    if result.truncated or len(held) >= needed:
        return None
    return {
        "held": len(held),
        "needed": needed,
        "prompt": len(result.prompt_tokens),
        "returned": len(result.tokens),
        "lost": needed - len(held),
        "common": _common_prefix(held, own),
    }
