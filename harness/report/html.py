"""The HTML views, rendered with Jinja2 from stored run directories: `index.html` of a run, `diff.html`
of two runs, `history.html` of several. One self-contained file each: inline CSS and SVG, a few lines
of inline script for filtering, nothing loaded from anywhere.

Only what a reader needs is rendered in full: every verdict is counted, but token diffs, charts and
logs are rendered only for cases that did not simply pass (pytest-html slows down and grows to
hundreds of MB by rendering everything).
"""

import functools
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from jinja2 import ChainableUndefined, Environment, PackageLoader, select_autoescape

from harness.paths import write_atomic
from harness.report import work
from harness.report.charts import bar_chart, margin_chart, position_chart
from harness.report.files import (
    STATUSES,
    RunDir,
    cell_id,
    distribution_line,
    item_name,
    joined,
    reported_only,
    speedups,
    status,
    throughput,
    worst,
)
from harness.signatures import Failure
from harness.signatures.group import by_verdict
from harness.signatures.text import new_suites

CONTEXT_TOKENS = 12
"""Tokens of common prefix shown before the first divergence in a token diff."""
AFTER_TOKENS = 24
"""Tokens shown from the divergence on, per side."""
AXES = ("check", "mode", "backend", "spec", "model", "suite")
SPEC_COUNTERS = (
    "draft_n",
    "draft_n_accepted",
    "spec_cycles",
    "spec_empty",
    "spec_skip",
    "ckpt_created",
    "ckpt_restored",
    "n_redecoded",
    "draft_dropped",
)
PYTEST_OPTIONS = ("server_bin", "source", "kv_scan", "logit_top_k", "repeat")
"""Run options `pytest suites/` has too; a run that used others is re-run with `specharness run`."""
NOT_RECORDED = "not recorded"
FIRST_DIVERGENCE = (
    "round",
    "index",
    "kind",
    "reason",
    "ref_token",
    "other_token",
    "ref_text",
    "other_text",
    "before",
    "margin",
    "noise_floor",
    "reference",
    "reference_tokens",
    "tokens",
    "reference_margins",
)
"""The fields of `evidence["first_divergence"]` (CONTRACTS.md); a missing one renders as "not recorded"."""
FIRST_DIVERGENCE_SINCE = ("other_margin", "rescored_how")
"""Fields runs record since re-scoring through llama-server (the other run's margin, how each re-scored row was
computed): shown where recorded, left out of older runs' views without a "not recorded"."""


@functools.cache
def environment() -> Environment:
    """The Jinja2 environment of the report templates (package data), with the shared helpers."""
    env = Environment(
        loader=PackageLoader("harness.report", "templates"),
        autoescape=select_autoescape(default=True),
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=ChainableUndefined,
    )
    env.globals.update(
        margin_chart=margin_chart,
        bar_chart=bar_chart,
        STATUSES=STATUSES,
        NOT_RECORDED=NOT_RECORDED,
        triage_line=triage_line,
        work_text=work.text,
    )
    env.filters["first_line"] = lambda text: (str(text or "").strip().splitlines() or [""])[0]
    env.filters["num"] = _num
    env.filters["pct"] = lambda x: NOT_RECORDED if x is None else f"{100 * x:.1f} %"
    env.filters["anchor"] = anchor
    env.filters["tokentext"] = _token_text
    return env


def _num(x, digits: int = 3) -> str:
    if x is None:
        return NOT_RECORDED
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _token_text(text: str | None, token: int | None, recorded: bool) -> str:
    if not recorded:
        return NOT_RECORDED
    if token is None:
        return "(stream ended)"
    return f"{text!r} (id {token})" if text else f"id {token}"


def anchor(name: str) -> str:
    """An HTML id for an item name (`quicksort[C-seq-...]` → `case-quicksort-C-seq-...`)."""
    return "case-" + "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name).strip("-")


# --- token diffs ----------------------------------------------------------------------------------------


def _shown(piece: str | None, token: int) -> str:
    if piece is None:
        return f"<{token}>"
    return piece.replace("\n", "↵\n").replace("\t", "→\t") or "∅"


