"""What a bisect found, printed and written as `bisect.json` and `bisect.html` in its run directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import jinja2

from harness.bisect.git import Commit
from harness.bisect.plan import Plan
from harness.bisect.step import read_log
from harness.paths import write_atomic


class Stop(Exception):
    """The bisect cannot name a first bad commit: why, in one sentence (and the candidates, if any)."""

    def __init__(self, message: str, candidates: list[str] | None = None):
        super().__init__(message)
        self.candidates = candidates or []
        self.what = "first bad commit"
        """What the bisect looked for (`--tags`: the first failing tag, or with `--fixed` the first passing one)."""


@dataclass
class Outcome:
    """The first bad commit (or release) and its parent (the last good one), with their logged verdicts."""

    first_bad: Commit
    parent: Commit
    first_bad_entry: dict
    parent_entry: dict
    extra: dict = field(default_factory=dict)
    """`--releases` / `--tags`: the two versions (`good_version` the older, `bad_version` the newer), `kind`."""


def headline(outcome: Outcome | None, stop: Stop | None) -> str:
    if outcome is None:
        return f"no {stop.what}: {stop}"
    if outcome.extra.get("kind") == "tag":
        change = "first passing tag" if outcome.extra.get("fixed") else "first failing tag"
        before = "last failing" if outcome.extra.get("fixed") else "last passing"
        return f"{change}: {outcome.extra['bad_version']}; {before}: {outcome.extra['good_version']}"
    if outcome.extra.get("bad_version"):
        return (
            f"first bad release: llama-cpp-python {outcome.extra['bad_version']} (llama.cpp "
            f"{outcome.first_bad.sha[:10]}); last good: {outcome.extra['good_version']} (llama.cpp "
            f"{outcome.parent.sha[:10]})"
        )
    return f"first bad commit: {outcome.first_bad.sha} {outcome.first_bad.subject!r} ({outcome.first_bad.date})"


def triage(evidence: dict) -> str:
    """' triage <class> at token N' for a comparison check, ' KV scan: ...' for kv-healthy, else ''."""
    first = evidence.get("first_divergence")
    if isinstance(first, dict):
        return f" triage {first.get('kind')} at token {first.get('index')} (round {first.get('round')})"
    if "duplicate_cells" in evidence:
        return (
            f" KV scan: {evidence['duplicate_cells']} duplicate (seq_id, pos) cells, {evidence.get('orphans', 0)} "
            f"orphans, {evidence.get('missing_positions', 0)} missing positions"
        )
    return ""


def _failing(entry: dict) -> list[dict]:
    return [c for c in entry.get("checks", []) if not c.get("passed")]


def describe(outcome: Outcome | None, stop: Stop | None) -> str:
    """The terminal summary: headline, then the verdict and triage at the first bad commit and its parent."""
    lines = [headline(outcome, stop)]
    if outcome is None:
        return "\n".join(lines)
    for label, commit, entry in (
        ("first bad", outcome.first_bad, outcome.first_bad_entry),
        ("parent", outcome.parent, outcome.parent_entry),
    ):
        lines.append(f"  {label:<9} {commit.sha[:10]} {entry['verdict']}: {entry['reason']}")
        for check in _failing(entry):
            lines.append(f"            {check['check']}: {check['status']}{triage(check['evidence'])}")
    if outcome.extra.get("hint"):
        lines.append(outcome.extra["hint"])
    return "\n".join(lines)


def write(run_dir: Path, plan: Plan, outcome: Outcome | None, stop: Stop | None) -> Path:
    """`bisect.json` (the outcome) and `bisect.html` (rendered with Jinja2) in `run_dir`; returns the HTML path."""
    steps = read_log(run_dir)
    data = {
        "plan": plan.__dict__,
        "cell": plan.describe(),
        "headline": headline(outcome, stop),
        "found": outcome is not None,
        "stop": str(stop) if stop else None,
        "candidates": stop.candidates if stop else [],
        "first_bad": dict(outcome.first_bad.to_json(), entry=outcome.first_bad_entry) if outcome else None,
        "parent": dict(outcome.parent.to_json(), entry=outcome.parent_entry) if outcome else None,
        "extra": outcome.extra if outcome else {},
        "steps": steps,
        "build_seconds": round(sum(s.get("build_seconds", 0) for s in steps), 1),
    }
    write_atomic(run_dir / "bisect.json", lambda p: p.write_text(json.dumps(data, indent=1, default=str) + "\n"))
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("harness.bisect", "templates"), autoescape=True, undefined=jinja2.StrictUndefined
    )
    env.filters["triage"] = triage
    html = env.get_template("bisect.html.j2").render(**data)
    target = run_dir / "bisect.html"
    write_atomic(target, lambda p: p.write_text(html))
    return target
