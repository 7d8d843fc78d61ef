"""Mutants of a llama.cpp tree, made by universalmutator (its regular-expression rules for C++), and a seeded sample.

A mutant is one changed line of one file. Its id is a digest of (file, line, original text, mutated text): the same
mutant of the same tree has the same id in every campaign, and a campaign resumed on a tree that changed meets
ids it does not know instead of judging a different edit under an old name.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import io
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.mutate.targets import Target

RULES = ("universal.rules", "cpp.rules", "c_like.rules")
"""universalmutator's rule files for a .cpp file (what its `mutate FILE.cpp` uses)."""


@dataclass(frozen=True)
class Mutant:
    file: str
    line: int
    original: str
    mutated: str
    rule: str

    @property
    def id(self) -> str:
        blob = "\0".join((self.file, str(self.line), self.original, self.mutated))
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def diff(self, text: str) -> str:
        """The mutant as a unified diff of `text` (the file it was made from), with context: `git apply` takes it."""
        return "".join(
            difflib.unified_diff(
                text.splitlines(keepends=True),
                self.apply(text).splitlines(keepends=True),
                f"a/{self.file}",
                f"b/{self.file}",
            )
        )

    def apply(self, text: str) -> str:
        """`text` (the file) with this mutant's line in place of the original; the original must be there."""
        lines = text.splitlines(keepends=True)
        if self.line > len(lines) or lines[self.line - 1] != self.original:
            raise HarnessError(f"{self.file}:{self.line} is not the line mutant {self.id} was made from")
        lines[self.line - 1] = self.mutated
        return "".join(lines)

    def to_json(self) -> dict:
        return {"id": self.id, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> Mutant:
        return cls(data["file"], data["line"], data["original"], data["mutated"], data["rule"])


def mutants_of(tree: Path, target: Target) -> list[Mutant]:
    """Every mutant universalmutator makes of `target`'s lines in `tree` (mutations inside string literals left
    out, as its `mutate` does by default), in line order."""
    from universalmutator import mutator

    wanted = set(target.lines(tree))  # first: a missing file is a one-line error there
    source = (tree / target.file).read_text(errors="replace").splitlines(keepends=True)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the rules it uses and what it skipped
        made = mutator.mutants_regexp(source, ruleFiles=list(RULES), ignorePatterns=[], ignoreStringOnly=True)
    out = []
    for line, mutated, (rule, where), _ in made:  # where: "builtin:<file>.rules:<line>"
        if line in wanted:
            rule_name = f"{rule}  ({where.removeprefix('builtin:')})"
            out.append(Mutant(target.file, line, source[line - 1], mutated, rule_name))
    return out


def pool(tree: Path, targets: tuple[Target, ...]) -> list[Mutant]:
    """Every mutant of every target, in (file, line) order, each once."""
    seen: dict[str, Mutant] = {}
    for target in targets:
        for m in mutants_of(tree, target):
            seen.setdefault(m.id, m)
    return sorted(seen.values(), key=lambda m: (m.file, m.line, m.mutated))


def sample(mutants: list[Mutant], n: int | None, seed: int) -> list[Mutant]:
    """`n` of `mutants` drawn without replacement with `seed` (all of them, shuffled, when n is None or larger)."""
    order = list(mutants)
    random.Random(seed).shuffle(order)
    return order if n is None else order[:n]
