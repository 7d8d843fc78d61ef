"""The case under reduction: one frozen value per step, and the suite and cell it is served as.

A `Candidate` names the failing case of a suite and every dimension shrink reduces: the prompt (token ids once
they are known), the chat turns kept, the other cases sent beside it (requests in flight), the rounds, n_predict,
the drafter's options, slots and n_ctx / n_batch / n_ubatch, and the model. `materialize` turns it into the
in-memory suite (that one case and its companions, one matrix cell) the executor runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from harness.errors import HarnessError
from harness.matrix import Cell
from harness.suites import Case, Suite, case_keys, load_suite

SERVE_KEYS = ("parallel", "n_ctx", "n_batch", "n_ubatch")
"""The serve settings shrink reduces (a suite's `serve:` names, as ServeConfig's fields)."""


def split_key(key: str) -> tuple[str, int | None]:
    """A record name as (case name, chat turn index or None): `iterative.turn2` → ('iterative', 1)."""
    name, dot, turn = key.rpartition(".turn")
    if dot and turn.isdigit():
        return name, int(turn) - 1
    return key, None


@dataclass(frozen=True)
class Candidate:
    """A failing case with every reducible dimension spelled out (None / empty: as the suite has it)."""

    suite: str
    """Path of the suite file the case comes from."""
    case: str
    """Name of the case in that suite."""
    check: str
    """The check whose failure is being kept."""
    cell: Cell
    turn: int | None = None
    """The failing chat turn (index into the case's turns); None for a completion case."""
    turns: tuple[int, ...] | None = None
    """Chat turns sent (indices, ending with `turn`); None: every turn up to the failing one."""
    prompt: tuple[int, ...] | None = None
    """Token ids replacing the case's prompt (a chat then becomes one completion of its failing turn's tokens)."""
    companions: tuple[str, ...] = ()
    """The suite's other cases sent beside it, round after round (requests in flight)."""
    rounds: tuple[str, ...] = ("par",)
    n_predict: int = 128
    spec: tuple[tuple[str, Any], ...] = ()
    """Drafter options (llama-server names without dashes) over the spec preset's and the run's."""
    serve: tuple[tuple[str, int], ...] = ()
    """SERVE_KEYS values over the suite's."""
    sampling_model: str = ""
    """The model whose matrix block's sampling the case keeps (the run's, also after a switch to a tiny model)."""

    @property
    def key(self) -> str:
        """The record name of the failing request in the materialized suite."""
        if self.turn is None or self.prompt is not None:
            return self.case
        return f"{self.case}.turn{len(self.sent_turns())}"

    def sent_turns(self) -> tuple[int, ...]:
        return self.turns if self.turns is not None else tuple(range(self.turn + 1))

    def serve_value(self, name: str, suite: Suite, default: int) -> int:
        return dict(self.serve).get(name, suite.serve.get(name, default))

    def with_(self, **changes) -> Candidate:
        return replace(self, **changes)

    def with_spec(self, name: str, value) -> Candidate:
        return replace(self, spec=tuple(sorted({**dict(self.spec), name: value}.items())))

    def with_serve(self, name: str, value: int) -> Candidate:
        return replace(self, serve=tuple(sorted({**dict(self.serve), name: value}.items())))

    def size(self) -> tuple:
        """What shrinking makes smaller, for progress lines."""
        return (len(self.prompt) if self.prompt else None, len(self.companions), self.n_predict)

    def describe(self) -> str:
        prompt = f"{len(self.prompt)} prompt tokens" if self.prompt is not None else "the case's prompt"
        turns = f", turns {[t + 1 for t in self.sent_turns()]}" if self.turn is not None and self.prompt is None else ""
        extra = ", ".join(f"{k}={v}" for k, v in (*self.spec, *self.serve))
        return (
            f"{self.cell.id} {self.case}: {prompt}{turns}, n_predict {self.n_predict}, "
            f"{len(self.companions)} other requests, {len(self.rounds)} round(s)" + (f", {extra}" if extra else "")
        )

    def to_json(self) -> dict:
        data = asdict(self)
        data["cell"] = asdict(self.cell)
        data["key"] = self.key
        return data

    @classmethod
    def from_json(cls, data: dict) -> Candidate:
        data = {k: v for k, v in data.items() if k != "key"}
        data["cell"] = Cell(**data["cell"])
        for name in ("turns", "prompt"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        data["companions"], data["rounds"] = tuple(data["companions"]), tuple(data["rounds"])
        data["spec"] = tuple(tuple(p) for p in data["spec"])
        data["serve"] = tuple(tuple(p) for p in data["serve"])
        return cls(**data)

    def load_suite(self) -> Suite:
        return load_suite(self.suite)

    def materialize(self, suite: Suite | None = None) -> Suite:
        """The one-cell suite that sends this candidate: the case (reduced) and its companions, in the suite's
        order, its rounds, its serve settings; each case with its matrix block's sampling as the original
        model ran it."""
        suite = suite or self.load_suite()
        original_model = self.sampling_model or self.cell.model
        by_name = {c.name: c for c in suite.cases}
        if self.case not in by_name:
            raise HarnessError(f"suite {suite.name} has no case '{self.case}'")
        cases = []
        for case in suite.cases:
            if case.name == self.case:
                cases.append(self._reduced(suite.cell_case(case, original_model)))
            elif case.name in self.companions:
                cases.append(suite.cell_case(case, original_model))
        block = {
            "backends": [self.cell.backend],
            "modes": [self.cell.mode],
            "specs": [self.cell.spec],
            "models": [self.cell.model],
        }
        return replace(
            suite, cases=cases, matrix=[block], rounds=list(self.rounds), serve={**suite.serve, **dict(self.serve)}
        )

    def _reduced(self, case: Case) -> Case:
        sampling = replace(case.sampling, n_predict=self.n_predict)
        if self.prompt is not None:
            return replace(case, sampling=sampling, prompt=list(self.prompt), turns=[])
        if self.turn is not None:
            return replace(case, sampling=sampling, turns=[case.turns[t] for t in self.sent_turns()])
        return replace(case, sampling=sampling)


def initial(suite_path: str, key: str, check: str, cell: Cell) -> Candidate:
    """The candidate of a run's failing case exactly as the run sent it."""
    suite = load_suite(suite_path)
    name, turn = split_key(key)
    case = next((c for c in suite.cases if c.name == name), None)
    if case is None or key not in case_keys(case):
        known = ", ".join(k for c in suite.cases for k in case_keys(c))
        raise HarnessError(f"suite {suite.name} has no case '{key}' (cases: {known})")
    if not cell.preset.runs_on(cell.backend):
        raise HarnessError(f"spec config '{cell.spec}' does not run on the {cell.backend} backend")
    return Candidate(
        suite=str(Path(suite_path).resolve()) if Path(suite_path).is_file() else str(suite.path.resolve()),
        case=name,
        check=check,
        cell=cell,
        turn=turn,
        companions=tuple(c.name for c in suite.cases if c.name != name),
        rounds=tuple(suite.rounds),
        n_predict=suite.cell_case(case, cell.model).sampling.n_predict,
        sampling_model=cell.model,
    )


def save(path: Path, candidate: Candidate) -> None:
    path.write_text(json.dumps(candidate.to_json(), indent=1) + "\n")
