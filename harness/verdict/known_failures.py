"""Known failures: defects of llama.cpp itself that the suites found (`suites/known-failures.yaml`).

Each entry names the defect's signature: the backend, the conditions it needs (modes, spec configs, models,
CPU flags; an empty list means any), the checks it fails and a regular expression of the evidence, with
exact counts where the defect's are exact (`limits`: bounds on numbers the evidence captures, e.g. at most 4
tokens lost). It lists the suites it has been seen in (`suites`, the first one its home, where its strict
expected failure runs), the llama.cpp commit, why, the upstream report, and `measured` evidence lines with
`wider` variants it must not explain (tests/test_known_failures.py checks both, entry by entry).

A check failure it explains is an expected failure, not a red run — but only when the evidence explains
every failing request of the verdict: a request whose failure the entry does not explain keeps the verdict
red. The entry is recognised wherever its signature shows: in a suite it does not list yet, the verdict is
reported as that known defect, "seen in a new suite", and does not fail the run (the report and the console
say so; add the suite to the entry). An entry whose evidence is not specific to its defect (a bare
`killed by SIGSEGV`) sets `anywhere: false` and is recognised in its listed suites only. Each entry also
runs as a strict expected failure of its own: when llama.cpp fixes the defect, the entry no longer
reproduces, that fails the run, and the entry is removed.
"""

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from harness.backends.base import cpu_flags
from harness.backends.build.versions import UNKNOWN, LlamaVersion, covers, parse_item
from harness.errors import HarnessError
from harness.matrix import Cell, cells, narrowing, served_as
from harness.suites import jsonschemas, yamltext
from harness.verdict.check_result import DID_NOT_COMPLETE, CheckResult

FILE_NAME = "known-failures.yaml"
_ENTRY = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "id",
        "suites",
        "backend",
        "check",
        "evidence",
        "versions",
        "reason",
        "upstream",
        "measured",
        "wider",
        "modes",
        "specs",
        "models",
    ],
    "properties": {
        "id": {"type": "string", "pattern": r"^[a-z0-9-]+$"},
        "suites": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "anywhere": {"type": "boolean"},
        "limits": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["value"],
                "properties": {
                    "value": {"type": "string", "pattern": r"^\s*[a-z_]+\s*(-\s*[a-z_]+\s*)*$"},
                    "min": {"type": "integer"},
                    "max": {"type": "integer"},
                },
            },
        },
        "measured": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "wider": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "backend": {"type": "string"},
        # where the defect was measured: an entry is recognised in no other mode, speculative config or model
        "modes": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "specs": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "models": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "check": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]},
        "evidence": {"type": "string"},
        "versions": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "fixed_in": {"type": "string", "pattern": r"^b\d+$"},
        "found": {"type": "string"},
        "reason": {"type": "string"},
        "cpu_flags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "without_cpu_flags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "upstream": {"type": "string", "minLength": 1},
        "tries": {"type": "integer", "minimum": 2, "maximum": 5},
    },
}


@dataclass(frozen=True)
class Limit:
    """A bound on a number the evidence captures: a named group, or a group less others (`reference -
    returned`); `min` / `max` inclusive (None: unbounded). A limit whose groups did not take part in the match
    (another branch of the pattern) does not apply."""

    value: str
    min: int | None = None
    max: int | None = None

    @property
    def names(self) -> list[str]:
        return [n.strip() for n in self.value.split("-")]

    def holds(self, match: re.Match) -> bool:
        values = [match.group(n) for n in self.names]
        if None in values:
            return True
        first, *rest = map(int, values)
        number = first - sum(rest)
        return (self.min is None or number >= self.min) and (self.max is None or number <= self.max)


