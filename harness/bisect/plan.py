"""The pinned cell a bisect judges: suite, case, checks, backend, mode, spec config and model.

Every dimension is fixed before the first build (a bisect that measures another cell than the failing
one finds nothing, or the wrong commit): given explicitly (`--suite S --case C --mode M ...`, a suite
axis with one value needs no flag) or read from a failing case of a run directory (`--from-run`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import HarnessError
from harness.execute import case_keys
from harness.matrix import Cell, narrowing, spec_preset
from harness.signatures import signature_of
from harness.suites import CHECK_NAMES, Suite, load_suite
from harness.verdict.baselines import default_root

BACKEND = "server"
"""A bisect rebuilds llama-server at every step, so the judged cell is always a llama-server cell."""
PLAN_FILE = "plan.json"


@dataclass
class Plan:
    """What every step of one bisect does; saved as `plan.json` in the run directory."""

    suite: str
    """Path of the suite file."""
    case: str
    """Record name of the case (`C`, or `iterative.turn2` for a chat turn)."""
    checks: list[str]
    mode: str
    spec: str
    model: str
    strict: bool = False
    """Count a divergence that triage proves a near-tie as bad too."""
    baselines: str = ""
    """Root of the baselines the `baseline` check reads (fixed when the plan is made)."""
    source: str = ""
    """The llama.cpp checkout (empty for `--releases`)."""
    good: str = ""
    bad: str = ""
    original_head: str = ""
    """The branch (refs/heads/...) or commit the checkout was on before the bisect."""
    step_cmd: str | None = None
    server_bin_pattern: str | None = None
    build_backend: str = "cpu"
    """What llama-server is compiled for (`specharness build --backend`)."""
    cmake_args: list[str] = field(default_factory=list)
    jobs: int | None = None
    releases: list[str] = field(default_factory=list)
    """`--releases`: the llama-cpp-python versions bisected, oldest first."""
    tags: list[str] = field(default_factory=list)
    """`--tags`: the upstream tags bisected, oldest first."""
    fixed: bool = False
    """`--fixed`: look for the change that made the case pass (the older end fails, the newer passes)."""
    signatures: list[str] = field(default_factory=list)
    """The pinned failure's signatures (harness.signatures): a step fails only with one of them, another failure
    is a skip. From the run the plan was read from (`--from-run`), else from the failing end's first judgement."""

    @property
    def cell(self) -> Cell:
        return Cell(BACKEND, self.mode, self.spec, self.model)

    def describe(self) -> str:
        """`quicksort[C-seq-draft-simple-tiny-hybrid-server] checks lossless,kv-healthy` (pytest item style)."""
        return f"{Path(self.suite).stem}[{self.case}-{self.cell.id}] checks {','.join(self.checks)}"

    def load_suite(self) -> Suite:
        return load_suite(self.suite)

    def save(self, run_dir: Path) -> None:
        (run_dir / PLAN_FILE).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> Plan:
        path = Path(run_dir) / PLAN_FILE
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise HarnessError(f"{run_dir} is not a bisect run directory (no {PLAN_FILE})") from None
        except (OSError, ValueError, TypeError) as err:
            raise HarnessError(f"unreadable {path}: {' '.join(str(err).split())}") from None


def _pick(given: str | None, axis: list[str], flag: str, suite: str) -> str:
    """The value of one cell dimension: the given one, or the suite's only one."""
    if given is not None:
        return given
    if len(axis) == 1:
        return axis[0]
    raise HarnessError(f"suite {suite} runs several values of {flag[2:]} ({', '.join(axis)}): pin one with {flag}")


def _case_key(suite: Suite, case: str | None) -> str:
    keys = [key for c in suite.cases for key in case_keys(c)]
    if case is None and len(keys) == 1:
        return keys[0]
    if case is None:
        raise HarnessError(f"suite {suite.name} has several cases ({', '.join(keys)}): pin one with --case")
    if case not in keys:
        raise HarnessError(f"suite {suite.name} has no case '{case}' (cases: {', '.join(keys)})")
    return case


def _check_names(checks: list[str] | None, suite: Suite) -> list[str]:
    names = checks or suite.checks
    unknown = [n for n in names if n not in CHECK_NAMES]
    if unknown:
        raise HarnessError(f"unknown check '{unknown[0]}' (known: {', '.join(CHECK_NAMES)})")
    return list(names)


def _validated(plan: Plan) -> Plan:
    narrowing(modes=[plan.mode], specs=[plan.spec])
    if not spec_preset(plan.spec).runs_on("server"):
        raise HarnessError(
            f"spec config '{plan.spec}' exists only in the in-process engine; a bisect judges llama-server"
        )
    from harness.models import resolve

    resolve(plan.model)  # a missing model is bad input before anything is built
    return plan


