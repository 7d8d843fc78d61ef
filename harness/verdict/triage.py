"""First-divergence triage: where two token streams part, and what evidence says about why.

Works for any pair of runs (against a baseline, spec vs no-spec, seq vs par, backend vs backend). A class
is a claim, so each needs its evidence (the README's class table says the same):

* `kv-corrupt`  — the KV scan of either request found duplicate (seq_id, pos) cells, orphans past the
                  sequence or holes: a logic bug, whatever the margin (checked first);
* `drift`       — the two runs' logits were already apart before the divergence, beyond the calibrated
                  tolerance, or the other run prefers its token by more than the near-tie floor there;
* `near-tie`    — proven: the reference prefers its token over the other run's (0 ≤ its gap < the calibrated
                  near-tie floor of the mode), the other run prefers its own (0 ≤ its gap < that floor; logits
                  of BOTH runs at the divergence, each from the configuration that produced its tokens), and
                  both runs' logits agree within tolerance before it;
* `hard`        — the logits agree within tolerance before it and the reference's margin is beyond the
                  floor: numerics cannot explain it, a logic bug (state, rollback, verification, sampling);
                  or the logit rows at the divergence are bit-identical in both runs (same digest) and yet
                  the picks differ: the sampler's state differed (also for sampled tokens);
* `unexplained` — the evidence a class needs is missing (e.g. llama-server withholds the probabilities of
                  tokens emitted by a speculative verification step, and no other configuration may stand in
                  for the run's), or it points the wrong way (a run's own logits rank the other run's token
                  higher, yet it picked its own); fails like `hard`.

Where a run has no logits at a position, `rescore(side, position)` may supply them, but only logits of the
configuration that produced that run's tokens (harness.execute.Rescorer: on llama-server the server itself, with
the run's command line, in the batch shape the run computed the position in; in-process a plain decode for a run
without speculation, nothing for a speculative one, which logs every verification row itself). Each re-scored row
says how it was computed (`Divergence.how`), and both runs' margins at the divergence are kept
(`Divergence.margin`, `Divergence.other_margin`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from harness.result.logits import PositionLogits, check, compare
from harness.verdict.noise import DEFAULT, NoiseFloor

BEFORE_CHARS = 40
"""How much text before the divergence a Divergence shows."""
CLASSES = ("near-tie", "drift", "hard", "kv-corrupt", "unexplained")

Rescore = Callable[[str, int], PositionLogits | None]
"""(side: "reference" | "other", position) → that run's logits at the position, from the configuration that
produced its tokens, or None (never another configuration's view)."""


@dataclass
class Divergence:
    """The first position where two token streams differ, and why."""

    index: int
    """First differing token index (the shorter stream's length when one is a prefix of the other)."""
    kind: str
    """One of CLASSES (see the module docstring)."""
    reason: str
    """The evidence behind `kind`, in words."""
    ref_token: int | None
    """The reference's token at `index`, None when the reference stream ended there."""
    other_token: int | None
    ref_text: str = ""
    other_text: str = ""
    before: str = ""
    """About 40 characters of reference text before `index` ("" without a detokenizer)."""
    margins: dict[int, float | None] = field(default_factory=dict)
    """position → reference top1−top2 margin (nats) at `index` and the positions before it; None where
    the reference has no (or a single) candidate there."""
    noise_floor: float = DEFAULT.near_tie
    floor_source: str = DEFAULT.source
    rescored: list[str] = field(default_factory=list)
    """Which sides' logits were re-scored ("reference at 12", ...)."""
    how: list[str] = field(default_factory=list)
    """How each re-scored row was computed, against how its run computed it ("other at 12: re-scored through
    llama-server ..."), where the re-scorer says."""
    other_margin: float | None = None
    """The other run's preference for its own token over the reference's at the divergence (nats; its own logits,
    logged or re-scored), None where it was not needed or not to be had."""
    same_logits: bool = False
    """The full logit rows behind the diverging picks are bit-identical (and so are the earlier ones where
    the sampler state also depends on logits): the picks differ because the sampler state did."""

    @property
    def margin(self) -> float | None:
        """The reference's top1−top2 margin at the divergence."""
        return self.margins.get(self.index)

    def describe(self) -> str:
        """One paragraph for a failing check's message and the report."""
        after = f" after {self.before!r}" if self.before else ""
        text = (
            f"First divergence at token {self.index}{after}: reference {_token(self.ref_token, self.ref_text)}, "
            f"other {_token(self.other_token, self.other_text)}."
        )
        if any(m is not None for m in self.margins.values()):
            here = "unknown" if self.margin is None else f"{self.margin:.4g} nats"
            text += f" Reference top1−top2 margin there {here}"
            earlier = {p: m for p, m in self.margins.items() if p != self.index}
            if earlier:
                values = ", ".join("n/a" if m is None else f"{m:.3g}" for m in earlier.values())
                text += f" (positions {min(earlier)}–{max(earlier)}: {values})"
            text += "."
        return f"{text} Class {self.kind}: {self.reason}."

    def to_evidence(
        self,
        round_: int,
        reference: str,
        ref_tokens: list[int],
        tokens: list[int],
        ref_logits: list[PositionLogits] | None,
    ) -> dict:
        """The JSON form kept as a check's `first_divergence` evidence (and in run diffs): the class and its
        evidence, both token streams and the reference's margin at every position (for the report)."""
        margins = [
            None if (p := at(ref_logits, i)) is None or p.margin is None else round(p.margin, 5)
            for i in range(len(ref_tokens))
        ]
        return {
            "round": round_,
            "index": self.index,
            "kind": self.kind,
            "reason": self.reason,
            "ref_token": self.ref_token,
            "other_token": self.other_token,
            "ref_text": self.ref_text,
            "other_text": self.other_text,
            "before": self.before,
            "margin": self.margin,
            "noise_floor": self.noise_floor,
            "floor_source": self.floor_source,
            "rescored": self.rescored,
            "rescored_how": self.how,
            "other_margin": self.other_margin,
            "same_logits": self.same_logits,
            "reference": reference,
            "reference_tokens": list(ref_tokens),
            "tokens": list(tokens),
            "reference_margins": margins,
        }


def _token(token: int | None, text: str) -> str:
    if token is None:
        return "stream ended"
    return f"{text!r} (id {token})" if text else f"id {token}"


def at(logits: list[PositionLogits] | None, pos: int) -> PositionLogits | None:
    """The logits of a position, None where none were logged (or llama-server withheld them)."""
    if logits is None or pos >= len(logits) or len(logits[pos].top_ids) == 0:
        return None
    return logits[pos]


def gap(logits: PositionLogits, preferred: int, other: int) -> float | None:
    """How much `logits` prefer token `preferred` over `other` (nats), None when `other` is not among its
    top-k (then the gap is at least top-1 − k-th: large)."""
    ids = logits.top_ids.tolist()
    if preferred not in ids or other not in ids:
        return None
    return float(logits.top_logits[ids.index(preferred)]) - float(logits.top_logits[ids.index(other)])


def triage(
    ref_tokens: list[int],
    other_tokens: list[int],
    ref_logits: list[PositionLogits] | None = None,
    other_logits: list[PositionLogits] | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    floor: NoiseFloor = DEFAULT,
    greedy: bool = True,
    kv_findings: Sequence[str] = (),
    rescore: Rescore | None = None,
    context: int = 3,
    state_follows_tokens: bool = True,
) -> Divergence | None:
    """The first divergence of `other_tokens` from `ref_tokens` (None when they are equal), classified.

    `kv_findings` are the KV scanner's findings on either request (one line each); `greedy` says whether
    the tokens were argmax picks of the logits (a margin can only explain such a flip);
    `state_follows_tokens` whether the sampler state depends on the earlier tokens alone (else identical
    logits at the divergence prove a different sampler state only when all earlier rows are identical too).
    Margins are the reference's
    top1−top2 at the divergence and the `context` positions before it; llama-server's log-probabilities
    give the same differences as raw logits (the log-softmax subtracts one constant per row).
    """
    n = min(len(ref_tokens), len(other_tokens))
    index = next((i for i in range(n) if ref_tokens[i] != other_tokens[i]), n)
    if index == len(ref_tokens) == len(other_tokens):
        return None
    ref_token = ref_tokens[index] if index < len(ref_tokens) else None
    other_token = other_tokens[index] if index < len(other_tokens) else None
    same = _same_rows(ref_logits, other_logits, index)
    judge = _Judge(
        index,
        ref_token,
        other_token,
        ref_logits,
        other_logits,
        floor,
        greedy,
        rescore,
        context,
        same_logits=bool(same) and same[-1] and (state_follows_tokens or all(same)),
    )
    kind, reason = judge.classify(kv_findings)

    def text(tokens: list[int]) -> str:
        return detokenize(tokens) if detokenize is not None else ""

    margins = {p: (m.margin if (m := at(ref_logits, p)) else None) for p in range(max(0, index - context), index + 1)}
    if margins[index] is None and judge.ref_here is not None:
        margins[index] = judge.ref_here.margin
    return Divergence(
        index=index,
        kind=kind,
        reason=reason,
        ref_token=ref_token,
        other_token=other_token,
        ref_text=text([ref_token]) if ref_token is not None else "",
        other_text=text([other_token]) if other_token is not None else "",
        before=text(ref_tokens[max(0, index - BEFORE_CHARS) : index])[-BEFORE_CHARS:],
        margins=margins,
        noise_floor=floor.near_tie,
        floor_source=floor.source,
        rescored=judge.rescored,
        how=judge.how,
        other_margin=judge.other_margin,
        same_logits=judge.same_logits,
    )


def _same_rows(a: list[PositionLogits] | None, b: list[PositionLogits] | None, index: int) -> list[bool]:
    """Per position 0..index, whether both runs logged the same full row (CRC-32 digests; llama-server
    gives none); [] when a run has no row at `index`."""
    if a is None or b is None or index >= min(len(a), len(b)):
        return []
    return [bool(x.digest) and x.digest == y.digest for x, y in zip(a[: index + 1], b[: index + 1], strict=False)]


@dataclass
class _Judge:
    """The evidence gathering behind one classification."""

    index: int
    ref_token: int | None
    other_token: int | None
    ref_logits: list[PositionLogits] | None
    other_logits: list[PositionLogits] | None
    floor: NoiseFloor
    greedy: bool
    rescore: Rescore | None
    context: int
    same_logits: bool = False
    rescored: list[str] = field(default_factory=list)
    how: list[str] = field(default_factory=list)
    ref_here: PositionLogits | None = None
    other_margin: float | None = None

    def logits(self, side: str, pos: int) -> PositionLogits | None:
        """A side's logits at `pos`: logged, else re-scored when possible."""
        found = at(self.ref_logits if side == "reference" else self.other_logits, pos)
        if found is None and self.rescore is not None:
            found = self.rescore(side, pos)
            if found is not None and len(found.top_ids):
                self.rescored.append(f"{side} at {pos}")
                if found.how:
                    self.how.append(f"{side} at {pos}: {found.how}")
            else:
                found = None
        return found

    def agreement(self) -> tuple[str | None, int]:
        """(drift message or None, positions compared) over the positions before the divergence: the logged
        ones of both runs, else (when none overlap) the last `context` positions, re-scored where needed."""
        tol = replace(self.floor.tolerances, top1_agreement=0.0)  # equal tokens before it: a flip is a near-tie
        a, b = self.ref_logits or [], self.other_logits or []
        comparison = compare(a[: self.index], b[: self.index])
        if comparison.n_compared == 0 and self.index > 0 and self.rescore is not None:
            window = range(max(0, self.index - self.context), self.index)
            pairs = [(self.logits("reference", p), self.logits("other", p)) for p in window]
            pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
            comparison = compare([x for x, _ in pairs], [y for _, y in pairs])
        if comparison.n_compared == 0:
            return None, 0
        ok, message = check(comparison, tol)
        return (None if ok else f"the {message}"), comparison.n_compared

    def classify(self, kv_findings: Sequence[str]) -> tuple[str, str]:
        if kv_findings:
            return "kv-corrupt", (
                f"{'; '.join(kv_findings)} — a corrupted KV cache is a logic bug, never a near-tie, whatever the margin"
            )
        if self.same_logits and self.ref_token is not None and self.other_token is not None:
            return "hard", (
                "the logit rows behind the two picks are bit-identical in both runs (CRC-32 of the "
                "full vector), yet the picks differ: the sampler's state differed (penalty history, "
                "DRY, grammar or random number generator)"
            )
        drift, compared = self.agreement()
        if drift:
            return "drift", drift
        agreed = (
            f"logits agree within tolerance over the {compared} compared positions before it"
            if compared
            else "it is the first generated token"
            if self.index == 0
            else ""
        )
        if self.ref_token is None or self.other_token is None:
            return "unexplained", (
                "one stream ended there (an end-of-generation token or a stop string, whose "
                "logits are not logged): no margin to judge"
            )
        if not self.greedy:
            return "unexplained", (
                "a sampled or penalized pick (temperature > 0, penalties, DRY, a grammar or a "
                "logit bias): the model's logit margin cannot prove a near-tie" + (f"; {agreed}" if agreed else "")
            )
        self.ref_here = self.logits("reference", self.index)
        if self.ref_here is None:
            return "unexplained", (
                "the reference has no logits at the divergence (llama-server withholds those of tokens a "
                "speculative verification step emitted) and its own configuration cannot supply them"
            )
        margin = gap(self.ref_here, self.ref_token, self.other_token)
        if margin is not None and margin < 0:
            return "unexplained", (
                f"the reference's own logits prefer the other token by {-margin:.3g} nats, yet it picked its "
                "own: not a near-tie"
            )
        floor = self.floor.near_tie
        if margin is None or margin >= floor:
            shown = "beyond its top-k" if margin is None else f"{margin:.3g} nats"
            if not agreed:
                return "unexplained", (
                    f"the reference prefers its token by {shown} (≥ the {self.floor.describe()}), "
                    "but no position before it has logits in both runs to tell a logic bug "
                    "from drift"
                )
            return "hard", (
                f"{agreed}, and the reference prefers its token by {shown} (≥ the "
                f"{self.floor.describe()}): numerics cannot explain it, look for a logic bug (state, "
                "rollback, verification, sampling)"
            )
        other_here = self.logits("other", self.index)
        if other_here is None:
            return "unexplained", (
                f"the reference's margin {margin:.3g} nats is inside the {self.floor.describe()}, "
                "but the other run's logits at the divergence are missing (llama-server withholds those of "
                "tokens a speculative verification step emitted) and re-scoring in its own configuration "
                "could not supply them (the batch that computed them is not known, or the server did not "
                "answer): a decode without speculation would measure the reference's view, not the run's"
            )
        other_gap = self.other_margin = gap(other_here, self.other_token, self.ref_token)
        if other_gap is not None and other_gap < 0:
            rescored = f" ({'; '.join(self.how)})" if self.how else ""
            return "unexplained", (
                f"the other run's own logits{rescored} prefer the reference's token by {-other_gap:.3g} nats, yet "
                "it picked its own: nothing shows it preferred its token, so no near-tie"
            )
        if other_gap is None or other_gap >= floor:
            shown = "beyond its top-k" if other_gap is None else f"{other_gap:.3g} nats"
            return "drift", (
                f"at the divergence the other run prefers its token by {shown}, beyond the "
                f"{self.floor.describe()}: the runs' logits are apart there"
            )
        if not agreed:
            return "unexplained", (
                "the margins at the divergence are inside the floor, but no position before it "
                "has logits in both runs to show they agreed"
            )
        via = (
            f" (re-scored in the run's own configuration: {'; '.join(self.how or self.rescored)})"
            if self.rescored
            else ""
        )
        return "near-tie", (
            f"the reference prefers its token by {margin:.3g} nats and the other run its own by "
            f"{other_gap:.3g} nats, both inside the {self.floor.describe()}; {agreed}{via}"
        )
