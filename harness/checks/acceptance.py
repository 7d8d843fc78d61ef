"""Draft acceptance of one request and how far it may fall: the measures behind the `acceptance` check.

A request's acceptance is judged by two fractions, both deterministic for greedy decoding on one build:
accepted / drafted (the acceptance rate: the drafts got worse) and accepted / generated (the share of the
output that came from drafts: drafting got rarer, even where each draft is as good). A drop of either
beyond the tolerance fails, unless one token undoes it (one more accepted and, for the rate, one fewer
drafted): a single draft token accepted or rejected the other way is no finding, and no calibration can
tell it from a legitimate change of one draft.
"""

from dataclasses import dataclass


@dataclass
class Acceptance:
    """The speculative counters of one request (or of several, summed)."""

    drafted: int
    accepted: int
    generated: int
    drafted_per_pos: list[int] | None = None
    accepted_per_pos: list[int] | None = None
    """Per draft position (in-process only: llama-server's /completion does not report them)."""

    @classmethod
    def of(cls, stats: dict, generated: int) -> "Acceptance":
        return cls(
            int(stats.get("draft_n", 0)),
            int(stats.get("draft_n_accepted", 0)),
            generated,
            stats.get("drafted_per_pos"),
            stats.get("accepted_per_pos"),
        )

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_generated(self) -> float:
        return self.accepted / self.generated if self.generated else 0.0

    @property
    def steps(self) -> int | None:
        """Verification steps that had a draft (where per-position counts are known)."""
        return self.drafted_per_pos[0] if self.drafted_per_pos else None

    @property
    def per_draft(self) -> float | None:
        """Accepted tokens per draft (mean acceptance length − 1)."""
        return self.accepted / self.steps if self.steps else None

    def position_rates(self) -> list[float] | None:
        """Per draft position k: the share of drafts with a token at k whose token at k was accepted."""
        if self.drafted_per_pos is None or self.accepted_per_pos is None:
            return None
        return [a / d if d else 0.0 for d, a in zip(self.drafted_per_pos, self.accepted_per_pos, strict=False)]

    def describe(self) -> str:
        per_draft = "" if self.per_draft is None else f", {self.per_draft:.2f} accepted per draft"
        return f"{100 * self.rate:.1f} % ({self.accepted}/{self.drafted} drafted{per_draft})"

    def to_evidence(self) -> dict:
        out = {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated": self.generated,
            "acceptance": round(self.rate, 4),
        }
        if self.per_draft is not None:
            out["accepted_per_draft"] = round(self.per_draft, 3)
        if self.position_rates() is not None:
            out["drafted_per_pos"], out["accepted_per_pos"] = self.drafted_per_pos, self.accepted_per_pos
        return out


def summed(items: list[Acceptance]) -> Acceptance:
    """Several requests' counters added up (per position where every one has them)."""

    def add(lists):
        if any(x is None for x in lists):
            return None
        out = [0] * max((len(x) for x in lists), default=0)
        for x in lists:
            for i, v in enumerate(x):
                out[i] += v
        return out

    return Acceptance(
        sum(a.drafted for a in items),
        sum(a.accepted for a in items),
        sum(a.generated for a in items),
        add([a.drafted_per_pos for a in items]),
        add([a.accepted_per_pos for a in items]),
    )


def fall(before: Acceptance, after: Acceptance, tolerance: float) -> str | None:
    """Why `after` fell too far below `before` (None when it holds): the rate or the share of accepted
    tokens dropped by more than `tolerance`, even with one token given back to `after`."""
    if before.drafted == 0:
        return None
    why = []
    rate_with_one = min(1.0, (after.accepted + 1) / max(1, after.drafted - 1))
    if rate_with_one < before.rate - tolerance:
        why.append(f"acceptance {before.describe()} -> {after.describe()}")
    share_with_one = (after.accepted + 1) / max(1, after.generated)
    if share_with_one < before.per_generated - tolerance:
        why.append(f"accepted tokens {before.accepted} -> {after.accepted} of {after.generated} generated")
    if not why:
        return None
    where = steepest_fall(before, after)
    if where is not None:
        k, a, b = where
        why.append(f"steepest fall at draft position {k + 1} ({100 * a:.0f} % -> {100 * b:.0f} % accepted)")
    return "; ".join(why)


def steepest_fall(before: Acceptance, after: Acceptance) -> tuple[int, float, float] | None:
    """(position, rate before, rate after) of the draft position whose acceptance fell most (None when the
    per-position counts are missing or nothing fell)."""
    a, b = before.position_rates(), after.position_rates()
    if a is None or b is None:
        return None
    drops = [(x - (b[k] if k < len(b) else 0.0), k) for k, x in enumerate(a)]
    drop, k = max(drops, default=(0.0, 0))
    return (k, a[k], b[k] if k < len(b) else 0.0) if drop > 0 else None
