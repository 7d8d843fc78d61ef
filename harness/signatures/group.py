"""A stored run's failing verdicts, one `Failure` per signature: its own failing verdicts and the verdicts
that only restate it (consequences), most severe kind first, then the most widespread."""

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from harness.signatures.signature import CHECK, CRASH, DIVERGENCE, ERROR, TIMEOUT, classify

KINDS = (CRASH, TIMEOUT, ERROR, DIVERGENCE, CHECK)
"""Signature kinds, in the order a report lists them."""
CELL = ("suite", "mode", "spec", "model", "backend")
"""What names a cell of a suite in records, verdicts and run.json cells."""


def case_key(row: dict) -> tuple:
    """(suite, mode, spec, model, backend, case): one case of one cell, of a record or a verdict."""
    return (*(row[a] for a in CELL), row["case"])


@dataclass
class Failure:
    """One distinct failure of a run: its signature, and the verdicts that show it."""

    signature: str
    kind: str
    verdicts: list[dict] = field(default_factory=list)
    """Failing verdicts that show it with evidence of their own."""
    consequences: list[dict] = field(default_factory=list)
    """Failing verdicts that only restate it (a check of a request that crashed)."""

    @property
    def cases(self) -> list[tuple]:
        """The cases (case_key) it failed in: those of its own verdicts (of the consequences when it has none:
        a crash of a reference request that ran for a comparison only)."""
        return sorted({case_key(v) for v in (self.verdicts or self.consequences)})


def group(checks: Iterable[dict], records: Iterable[dict], failed: Callable[[dict], bool]) -> list[Failure]:
    """The distinct failures of a run's verdicts (checks.json) and requests (results.json); `failed` tells a
    failing verdict (a report's status: known llama.cpp defects and passes are not failures)."""
    failing = [v for v in checks if failed(v)]
    verdicts: dict[tuple, list[dict]] = defaultdict(list)
    for v in failing:
        verdicts[case_key(v)].append(v)
    requests: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        requests[case_key(r)].append(r)
    found: dict[str, Failure] = {}
    for v in failing:
        sig = classify(v, requests.get(case_key(v), ()), verdicts[case_key(v)])
        entry = found.setdefault(sig.text, Failure(sig.text, sig.kind))
        (entry.consequences if sig.consequence else entry.verdicts).append(v)
    return sorted(found.values(), key=lambda f: (KINDS.index(f.kind), -len(f.cases), f.signature))


def by_verdict(failures: list[Failure]) -> dict[int, tuple[str, bool]]:
    """id(verdict) → (its failure's signature, whether it only restates it), for the failing verdicts of a
    run whose `failures` these are (the same dict objects)."""
    return {
        id(v): (f.signature, i >= len(f.verdicts)) for f in failures for i, v in enumerate(f.verdicts + f.consequences)
    }


def headline(failures: list[Failure]) -> str:
    """`2 distinct failures: crash: GGML_ASSERT(...) failed (40 cases, 40 consequences); lossless: hard
    divergence (3 cases)` ("no failures" for none)."""
    if not failures:
        return "no failures"
    parts = []
    for f in failures:
        n = len(f.cases)
        more = f", {len(f.consequences)} consequence{'s' if len(f.consequences) != 1 else ''}" if f.consequences else ""
        parts.append(f"{f.signature} ({n} case{'s' if n != 1 else ''}{more})")
    return f"{len(failures)} distinct failure{'s' if len(failures) != 1 else ''}: " + "; ".join(parts)