@dataclass(frozen=True)
class KnownFailure:
    """One recorded llama.cpp defect."""

    id: str
    suites: tuple[str, ...]
    """The suites it has been seen in; the first is its home (its strict expected failure runs there)."""
    backend: str
    check: tuple[str, ...]
    """The checks whose failures the defect explains (a string in the file is one check)."""
    evidence: str
    reason: str
    upstream: str
    """Where llama.cpp tracks it (an issue or pull request), or what was filed."""
    measured: tuple[str, ...] = ()
    """Failure lines the defect produced, as measured: the entry explains each."""
    wider: tuple[str, ...] = ()
    """Variants of the measured lines the defect cannot produce: the entry explains none."""
    modes: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    found: str = ""
    cpu_flags: tuple[str, ...] = ()
    """The defect shows only on a CPU with these flags (`/proc/cpuinfo`); elsewhere the entry does not apply."""
    without_cpu_flags: tuple[str, ...] = ()
    """The defect was measured not to show on a CPU with these flags (its numerics differ): there the entry does not
    apply, and its strict expected failure is skipped instead of passing as a false "fixed"."""
    limits: tuple[Limit, ...] = ()
    anywhere: bool = True
    """Recognised in any suite (False: only in `suites`, for evidence not specific to the defect)."""
    versions: tuple[str, ...] = ()
    """The llama.cpp versions it was measured in: tags (bN), tag ranges (bA..bB), commits, or COMMIT..bN (from a
    vendored commit to a tag). It applies only there (harness/backends/build/versions.py)."""
    fixed_in: str = ""
    """The first tag where it no longer reproduces (found by `specharness bisect --tags`), or ''."""
    tries: int = 1
    """An intermittent defect (it shows only when the slots' steps interleave so): its strict expected failure
    serves its cells afresh up to this many times and counts as gone only when none of them reproduces it
    (`found` says how often it did)."""

    @property
    def suite(self) -> str:
        """The home suite: where the entry was found and its strict expected failure runs."""
        return self.suites[0]

    @property
    def missing_cpu_flags(self) -> list[str]:
        """The CPU flags the entry needs that this machine lacks, and `no F` for each flag it must not have that this
        machine has (empty: it applies here)."""
        have = cpu_flags()
        return [f for f in self.cpu_flags if f not in have] + [f"no {f}" for f in self.without_cpu_flags if f in have]

    def shows_in(self, cell: Cell, overrides: dict | None = None) -> bool:
        """True for the cells whose configuration the defect needs (an empty list of modes, specs or models
        means all), on a CPU it shows on, whatever the suite. A cell has one of the listed specs when it was served
        as that spec would have been under the run's `--spec-*` `overrides` (matrix.served_as): the entry
        goes by what a cell was served with, not by its preset's name."""
        return not self.missing_cpu_flags and self.configured_in(cell, overrides)

    def configured_in(self, cell: Cell, overrides: dict | None = None) -> bool:
        """True for the cells whose configuration the defect needs, whatever the CPU (see `shows_in`)."""
        return (
            cell.backend == self.backend
            and all(
                not allowed or value in allowed
                for value, allowed in ((cell.mode, self.modes), (cell.model, self.models))
            )
            and self.has_spec(cell.spec, overrides or {})
        )

    def has_spec(self, spec: str, overrides: dict) -> bool:
        """Whether a cell of `spec` served under `overrides` is served as one of the entry's specs is."""
        served = served_as(spec, overrides)
        return not self.specs or any(served_as(listed, overrides) == served for listed in self.specs)

    def measured_in(self, cell: Cell, overrides: dict | None = None) -> bool:
        """Whether `cell`, served under the run's `overrides`, is served as one of the entry's specs was when the
        defect was measured (no overrides): only such a cell can show that the defect is gone."""
        served = served_as(cell.spec, overrides or {})
        return self.shows_in(cell, overrides) and (
            not self.specs or any(served_as(listed, {}) == served for listed in self.specs)
        )

    def covers(self, suite: str, cell: Cell, overrides: dict | None = None) -> bool:
        """True for the cells of the suites it has been seen in that the defect shows in."""
        return suite in self.suites and self.shows_in(cell, overrides)

    def recognises(self, suite: str, cell: Cell, overrides: dict | None = None) -> bool:
        """True where its signature counts as the defect: its listed suites, and any other one unless the
        entry says `anywhere: false`."""
        return self.shows_in(cell, overrides) and (self.anywhere or suite in self.suites)

    def matches(self, item: str) -> bool:
        """True when one failing item is this defect's evidence, counts within the limits."""
        found = re.search(self.evidence, item)
        return found is not None and all(limit.holds(found) for limit in self.limits)

    def explained(self, result: CheckResult) -> tuple[int, int]:
        """(failing items this defect explains, failing items) of a failed verdict of its check: the
        verdict's per-request `failures`, or its message when it has none. A verdict with one failing request
        is matched on its line or its message, which describes that request in full (a comparison's line names
        only the triage class, "round 0: unexplained at token 22"; its message says why); with several, the
        message describes only the first, so each line must match on its own."""
        if result.passed or result.name not in self.check:
            return 0, 0
        items = result.failures or [result.message]
        if len(result.failures) == 1:  # the message describes that one request (a comparison: its triage's why)
            return int(self.matches(items[0]) or self.matches(result.message)), 1
        return sum(self.matches(item) for item in items), len(items)

    def explains(self, result: CheckResult) -> bool:
        """True when a failed check verdict is this defect in every one of its failing requests, or (`exercised`)
        its completions fell short only because this defect killed requests (`shortfall`)."""
        hits, total = self.explained(result)
        return total > 0 and (hits == total or self.shortfall(result) is not None)

    def shortfall(self, result: CheckResult) -> str | None:
        """Why a failed `exercised` verdict's shortfall of completions is this defect's, or None. A request this
        defect killed (a later turn of its chat not sent after it included: the line carries the same error)
        could not complete, so it is not counted: the verdict is the defect's when the requests it left alone
        reach the suite's completed share (all killed: none left to judge) and the verdict fails nothing else
        (a counter short of its minimum). A request that ended otherwise (context_full, another crash) counts
        against the share as the check counts it, so a kv-fill regression that leaves too few completions
        among the requests the defect spared still fails."""
        if result.passed or result.name != "exercised" or "exercised" not in self.check:
            return None
        evidence, items = result.evidence, result.failures
        requests, completed = evidence.get("requests"), evidence.get("completed")
        minimum = evidence.get("completed_min")
        if not items or None in (requests, completed, minimum) or any(DID_NOT_COMPLETE not in i for i in items):
            return None
        killed = sum(self.matches(item) for item in items)
        spared = requests - killed
        if not killed or (spared and completed / spared < minimum):
            return None
        if not spared:
            return f"{self.id} killed all {requests} requests: none was left to complete"
        others = Counter(_NOT_SENT.sub("", i.split(DID_NOT_COMPLETE, 1)[1]) for i in items if not self.matches(i))
        ended = ", ".join(f"{error} ×{n}" if n > 1 else error for error, n in others.items())
        return (
            f"{self.id} killed {killed} of {requests} requests; of the {spared} it spared {completed} completed "
            f"({completed / spared:.0%}, expected at least {minimum:.0%})"
            + (f", the others ended {ended}" if ended else "")
        )

    @property
    def summary(self) -> str:
        return f"known llama.cpp defect {self.id} (llama.cpp {', '.join(self.versions)}; see suites/{FILE_NAME})"


