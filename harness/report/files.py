"""A run directory's files, written at the end of a run and read back by every report.

- `results.json` / `results.parquet`: one record per request (`results.json` is written last: its
  presence means the directory is complete, and it is never overwritten);
- `checks.json`: one record per check verdict, with its evidence;
- `logits.parquet`: top-k logits per generated position, cases named `<suite>/<case>/<cell>/<round>`;
- `run.json`: what ran, where and how (the report's header; what `--merge` and `diff` compare);
- `vocab.json`: the text of every token id the run's records and evidence hold, per model, so a
  report re-renders from these files alone, on a machine without the models.
"""

import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from harness import __version__
from harness.errors import HarnessError
from harness.paths import write_atomic
from harness.result.logits import PositionLogits, from_frame, load_parquet, save_parquet, to_frame
from harness.signatures import Failure, Pattern, failure_patterns, group

FORMAT = 1
"""Version of the run directory layout (`run.json` `format`)."""
STATUSES = ("harness-error", "failed", "known", "reported", "near-tie", "no-baseline", "passed", "not-run")
"""A check record's status in reports, worst first: `harness-error` and `not-run` records are no verdicts (a
harness fault kept the check from judging; the check does not apply or lacked what it judges, with the reason).
`not-run` comes last: a case whose other checks passed passed (its checks not run are listed apart)."""
REPORTED_WHY = (
    "lossless; the logits at the divergence are not proven bit-identical (llama-server gives no logit digests), and "
    "the count of such divergences is within the measured noise rate: harness/checks/seeded.py"
)
"""Why a `reported` verdict passed (harness.checks.lossless)."""


def records(runs: list) -> list[dict]:
    """One JSON-able record per request of every cell run (harness.execute.CellRun, from the caller: reports
    import no executor)."""
    out = []
    for run in runs:
        c = run.cell
        for o in run.outcomes:
            r = o.result
            out.append(
                {
                    "suite": run.suite.name,
                    "case": o.case,
                    "model": c.model,
                    "backend": c.backend,
                    "mode": c.mode,
                    "spec": c.spec,
                    "repeat": o.round,
                    "tokens": r.tokens,
                    "text": r.text,
                    "stop_reason": r.stop_reason,
                    "error": r.error,
                    "slot_id": r.slot_id,
                    "prompt_n": len(r.prompt_tokens),
                    "timings": r.timings.to_dict(),
                    "spec_stats": r.spec_stats,
                    "kv_scan": r.kv_scan,
                    "work": r.work.to_dict(),
                    "metrics": r.metrics,
                    **({"stale_checkpoint": r.stale_checkpoint} if r.stale_checkpoint else {}),
                    **({"probs_absent": r.probs_absent} if r.probs_absent else {}),
                }
            )
    return out


def check_records(checks: list) -> list[dict]:
    """(suite, case, cell, CheckResult) tuples as JSON-able records."""
    return [
        {
            "suite": s,
            "case": k,
            "model": c.model,
            "backend": c.backend,
            "mode": c.mode,
            "spec": c.spec,
            "check": r.name,
            "passed": r.passed,
            "message": r.message,
            "evidence": r.evidence,
            **({"failures": r.failures} if r.failures else {}),  # per request: signatures fold by request
            **({"not_run": r.not_run} if getattr(r, "not_run", None) is not None else {}),
            **({"harness_error": r.harness_error} if getattr(r, "harness_error", None) is not None else {}),
        }
        for s, k, c, r in checks
    ]


def frame(rows: list[dict]) -> pd.DataFrame:
    """Records as a flat DataFrame (timings and spec counters become columns)."""
    return pd.json_normalize(rows, sep=".")