def from_suite(
    suite_name: str,
    case: str | None = None,
    checks: list[str] | None = None,
    mode: str | None = None,
    spec: str | None = None,
    model: str | None = None,
    strict: bool = False,
) -> Plan:
    """The plan for one case of a suite; each dimension the suite leaves open must be given."""
    suite = load_suite(suite_name)

    def axis(name: str) -> list[str]:  # the values the suite's matrix blocks name, in order
        return list(dict.fromkeys(v for block in suite.matrix for v in block[name]))

    specs = [s for s in axis("specs") if spec_preset(s).runs_on("server")]
    return _validated(
        Plan(
            suite=str(Path(suite.path).resolve()),
            case=_case_key(suite, case),
            checks=_check_names(checks, suite),
            mode=_pick(mode, axis("modes"), "--mode", suite.name),
            spec=_pick(spec, specs or axis("specs"), "--spec", suite.name),
            model=_pick(model, axis("models"), "--model", suite.name),
            strict=strict,
            baselines=str(default_root().resolve()),
        )
    )


def failing_records(
    run_dir: Path, case: str | None, checks: list[str] | None = None, what: str = "bisect", **cell: str | None
) -> list[dict]:
    """The failing verdicts of `case` in a run directory's `checks.json` (of the given checks, in the cells
    matching the given `mode`, `spec`, `model`, `backend`); a one-line error when there are none."""
    path = Path(run_dir) / "checks.json"
    if case is None:
        raise HarnessError(f"--from-run needs --case ID (the failing case to {what})")
    try:
        records = json.loads(path.read_text())
    except FileNotFoundError:
        raise HarnessError(f"{run_dir} is not a run directory (no checks.json)") from None
    except (OSError, ValueError) as err:
        raise HarnessError(f"unreadable {path}: {' '.join(str(err).split())}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise HarnessError(f"{path} is not a list of check records")
    wanted = {"case": case, **cell}
    mine = [r for r in records if all(v is None or r.get(k) == v for k, v in wanted.items())]
    failing = [r for r in mine if r.get("passed") is False and (not checks or r.get("check") in checks)]
    if not mine:
        known = sorted({str(r.get("case")) for r in records})
        raise HarnessError(f"{run_dir} has no case '{case}' in the given cell (cases: {', '.join(known) or 'none'})")
    if not failing:
        raise HarnessError(f"case '{case}' did not fail in {run_dir}: nothing to {what}")
    return failing


def from_run(
    run_dir: Path,
    case: str | None,
    checks: list[str] | None = None,
    mode: str | None = None,
    spec: str | None = None,
    model: str | None = None,
    strict: bool = False,
) -> Plan:
    """The plan for a failing case of a run directory (its `checks.json`), narrowed by the given dimensions."""
    failing = failing_records(run_dir, case, checks, mode=mode, spec=spec, model=model)
    on_server = [r for r in failing if r.get("backend") == BACKEND]
    if not on_server:
        raise HarnessError(
            f"case '{case}' failed only on the {failing[0].get('backend')} backend; a bisect rebuilds "
            "llama-server, so it needs a failure of the server backend"
        )
    cells = sorted({(r["mode"], r["spec"], r["model"]) for r in on_server})
    if len(cells) > 1:
        listed = "; ".join(f"--mode {m} --spec {s} --model {md}" for m, s, md in cells)
        raise HarnessError(f"case '{case}' failed in {len(cells)} cells of {run_dir}: pin one ({listed})")
    mode, spec, model = cells[0]
    suite = load_suite(on_server[0]["suite"])
    names = sorted({r["check"] for r in on_server})
    requests = _requests(run_dir, case, on_server[0])
    return _validated(
        Plan(
            suite=str(Path(suite.path).resolve()),
            case=_case_key(suite, case),
            checks=_check_names(names, suite),
            mode=mode,
            spec=spec,
            model=model,
            strict=strict,
            baselines=str(default_root().resolve()),
            signatures=sorted({signature_of(r, requests) for r in on_server}),
        )
    )


def _requests(run_dir: Path, case: str, record: dict) -> list[dict]:
    """The results.json records of a failing verdict's case and cell ([] when unreadable): their errors name a
    crash's signature."""
    try:
        rows = json.loads((Path(run_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return []
    keys = ("suite", "model", "backend", "mode", "spec")
    return [
        r
        for r in rows
        if isinstance(r, dict) and r.get("case") == case and all(r.get(k) == record.get(k) for k in keys)
    ]