def scope_line(entry: KnownFailure, version: LlamaVersion, backend: str) -> str | None:
    """Why `entry` does not apply to a backend of `version` (None: it applies). An unknown version applies every
    entry (a history of its own, e.g. a fork's: nothing says where it stands)."""
    if not version.known or covers(entry.versions, version):
        return None
    where = "llama-server" if backend == "server" else "the in-process engine"
    if entry.fixed_in and version.at_or_after(int(entry.fixed_in[1:])):
        return f"known failure {entry.id}: fixed in {entry.fixed_in} ({where} runs {version}): its cells are judged"
    return (
        f"known failure {entry.id}: not known for {version} (measured in {', '.join(entry.versions)}; {where}): "
        "its cells are judged"
    )


def scoped(entries: list[KnownFailure], versions: dict[str, LlamaVersion]) -> tuple[list[KnownFailure], list[str]]:
    """The entries that apply to the backends' llama.cpp versions, and a line for each that does not (said in the
    console and run.json): its cells are judged as any others. An entry gated on CPU flags this machine lacks
    (`missing_cpu_flags`) applies to none of its cells at any version and gets no line."""
    kept, lines = [], []
    for entry in entries:
        if entry.missing_cpu_flags:  # applies to no cell on this machine, whatever the version: nothing to say
            kept.append(entry)
            continue
        line = scope_line(entry, versions.get(entry.backend, UNKNOWN), entry.backend)
        if line is None:
            kept.append(entry)
        else:
            lines.append(line)
    return kept, lines


def _check_limits(raw: dict) -> None:
    groups = re.compile(raw["evidence"]).groupindex
    for limit in raw.get("limits", []):
        for name in (n.strip() for n in limit["value"].split("-")):
            if name not in groups:
                raise HarnessError(
                    f"limit on '{limit['value']}' names '{name}', which the evidence pattern does not capture "
                    f"(add a named group (?P<{name}>\\d+))"
                )