def status(verdict: dict) -> str:
    """`harness-error` or `not-run` (no verdict: see STATUSES), `known` (a recorded llama.cpp defect), `failed`,
    `reported` (passed with a seeded sampled divergence reported only: `reported_only`), `near-tie` (passed by
    excusing proven near-ties), `no-baseline` (passed; the model has no baseline yet to compare with) or `passed`."""
    evidence = verdict.get("evidence") or {}
    if verdict.get("harness_error") is not None:
        return "harness-error"
    if verdict.get("not_run") is not None:
        return "not-run"
    if "known_failure" in evidence:
        return "known"
    if not verdict.get("passed"):
        return "failed"
    if evidence.get("reported_only"):
        return "reported"
    if evidence.get("near_ties"):
        return "near-tie"
    return "no-baseline" if evidence.get("no_baseline") else "passed"


def reported_only(checks: list[dict]) -> tuple[str, list[dict]]:
    """The verdicts that passed with a seeded sampled divergence reported only (status `reported`), and their
    headline: how many of the seeded sampled speculative requests compared (evidence `sampled`) diverged so
    ("" and [] when none did)."""
    shown = [v for v in checks if status(v) == "reported"]
    if not shown:
        return "", []
    evidence = [v.get("evidence") or {} for v in checks]
    sampled = sum(e.get("compared", 0) for e in evidence if e.get("sampled") or e.get("seeded_sampling"))
    diverged = sum(v["evidence"].get("compared", 0) - v["evidence"].get("matching", 0) for v in shown)
    line = f"sampled divergences reported only: {diverged} of {sampled} seeded sampled speculative requests"
    return f"{line} ({REPORTED_WHY})", shown


def distribution_line(checks: list[dict]) -> str:
    """How the `distribution` check judged the run's sampled speculative output: cases and tokens judged, how many
    failed, the lowest p-value ("" when it judged none)."""
    judged = [v for v in checks if v.get("check") == "distribution" and status(v) not in ("not-run", "harness-error")]
    if not judged:
        return ""
    evidence = [v.get("evidence") or {} for v in judged]
    failed = sum(1 for v in judged if status(v) in ("failed", "known"))
    tokens = sum(e.get("tokens", 0) for e in evidence)
    lowest = min((e["p_value"] for e in evidence if "p_value" in e), default=None)
    low = f", lowest p {lowest:.3g}" if lowest is not None else ""
    return (
        f"sampled output distribution: {len(judged)} speculative sampled cases judged over {tokens} tokens, "
        f"{failed} not draws from the target's distribution{low} (alpha {evidence[0].get('alpha', 0):g} per case)"
    )


def reported_lines(checks: list[dict]) -> list[str]:
    """The console lines of sampled speculation: the distribution check's line, `reported_only`'s headline, then
    `SAMPLED <item> [<check>] <message's first line>` per reported verdict ([] when there is neither)."""
    line = distribution_line(checks)
    headline, shown = reported_only(checks)
    first = [(str(v.get("message") or "").strip().splitlines() or [""])[0] for v in shown]
    sampled = [f"SAMPLED {item_name(v)} [{v['check']}] {m}" for v, m in zip(shown, first, strict=True)]
    return [x for x in (line, headline) if x] + sampled


def worst(statuses) -> str:
    """The worst of some statuses (`passed` for none)."""
    return min(statuses, key=STATUSES.index, default="passed")


def cell_id(row: dict) -> str:
    """`<mode>-<spec>-<model>-<backend>` of a record, a verdict or a run.json cell."""
    return f"{row['mode']}-{row['spec']}-{row['model']}-{row['backend']}"


def logits_key(row: dict) -> str:
    """The logits.parquet case name of a record: `<suite>/<case>/<cell>/<round>`."""
    return f"{row['suite']}/{row['case']}/{cell_id(row)}/{row['repeat']}"


def item_name(row: dict) -> str:
    """The pytest item name of a record's or verdict's case: `suite[case-mode-spec-model-backend]`."""
    return f"{row['suite']}[{row['case']}-{cell_id(row)}]"


