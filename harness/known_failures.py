"""Known failures: defects of llama.cpp itself that the suites found (`suites/known-failures.yaml`).

Each entry names the suite, the matrix cells, the check and a regular expression of the evidence, plus
the llama.cpp commit, why, and the upstream report. A check failure it explains is an expected failure,
not a red run — but only when the evidence explains every failing request of the verdict: a request
whose failure the entry does not explain keeps the verdict red. Each entry also runs as a strict expected
failure of its own: when llama.cpp fixes the defect, the entry no longer reproduces, that fails the run,
and the entry is removed.
"""

import re
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from harness.backends.base import cpu_flags
from harness.checks.base import CheckResult
from harness.errors import HarnessError
from harness.matrix import Cell, narrowing

FILE_NAME = "known-failures.yaml"
_ENTRY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "suite", "backend", "check", "evidence", "llama_cpp_commit", "reason", "upstream"],
    "properties": {
        "id": {"type": "string", "pattern": r"^[a-z0-9-]+$"},
        "suite": {"type": "string"},
        "backend": {"type": "string"},
        "modes": {"type": "array", "items": {"type": "string"}},
        "specs": {"type": "array", "items": {"type": "string"}},
        "models": {"type": "array", "items": {"type": "string"}},
        "check": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
        "evidence": {"type": "string"},
        "llama_cpp_commit": {"type": "string"},
        "found": {"type": "string"},
        "reason": {"type": "string"},
        "cpu_flags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "upstream": {"type": "string", "minLength": 1},
    },
}


@dataclass(frozen=True)
class KnownFailure:
    """One recorded llama.cpp defect."""

    id: str
    suite: str
    backend: str
    check: tuple[str, ...]
    """The checks whose failures the defect explains (a string in the file is one check)."""
    evidence: str
    llama_cpp_commit: str
    reason: str
    upstream: str
    """Where llama.cpp tracks it (an issue or pull request), or what was filed."""
    modes: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    found: str = ""
    cpu_flags: tuple[str, ...] = ()
    """The defect shows only on a CPU with these flags (`/proc/cpuinfo`); elsewhere the entry does not apply."""

    @property
    def missing_cpu_flags(self) -> list[str]:
        """The CPU flags the entry needs that this machine lacks (empty: it applies here)."""
        have = cpu_flags()
        return [f for f in self.cpu_flags if f not in have]

    def covers(self, suite: str, cell: Cell) -> bool:
        """True for the cells the defect shows in (an empty list of modes, specs or models means all) on a
        CPU it shows on."""
        return (
            suite == self.suite
            and cell.backend == self.backend
            and not self.missing_cpu_flags
            and all(
                not allowed or value in allowed
                for value, allowed in ((cell.mode, self.modes), (cell.spec, self.specs), (cell.model, self.models))
            )
        )

    def explained(self, result: CheckResult) -> tuple[int, int]:
        """(failing items this defect explains, failing items) of a failed verdict of its check: the
        verdict's per-request `failures`, or its message when it has none."""
        if result.passed or result.name not in self.check:
            return 0, 0
        items = result.failures or [result.message]
        return sum(re.search(self.evidence, item) is not None for item in items), len(items)

    def explains(self, result: CheckResult) -> bool:
        """True when a failed check verdict is this defect in every one of its failing requests."""
        hits, total = self.explained(result)
        return total > 0 and hits == total

    @property
    def summary(self) -> str:
        return f"known llama.cpp defect {self.id} (llama.cpp {self.llama_cpp_commit[:12]}; see suites/{FILE_NAME})"


def load(path: Path) -> list[KnownFailure]:
    """The entries of a known-failures file ([] when there is none); errors name the file and entry."""
    if not path.is_file():
        return []
    try:
        data = yaml.safe_load(path.read_text()) or []
    except yaml.YAMLError as err:
        raise HarnessError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, list):
        raise HarnessError(f"{path}: must be a list of entries")
    from harness.suites import CHECK_NAMES, suite_files

    suites = {p.stem for p in suite_files(path.parent)}
    entries = []
    for i, raw in enumerate(data):
        try:
            jsonschema.validate(raw, _ENTRY)
            if re.search(raw["evidence"], "") is not None:
                raise HarnessError(
                    f"evidence pattern {raw['evidence']!r} matches an empty string, so it would "
                    "explain any failure; make it name the defect's message"
                )
            narrowing([raw["backend"]], list(raw.get("modes", [])), list(raw.get("specs", [])))
        except (jsonschema.ValidationError, re.error, HarnessError) as err:
            raise HarnessError(f"{path}: entry {i}: {str(err).splitlines()[0]}") from None
        raw["check"] = [raw["check"]] if isinstance(raw["check"], str) else raw["check"]
        for value, known, what in ((raw["suite"], suites, "suite"), *((c, CHECK_NAMES, "check") for c in raw["check"])):
            if value not in known:
                raise HarnessError(f"{path}: entry {i}: unknown {what} '{value}' (known: {', '.join(sorted(known))})")
        entries.append(KnownFailure(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}))
    return entries


def matching(entries: list[KnownFailure], suite: str, cell: Cell, result: CheckResult) -> KnownFailure | None:
    """The entry that explains a failed verdict of `suite` in `cell`, if any."""
    return next((e for e in entries if e.covers(suite, cell) and e.explains(result)), None)


def tag(entries: list[KnownFailure], suite: str, cell: Cell, results: list[CheckResult]) -> list[CheckResult]:
    """Mark the failed verdicts a known defect explains (`evidence["known_failure"]`); returns the others."""
    unexplained = []
    for r in results:
        if r.passed:
            continue
        entry = matching(entries, suite, cell, r)
        if entry is None:
            unexplained.append(r)
            partial = [(e, *e.explained(r)) for e in entries if e.covers(suite, cell)]
            for e, hits, total in partial:
                if hits:
                    r.evidence["known_failure_partial"] = f"{e.id} explains {hits} of {total} failing requests"
                    r.message += (
                        f"\n  ({e.id} explains {hits} of {total} failing requests; the other "
                        f"{total - hits} stay failures)"
                    )
        else:
            r.evidence["known_failure"] = entry.id
    return unexplained
