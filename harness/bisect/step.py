"""One bisect step: build llama-server from the tree as it is now, judge the pinned case, log it.

`git bisect run` calls `python -m harness.bisect.step RUN_DIR` in the checkout at every commit; the exit
status tells git the verdict: 0 good, 1 bad, 125 skip (the commit does not build, tried twice, or the step
cannot say whether the pinned failure is there: harness.verdict.outcome), 128 abort (a harness error such as a
missing model: no later step could do better). Every step appends one JSON line to `RUN_DIR/bisect-log.jsonl`:
commit, subject, author date, role, build seconds (and whether the build came from the cache), verdict, reason and
every check verdict with its evidence (the triaged first divergence included).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from harness import interrupt
from harness.backends.build import BuildInfo, ensure_server, prebuilt_server
from harness.bisect.git import Git
from harness.bisect.judge import BAD, GOOD, SKIP, judge
from harness.bisect.plan import Plan
from harness.errors import HarnessError
from harness.paths import append_jsonl, read_jsonl

LOG_FILE = "bisect-log.jsonl"
CURRENT = "current-step.json"
"""Present while a step runs: its commit, phase (build or judge) and process id."""
EXIT = {GOOD: 0, BAD: 1, SKIP: 125}
EXIT_ABORT = 128
BUILD_ATTEMPTS = 2


def read_log(run_dir: Path) -> list[dict]:
    """Every logged step, oldest first (a line cut short by a kill is ignored)."""
    return read_jsonl(Path(run_dir) / LOG_FILE)


def append_log(run_dir: Path, entry: dict) -> None:
    append_jsonl(Path(run_dir) / LOG_FILE, entry)


def _custom_build(plan: Plan, source: Path, log_path: Path) -> BuildInfo:
    """Run `--step-cmd` in the tree and take the newest binary matching `--server-bin-pattern`."""
    import subprocess

    with open(log_path, "a") as log:
        log.write(f"$ {plan.step_cmd}\n")
        log.flush()
        status = subprocess.run(
            plan.step_cmd, shell=True, cwd=source, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ).returncode
    if status != 0:
        raise HarnessError(f"--step-cmd exited with status {status} (log: {log_path})")
    found = [Path(p) for p in glob.glob(os.path.join(str(source), plan.server_bin_pattern)) if Path(p).is_file()]
    if not found:
        raise HarnessError(
            f"--step-cmd made no file matching --server-bin-pattern {plan.server_bin_pattern} in {source}"
        )
    return prebuilt_server(max(found, key=lambda p: p.stat().st_mtime))


def build_at(plan: Plan, source: Path, run_dir: Path, label: str) -> tuple[BuildInfo | None, dict]:
    """llama-server for the tree in `source`, trying a failed build once more; (None, facts) if it never builds."""
    facts: dict[str, Any] = {"build_seconds": 0.0, "build_cached": False}
    error = ""
    for attempt in range(1, BUILD_ATTEMPTS + 1):
        facts["build_attempts"] = attempt
        started = time.monotonic()
        try:
            if plan.step_cmd:
                info = _custom_build(plan, source, run_dir / f"step-cmd-{label}.log")
            else:
                info = ensure_server(source, plan.build_backend, plan.cmake_args, plan.jobs)
        except HarnessError as err:
            error = str(err)
            facts["build_seconds"] = round(facts["build_seconds"] + time.monotonic() - started, 1)
            continue
        facts["build_seconds"] = round(facts["build_seconds"] + time.monotonic() - started, 1)
        facts["build_cached"] = info.cached and not plan.step_cmd
        return info, facts
    facts["build_error"] = error
    return None, facts


def _phase(run_dir: Path, entry: dict, phase: str) -> None:
    (run_dir / CURRENT).write_text(
        json.dumps(
            {
                "commit": entry.get("commit"),
                "version": entry.get("version"),
                "role": entry.get("role"),
                "phase": phase,
                "pid": os.getpid(),
            }
        )
        + "\n"
    )


def evaluate(plan: Plan, source: Path, run_dir: Path, facts: dict) -> dict:
    """Build and judge the tree in `source`; append the step to the log and return it.

    `facts` describe the tree (commit, subject, date, role, ...) and start the log entry."""
    interrupt.phase(f"bisect-{facts.get('role', 'step')}")
    started = time.monotonic()
    entry = dict(facts, started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    label = str(entry.get("commit") or entry.get("version") or "tree")[:12]
    try:
        _phase(run_dir, entry, "build")
        info, build_facts = build_at(plan, source, run_dir, label)
        entry.update(build_facts)
        if info is None:
            lines = build_facts["build_error"].splitlines()
            first = next((line.strip() for line in lines[1:] if re.search(r"\berror\b", line)), lines[0])
            entry.update(verdict=SKIP, reason=f"does not build ({BUILD_ATTEMPTS} attempts): {first}", checks=[])
        else:
            entry["server"] = {"server_bin": str(info.server_bin), "source_identity": info.source_identity}
            _phase(run_dir, entry, "judge")
            entry.update(judge(plan, info, run_dir / "server-logs" / label))
            if entry.get("role") == "verify-bad" and entry["verdict"] == BAD and not plan.signatures:
                plan.signatures = entry["signatures"]  # the failure every later step must show to be bad
                plan.save(run_dir)
        entry["seconds"] = round(time.monotonic() - started, 1)
        with interrupt.deferred():  # a judged step is logged whole (what --resume goes on from)
            append_log(run_dir, entry)
    finally:
        (run_dir / CURRENT).unlink(missing_ok=True)
    interrupt.check()
    return entry


def summary(entry: dict) -> str:
    """One line for the terminal: commit, verdict, build time, reason."""
    what = entry.get("version") or str(entry.get("commit", "?"))[:10]
    build = "cached build" if entry.get("build_cached") else f"build {entry.get('build_seconds', 0):.0f} s"
    return f"bisect: {what} {entry['verdict']:<4} ({entry.get('role', 'step')}, {build}) {entry['reason']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.bisect.step", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--role", default="step", help="what the step is for (step, verify-good, verify-bad, parent)")
    args = parser.parse_args(argv)
    run_dir = args.run_dir.resolve()
    facts: dict[str, Any] = {"role": args.role}
    try:
        with interrupt.handled():  # the driver's SIGTERM stops builds and servers on the way out, like Ctrl-C
            plan = Plan.load(run_dir)
            facts.update(Git(Path(plan.source)).commit("HEAD").to_json())
            entry = evaluate(plan, Path(plan.source), run_dir, facts)
    except KeyboardInterrupt:
        print("bisect: step interrupted", file=sys.stderr)
        return interrupt.status()
    except HarnessError as err:
        entry = dict(facts, verdict="error", reason=str(err))
    except Exception as err:  # a harness bug: stop the bisect, keep the traceback in the log
        entry = dict(
            facts,
            verdict="error",
            reason=f"harness error: {type(err).__name__}: {err}",
            traceback=traceback.format_exc(),
        )
    if entry["verdict"] == "error":
        append_log(run_dir, entry)
        (run_dir / CURRENT).unlink(missing_ok=True)
        print(f"bisect: error at {str(facts.get('commit', '?'))[:10]}: {entry['reason']}", file=sys.stderr)
        return EXIT_ABORT
    print(summary(entry), file=sys.stderr)
    return EXIT[entry["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