def throughput(rows: list[dict]) -> dict:
    """Generated tokens, tokens/s and draft acceptance summed over some requests (None where undefined)."""
    ms = sum(r["timings"].get("predicted_ms", 0) for r in rows)
    n = sum(r["timings"].get("predicted_n", 0) for r in rows)
    drafted = sum((r.get("spec_stats") or {}).get("draft_n", 0) for r in rows)
    accepted = sum((r.get("spec_stats") or {}).get("draft_n_accepted", 0) for r in rows)
    return {
        "tokens": n,
        "tok_s": 1000.0 * n / ms if ms else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }


def speedups(records: list[dict]) -> dict[str, dict]:
    """Per speculative cell (`<suite> <cell id>`), its speed-up over the same suite, model, backend and mode
    without speculation in the same run: per request, its generation tokens/s over that of the same case
    and round in the `none` cell (paired by request), with the median and the min–max over the pairs — the
    noise band this run measured. Both cells ran on the same machine in the same run, so the ratio does not
    depend on how busy the machine was, as long as it was equally busy for both."""

    def rate(r: dict) -> float | None:
        t = r.get("timings") or {}
        return t["predicted_n"] / t["predicted_ms"] if r.get("error") is None and t.get("predicted_ms") else None

    plain = {
        (r["suite"], r["model"], r["backend"], r["mode"], r["case"], r["repeat"]): rate(r)
        for r in records
        if r["spec"] == "none"
    }
    pairs: dict[str, list[float]] = {}
    for r in records:
        base = plain.get((r["suite"], r["model"], r["backend"], r["mode"], r["case"], r["repeat"]))
        if r["spec"] != "none" and base and rate(r):
            pairs.setdefault(f"{r['suite']} {cell_id(r)}", []).append(rate(r) / base)
    return {
        cell: {
            "speedup": float(pd.Series(ratios).median()),
            "low": min(ratios),
            "high": max(ratios),
            "pairs": len(ratios),
        }
        for cell, ratios in pairs.items()
    }


def joined(pieces: dict[str, str], tokens: list[int]) -> str:
    """The text of some tokens from a vocab.json table (`<id>` for a token it lacks)."""
    return "".join(pieces.get(str(t), f"<{t}>") for t in tokens)


def token_ids(rows: list[dict], checks: list[dict]) -> dict[str, set[int]]:
    """model → every token id in the records and in the verdicts' divergence evidence."""
    ids: dict[str, set[int]] = {}
    for r in rows:
        ids.setdefault(r["model"], set()).update(r["tokens"])
    for v in checks:
        first = (v.get("evidence") or {}).get("first_divergence") or {}
        for key in ("reference_tokens", "tokens"):
            ids.setdefault(v["model"], set()).update(first.get(key) or [])
    return ids


def vocabulary(
    rows: list[dict], checks: list[dict], detokenizer: Callable[[str], Callable | None]
) -> dict[str, dict[str, str]]:
    """model → {token id: text} for `vocab.json`, with the detokenizer the caller has for each model (models
    it has none for are left out: their tokens show as ids). Reports only read the stored table."""
    out = {}
    for model, ids in token_ids(rows, checks).items():
        detok = detokenizer(model)
        if detok is not None:
            out[model] = {str(t): detok([t]) for t in sorted(ids)}
    return out


def _dump(path: Path, data) -> None:
    write_atomic(path, lambda p: p.write_text(json.dumps(data, indent=1, default=str) + "\n"))


def write_run(
    out: Path,
    runs: list,
    checks: list,
    meta: dict | None = None,
    detokenizer: Callable[[str], Callable | None] = lambda model: None,
) -> Path:
    """Write the run directory (refusing to overwrite an existing results.json); returns results.json.

    With `meta` (see `describe_run`) also `run.json` and `vocab.json` (the text of every token, from the
    caller's `detokenizer(model)`), which the reports need."""
    rows = records(runs)
    verdicts = check_records(checks)
    logits = {
        f"{run.suite.name}/{o.case}/{run.cell.id}/{o.round}": to_frame(o.result.logits)
        for run in runs
        for o in run.outcomes
        if o.result.logits
    }
    vocab = vocabulary(rows, verdicts, detokenizer) if meta is not None else None
    return write_files(out, rows, verdicts, logits, vocab, meta)