def load(path: Path) -> list[KnownFailure]:
    """The entries of a known-failures file ([] when there is none); errors name the file and entry."""
    if not path.is_file():
        return []
    try:
        data = yamltext.load(path.read_text()) or []
    except yaml.YAMLError as err:
        raise HarnessError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, list):
        raise HarnessError(f"{path}: must be a list of entries")
    from harness.suites import CHECK_NAMES, suite_files

    suites = {p.stem for p in suite_files(path.parent)}
    entries = []
    for i, raw in enumerate(data):
        try:
            if isinstance(raw, dict) and "suite" in raw and "suites" not in raw:
                raise HarnessError(
                    "'suite' is now 'suites': the list of suites the defect has been seen in "
                    f"(write suites: [{raw['suite']}])"
                )
            jsonschemas.validate(raw, _ENTRY)
            if re.search(raw["evidence"], "") is not None:
                raise HarnessError(
                    f"evidence pattern {raw['evidence']!r} matches an empty string, so it would "
                    "explain any failure; make it name the defect's message"
                )
            _check_limits(raw)
            for item in raw["versions"]:
                parse_item(item)
            narrowing([raw["backend"]], list(raw.get("modes", [])), list(raw.get("specs", [])))
        except (jsonschema.ValidationError, re.error, HarnessError, ValueError) as err:
            raise HarnessError(f"{path}: entry {i}: {str(err).splitlines()[0]}") from None
        raw["check"] = [raw["check"]] if isinstance(raw["check"], str) else raw["check"]
        for value, known, what in (
            *((s, suites, "suite") for s in raw["suites"]),
            *((c, CHECK_NAMES, "check") for c in raw["check"]),
        ):
            if value not in known:
                raise HarnessError(f"{path}: entry {i}: unknown {what} '{value}' (known: {', '.join(sorted(known))})")
        raw["limits"] = [Limit(**limit) for limit in raw.get("limits", [])]
        entries.append(KnownFailure(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}))
    for i, entry in enumerate(entries):  # once all are read: each entry is made once, its cells after
        _check_strict_cell(entry, path, i)
    return entries


def _check_strict_cell(entry: KnownFailure, path: Path, i: int) -> None:
    """An entry must have a cell in its home suite's default matrix: its strict expected failure runs there, and
    without one it could never show as fixed while it still excuses failures elsewhere. (A CPU-gated entry's cells
    are judged on a CPU with its flags only: checked as if this one had them.)"""
    from harness.suites import load_suite

    suite = load_suite(entry.suite, path.parent)
    if not any(suite.name in entry.suites and entry.configured_in(cell) for cell in cells(suite.matrix, {})):
        raise HarnessError(
            f"{path}: entry {i} ({entry.id}): no cell of its home suite {entry.suite}'s default matrix has its "
            f"backend, modes, specs and models, so its strict expected failure never runs; add such a cell to the "
            "suite or remove the entry"
        )


def matching(
    entries: list[KnownFailure], suite: str, cell: Cell, result: CheckResult, overrides: dict | None = None
) -> KnownFailure | None:
    """The entry that explains a failed verdict of `suite` in `cell` (served under the run's `--spec-*`
    `overrides`), if any: one that lists the suite first, else one recognised in it (a known defect seen in a new
    suite)."""
    return next((e for e in entries if e.covers(suite, cell, overrides) and e.explains(result)), None) or next(
        (e for e in entries if e.recognises(suite, cell, overrides) and e.explains(result)), None
    )


_NOT_SENT = re.compile(r" \(so \S+ was not sent\)$")
"""The tail of a chat turn's error when an earlier turn's error kept it from being sent."""

NEW_SUITE = "known_failure_new_suite"
"""Evidence key of a verdict a known defect explains in a suite its entry does not list yet."""


def tag(
    entries: list[KnownFailure], suite: str, cell: Cell, results: list[CheckResult], overrides: dict | None = None
) -> list[CheckResult]:
    """Mark the failed verdicts a known defect explains (`evidence["known_failure"]`, and `NEW_SUITE` with the
    suite where the entry does not list it: a known defect seen in a new suite, which does not fail the run);
    returns the others. `overrides`: the run's `--spec-*` options, which decide what each cell was served as."""
    unexplained = []
    for r in results:
        if r.passed:
            continue
        entry = matching(entries, suite, cell, r, overrides)
        if entry is None:
            unexplained.append(r)
            partial = [(e, *e.explained(r)) for e in entries if e.recognises(suite, cell, overrides)]
            for e, hits, total in partial:
                if hits:
                    r.evidence["known_failure_partial"] = f"{e.id} explains {hits} of {total} failing requests"
                    r.message += (
                        f"\n  ({e.id} explains {hits} of {total} failing requests; the other "
                        f"{total - hits} stay failures)"
                    )
        else:
            r.evidence["known_failure"] = entry.id
            why = entry.shortfall(r) if entry.explained(r)[0] < entry.explained(r)[1] else None
            if why:
                r.evidence["known_failure_shortfall"] = why
                r.message += f"\n  ({why})"
            if suite not in entry.suites:
                r.evidence[NEW_SUITE] = suite
                r.message += (
                    f"\n  (known defect {entry.id}, seen in a new suite: {suite}; the entry lists "
                    f"{', '.join(entry.suites)}. It does not fail the run: add {suite} to the entry's suites in "
                    f"suites/{FILE_NAME})"
                )
    return unexplained
