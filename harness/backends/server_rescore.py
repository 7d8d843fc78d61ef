"""Re-scoring one position of a llama-server request through llama-server itself, in the batch shape the request
computed it in (docs/internals/triage.md, "Re-scoring through llama-server").

llama-server (0c1e570, b11434) withholds the probabilities of every token a speculative verification step emits
(`result.prob = 1.0f; // set later`, upstream #27972), so a flip at such a token has no evidence from the run's own
side. The prompt cache gives it back, through the server and the command line that served the run:

1. `shape_of`: the request's generation batches in order (`Work.steps["batches"]`, read from its `-lv 5` log by
   harness.backends.server_work) say which batch computed the logits of output token `pos`: its first token's
   index in prompt + output (the slot's last sampled token), the row of `pos` in it, and its rows;
2. `ServerSession.rescore` (harness.backends.server_backend) sends that prefix with `cache_prompt` off (a fresh,
   repeatable prefix), then prefix + the batch's rows up to `pos`'s with `cache_prompt` on, `n_predict` 1 and
   `n_probs`: the uncached tail is one batch, and the first token of a request is sampled normally, with its
   probabilities (rescore.md in the project's reference sheets).

What it reproduces: a one-token decode exactly (a run without speculation, a step without drafts); a verification
batch's rows up to `pos`'s, from the same first position, not the rows after it (llama-server asks logits of the
last prompt token only), nor the other slots' tokens that shared the run's batch in `par`. `Shape.describe` says
so in every re-scored row's `how`, which the triage evidence and the report show beside both margins.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.result import Result


@dataclass(frozen=True)
class Shape:
    """Where the run computed the logits of one output token: in a batch whose first token is `start` (an index of
    prompt + output), at row `row` of its `rows` rows."""

    start: int
    row: int
    rows: int
    kind: str
    """`prompt` (the request's last prompt batch), `decode` (a one-token step) or `verification` (a step with
    drafts, or the replay after a restored one)."""

    def describe(self, prefix: int) -> str:
        """How the re-score computed it, against how the run did."""
        tail = self.row + 1
        how = f"re-scored through llama-server with the run's command line: {prefix} tokens cached, then {tail} "
        how += "token" if tail == 1 else "tokens"
        how += " in one batch"
        if self.kind == "verification":
            exact = "the same shape" if tail == self.rows else f"its first {tail} of {self.rows} rows"
            run = f"row {self.row} of a {self.rows}-row verification batch at position {self.start}"
            return f"{how} (the run: {run}; {exact})"
        if self.kind == "decode":
            return f"{how} (the run: a one-token decode at position {self.start}; the same shape)"
        return f"{how} (the run: row {self.row} of its {self.rows}-token last prompt batch at position {self.start})"


@dataclass(frozen=True)
class Replay:
    """The request's decodes up to the batch that computed one output token's logits, as llama-server made them.
    Each is a dict: `start` (position), `tokens`, `every_row` (logits on every row, as a verification step asks;
    else on the last only, as a prompt batch), `keep` (the sequence is cut back to `keep` positions after it: the
    rows a step rejected; a recurrent state rolls back to its snapshot of that row), `seq` (the slot), `before` /
    `after` (`[[slot, n_tokens, every row], ...]`: the other slots' entries that shared the decode, replayed as
    stand-in rows of their own sequences: the kernels a row takes depend on the rows around it, not on what they
    hold). The last decode is the one whose row `row` holds the logits."""

    decodes: list[dict]
    row: int
    shape: Shape
    shared: bool
    """Whether any replayed decode had other slots' rows in it (par, no-kv-unified)."""

    def describe(self, by: str = "the libllama this llama-server build runs") -> str:
        """How the replay computed the row (`by` what), against how the run did."""
        steps = len(self.decodes) - 1
        padded = (
            " (the rows after it padded: the run's rejected drafts are not logged)"
            if self.row + 1 < self.shape.rows
            else ""
        )
        shared = (
            ", the other slots' rows of each shared decode stood in for by rows of their own sequences"
            if self.shared
            else ""
        )
        return (
            f"re-scored through {by}, with the cell's context options: the "
            f"request's {steps} earlier batches replayed as its log lists them (the prompt's batches, each step's "
            f"rows with the rejected ones cut back{shared}), then the {self.shape.rows}-row batch at position "
            f"{self.shape.start} with logits on every row, row {self.row}{padded}"
        )


