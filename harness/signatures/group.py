"""A stored run's failing verdicts, one `Failure` per signature: its own failing verdicts and the verdicts
that only restate it (consequences), most severe kind first, then the most widespread.

A signature's text is keyed within its pattern: the same text in cells that share no mode, no drafter and no
model kind (nor a cell linked to both through such shared values) is two failures, each named with where it
shows (`lossless: hard divergence [seq · ngram-mod · dense]`), until evidence of the defect itself joins them:
a crash's abort line, an error's message (`SPECIFIC`). A divergence's triage class, a kind of KV damage or a
check's shape is what many defects have in common, so it joins only through the axes."""

import re
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


def specific(text: str, kind: str) -> bool:
    """True for a signature whose text is evidence of one defect wherever it shows: a crash with an abort line
    (not only how the process ended), an error's message."""
    if kind == CRASH:
        return not re.fullmatch(r"crash: (?:killed by \S+|exited with code \S+)", text)
    return kind == ERROR


def _components(axes: list[tuple[str, str, str]]) -> list[int]:
    """Per cell (mode, spec, kind), the index of its component: cells sharing a value on any axis are linked."""
    parent = list(range(len(axes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[tuple[int, str], int] = {}
    for i, cell in enumerate(axes):
        for a, value in enumerate(cell):
            j = first.setdefault((a, value), i)
            parent[root(i)] = root(j)
    return [root(i) for i in range(len(axes))]


def _where(axes: list[tuple[str, str, str]]) -> str:
    return " · ".join("/".join(dict.fromkeys(values)) for values in zip(*axes, strict=True))


def group(
    checks: Iterable[dict],
    records: Iterable[dict],
    failed: Callable[[dict], bool],
    kinds: dict[str, str] | None = None,
) -> list[Failure]:
    """The distinct failures of a run's verdicts (checks.json) and requests (results.json); `failed` tells a
    failing verdict (a report's status: known llama.cpp defects and passes are not failures). `kinds`: model
    name → kind (run.json's models; a model's name stands for its kind where not given)."""
    kinds = kinds or {}
    failing = [v for v in checks if failed(v)]
    verdicts: dict[tuple, list[dict]] = defaultdict(list)
    for v in failing:
        verdicts[case_key(v)].append(v)
    requests: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        requests[case_key(r)].append(r)
    classified = [(v, classify(v, requests.get(case_key(v), ()), verdicts[case_key(v)])) for v in failing]
    by_text: dict[str, list] = defaultdict(list)
    for v, sig in classified:
        by_text[sig.text].append((v, sig))
    found: list[Failure] = []
    for text, shown in by_text.items():
        kind = shown[0][1].kind
        cell = [(v["mode"], v["spec"], kinds.get(v["model"]) or v["model"]) for v, _ in shown]
        parts = [0] * len(shown) if specific(text, kind) else _components(cell)
        labels = list(dict.fromkeys(parts))
        for part in labels:
            mine = [i for i, p in enumerate(parts) if p == part]
            name = text if len(labels) == 1 else f"{text} [{_where([cell[i] for i in mine])}]"
            entry = Failure(name, kind)
            for i in mine:
                v, sig = shown[i]
                (entry.consequences if sig.consequence else entry.verdicts).append(v)
            found.append(entry)
    return sorted(found, key=lambda f: (KINDS.index(f.kind), -len(f.cases), f.signature))


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
