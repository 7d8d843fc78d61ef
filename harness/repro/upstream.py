"""`specharness repro --upstream ID`: a report of a known llama.cpp defect ready to post upstream.

For the llama-server entry ID of suites/known-failures.yaml it serves the entry's cells in its home suite on the
build under test (`specharness run`, narrowed to the entry's models, modes and specs), takes the first failure the
entry explains, writes that case's bundle (repro.sh: the llama-server command line and the `/completion` bodies
sent with curl, nothing of specharness), runs repro.sh once against the same build, and writes UPSTREAM.md beside
them: what happens and why (the entry's `reason`, with its file:line), where it was measured (`versions`,
`found`), what this build printed, the standalone reproducer and the proposed patch, where one is kept as
docs/upstream-reports/patches/<ID>.diff. The statistical job's entries (suites/statistical/known-failures.yaml) are
served from there. Two kinds are refused with one line: the in-process engine's entries, which have no standalone
reproducer (their bundle's repro.py runs specharness), and entries that only specharness can judge (STANDALONE_CHECKS:
a distribution, an acceptance rate, counted work), which name their hand-written report in docs/upstream-reports/
where there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness.errors import HarnessError
from harness.verdict.known_failures import FILE_NAME, KnownFailure, load

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (docs/upstream-reports/patches is read from it)."""
REPRO_TIMEOUT_S = 900
"""The most one run of the bundle's repro.sh may take."""


def patches_dir() -> Path:
    """Where proposed patches of known defects are kept, one `<id>.diff` each."""
    return ROOT / "docs" / "upstream-reports" / "patches"


STANDALONE_CHECKS = ("no-crash", "lossless", "mode-invariant", "repeat-identical", "kv-healthy", "restore-identical")
"""The checks whose failures a bundle's repro.sh decides by itself (harness.repro.legs.judge_of: a crash, an error,
outputs that differ, an unhealthy KV cache, a restore that changes the counts). The others (`distribution`,
`acceptance`, `work`, `probs-complete`, ...) only specharness judges."""
HAND_WRITTEN = ROOT / "docs" / "upstream-reports"
"""Where a hand-written report (`<ID>.md`) is kept for a defect no repro.sh can decide."""


def entry_of(known_id: str, suites: Path) -> tuple[KnownFailure, Path]:
    """The known failure `known_id` and the suites directory whose known-failures file holds it (suites/, or the
    statistical job's suites/statistical/); HarnessError naming the ids when there is none, when it is not a
    llama-server defect, or when no repro.sh can decide it (naming its hand-written report where there is one)."""
    homes = [d for d in (suites, suites / "statistical") if (d / FILE_NAME).is_file()]
    found = {e.id: (e, d) for d in reversed(homes) for e in load(d / FILE_NAME)}
    if known_id not in found:
        files = " or ".join(str(d / FILE_NAME) for d in homes)
        raise HarnessError(f"no known failure {known_id} in {files} (known: {', '.join(sorted(found))})")
    entry, home = found[known_id]
    if entry.backend != "server":
        raise HarnessError(
            f"{known_id} is a defect of the in-process engine's cells: its reproducer needs specharness "
            "(repro.py), so there is no standalone upstream report; use `specharness repro` on a run of it"
        )
    if not any(check in STANDALONE_CHECKS for check in entry.check):
        hand = HAND_WRITTEN / f"{known_id}.md"
        where = (
            f"its hand-written report with a standalone reproducer is {hand.relative_to(ROOT)}"
            if hand.is_file()
            else f"write one by hand in {HAND_WRITTEN.relative_to(ROOT)}/"
        )
        raise HarnessError(
            f"{known_id} fails `{', '.join(entry.check)}`, which only specharness can judge, so no repro.sh decides "
            f"it and there is no generated upstream report; {where}"
        )
    return entry, home


def run_argv(entry: KnownFailure, out: Path, build: list[str], home: Path | None = None) -> list[str]:
    """`specharness run` of the entry's cells in its home suite (`build`: --server-bin / --source options; `home`:
    the suites directory that holds it when it is not the installed one, e.g. suites/statistical)."""
    argv = [sys.executable, "-m", "harness.cli", "run", "--suite", entry.suite, "--backend", "server"]
    if home is not None:
        argv += ["--suites-dir", str(home)]
    for flag, values in (("--model", entry.models), ("--mode", entry.modes), ("--spec", entry.specs)):
        if values:
            argv += [flag, ",".join(values)]
    return [*argv, *build, "--out", str(out)]


def explained(run_dir: Path, entry: KnownFailure) -> dict | None:
    """The first failed verdict of the run that the entry explains (the run says so in its evidence, or, outside the
    entry's versions, every failing line matches its evidence), else None."""
    try:
        checks = json.loads((run_dir / "checks.json").read_text())
    except (OSError, ValueError):
        return None
    for row in checks:
        if row.get("passed") is not False or row.get("check") not in entry.check:
            continue
        lines = row.get("failures") or [row.get("message", "")]
        if row.get("evidence", {}).get("known_failure") == entry.id or all(entry.matches(x) for x in lines):
            return row
    return None


def failure_id(row: dict) -> str:
    """The failure ID the console prints for a verdict row."""
    return f"{row['suite']}[{row['case']}-{row['mode']}-{row['spec']}-{row['model']}-{row['backend']}]"


