"""`--shard I/N`: one part of a run's cells, balanced by estimated cost."""

from dataclasses import dataclass

from harness.errors import HarnessError
from harness.matrix.cell import Cell


@dataclass(frozen=True)
class Shard:
    """`--shard I/N`: the I-th (1-based) of N parts of a run's cells."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        try:
            index, count = (int(p) for p in text.split("/"))
        except ValueError:
            index = count = 0
        if not 1 <= index <= count:
            raise HarnessError(f"--shard takes I/N with 1 <= I <= N (e.g. 2/3), not '{text}'")
        return cls(index, count)

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


MODEL_WEIGHT_BYTES = 32 * 2**20
"""Per generated token, a model costs about its file size over this (the tiny models 1, Gemma 3 270M ~7.5)."""
SERVER_START_TOKENS = 200
"""Starting llama-server for a cell costs about as much as generating this many tiny-model tokens."""


def estimated_cost(suite, cell: Cell) -> float:
    """A cell's cost in tiny-model tokens: rounds × requests × n_predict × model weight, more with a draft
    model, plus a server start."""
    from harness.models import resolve

    cases = [suite.cell_case(c, cell.model) for c in suite.cases]
    tokens = len(suite.rounds) * sum(
        (len(c.turns) or 1) * (c.sampling.n_predict if c.sampling.n_predict > 0 else 128) for c in cases
    )
    try:
        weight = max(1.0, resolve(cell.model, make=False).size / MODEL_WEIGHT_BYTES)
    except HarnessError:
        weight = 1.0
    if "draft-simple" in cell.spec:
        weight *= 1.5
    return tokens * weight + (SERVER_START_TOKENS if cell.backend == "server" else 0)


def shard(jobs: list[tuple], part: Shard, cost=estimated_cost) -> list[tuple]:
    """The (suite, cell) jobs of shard `part`: deterministic (the same jobs give the same split in any
    order, on any machine) and balanced by estimated cost.

    Cells that compare with each other (lossless with spec `none`, mode-invariant with `seq`, logits-close
    with both) share suite, backend and model, so those groups are kept whole: no shard runs another's
    reference cells. A group is split into cells, each then also running its reference cells (counted in its
    cost), only while there are fewer units than shards or it alone would take more than half a shard's
    share. Units go, largest first, to the shard whose load grows least by it, counting only the cells
    (reference cells included) that shard does not run already (longest-processing-time scheduling)."""
    groups: dict[tuple, list[tuple]] = {}
    for suite, cell in jobs:
        groups.setdefault((suite.name, cell.backend, cell.model), []).append((suite, cell))
    units = [(_cost_of(_executes(members), cost), key, members) for key, members in groups.items()]
    share = sum(u[0] for u in units) / part.count

    def too_big() -> bool:
        splittable = [u for u in units if len(u[2]) > 1]
        return bool(splittable) and (len(units) < part.count or max(u[0] for u in splittable) > share / 2)

    while too_big():
        units.sort(key=lambda u: (len(u[2]) > 1, u[0], u[1]))
        _, key, members = units.pop()
        for suite, cell in members:
            units.append((_cost_of(_executes([(suite, cell)]), cost), (*key, cell.mode, cell.spec), [(suite, cell)]))
    load = [0.0] * part.count
    held: list[set] = [set() for _ in range(part.count)]  # (suite, cell) each shard executes, references too
    mine = set()
    for _, _key, members in sorted(units, key=lambda u: (-u[0], u[1])):
        needs = _executes(members)
        extra = [_cost_of({k: s for k, s in needs.items() if k not in held[i]}, cost) for i in range(part.count)]
        target = min(range(part.count), key=lambda i: (load[i] + extra[i], i))
        load[target] += extra[target]
        held[target].update(needs)
        if target == part.index - 1:
            mine.update((s.name, c) for s, c in members)
    return [(s, c) for s, c in jobs if (s.name, c) in mine]


def _executes(members: list[tuple]) -> dict[tuple, object]:
    """(suite name, cell) → suite of what a shard unit executes: a whole group its own cells (they hold each
    other's references); a lone cell also the cells it compares with, run on demand (lossless with spec `none`,
    mode-invariant with `seq`, logits-close with both). Its cost is what the unit weighs when shards are filled,
    so a lone cell whose references are dear (Gemma's ngram-cache in par) counts them."""
    if len(members) > 1:
        return {(s.name, c): s for s, c in members}
    ((suite, cell),) = members
    refs = (cell, cell.reference(spec="none"), cell.reference(mode="seq"), cell.reference(mode="seq", spec="none"))
    return {(suite.name, ref): suite for ref in refs}


def _cost_of(executed: dict[tuple, object], cost) -> float:
    return sum(cost(suite, cell) for (_, cell), suite in executed.items())