def shape_of(result: Result, pos: int) -> Shape | None:
    """The batch that computed the logits of output token `pos` (those that picked `result.tokens[pos]`), from the
    request's generation batches; None where its steps are not known (its log lines did not all come, or a
    build without `-lv`) or `pos` is past them."""
    steps = result.work.steps if result.work is not None else None
    n_prompt = len(result.prompt_tokens)
    if pos == 0:
        starts = [s for s in (steps or {}).get("prompt_batches", []) if 0 <= s < n_prompt]
        start = starts[-1] if starts else 0
        return Shape(start=start, row=n_prompt - 1 - start, rows=n_prompt - start, kind="prompt")
    batches = (steps or {}).get("batches")
    if not batches:
        return None
    emitted = 1  # the first output token comes from the prompt
    for rows, n in batches:
        if n is None:  # a step whose outcome the log did not tell
            return None
        if emitted <= pos < emitted + n:
            row = pos - emitted
            return Shape(
                start=n_prompt + emitted - 1, row=row, rows=rows, kind="decode" if rows == 1 else "verification"
            )
        emitted += n
    return None


def replay_of(result: Result, pos: int) -> Replay | None:
    """The decodes that reproduce how llama-server computed the logits of output token `pos` (see Replay), from the
    request's prompt batches, generation batches and where each sat in its decode (`Work.steps["places"]`, from
    the log: harness.backends.server_batches.places); None where its steps are not known. A restored verification
    is left out (its checkpoint restore undoes it; the replay batch after it is kept); a rejected draft's row is
    padded with the sequence's next token (the log does not name it; it enters no earlier row, causal attention).
    Positions a cached prompt reused are replayed first: in the batches of the earlier request that computed them
    (`Work.steps["reused"]`, recorded by the session: PrefixHistory), else, where that is not known, as one batch."""
    shape = shape_of(result, pos)
    steps = result.work.steps if result.work is not None else None
    if shape is None or steps is None:
        return None
    reused, prompt, generation = _decodes(result, steps)
    if shape.kind == "prompt":  # the first output token: the prompt's batches up to its last, no step
        prompt, generation = [d for d in prompt if d["start"] <= shape.start], []
    else:
        target = next(
            (i for i, d in enumerate(generation) if d["start"] == shape.start and d["emits"][0] <= pos < d["emits"][1]),
            None,
        )
        if target is None:
            return None
        generation = generation[: target + 1]
    decodes = [*reused, *prompt, *(_public(d) for d in generation if not d["restored"])]
    shared = any(d["before"] or d["after"] for d in decodes)
    return Replay(decodes, shape.row, shape, shared)


def history_of(result: Result) -> list[dict] | None:
    """Every decode of a request, in order, as replay_of lists them (the reused prefix's, the prompt's, each step's
    not restored): what its sequence holds afterwards was computed in these. None where its steps are not known."""
    steps = result.work.steps if result.work is not None else None
    if steps is None or any(n is None for _, n in steps.get("batches") or []):
        return None
    reused, prompt, generation = _decodes(result, steps)
    return [*reused, *prompt, *(_public(d) for d in generation if not d["restored"])]


def reused_prefix(history: list[dict], n: int) -> list[dict] | None:
    """The decodes of `history` that computed positions 0..n-1, the last cut back to `n` (a later request reused
    them from the cache); None where they do not hold n positions."""
    kept = [dict(d) for d in history if d["start"] < n]
    if not kept or kept[-1]["start"] + len(kept[-1]["tokens"]) < n or kept[-1]["keep"] < n:
        return None
    kept[-1]["keep"] = n
    return kept