def run_repro(bundle: Path, server_bin: str | None) -> tuple[int, str]:
    """repro.sh run once (against `server_bin` when given): (exit status, its last lines)."""
    env = dict(os.environ, REPRO_RUNS="1", **({"LLAMA_SERVER": server_bin} if server_bin else {}))
    try:
        proc = subprocess.run(
            ["bash", str(bundle / "repro.sh")],
            cwd=bundle,
            env=env,
            capture_output=True,
            text=True,
            timeout=REPRO_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return 124, f"repro.sh did not finish within {REPRO_TIMEOUT_S} s"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return proc.returncode, "\n".join(lines[-12:])


def report(entry: KnownFailure, row: dict, version: str, repro: tuple[int, str], bundle: Path) -> str:
    """UPSTREAM.md: the defect, its cause, where it was measured, the standalone reproducer, and the patch."""
    issue = (bundle / "ISSUE.md").read_text() if (bundle / "ISSUE.md").is_file() else ""
    command = _section(issue, "## Command")
    patch = patches_dir() / f"{entry.id}.diff"
    status, printed = repro
    lines = [
        f"# {entry.id}: {_first_sentence(entry.reason)}",
        "",
        f"Known llama.cpp defect `{entry.id}` of specharness (suites/known-failures.yaml), measured in "
        f"{', '.join(entry.versions) or 'every version'}; this report was written on llama-server {version}.",
        "",
        "## Upstream",
        "",
        entry.upstream,
        "",
        "## What happens, and why",
        "",
        entry.reason,
        "",
        "## Measured",
        "",
        f"- found: {entry.found}",
        *[f"- measured: `{m}`" for m in entry.measured],
        f"- this build ({version}): `{failure_id(row)}` {row['check']}: "
        + "; ".join(f"`{x}`" for x in (row.get("failures") or [row.get("message", "").splitlines()[0]])),
        "",
        "## Reproducer (llama-server and curl, no specharness)",
        "",
        "The bundle beside this file: `repro.sh` starts the command below on a free port, sends the `/completion`"
        " bodies of `requests/` (prompts as token ids) as they were sent, and compares what came back. "
        "`LLAMA_SERVER=... MODEL=... bash repro.sh`; it exits 1 when the failure reproduces, 0 when not. "
        "The model is specharness's generated one (ISSUE.md says how to make it, byte-identical).",
        "",
        command.strip() or "(see ISSUE.md)",
        "",
        f"What `repro.sh` printed against this build (exit {status}):",
        "",
        "```",
        printed,
        "```",
        "",
        "## Proposed patch",
        "",
    ]
    if patch.is_file():
        lines += ["```diff", patch.read_text().rstrip(), "```"]
    else:
        lines.append(f"None kept yet (docs/upstream-reports/patches/{entry.id}.diff would be shown here).")
    return "\n".join(lines) + "\n"


def _section(text: str, heading: str) -> str:
    """The body of a `## heading` section of a markdown text ('' when absent)."""
    if heading not in text:
        return ""
    body = text.split(heading, 1)[1]
    return body.split("\n## ", 1)[0]


def _first_sentence(text: str) -> str:
    return " ".join(text.split()).split(". ")[0].rstrip(".")


def write_upstream(args: argparse.Namespace, shrink) -> int:
    """`specharness repro --upstream ID`: serve, bundle, run the reproducer, write UPSTREAM.md (exit 0), or 1 when
    the entry's defect did not show on this build (nothing written but the run)."""
    from harness.execute.run_options import new_run_dir, prepare_out
    from harness.paths import reports_dir
    from harness.suites import suites_dir

    suites = suites_dir()
    entry, home = entry_of(args.upstream, suites)
    out = prepare_out(Path(args.out) if args.out else new_run_dir(reports_dir()))
    build = (["--server-bin", str(args.server_bin)] if args.server_bin else []) + (
        ["--source", str(args.source)] if args.source else []
    )
    run_dir = out / "run"
    print(f"repro --upstream: serving {entry.id}'s cells of suite {entry.suite} into {run_dir}", file=sys.stderr)
    subprocess.run(run_argv(entry, run_dir, build, None if home == suites else home), cwd=ROOT, timeout=3600)
    row = explained(run_dir, entry)
    if row is None:
        print(f"repro --upstream: {entry.id} did not show on this build (run: {run_dir})", file=sys.stderr)
        return 1
    bundle_args = argparse.Namespace(**{**vars(args), "failure": failure_id(row), "from_run": run_dir})
    bundle_args.case = None
    bundle_args.check = row["check"]
    for axis in ("mode", "spec", "model", "backend"):
        setattr(bundle_args, axis, None)
    bundle_args.out = str(out / "bundle")
    status = shrink(bundle_args, shrink=False)
    if status != 0:
        return status
    run = json.loads((run_dir / "run.json").read_text())
    server = run.get("backends", {}).get("server", {})
    version = str(server.get("llama_cpp_version") or server.get("version") or "under test")
    repro = run_repro(out / "bundle", str(args.server_bin) if args.server_bin else None)
    path = out / "bundle" / "UPSTREAM.md"
    path.write_text(report(entry, row, version, repro, out / "bundle"))
    print(f"UPSTREAM.md: {path}")
    return 0