def write_files(
    out: Path, rows: list[dict], verdicts: list[dict], logits: dict, vocab: dict | None, meta: dict | None
) -> Path:
    """Write records, verdicts, logits frames (by case key) and, when given, token texts and run.json;
    results.json last. Refuses a directory that already has results.json."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / "results.json"
    if target.exists():
        raise HarnessError(f"{target} already exists (choose another --out; results are never overwritten)")
    _dump(out / "checks.json", verdicts)
    write_atomic(out / "results.parquet", lambda p: frame(rows).to_parquet(p, index=False))
    if logits:
        write_atomic(out / "logits.parquet", lambda p: save_parquet(p, logits))
    if vocab is not None:
        _dump(out / "vocab.json", vocab)
    if meta is not None:
        _dump(out / "run.json", {**meta, "run_id": out.name})
    write_atomic(target, lambda p: p.write_text(json.dumps(rows, indent=1) + "\n"))
    return target


# --- run.json -------------------------------------------------------------------------------------------


def now() -> str:
    """UTC time, ISO 8601 to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> dict:
    """The machine: CPU model, cores, OS and Python (no host name, no paths), and whether the suites load
    weights with repacking (off on a CPU whose AMX path crashes llama.cpp: llama_defaults.default_repack)."""
    from harness.llama.defaults import AMX_DEFECT, default_repack

    return {
        "cpu": _cpu(),
        "cores": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "weight repacking": "on"
        if default_repack()
        else f"off (--no-repack: the CPU has {AMX_DEFECT}, known failure amx-repack-segfault, llama.cpp #20824)",
    }


def llama_cpp_identity(meta: dict) -> dict:
    """backend → what identifies the llama.cpp it ran (source identity or llama-cpp-python version)."""
    out = {}
    for name, facts in (meta.get("backends") or {}).items():
        out[name] = (
            facts.get("source_identity")
            or facts.get("llama_cpp_commit")
            or facts.get("llama_cpp_python")
            or "not recorded"
        )
    return out


def cell_entries(executor, planned: list, done: list) -> list[dict]:
    """run.json's `cells`: each planned (suite name, Cell) with its status (`done`, `error` with the error, or `not
    run`)."""
    runs = {(r.suite.name, r.cell): r for r in executor.runs()}
    finished = set(done)
    cells = []
    for suite, cell in planned:
        run = runs.get((suite, cell))
        entry = {
            "suite": suite,
            **asdict(cell),
            "id": cell.id,
            "status": "not run" if (suite, cell) not in finished else "error" if run and run.error else "done",
        }
        if run is not None and run.error:
            entry["error"] = run.error
            if getattr(run, "harness_error", None):
                entry["harness_error"] = run.harness_error
        cells.append(entry)
    return cells


def describe_run(
    executor,
    *,
    tool: str,
    command: list[str],
    options: dict,
    started: str,
    planned: list,
    done: list,
    suites: dict,
    known: list,
    backends: dict,
    models: dict,
    shard: str | None = None,
    interrupted: bool = False,
) -> dict:
    """The content of `run.json` (`run_id` is added by write_run).

    `planned` and `done` are (suite name, Cell) pairs: the cells this run was to check and those it
    finished; `suites` maps suite name → file; `known` is the list of known-failure entries; `backends` the
    facts of the run's backends (harness.backends.facts.run_backends: the caller asks the live backends, so
    writing the files runs no llama.cpp tool) and `models` those of its models (harness.models.facts.run_models:
    a report reads stored runs and never resolves a model)."""
    return {
        "format": FORMAT,
        "tool": tool,
        "command": shlex.join(command),
        "options": options,
        "started": started,
        "finished": now(),
        "harness_version": __version__,
        "shard": shard,
        "interrupted": interrupted,
        "host": host(),
        "backends": backends,
        "models": models,
        "suites": {name: _shown(path) for name, path in suites.items()},
        "cells": cell_entries(executor, planned, done),
        "known_failures": [asdict(e) for e in known],
    }


