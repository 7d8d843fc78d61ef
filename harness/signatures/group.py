"""A stored run's failing verdicts, one `Failure` per signature: its own failing verdicts and the verdicts
that only restate it (consequences), most severe kind first, then the most widespread.

A signature's text is keyed within its pattern: the same text in cells that share no mode, no drafter and no
model kind (nor a cell linked to both through such shared values) is two failures, each named with where it
shows (`lossless: hard divergence [seq · ngram-mod · dense]`), until evidence of the defect itself joins them:
a crash's abort line, an error's message (`SPECIFIC`). A divergence's triage class, a kind of KV damage or a
check's shape is what many defects have in common, so it joins only through the axes.

A batch llama.cpp refused because the KV cache's positions disagree with the slot's tokens (X and Y in its
message: `Signature.refused_batch`) is KV damage. It folds under a KV-damage root (a failing `kv-healthy` verdict
that is no consequence) as its consequence, with what restates it, only on evidence that the root's damage is what
the batch met (`Fold`): the refused request's slot, X and Y, and an earlier request of the same cell on the same
slot (the one before it in the cell's records: served before it, one request at a time per slot) whose KV scan
found cells past its returned tokens (or duplicate cells), that root's request. A folded verdict links no cells,
and its `Failure.folds` say why. Without that evidence it stands as its own KV damage (`kv-healthy: duplicate
cells` / `holes`), with the run's other verdicts of that text in its pattern's parts."""

import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from harness.verdict.signature import (
    CHECK,
    CRASH,
    DIVERGENCE,
    ERROR,
    REFUSED_BATCH,
    TIMEOUT,
    Signature,
    classify,
)

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
    folds: list[str] = field(default_factory=list)
    """Why each refused batch among the consequences folds under it (`Fold.line`): its evidence."""

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
    classified, anchors, folds = _fold_refused_batches(classified, records_by_cell(requests))
    by_text: dict[str, list] = defaultdict(list)
    for v, sig in classified:
        by_text[sig.text].append((v, sig))
    found: list[Failure] = []
    for text, shown in by_text.items():
        kind = shown[0][1].kind
        cell = [(v["mode"], v["spec"], kinds.get(v["model"]) or v["model"]) for v, _ in shown]
        own = [i for i, (v, _) in enumerate(shown) if id(v) not in anchors]  # a folded batch links no cells
        linked = [0] * len(own) if specific(text, kind) else _components([cell[i] for i in own])
        part_of = {id(shown[i][0]): p for i, p in zip(own, linked, strict=True)}
        parts = [part_of[id(anchors[id(v)])] if id(v) in anchors else part_of[id(v)] for v, _ in shown]
        labels = list(dict.fromkeys(parts))
        for part in labels:
            mine = [i for i, p in enumerate(parts) if p == part]
            name = text if len(labels) == 1 else f"{text} [{_where([cell[i] for i in own if parts[i] == part])}]"
            entry = Failure(name, kind)
            for i in mine:
                v, sig = shown[i]
                (entry.consequences if sig.consequence else entry.verdicts).append(v)
                if id(v) in folds:
                    entry.folds.append(folds[id(v)].line())
            found.append(entry)
    return sorted(found, key=lambda f: (KINDS.index(f.kind), -len(f.cases), f.signature))


@dataclass(frozen=True)
class Fold:
    """The evidence that a refused batch met another request's KV damage: the refused request, its slot, llama.cpp's
    X (the cache's last position of the sequence) and Y (where the batch starts it), and the earlier request of the
    same cell and slot whose KV scan found the damage (its first and last position past its returned tokens, or
    its duplicate cells)."""

    request: str
    slot: int
    x: int
    y: int
    earlier: str
    damage: str

    def line(self) -> str:
        return (
            f"{self.request} on slot {self.slot}: llama.cpp refused its batch (X = {self.x}, Y = {self.y}) after "
            f"{self.earlier} on the same slot left {self.damage}"
        )


def cell_of(row: dict) -> tuple:
    """(suite, mode, spec, model, backend) of a record or a verdict."""
    return tuple(row[a] for a in CELL)


def records_by_cell(requests: dict[tuple, list[dict]]) -> dict[tuple, list[dict]]:
    """Each cell's records in the order results.json lists them (the order its requests were served per slot)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for key, rows in requests.items():
        out[key[:-1]].extend(rows)
    return out


def _damage(record: dict) -> str | None:
    """What a record's KV scan found that a later batch of its slot can meet: positions past its returned tokens,
    or duplicate cells; None when its scan found neither (or it has none)."""
    scan = record.get("kv_scan") or {}
    if not scan or not scan.get("judged", True):
        return None
    last = max((int(p) for p in (scan.get("pos_max") or {}).values()), default=-1)
    bound = int(record.get("prompt_n") or 0) + len(record.get("tokens") or [])
    if record.get("stop_reason") != "truncated" and record.get("prompt_n") is not None and last >= bound > 0:
        return f"positions {bound}..{last} past its {bound} prompt + returned tokens"
    if int(scan.get("duplicates") or 0):
        return f"{scan['duplicates']} duplicate cells"
    return None


def fold_of(verdict: dict, cell_records: list[dict]) -> Fold | None:
    """The evidence (`Fold`) that a refused batch of `verdict` met the KV damage an earlier request of its cell left
    on its slot; None without it (the slot unknown, no earlier request of that slot, or none with damage)."""
    for i, row in enumerate(cell_records):
        if row["case"] != verdict["case"] or not (m := REFUSED_BATCH.search(row.get("error") or "")):
            continue
        slot = int(row.get("slot_id", -1))
        if slot < 0:
            return None
        for earlier in reversed(cell_records[:i]):
            if int(earlier.get("slot_id", -1)) != slot:
                continue
            damage = _damage(earlier)
            if damage is None:
                return None  # the slot's request just before it left no damage its scan saw
            x, y = map(int, m.groups())
            return Fold(
                f"{row['case']} round {row.get('repeat', 0)}",
                slot,
                x,
                y,
                f"{earlier['case']} round {earlier.get('repeat', 0)}",
                damage,
            )
        return None
    return None


def _fold_refused_batches(
    classified: list[tuple[dict, Signature]], cells: dict[tuple, list[dict]]
) -> tuple[list[tuple[dict, Signature]], dict[int, dict], dict[int, Fold]]:
    """`classified` with every refused batch that met an earlier request's KV damage on its slot (`fold_of`), and
    what restates it, a consequence of that request's KV-damage root, under its signature; id(folded verdict) →
    the root verdict, and → its `Fold`. A refused batch without that evidence keeps its own signature."""
    roots = {
        (cell_of(v), v["case"]): (v, sig) for v, sig in classified if v["check"] == "kv-healthy" and not sig.consequence
    }
    evidence: dict[tuple, Fold] = {}
    for v, sig in classified:
        if sig.refused_batch and (fold := fold_of(v, cells.get(cell_of(v), []))) is not None:
            earlier_case = fold.earlier.rsplit(" round ", 1)[0]
            if (cell_of(v), earlier_case) in roots:
                evidence[case_key(v)] = fold
    out, anchors, folds = [], {}, {}
    for v, sig in classified:
        fold = evidence.get(case_key(v))
        if sig.refused_batch and fold is not None:  # the refused batch's verdict, or one restating it
            root, root_sig = roots[(cell_of(v), fold.earlier.rsplit(" round ", 1)[0])]
            sig, anchors[id(v)] = Signature(root_sig.text, root_sig.kind, consequence=True), root
            if v["check"] == "no-crash":
                folds[id(v)] = fold
        out.append((v, sig))
    return out, anchors, folds


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
