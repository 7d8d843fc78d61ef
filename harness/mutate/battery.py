"""The staged battery a mutant build meets: `specharness run` of one suite at a time on llama-server, in order,
stopping at the first suite that fails.

Stage 1 is the default job's llama-server cells (`quicksort`); survivors go on to stage 2, every other suite with
llama-server cells. Each suite runs as a user runs it, in a process of its own (`specharness run --suite S --backend
server --server-bin B`), so a mutant that crashes, hangs or corrupts the harness's view meets exactly what a
maintainer's run would show. The in-process engine's cells are not served: the engine is llama.cpp's speculative
loop ported to Python over the wheel's libllama, which a mutant of common/ or tools/server/ does not change.

A suite kills a mutant when its run fails (exit 1) on a verdict a clean build passes; the kill names the first
failure's signature, its check and its cell, and is confirmed by serving that one cell again (a failure that does
not show twice is recorded as unconfirmed and the mutant goes on). A run that takes RUN_TIMEOUT_FACTOR times the
clean build's time (and at least RUN_TIMEOUT_MIN_S) is stopped: a hang, killed by timeout as in every mutation tool.
A harness error (exit 3) is the campaign's fault, not the mutant's: recorded as `error`, never a kill.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.matrix import Cell, cells
from harness.report.files import status
from harness.signatures import group
from harness.suites import load_suite, suite_files
from harness.suites.schema import DEFAULT_MATRIX

STAGE1 = ("quicksort",)
"""The default job's suite (`specharness run` with no --suite)."""
RUN_TIMEOUT_FACTOR = 4
RUN_TIMEOUT_MIN_S = 300
STOP_GRACE_S = 30
"""Seconds a stopped run gets to stop its llama-servers (SIGTERM) before it is killed."""
EXIT_PASS, EXIT_FAIL, EXIT_ERROR = 0, 1, 3


def server_suites() -> list[str]:
    """Every installed suite with llama-server cells, by name (stage 2 is those after STAGE1)."""
    names = []
    for path in suite_files():
        suite = load_suite(str(path))
        if any("server" in block.get("backends", DEFAULT_MATRIX["backends"]) for block in suite.matrix):
            names.append(suite.name)
    return names


@functools.cache
def server_cells(suite: str) -> tuple[Cell, ...]:
    """The llama-server cells of the installed suite named `suite`, as `specharness run --backend server` plans
    them (read once per process: a campaign asks for every suite's at every reached mutant)."""
    path = next((p for p in suite_files() if load_suite(str(p)).name == suite), None)
    if path is None:
        raise HarnessError(f"no installed suite named {suite}")
    return tuple(c for c in cells(load_suite(str(path)).matrix) if c.backend == "server")


@dataclass
class SuiteRun:
    """One `specharness run` of one suite on one build."""

    suite: str
    exit: int
    seconds: float
    out: Path
    kill: dict | None = None
    """The first failure of a failed run: signature, check, cell, case (None when the run passed)."""
    error: str = ""

    def to_json(self) -> dict:
        return {"suite": self.suite, "exit": self.exit, "seconds": self.seconds, "kill": self.kill, "error": self.error}


def run_suite(
    suite: str,
    server_bin: Path,
    out: Path,
    timeout_s: float | None,
    cell: dict | None = None,
    env: dict | None = None,
    cell_ids: list[str] | None = None,
) -> SuiteRun:
    """`specharness run --suite SUITE --backend server --server-bin SERVER_BIN --out OUT` (only `cell`'s mode, spec
    and model when given, only the cells `cell_ids` names when given; `env` added to the environment), stopped after
    `timeout_s`; its outcome read from what it wrote."""
    cmd = [sys.executable, "-m", "harness.cli", "run", "--suite", suite, "--backend", "server"]
    if cell:
        cmd += ["--mode", cell["mode"], "--spec", cell["spec"], "--model", cell["model"]]
    for cell_id in cell_ids or ():
        cmd += ["--cell", cell_id]
    cmd += ["--server-bin", str(server_bin), "--out", str(out), "--no-auto-calibrate"]
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    code, tail = _child(cmd, out.with_suffix(".log"), timeout_s, env)
    run = SuiteRun(suite, code, round(time.monotonic() - started, 1), out)
    if code == EXIT_FAIL:
        run.kill = first_failure(out)
        if run.kill is None:
            run.exit, run.error = EXIT_ERROR, f"the run exited 1 but {out} names no failed verdict: {tail}"
    elif code == "timeout":
        run.kill = {"check": "timeout", "signature": f"the run did not end within {timeout_s:.0f} s", "cell": None}
    elif code != EXIT_PASS:
        run.error = f"exit {code}: {tail}"
    return run


def _child(cmd: list[str], log_path: Path, timeout_s: float | None, extra: dict | None = None) -> tuple[int | str, str]:
    """Run `cmd` with its output in `log_path`; (exit status or "timeout", its last line). Ctrl-C or SIGTERM here
    stops it as a user would (SIGTERM, then SIGKILL after STOP_GRACE_S): its llama-servers stop with it."""
    env = {**os.environ, **(extra or {})}
    env.pop("SPECHARNESS_HOLD_PHASE", None)  # a test's hold is for this process, not for each suite's run
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            code = "timeout"
        except BaseException:
            _stop(proc)
            raise
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return code, (lines[-1].strip() if lines else "no output")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def first_failure(out: Path) -> dict | None:
    """The first distinct failure of a stored run (harness.signatures' grouping, the report's notion of failed):
    its signature, check, cell and case, and how many verdicts failed in all."""
    try:
        checks = json.loads((out / "checks.json").read_text())
        records = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return None
    failures = group(checks, records, lambda v: status(v) == "failed")
    if not failures:
        return None
    first = failures[0]
    verdict = first.verdicts[0] if first.verdicts else first.consequences[0]
    cell = {key: verdict[key] for key in ("backend", "mode", "spec", "model")}
    return {
        "signature": first.signature,
        "check": verdict["check"],
        "cell": cell,
        "case": verdict["case"],
        "message": (verdict.get("message") or "").splitlines()[0][:300] if verdict.get("message") else "",
        "failed_verdicts": sum(1 for v in checks if status(v) == "failed"),
        "signatures": len(failures),
    }


def timeout_for(clean_seconds: float) -> float:
    return max(RUN_TIMEOUT_MIN_S, RUN_TIMEOUT_FACTOR * clean_seconds)


def require_clean_pass(run: SuiteRun) -> None:
    """The unmutated build must pass a suite before a mutant's failure of it can mean anything."""
    if run.exit == EXIT_PASS:
        return
    what = run.kill["signature"] if run.kill else run.error
    raise HarnessError(
        f"the unmutated llama-server fails suite {run.suite} ({what}; run: {run.out}): a mutation score needs a "
        "build that passes its battery; fix that first or leave the suite out with --stage2"
    )