class PrefixHistory:
    """Per slot of one llama-server process, the sequence its last request left and the decodes that computed it,
    so that the next request that reuses part of it from the prompt cache records those batches
    (`Work.steps["reused"]`): a reused position's cache entries were computed in the earlier request's batches, and
    a batch's shape moves the numbers (a row decoded among 22 is not the same row decoded among 7)."""

    def __init__(self):
        self.slots: dict[int, tuple[list[int], list[dict]]] = {}

    def record(self, result: Result, loaded_elsewhere: bool) -> None:
        """Attach the reused prefix's batches to `result` where its slot's last request computed them, then keep
        `result`'s own. `loaded_elsewhere`: its log says the prompt cache loaded another state into the slot."""
        steps = result.work.steps if result.work is not None else None
        if steps is None or result.slot_id < 0:
            return
        sequence = [*result.prompt_tokens, *result.tokens]
        n = _reused_n(steps, len(result.prompt_tokens))
        held = None if loaded_elsewhere else self.slots.get(result.slot_id)
        if n > 0 and held is not None and held[0][:n] == sequence[:n]:
            prefix = reused_prefix(held[1], n)
            if prefix is not None:
                steps["reused"] = prefix
        history = history_of(result)
        if history is None:
            self.slots.pop(result.slot_id, None)
        else:
            self.slots[result.slot_id] = (sequence, history)

    def forget(self, slot: int) -> None:
        """The slot now holds a state the harness did not see computed (a slot restore)."""
        self.slots.pop(slot, None)


def _reused_n(steps: dict, n_prompt: int) -> int:
    """How many positions the prompt cache gave the request: where its first prompt batch started."""
    starts = sorted({s for s in steps.get("prompt_batches", []) if 0 <= s < n_prompt})
    return starts[0] if starts else 0


def _decodes(result: Result, steps: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(the reused prefix's decodes, the prompt's, every generation batch's): the last carry `restored` and
    `emits` (the output tokens it emitted, [first, end))."""
    sequence = [*result.prompt_tokens, *result.tokens]
    n_prompt = len(result.prompt_tokens)
    seq = max(result.slot_id, 0)
    starts = sorted({s for s in steps.get("prompt_batches", []) if 0 <= s < n_prompt})
    reused = []
    if starts and starts[0] > 0:
        given = steps.get("reused")
        reused = [dict(d) for d in given] if given else [_decode(seq, 0, sequence[: starts[0]], False, starts[0])]
    starts = starts or [0]
    bounds = [*starts[1:], n_prompt]
    prompt = [_decode(seq, a, sequence[a:b], False, b) for a, b in zip(starts, bounds, strict=True)]
    generation = []
    emitted = 1  # the first output token comes from the prompt
    for rows, n in steps.get("batches") or []:
        start = n_prompt + emitted - 1
        generation.append(_decode(seq, start, _padded(sequence[start:], rows), rows > 1, start + (n or 0)))
        generation[-1] |= {"restored": not n, "emits": (emitted, emitted + (n or 0))}
        emitted += n or 0
    _place(prompt, generation, steps.get("places"))
    return reused, prompt, generation


def _public(decode: dict) -> dict:
    """A decode as Replay and the replayers take it (without the bookkeeping of `_decodes`)."""
    return {k: v for k, v in decode.items() if k not in ("restored", "emits")}


def _decode(seq: int, start: int, tokens: list[int], every_row: bool, keep: int) -> dict:
    return {
        "seq": seq,
        "start": start,
        "tokens": tokens,
        "every_row": every_row,
        "keep": keep,
        "before": [],
        "after": [],
    }


def _place(prompt: list[dict], generation: list[dict], places: list[dict] | None) -> None:
    """Give each decode the other slots' entries that shared it (`before`, `after`), from the log's places, where
    they line up with the request's batches (the prompt's in order, then the generation's)."""
    if not places:
        return
    mine = [p for p in places if p["kind"] == "prompt"], [p for p in places if p["kind"] != "prompt"]
    for decodes, found in zip((prompt, generation), mine, strict=True):
        if len(found) < len(decodes):
            continue
        for decode, place in zip(decodes, found, strict=False):
            batch = place.get("batch")
            if batch is None:
                continue
            i = place["index"]
            decode["before"], decode["after"] = [list(e) for e in batch[:i]], [list(e) for e in batch[i + 1 :]]


def _padded(tokens: list[int], n: int) -> list[int]:
    """The first `n` of `tokens`, the last repeated where there are fewer."""
    return [*tokens[:n], *[tokens[-1]] * (n - len(tokens))] if tokens else []