def token_diff(
    pieces: dict[str, str], reference: list[int] | None, tokens: list[int] | None, index: int | None
) -> dict | None:
    """Both streams around their first divergence as lists of (id, text), for a side-by-side view;
    None when the streams were not recorded."""
    if reference is None or tokens is None:
        return None
    if index is None:
        index = next(
            (i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b),
            min(len(reference), len(tokens)),
        )
    start = max(0, index - CONTEXT_TOKENS)

    def side(stream: list[int]) -> dict:
        return {
            "context": [(t, _shown(pieces.get(str(t)), t)) for t in stream[start:index]],
            "at": (stream[index], _shown(pieces.get(str(stream[index])), stream[index]))
            if index < len(stream)
            else None,
            "after": [(t, _shown(pieces.get(str(t)), t)) for t in stream[index + 1 : index + 1 + AFTER_TOKENS]],
            "more": max(0, len(stream) - index - 1 - AFTER_TOKENS),
            "length": len(stream),
        }

    prefix = joined(pieces, reference[:index])
    return {"index": index, "skipped": start, "prefix": prefix, "reference": side(reference), "other": side(tokens)}


# --- one run --------------------------------------------------------------------------------------------


@dataclass
class Item:
    """One case of one cell (a pytest item): its verdicts and requests."""

    name: str
    row: dict
    verdicts: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        return worst(status(v) for v in self.verdicts)

    @property
    def anchor(self) -> str:
        return anchor(self.name)


def items(run: RunDir) -> list[Item]:
    """The run's items in verdict order, each with its verdicts and its requests."""
    by_name: dict[str, Item] = {}
    for v in run.checks:
        name = item_name(v)
        by_name.setdefault(name, Item(name, v)).verdicts.append(v)
    for r in run.records:
        item = by_name.get(item_name(r))
        if item is not None:
            item.records.append(r)
    return list(by_name.values())


def counts(checks: list[dict], axis: str) -> list[tuple[str, dict]]:
    """Per value of an axis: verdicts per status and in all; rows with failures first."""
    table: dict[str, dict] = {}
    for v in checks:
        row = table.setdefault(v[axis], {**dict.fromkeys(STATUSES, 0), "total": 0})
        row[status(v)] += 1
        row["total"] += 1
    return sorted(table.items(), key=lambda kv: (-kv[1]["failed"], -kv[1]["known"], -kv[1]["near-tie"], kv[0]))


def spec_counters(rows: list[dict]) -> dict:
    """Summed speculative counters of some requests (keys present in any), with the acceptance rate."""
    totals: dict = {}
    for r in rows:
        for key, value in (r.get("spec_stats") or {}).items():
            if key in SPEC_COUNTERS and isinstance(value, (int, float)):
                totals[key] = totals.get(key, 0) + value
    if totals.get("draft_n"):
        totals["acceptance"] = totals.get("draft_n_accepted", 0) / totals["draft_n"]
    return totals


