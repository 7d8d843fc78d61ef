"""First-divergence triage: where two token streams part, and whether numerics or logic parted them.

Works for any pair of runs (against a baseline, spec vs no-spec, seq vs par, backend vs backend). With
logits it classifies the divergence:

* `drift`    — the logits before it already differ beyond tolerance (the runs compute different numbers);
* `near-tie` — the reference's top1−top2 margin at the divergence is below `near_tie` nats, so noise
               within tolerance can flip it;
* `hard`     — logits agree within tolerance up to the step and the margin is large: a logic bug;
* `unknown`  — not enough logits to say.

Drift is checked first: noise beyond tolerance is the finding even when it flipped a near-tie.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Optional

from harness.logits import PositionLogits, Tolerances, check, compare

NEAR_TIE = 0.05
"""Default near-tie margin, nats."""
BEFORE_CHARS = 40
"""How much text before the divergence a Divergence shows."""


@dataclass
class Divergence:
    """The first position where two token streams differ, and why."""

    index: int
    """First differing token index (the shorter stream's length when one is a prefix of the other)."""
    kind: str
    """`near-tie`, `drift`, `hard` or `unknown` (see the module docstring)."""
    reason: str
    """Why it is that kind (for drift: the tolerance check's message naming the worst position)."""
    ref_token: Optional[int]
    """The reference's token at `index`, None when the reference stream ended there."""
    other_token: Optional[int]
    ref_text: str = ""
    other_text: str = ""
    before: str = ""
    """About 40 characters of reference text before `index` ("" without a detokenizer)."""
    margins: dict[int, Optional[float]] = field(default_factory=dict)
    """position → reference top1−top2 margin (nats) at `index` and the positions before it; None where
    the reference has no (or a single) candidate there."""

    @property
    def margin(self) -> Optional[float]:
        """The reference's margin at the divergence."""
        return self.margins.get(self.index)

    def describe(self) -> str:
        """One paragraph for a failing check's message and the report."""
        after = f" after {self.before!r}" if self.before else ""
        text = (f"First divergence at token {self.index}{after}: reference {_token(self.ref_token, self.ref_text)}, "
                f"other {_token(self.other_token, self.other_text)}.")
        if any(m is not None for m in self.margins.values()):
            here = "unknown" if self.margin is None else f"{self.margin:.4g} nats"
            text += f" Reference top1−top2 margin there {here}"
            earlier = {p: m for p, m in self.margins.items() if p != self.index}
            if earlier:
                values = ", ".join("n/a" if m is None else f"{m:.3g}" for m in earlier.values())
                text += f" (positions {min(earlier)}–{max(earlier)}: {values})"
            text += "."
        return f"{text} Class {self.kind}: {self.reason}."


def _token(token: Optional[int], text: str) -> str:
    if token is None:
        return "stream ended"
    return f"{text!r} (id {token})" if text else f"id {token}"


def _margin(logits: Optional[list[PositionLogits]], pos: int) -> Optional[float]:
    return logits[pos].margin if logits is not None and pos < len(logits) else None


def triage(
    ref_tokens: list[int],
    other_tokens: list[int],
    ref_logits: Optional[list[PositionLogits]] = None,
    other_logits: Optional[list[PositionLogits]] = None,
    detokenize: Optional[Callable[[list[int]], str]] = None,
    near_tie: float = NEAR_TIE,
    context: int = 3,
    tol: Tolerances = Tolerances(),
) -> Optional[Divergence]:
    """The first divergence of `other_tokens` from `ref_tokens` (None when they are equal), classified.

    Margins are the reference's top1−top2 at the divergence and the `context` positions before it. For
    llama-server records they are log-probability differences, which equal the logit differences (the
    log-softmax subtracts one constant per row); with `post_sampling_probs` they are the sampler's.
    Drift is judged on values only (`tol` without its top-1 rate: before the divergence both runs
    emitted the same tokens, and a top-1 flip inside tolerance is itself a near-tie).
    """
    n = min(len(ref_tokens), len(other_tokens))
    index = next((i for i in range(n) if ref_tokens[i] != other_tokens[i]), n)
    if index == len(ref_tokens) == len(other_tokens):
        return None
    ref_token = ref_tokens[index] if index < len(ref_tokens) else None
    other_token = other_tokens[index] if index < len(other_tokens) else None
    margins = {p: _margin(ref_logits, p) for p in range(max(0, index - context), index + 1)}
    kind, reason = _classify(margins[index], ref_logits, other_logits, index, near_tie, tol)

    def text(tokens: list[int]) -> str:
        return detokenize(tokens) if detokenize is not None else ""

    return Divergence(
        index=index, kind=kind, reason=reason, ref_token=ref_token, other_token=other_token,
        ref_text=text([ref_token]) if ref_token is not None else "",
        other_text=text([other_token]) if other_token is not None else "",
        before=text(ref_tokens[max(0, index - BEFORE_CHARS):index])[-BEFORE_CHARS:],
        margins=margins,
    )


def _classify(margin: Optional[float], ref_logits, other_logits, index: int, near_tie: float,
              tol: Tolerances) -> tuple[str, str]:
    """(kind, reason) from the reference's margin at `index` and both runs' logits before it."""
    if ref_logits is None:
        return "unknown", "no logits were logged for the reference"
    agreed = ""
    if other_logits is not None:
        comparison = compare(ref_logits[:index], other_logits[:index])
        ok, message = check(comparison, replace(tol, top1_agreement=0.0))
        if comparison.n_compared and not ok:
            return "drift", f"the {message}"
        if comparison.n_compared or index == 0:
            agreed = (f"logits agree within tolerance over the {comparison.n_compared} compared positions before it"
                      if index else "it is the first generated token")
    if margin is None:
        return "unknown", "the reference has no logits at the divergence"
    if margin < near_tie:
        tail = f"; {agreed}" if agreed else ""
        return "near-tie", f"the margin is below {near_tie:g} nats, so numerical noise can flip it{tail}"
    if not agreed:
        return "unknown", f"margin {margin:.3g} nats, but no logits of the other run before it to rule out drift"
    return "hard", (f"{agreed} and the margin is {margin:.3g} nats: numerics cannot explain it, "
                    "look for a logic bug (state, rollback, verification, sampling)")
