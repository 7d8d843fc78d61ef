"""One slot: a request's tokens, its position in the slot's sequence, stop rules and its Result."""

import codecs
import time
from enum import Enum

import numpy as np

from harness.engine.context import Context
from harness.engine.ctxshift import needs_shift
from harness.engine.model import Model
from harness.engine.sampler import Sampler
from harness.result import Result
from harness.result.logits import PositionLogits, capture
from harness.suites.request import Request


class Phase(Enum):
    IDLE = "idle"
    PROMPT = "prompt"
    GENERATE = "generate"


class Slot:
    """A slot serves one request at a time in its own sequence (seq id = slot id).

    Invariant: the slot's sequence holds exactly `n_past` positions `0..n_past-1`; `pending` is the
    last sampled token, not yet decoded (llama-server's `sampled`). With `context_shift` a full sequence is
    shifted (`shift`) instead of ending the request at the context end.
    """

    def __init__(
        self,
        slot_id: int,
        model: Model,
        n_ctx_seq: int,
        seed: int,
        logit_top_k: int = 0,
        prompt_breaks: tuple[int, ...] = (),
        context_shift: bool = False,
    ):
        self.id = slot_id
        self.context_shift = context_shift
        self.prompt_breaks = prompt_breaks
        """Prompt chunks stop this many tokens before the prompt's end (see `prompt_chunk`)."""
        self.seed = seed
        self.logit_top_k = logit_top_k
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.phase = Phase.IDLE
        self.request_index = -1

    def start(self, request_index: int, request: Request) -> Result | None:
        """Take a request; returns an error Result at once when it cannot be served."""
        self.request = request
        self.request_index = request_index
        self.result = Result(slot_id=self.id)
        self.text_bytes = bytearray()
        self.sampler: Sampler | None = None
        self.t_start = time.perf_counter()
        prompt = request.prompt if request.messages is None else self.model.render_chat(request.messages)
        tokens = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.result.prompt_tokens = tokens
        self.result.timings.prompt_n = len(tokens)
        if not tokens:
            return self._fail("the prompt is empty")
        if len(tokens) >= self.n_ctx_seq:
            return self._fail(
                f"context_full: the prompt has {len(tokens)} tokens but a slot holds {self.n_ctx_seq} (raise n_ctx)"
            )
        try:
            self.sampler = Sampler.for_request(request.sampling, self.seed, self.model)
        except ValueError as err:
            return self._fail(str(err))
        self.sampler.accept_prompt(tokens)
        self.top_k = self.logit_top_k if request.sampling.n_probs is None else request.sampling.n_probs
        self.prompt = tokens
        self.n_past = 0
        self.pending = -1
        self._history: list[int] = []
        self.n_kept = 0
        self.n_discarded = 0
        """Context shifts: the tokens after the first `n_kept` of prompt + output that left the sequence."""
        stops = request.sampling.stop
        if stops:
            self._stop_decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
            self._stop_keep = max(len(s) for s in stops)
            self._stop_tail = ""
        self.phase = Phase.PROMPT
        return None

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet decoded."""
        return len(self.prompt) - self.n_past

    def prompt_chunk(self, n: int) -> list[int]:
        """The next up to `n` prompt tokens (they start at position `n_past`). A chunk ends where one of
        `prompt_breaks` tokens are left, as llama-server ends its prompt batches for models it keeps
        context checkpoints of (server-context.cpp, checkpoint offsets 4 + n_ubatch and 4): both engines
        then decode the same batches, whose shapes change the logits of quantized models in the last bits."""
        for offset in self.prompt_breaks:
            cut = len(self.prompt) - offset
            if self.n_past < cut:
                n = min(n, cut - self.n_past)
                break
        return self.prompt[self.n_past : self.n_past + n]

    @property
    def history(self) -> list[int]:
        """Every token decoded into the sequence, positions 0..n_past-1 (prompt, then output, less the
        `n_discarded` tokens after the first `n_kept` that context shifts removed).

        The slot's own list, brought up to date from the output (which only grows) and `n_past` (which a
        rollback lowers) at each call, so a step costs what changed since the last: read it, but neither
        modify it nor keep it across steps."""
        history, n, kept, skipped = self._history, self.n_past, self.n_kept, self.n_discarded
        if len(history) > n:
            del history[n:]
        while len(history) < n:
            lo = len(history)
            skip = skipped if lo >= kept else 0
            hi = n if skip or not skipped else min(n, kept)
            history += self._decoded(lo + skip, hi + skip)
        return history

    def _decoded(self, i0: int, i1: int) -> list[int]:
        """Tokens i0..i1-1 of prompt + output."""
        n_prompt = len(self.prompt)
        part = self.prompt[i0 : min(i1, n_prompt)]
        if i1 > n_prompt:
            part += self.result.tokens[max(i0, n_prompt) - n_prompt : i1 - n_prompt]
        return part

    def shift(self, n_keep: int, n_discard: int) -> None:
        """The sequence lost positions [n_keep, n_keep + n_discard) and the rest moved down (a context
        shift): so does the history. `n_keep` is the same at every shift of a request (it depends on the
        request and the context size only), so all discarded tokens follow the first `n_keep`."""
        history = self.history
        del history[n_keep : n_keep + n_discard]
        self.n_kept = n_keep
        self.n_discarded += n_discard
        self.n_past -= n_discard
        self.result.truncated = True

    @property
    def n_remaining(self) -> int:
        """Tokens the request may still generate; -1 when unlimited (`n_predict: -1`), as llama-server."""
        n_predict = self.request.sampling.n_predict
        return -1 if n_predict == -1 else n_predict - len(self.result.tokens)

    def sample(self, ctx: Context, row: int) -> tuple[int, PositionLogits | None]:
        """Sample output row `row` with the slot's sampler; its top-k logits too when logging is on
        (the row's logits are fetched once for both), or with `post_sampling_probs` the log of the top-k
        probabilities the sampler chain left (as llama-server reports them)."""
        if not self.top_k:
            return self.sampler.sample(ctx, row), None
        logits = ctx.logits(row)
        token = self.sampler.sample(ctx, row, logits)
        if self.request.sampling.post_sampling_probs:
            ids, probs = self.sampler.candidates.top_probs(self.top_k)
            return token, PositionLogits(ids, np.log(probs))
        return token, capture(logits, self.top_k, deferred=True)

    def emit_all(self, tokens: list[int], logits: list[PositionLogits | None]) -> bool:
        """Emit a speculative step's tokens in order until the request is done; the rest are discarded. The
        i-th token meets the context limit with the positions a step without speculation would hold when it
        is sampled: `n_past` (the whole step's) less the step's tokens after it."""
        last = len(tokens) - 1
        return any(
            self.emit(t, lg, self.n_past - (last - i)) for i, (t, lg) in enumerate(zip(tokens, logits, strict=False))
        )

    def emit(self, token: int, logits: PositionLogits | None = None, n_tokens: int | None = None) -> bool:
        """Record a sampled token (and its logits) and apply llama-server's stop rules in its order (a stop
        string, then the context limit, then n_predict, which a stop string already met leaves `word`); True
        when the request is done.

        An end-of-generation token ends the request without being recorded. The context limit is
        llama-server's `n_tokens + 1 >= n_ctx` (only with context shift off; it marks the result
        `truncated`), `n_tokens` being the positions decoded when the token was sampled (default `n_past`).
        llama-server counts all of a speculative step's positions for each of its tokens instead, so a step
        whose draft filled the budget left by the context (`n_ctx - n_tokens - 2`) and was wholly accepted
        ends the request at its first token, with fewer tokens than without speculation (known failure
        server-spec-context-end-early-stop); the engine keeps the non-speculative output there."""
        now = time.perf_counter()
        if self.phase is Phase.PROMPT:
            self.phase = Phase.GENERATE
            self.t_first = now
            self.result.timings.prompt_ms = 1000.0 * (now - self.t_start)
        sampling = self.request.sampling
        if self.model.is_eog(token):
            return self._finish("eos")
        self.result.tokens.append(token)
        if logits is not None:
            self.result.logits.append(logits)
        self.pending = token
        piece = self.model.piece(token)
        self.text_bytes += piece
        stop = None
        if sampling.stop and self._stop_reached(piece):
            text = self.text_bytes.decode("utf-8", errors="ignore")
            hits = [i for i in (text.find(s) for s in sampling.stop) if i >= 0]
            self.text_bytes = bytearray(text[: min(hits)].encode())
            stop = "word"
        full = not self.context_shift and needs_shift(self.n_past if n_tokens is None else n_tokens, self.n_ctx_seq)
        if full or (stop is None and sampling.n_predict != -1 and self.n_remaining <= 0):
            stop = "limit"  # the context limit overrides a stop string, n_predict does not (process_token)
        self.result.truncated |= full
        return self._finish(stop) if stop else False

    def _stop_reached(self, piece: bytes) -> bool:
        """Whether the text (UTF-8 decoded with errors ignored) holds a stop string now that `piece` was
        added. The text before it held none, so a new match ends in the newly decoded characters and
        starts at most (longest stop string) characters before them: only that window is searched. The
        incremental decoder yields exactly what decoding all the bytes at once does (bytes of a character
        still incomplete are held back, as the one-shot decode drops them), so a match here is one of
        the whole text."""
        window = self._stop_tail + self._stop_decoder.decode(piece)
        if any(s in window for s in self.request.sampling.stop):
            return True
        self._stop_tail = window[max(0, len(window) - self._stop_keep) :]
        return False

    def fail(self, message: str) -> Result:
        """End the request with an error (a failed decode); the caller clears the sequence."""
        return self._fail(message)

    def _fail(self, message: str) -> Result:
        self.result.error = message
        self.result.stop_reason = "error"
        self._close()
        return self.result

    def _finish(self, stop_reason: str) -> bool:
        self.result.stop_reason = stop_reason
        self._close()
        return True

    def _close(self) -> None:
        now = time.perf_counter()
        timings = self.result.timings
        if self.phase is Phase.GENERATE:
            timings.predicted_ms = 1000.0 * (now - self.t_first)
        timings.predicted_n = len(self.result.tokens)
        for logits in self.result.logits:
            logits.settle()
        self.result.text = self.text_bytes.decode("utf-8", errors="replace")
        if self.sampler is not None:
            self.sampler.free()
            self.sampler = None
        self.phase = Phase.IDLE