def performance(records: list[dict], checks: list[dict] = ()) -> list[dict]:
    """Per (suite, model, backend, mode, spec), over the requests that produced output: tokens/s, acceptance,
    the speed-up over no speculation measured in this run, the work the requests' steps did (`work`:
    harness.report.work.totals), and — from the `acceptance` verdicts — the baseline's acceptance beside this
    run's, per draft position where known."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("error") is None:
            groups[(r["suite"], r["model"], r["backend"], r["mode"], r["spec"])].append(r)
    verdicts: dict[tuple, list[dict]] = defaultdict(list)
    for v in checks:
        if v["check"] == "acceptance" and "baseline" in (v.get("evidence") or {}):
            verdicts[(v["suite"], v["model"], v["backend"], v["mode"], v["spec"])].append(v)
    speed = speedups(records)
    out = []
    for (suite, model, backend, mode, spec), rs in groups.items():
        row = {
            "suite": suite,
            "model": model,
            "backend": backend,
            "mode": mode,
            "spec": spec,
            "requests": len(rs),
            **throughput(rs),
            "speedup": speed.get(f"{suite} {mode}-{spec}-{model}-{backend}"),
            "work": work.totals(rs),
        }
        mine = verdicts.get((suite, model, backend, mode, spec))
        if mine:
            row["baseline"] = {side: _summed([v["evidence"][side] for v in mine]) for side in ("baseline", "after")}
            row["acceptance_failed"] = any(not v["passed"] for v in mine)
        out.append(row)
    return out


def _summed(parts: list[dict]) -> dict:
    """Acceptance evidence of several cases added up: acceptance and per-position rates from the counts."""
    drafted, accepted = sum(p["drafted"] for p in parts), sum(p["accepted"] for p in parts)
    out = {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}
    if all("drafted_per_pos" in p for p in parts):
        n = max(len(p["drafted_per_pos"]) for p in parts)
        d = [sum(p["drafted_per_pos"][k] for p in parts if k < len(p["drafted_per_pos"])) for k in range(n)]
        a = [sum(p["accepted_per_pos"][k] for p in parts if k < len(p["accepted_per_pos"])) for k in range(n)]
        out["per_position"] = [x / y if y else 0.0 for x, y in zip(a, d, strict=False)]
    return out


def rerun_command(meta: dict, row: dict) -> str:
    """A command that re-runs exactly this case in its cell, with the run's other options: the pytest item
    (the cell runs whole, as in the run, and only this case's checks are judged), or `specharness run` of
    the cell when the run used options pytest does not have."""
    options = dict(meta.get("options") or {})
    suite_file = (meta.get("suites") or {}).get(row["suite"]) or f"suites/{row['suite']}.yaml"
    narrow = ["--backend", row["backend"], "--mode", row["mode"], "--spec", row["spec"], "--model", row["model"]]
    extra = []
    for key, value in sorted(options.items()):
        flag = "--" + key.replace("_", "-")
        extra += [flag] if value is True else [flag, str(value)]
    if set(options) <= set(PYTEST_OPTIONS):
        return shlex.join(["pytest", f"{suite_file}::{item_name(row)}", *narrow, *extra])
    return shlex.join(["specharness", "run", "--suite", row["suite"], *narrow, *extra])


def triage_line(verdict: dict, limit: int = 220) -> str:
    """One line for the failure list: the divergence's class, place and tokens, else the message's first line."""
    first = (verdict.get("evidence") or {}).get("first_divergence")
    if isinstance(first, dict) and first.get("index") is not None:
        view = divergence_view({}, first)["first"]
        against = f" vs {view['reference']}" if view["reference"] else ""
        tokens = (
            f": {_token_text(view['ref_text'], view['ref_token'], 'ref_token' in first)} → "
            f"{_token_text(view['other_text'], view['other_token'], 'other_token' in first)}"
        )
        return f"{view['kind'] or NOT_RECORDED} at token {view['index']}{tokens}{against}"
    line = (str(verdict.get("message") or "").strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def divergence_view(pieces: dict[str, str], first) -> dict | None:
    """A first-divergence record with every schema field (None where missing) and its token diff."""
    if not isinstance(first, dict):
        return None
    missing = {key for key in FIRST_DIVERGENCE if key not in first}
    first = {key: first.get(key) for key in (*FIRST_DIVERGENCE, *FIRST_DIVERGENCE_SINCE)}
    return {
        "first": first,
        "missing": missing,
        "diff": token_diff(pieces, first["reference_tokens"], first["tokens"], first["index"]),
    }


def case_view(run: RunDir, item: Item) -> dict:
    """What a case's section shows: verdicts with their divergence views, counters, KV findings, errors."""
    pieces = run.vocab.get(item.row["model"], {})
    verdicts = []
    for v in item.verdicts:
        view = divergence_view(pieces, (v.get("evidence") or {}).get("first_divergence"))
        verdicts.append({"verdict": v, "status": status(v), "divergence": view})
    kv = [
        (r["repeat"], where, scan)
        for r in item.records
        if r.get("kv_scan")
        for where, scan in (("", r["kv_scan"]), (" of the draft context", r["kv_scan"].get("draft")))
        if scan and not scan.get("healthy", True)
    ]  # (round, which context, its unhealthy verdict)
    errors = [r for r in item.records if r.get("error")]
    return {
        "item": item,
        "verdicts": verdicts,
        "counters": spec_counters([r for r in item.records if r.get("error") is None]),
        "work": work.totals([r for r in item.records if r.get("error") is None]),
        "kv": kv,
        "errors": errors,
        "rerun": rerun_command(run.meta, item.row),
    }


def run_status(run: RunDir) -> str:
    """The worst status of the run's check records (STATUSES; a cell that could not be served is a harness error),
    `passed` when every check passed or did not run (a `reported` verdict passed: the report shows it apart)."""
    cells = run.meta.get("cells") or []
    statuses = [status(v) for v in run.checks] + ["harness-error" for c in cells if c.get("status") == "error"]
    found = worst(s for s in statuses if s != "reported")
    return "passed" if found == "not-run" else found


def not_run_view(run: RunDir) -> list[dict]:
    """The checks that did not run (no verdict, and no harness error), grouped by check and reason: how many cases,
    and which."""
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for v in run.checks:
        if status(v) == "not-run":
            groups[(v["check"], v.get("not_run") or "")].append(item_name(v))
    return [{"check": check, "reason": reason, "cases": cases} for (check, reason), cases in sorted(groups.items())]


def known_view(run: RunDir, known: dict[str, list[Failure]]) -> list[dict]:
    """The known-failure entries with the items each explains in this run and, by signature, what it explained
    (`known`: RunDir.known); `new_suites`: where it showed in a suite its entry does not list (not failing the run)."""
    entries = {e["id"]: e for e in run.meta.get("known_failures") or []}
    return [
        {
            "id": kid,
            "entry": entries.get(kid, {}),
            "failures": failures,
            "cases": sorted({item_name(v) for f in failures for v in f.verdicts + f.consequences}),
            "new_suites": new_suites(failures),
        }
        for kid, failures in known.items()
    ]


def render_index(run: RunDir) -> str:
    """The report of one run directory."""
    all_items = items(run)
    shown = [i for i in all_items if i.status not in ("passed", "no-baseline", "not-run")]
    shown.sort(key=lambda i: STATUSES.index(i.status))
    perf = sorted(
        performance(run.records, run.checks), key=lambda r: (r["suite"], r["model"], r["backend"], r["mode"], r["spec"])
    )
    cells = run.meta.get("cells") or []
    found, known = run.failures(), run.known()
    grouped = [v for f, _ in found for v in f.verdicts + f.consequences]
    reported_headline, reported = reported_only(run.checks)
    signature = by_verdict([f for f, _ in found] + [f for failures in known.values() for f in failures])
    return (
        environment()
        .get_template("index.html.j2")
        .render(
            run=run,
            meta=run.meta,
            run_status=run_status(run),
            items=all_items,
            failures=found,
            signature=lambda v: signature.get(id(v), (None, False)),
            failing=grouped
            + [v for v in run.checks if status(v) not in ("passed", "failed", "no-baseline", "not-run", "reported")],
            reported=reported,
            reported_headline=reported_headline,
            distribution_line=distribution_line(run.checks),
            checks_not_run=not_run_view(run),
            verdicts=sum(1 for v in run.checks if status(v) not in ("not-run", "harness-error")),
            cases=[case_view(run, i) for i in shown],
            counts={axis: counts(run.checks, axis) for axis in AXES},
            totals={s: sum(1 for v in run.checks if status(v) == s) for s in STATUSES},
            performance=perf,
            perf_bars=[(_label(p), p["tok_s"], f"{p['tok_s']:.1f} tok/s") for p in perf if p["tok_s"]],
            accept_bars=[(_label(p), p["acceptance"], f"{100 * p['acceptance']:.1f} %") for p in perf if p["drafted"]],
            speedup_bars=[
                (
                    _label(p),
                    p["speedup"]["speedup"],
                    f"{p['speedup']['speedup']:.2f}x ({p['speedup']['low']:.2f}–{p['speedup']['high']:.2f})",
                )
                for p in perf
                if p["speedup"]
            ],
            position_chart=position_chart,
            known=known_view(run, known),
            not_run=[c for c in cells if c.get("status") == "not run"],
            cell_errors=[c for c in cells if c.get("status") == "error"],
            cell_id=cell_id,
            item_name=item_name,
            status=status,
        )
    )


def _label(row: dict) -> str:
    return f"{row['suite']} · {row['model']} · {row['backend']} · {row['mode']} · {row['spec']}"


def write_index(run: RunDir) -> Path:
    """Render `index.html` into the run directory (replacing an earlier rendering)."""
    target = run.path / "index.html"
    html = render_index(run)
    write_atomic(target, lambda p: p.write_text(html, encoding="utf-8"))
    return target


def render(template: str, **context) -> str:
    """Render another report template (diff, history) with the shared helpers."""
    return environment().get_template(template).render(cell_id=cell_id, item_name=item_name, status=status, **context)