def _shown(path) -> str | None:
    """A suite file relative to the working directory when inside it (as pytest node ids name it)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def command_line(argv: list[str] | None = None) -> list[str]:
    """How this process was started, as a user would type it (`specharness ...` / `pytest ...`)."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]).name if argv else ""
    if head in ("__main__.py", "cli.py"):
        head = "specharness"
    return [head, *argv[1:]]


# --- reading ------------------------------------------------------------------------------------------


def _load_json(path: Path, what: str, default=None):
    if not path.exists():
        if default is not None:
            return default
        raise HarnessError(f"{path.parent} is not a complete run directory: no {path.name}")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise HarnessError(f"{path}: cannot read the {what} ({err})") from None


@dataclass
class RunDir:
    """A run directory read back: its records, verdicts, run.json (empty for runs made before it
    existed) and token texts."""

    path: Path
    records: list[dict]
    checks: list[dict]
    meta: dict = field(default_factory=dict)
    vocab: dict[str, dict[str, str]] = field(default_factory=dict)
    _logits: dict | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: Path) -> "RunDir":
        """Read a run directory; a one-line HarnessError when it is not one."""
        path = Path(path)
        if not path.is_dir():
            raise HarnessError(f"{path}: no such run directory")
        rows = _load_json(path / "results.json", "results")
        checks = _load_json(path / "checks.json", "check verdicts")
        meta = _load_json(path / "run.json", "run description", default={})
        vocab = _load_json(path / "vocab.json", "token texts", default={})
        if not isinstance(rows, list) or not isinstance(checks, list) or not isinstance(meta, dict):
            raise HarnessError(f"{path}: results.json and checks.json must hold lists, run.json an object")
        return cls(path, rows, checks, meta, vocab)

    @property
    def run_id(self) -> str:
        """The directory's name (what a reader sees; `run.json` records the name it was written under)."""
        return self.path.resolve().name

    def logit_frames(self) -> dict:
        """`<suite>/<case>/<cell>/<round>` → logits frame ({} when none were logged), read once."""
        if self._logits is None:
            try:
                self._logits = load_parquet(self.path / "logits.parquet")
            except (OSError, ValueError):
                self._logits = {}
        return self._logits

    def logits(self, key: str) -> list[PositionLogits]:
        """The logits of `<suite>/<case>/<cell>/<round>` ([] when not logged)."""
        frame_ = self.logit_frames().get(key)
        return from_frame(frame_) if frame_ is not None else []

    def text(self, model: str, tokens: list[int]) -> list[str | None]:
        """The text of each token (None where vocab.json does not have it)."""
        pieces = self.vocab.get(model, {})
        return [pieces.get(str(t)) for t in tokens]

    def failures(self) -> list[tuple[Failure, Pattern]]:
        """The run's distinct failures, each with its pattern (harness.signatures), from the stored files."""
        return failure_patterns(self.checks, self.records, self.meta, lambda v: status(v) == "failed")

    def known(self) -> dict[str, list[Failure]]:
        """Per known llama.cpp defect that explained verdicts of this run (its id), what it explained grouped by
        signature the way failures are: a known entry that shows a second signature is visible as such."""
        ids = sorted({v["evidence"]["known_failure"] for v in self.checks if status(v) == "known"})
        return {
            kid: group(self.checks, self.records, lambda v, k=kid: (v.get("evidence") or {}).get("known_failure") == k)
            for kid in ids
        }
