"""`specharness diff RUN_A RUN_B`: what changed from one run (the previous release) to another (the
candidate), case by case.

- verdicts that newly fail (failed in B, not failed or absent in A) and newly pass;
- checks no longer judged: a verdict in A whose check is missing from B's case, did not run there or met a
  harness error (a `kv-healthy` that disappears because a build's slot file cannot be scanned);
- other status changes (a known defect fixed, a near-tie or a sampled divergence reported only appearing);
- outputs that changed (same case, cell and round, different tokens), each triaged: the first
  divergence of B's tokens from A's, with A's logit margins and both runs' logits before it;
- per speculative cell, draft acceptance (compared only over the requests that produced output in both
  runs: averages over different sets of cases mislead) and the speed-up over no speculation that each run
  measured itself (`files.speedups`), flagged beyond a threshold and outside both runs' own noise bands.
  Absolute tokens/s are shown, marked machine-dependent, and never judged: across two runs they measure how
  busy the machine was, not llama.cpp.
- per cell, the work its requests did (results.json `work`, harness.report.work) per generated token, the two runs
  side by side, over the same requests: target tokens decoded, prompt tokens read and reused, checkpoints created
  and restored and their bytes, partial rollbacks, draft decodes (where the backend counts them); a counter that
  grew is flagged. Counted work is deterministic and machine-independent, but it is shown, not judged here: the
  `work` check judges it against the baselines with its calibrated tolerances and request pairing (its newly
  failing verdicts make the diff exit 1), where a cell's sum in `par` can move with the prompt cache a slot met.

Something regressed — a newly failing verdict, a verdict no longer judged, an acceptance drop or a speed-up loss
beyond its threshold — makes the exit status 1.
"""

from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError
from harness.paths import write_atomic
from harness.report import work
from harness.report.files import (
    RunDir,
    cell_id,
    item_name,
    joined,
    llama_cpp_identity,
    logits_key,
    speedups,
    status,
    throughput,
)
from harness.signatures.group import by_verdict
from harness.suites import case_keys, load_suite
from harness.verdict import noise
from harness.verdict.noise import NoiseFloor
from harness.verdict.triage import triage

SPEED_THRESHOLD = 0.10
"""A speculative cell whose speed-up over no speculation fell by more than this fraction of A's (and below
the lowest speed-up A measured) is a regression."""
ACCEPTANCE_THRESHOLD = 0.02
"""A cell whose draft acceptance drops by more than this (absolute) is a regression."""


@dataclass
class RunDiff:
    """The comparison of run A (before) with run B (after)."""

    a: RunDir
    b: RunDir
    newly_failing: list[dict] = field(default_factory=list)
    newly_passing: list[dict] = field(default_factory=list)
    no_longer_judged: list[dict] = field(default_factory=list)
    """Verdicts of A whose check B's same case has not (missing, not run, or a harness error)."""
    other_changes: list[dict] = field(default_factory=list)
    changed_outputs: list[dict] = field(default_factory=list)
    performance: list[dict] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    thresholds: dict = field(default_factory=dict)
    signatures: list[dict] = field(default_factory=list)
    """B's distinct failures that have newly failing verdicts (group_newly_failing)."""

    @property
    def slower(self) -> list[dict]:
        return [p for p in self.performance if p["speed_regressed"] or p["acceptance_regressed"]]

    @property
    def more_work(self) -> list[dict]:
        """The cells where a work counter grew per generated token (flagged, not a regression: see the module)."""
        return [p for p in self.performance if p["work"]["grew"]]

    @property
    def regressed(self) -> bool:
        return bool(self.newly_failing or self.no_longer_judged or self.slower)

    def cases(self) -> set[str]:
        """Every case (pytest item name) this diff lists as changed."""
        return {
            c["item"]
            for c in self.newly_failing
            + self.newly_passing
            + self.no_longer_judged
            + self.other_changes
            + self.changed_outputs
        } | {p["cell"] for p in self.performance if p["flagged"] or p["work"]["grew"]}


def _verdicts(run: RunDir) -> dict[tuple[str, str], dict]:
    return {(item_name(v), v["check"]): v for v in run.checks}


def _pieces(a: RunDir, b: RunDir, model: str) -> dict[str, str]:
    return {**a.vocab.get(model, {}), **b.vocab.get(model, {})}


def triage_context(run: RunDir, record: dict) -> tuple[NoiseFloor, bool]:
    """What a stored request is triaged with, as the run's own checks triaged it: the calibrated floor of its model,
    backend and device in its mode (NoiseFloor.for_mode) with its suite's own `tolerances:` (NoiseFloor.declared),
    and whether its case picked the argmax (its suite as the run names it in run.json; a suite no longer there: not
    greedy, so no flip is called a near-tie without the evidence that the pick was the logits' argmax)."""
    device = (run.meta.get("backends") or {}).get(record["backend"], {}).get("device", "cpu")
    floor = noise.load(record["model"], record["backend"], device).for_mode(record["mode"])
    for where in dict.fromkeys([(run.meta.get("suites") or {}).get(record["suite"]), record["suite"]]):
        try:
            suite = load_suite(where)
            case = next(c for c in suite.cases if record["case"] in case_keys(c))
            return floor.declared(suite.tolerances, suite.name), suite.cell_case(
                case, record["model"]
            ).sampling.picks_argmax
        except (HarnessError, StopIteration, OSError, TypeError):
            continue
    return floor, False


def output_change(a: RunDir, b: RunDir, ra: dict, rb: dict) -> dict:
    """The first divergence of B's output from A's for one request, triaged with both runs' logits and the floor and
    sampling of B's cell (`triage_context`), in the shape of a check's `first_divergence` evidence (A is the
    reference)."""
    pieces = _pieces(a, b, ra["model"])
    la, lb = a.logits(logits_key(ra)), b.logits(logits_key(rb))
    floor, greedy = triage_context(b, rb)
    d = triage(
        ra["tokens"],
        rb["tokens"],
        la or None,
        lb or None,
        detokenize=lambda tokens: joined(pieces, tokens),
        floor=floor,
        greedy=greedy,
    )
    return d.to_evidence(ra["repeat"], f"output of {a.run_id}", ra["tokens"], rb["tokens"], la)


def compare(
    a: RunDir, b: RunDir, speed_threshold: float = SPEED_THRESHOLD, acceptance_threshold: float = ACCEPTANCE_THRESHOLD
) -> RunDiff:
    """Compare run A with run B."""
    diff = RunDiff(a, b, thresholds={"speed": speed_threshold, "acceptance": acceptance_threshold})
    va, vb = _verdicts(a), _verdicts(b)
    diff.no_longer_judged = no_longer_judged(va, vb)
    for key in sorted(va.keys() | vb.keys()):
        sa = status(va[key]) if key in va else None
        sb = status(vb[key]) if key in vb else None
        if sa == sb or sb is None or (sa in VERDICT_STATUSES and sb in UNJUDGED):
            continue
        v = vb[key]
        entry = {
            "item": key[0],
            "check": key[1],
            "a": sa or "absent",
            "b": sb,
            "message": v.get("message", ""),
            "first_divergence": (v.get("evidence") or {}).get("first_divergence"),
            "row": v,
        }
        if sb == "failed":
            diff.newly_failing.append(entry)
        elif sa == "failed" and sb in ("passed", "near-tie"):
            diff.newly_passing.append(entry)
        elif sa is not None:
            diff.other_changes.append(entry)
    group_newly_failing(diff)
    items_a, items_b = {k[0] for k in va}, {k[0] for k in vb}
    diff.only_a, diff.only_b = sorted(items_a - items_b), sorted(items_b - items_a)

    ra = {(item_name(r), r["repeat"]): r for r in a.records}
    rb = {(item_name(r), r["repeat"]): r for r in b.records}
    both = sorted(k for k in ra.keys() & rb.keys() if ra[k].get("error") is None and rb[k].get("error") is None)
    seen = set()
    for key in both:
        if ra[key]["tokens"] != rb[key]["tokens"] and key[0] not in seen:
            seen.add(key[0])
            diff.changed_outputs.append(
                {"item": key[0], "row": rb[key], "first_divergence": output_change(a, b, ra[key], rb[key])}
            )

    cells: dict[str, tuple[list, list]] = {}
    for key in both:
        pair = cells.setdefault(f"{rb[key]['suite']} {cell_id(rb[key])}", ([], []))
        pair[0].append(ra[key])
        pair[1].append(rb[key])
    speed_a, speed_b = speedups(a.records), speedups(b.records)
    for cell, (rows_a, rows_b) in sorted(cells.items()):
        (ta, acc_a), (tb, acc_b) = ((t["tok_s"], t["acceptance"]) for t in (throughput(rows_a), throughput(rows_b)))
        sa, sb = speed_a.get(cell), speed_b.get(cell)
        ratio = sb["speedup"] / sa["speedup"] if sa and sb else None
        speed_bad = ratio is not None and ratio < 1 - speed_threshold and sb["high"] < sa["low"]
        speed_good = ratio is not None and ratio > 1 + speed_threshold and sb["low"] > sa["high"]
        acc_bad = acc_a is not None and acc_b is not None and acc_b < acc_a - acceptance_threshold
        acc_good = acc_a is not None and acc_b is not None and acc_b > acc_a + acceptance_threshold
        diff.performance.append(
            {
                "cell": cell,
                "requests": len(rows_b),
                "speculative": rows_b[0]["spec"] != "none",
                "a_tok_s": ta,
                "b_tok_s": tb,
                "a_speedup": sa,
                "b_speedup": sb,
                "ratio": ratio,
                "a_acceptance": acc_a,
                "b_acceptance": acc_b,
                "speed_regressed": speed_bad,
                "acceptance_regressed": acc_bad,
                "flagged": speed_bad or speed_good or acc_bad or acc_good,
                "work": work.compare(rows_a, rows_b),
            }
        )
    return diff


UNJUDGED = ("not-run", "harness-error")
"""Check statuses that are no verdict."""
VERDICT_STATUSES = ("failed", "known", "reported", "near-tie", "no-baseline", "passed")


def no_longer_judged(va: dict, vb: dict) -> list[dict]:
    """The verdicts of A (by (item, check)) whose check B's same case did not judge: missing from it (the case ran
    in B: a case missing whole is listed as only in A), not run, or a harness error."""
    items_b = {item for item, _ in vb}
    out = []
    for key in sorted(va):
        sa = status(va[key])
        if sa not in VERDICT_STATUSES or key[0] not in items_b:
            continue
        v = vb.get(key)
        sb = status(v) if v is not None else "missing"
        if sb not in (*UNJUDGED, "missing"):
            continue
        why = (v.get("harness_error") or v.get("not_run") or v.get("message") or "") if v is not None else ""
        out.append(
            {
                "item": key[0],
                "check": key[1],
                "a": sa,
                "b": sb,
                "message": why.strip().splitlines()[0] if why.strip() else f"no {key[1]} record in the case",
                "first_divergence": None,
                "row": v if v is not None else va[key],
            }
        )
    return out


def group_newly_failing(diff: RunDiff) -> None:
    """Give each newly failing verdict its failure signature in B (and whether it only restates it), order
    them by B's distinct failures, and list those failures (`diff.signatures`): each with its newly failing
    verdicts, its pattern in B, and whether A failed with the same signature too."""
    found_b = diff.b.failures()
    in_b = by_verdict([f for f, _ in found_b])
    in_a = {f.signature for f, _ in diff.a.failures()}
    for entry in diff.newly_failing:
        entry["signature"], entry["restates"] = in_b[id(entry["row"])]
    order = {f.signature: n for n, (f, _) in enumerate(found_b)}
    diff.newly_failing.sort(key=lambda e: (order[e["signature"]], e["restates"]))
    diff.signatures = [
        {
            "signature": f.signature,
            "kind": f.kind,
            "pattern": p,
            "in_a": f.signature in in_a,
            "newly_failing": [e for e in diff.newly_failing if e["signature"] == f.signature],
        }
        for f, p in found_b
        if any(e["signature"] == f.signature for e in diff.newly_failing)
    ]


def properties(run: RunDir) -> dict[str, str]:
    """A run's header facts, flattened (`backend.server.llama_cpp_commit`, `model.tiny-dense.sha256`, ...)."""
    meta = run.meta
    out = {
        "harness version": meta.get("harness_version"),
        "command": meta.get("command"),
        "cpu": (meta.get("host") or {}).get("cpu"),
        "started": meta.get("started"),
    }
    for name, facts in (meta.get("backends") or {}).items():
        for key, value in facts.items():
            if key == "build" and isinstance(value, dict):
                for k, v in value.items():
                    out[f"{name} build {k}"] = " ".join(v) if isinstance(v, list) else v
            else:
                out[f"{name} {key}"] = value
    for name, facts in (meta.get("models") or {}).items():
        out[f"model {name}"] = facts.get("sha256") or facts.get("error")
    if "versioned_baselines" in meta:  # which baselines kept for a llama.cpp version range the run compared with
        out["baselines kept for its llama.cpp version"] = ", ".join(meta["versioned_baselines"]) or "none"
    return {k: "not recorded" if v is None else str(v) for k, v in out.items()}


def differing_properties(a: RunDir, b: RunDir) -> list[tuple[str, str, str]]:
    """(property, A, B) for the header facts that differ (as compare-llama-bench shows only differing columns)."""
    pa, pb = properties(a), properties(b)
    return [
        (k, pa.get(k, "—"), pb.get(k, "—"))
        for k in sorted(pa.keys() | pb.keys())
        if pa.get(k) != pb.get(k) and k != "started"
    ]


def print_diff(diff: RunDiff, console) -> None:
    """The diff on the console (rich): what differs between the runs, B's newly failing distinct failures, the
    status changes, the changed outputs, the flagged speculative cells, then the one-line verdict."""
    _print_properties(diff, console)
    _print_signatures(diff, console)
    _print_status_changes(diff, console)
    _print_changed_outputs(diff, console)
    _print_performance(diff, console)
    _print_work(diff, console)
    _print_summary(diff, console)


def _print_properties(diff: RunDiff, console) -> None:
    """The header and the run facts that differ."""
    console.print(f"diff {diff.a.run_id} → {diff.b.run_id}", style="bold", markup=False)
    for prop, va, vb in differing_properties(diff.a, diff.b):
        console.print(f"  {prop}: {va} → {vb}", markup=False, highlight=False)


def _print_signatures(diff: RunDiff, console) -> None:
    """B's distinct failures with newly failing verdicts, one line, then each one's pattern."""
    if not diff.signatures:
        return
    n = len(diff.signatures)
    console.print(
        f"{n} distinct failure{'s' if n != 1 else ''} newly failing: "
        + "; ".join(
            f"{s['signature']} ({len(s['newly_failing'])} verdicts{', failed in A too' if s['in_a'] else ''})"
            for s in diff.signatures
        ),
        style="bold red",
        markup=False,
        highlight=False,
    )
    for s in diff.signatures:
        console.print(f"  {s['signature']}: {s['pattern'].reading}", markup=False, highlight=False)


def _print_status_changes(diff: RunDiff, console) -> None:
    """One table per kind of status change: newly failing (with B's signature), no longer judged, newly passing,
    other changes."""
    from rich.table import Table

    from harness.report.html import triage_line

    sections = (
        ("newly failing", diff.newly_failing, "red"),
        ("no longer judged (a verdict before, none now)", diff.no_longer_judged, "red"),
        ("newly passing", diff.newly_passing, "green"),
        ("other status changes", diff.other_changes, "yellow"),
    )
    for title, rows, color in sections:
        if not rows:
            continue
        table = Table(title=f"{title} ({len(rows)})", title_style=f"bold {color}", title_justify="left")
        signed = "signature" in rows[0]  # the newly failing verdicts: their failure signature in B
        for column in ("case", "check", *(("signature",) if signed else ()), "before → after", "message"):
            table.add_column(column)
        for r in rows:
            sig = (("restates " if r["restates"] else "") + r["signature"],) if signed else ()
            message = r["message"] if r in diff.no_longer_judged else triage_line(r["row"])
            table.add_row(r["item"], r["check"], *sig, f"{r['a']} → {r['b']}", message)
        console.print(table)


def _print_changed_outputs(diff: RunDiff, console) -> None:
    """The requests whose tokens changed, each at its first divergence, triaged."""
    from rich.table import Table

    if not diff.changed_outputs:
        return
    table = Table(title=f"changed output ({len(diff.changed_outputs)})", title_style="bold", title_justify="left")
    for column in ("case", "round", "first divergence", "triage"):
        table.add_column(column)
    for c in diff.changed_outputs:
        d = c["first_divergence"]
        table.add_row(
            c["item"], str(d["round"]), f"token {d['index']}: {d['ref_text']!r} → {d['other_text']!r}", d["kind"]
        )
    console.print(table)


def _print_performance(diff: RunDiff, console) -> None:
    """The speculative cells whose acceptance or speed-up moved beyond the thresholds."""
    from rich.table import Table

    flagged = [p for p in diff.performance if p["flagged"]]
    if not flagged:
        return
    table = Table(
        title=f"speculative cells whose acceptance moved beyond ±{100 * diff.thresholds['acceptance']:.0f} "
        f"points or whose speed-up over no speculation moved beyond ±{100 * diff.thresholds['speed']:.0f} % "
        f"and outside both runs' noise bands ({len(flagged)})",
        title_style="bold",
        title_justify="left",
    )
    for column in ("cell", "acceptance before", "after", "speed-up before", "after", "tok/s before*", "after*"):
        table.add_column(column, justify="left" if column == "cell" else "right")
    for p in flagged:
        table.add_row(
            p["cell"],
            _pct(p["a_acceptance"]),
            f"[{'red' if p['acceptance_regressed'] else 'green'}]{_pct(p['b_acceptance'])}[/]",
            speedup_text(p["a_speedup"]),
            f"[{'red' if p['speed_regressed'] else 'green'}]{speedup_text(p['b_speedup'])}[/]",
            _fmt(p["a_tok_s"]),
            _fmt(p["b_tok_s"]),
        )
    console.print(table)
    console.print("* tokens/s measure the machine as much as llama.cpp: shown, never judged", markup=False)


def _print_work(diff: RunDiff, console) -> None:
    """The cells whose work per generated token grew: one row per grown counter, both runs side by side."""
    from rich.table import Table

    if not diff.more_work:
        return
    table = Table(
        title=f"cells doing more work per generated token ({len(diff.more_work)}; shown, judged by the `work` check)",
        title_style="bold yellow",
        title_justify="left",
    )
    for column in ("cell", "counter", "per generated token before", "after", "change", "total before → after"):
        table.add_column(column, justify="left" if column in ("cell", "counter") else "right")
    for p in diff.more_work:
        w = p["work"]
        for c in w["counters"]:
            if c["grew"]:
                name = c["counter"]
                table.add_row(
                    p["cell"],
                    work.LABELS[name],
                    work.value(name, c["a_per_token"]),
                    f"[yellow]{work.value(name, c['b_per_token'])}[/]",
                    work.change_text(c),
                    f"{work.value(name, c['a'])} → {work.value(name, c['b'])} "
                    f"({w['a']['generated']} → {w['b']['generated']} tokens)",
                )
    console.print(table)


def _print_summary(diff: RunDiff, console) -> None:
    """Cases only in one run, then the one-line verdict: REGRESSED or not, with the counts."""
    if diff.only_a or diff.only_b:
        console.print(
            f"{len(diff.only_a)} cases only in {diff.a.run_id}, {len(diff.only_b)} only in {diff.b.run_id}",
            markup=False,
        )
    if not diff.cases():
        console.print("no changes", style="green")
    console.print(
        ("REGRESSED: " if diff.regressed else "no regression: ")
        + f"{len(diff.newly_failing)} newly failing, {len(diff.no_longer_judged)} no longer judged, "
        f"{len(diff.slower)} speculative cells with less acceptance or speed-up, "
        f"{len(diff.newly_passing)} newly passing, {len(diff.changed_outputs)} changed outputs, "
        f"{len(diff.more_work)} cells with more work per generated token",
        style="bold red" if diff.regressed else "bold green",
        markup=False,
    )


def speedup_text(s: dict | None) -> str:
    """`1.42x (1.31–1.55)`: a cell's median speed-up over no speculation with the run's own min–max."""
    return "-" if not s else f"{s['speedup']:.2f}x ({s['low']:.2f}–{s['high']:.2f})"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


WORK_COLUMNS = tuple(work.LABELS)
"""The work counters diff.html shows per cell, in this order."""


def write_diff_html(diff: RunDiff, target: Path) -> Path:
    """Render `diff.html`."""
    from harness.report.charts import bar_chart
    from harness.report.html import divergence_view, render

    for entry in (
        diff.newly_failing + diff.newly_passing + diff.no_longer_judged + diff.other_changes + diff.changed_outputs
    ):
        entry["view"] = divergence_view(_pieces(diff.a, diff.b, entry["row"]["model"]), entry.get("first_divergence"))
    ratios = [
        (p["cell"], p["ratio"], f"{p['ratio']:.2f}x") for p in diff.performance if p["ratio"]
    ]  # B's speed-up / A's
    html = render(
        "diff.html.j2",
        diff=diff,
        differing=differing_properties(diff.a, diff.b),
        speedup_text=speedup_text,
        work_counters=WORK_COLUMNS,
        work=work,
        identity_a=llama_cpp_identity(diff.a.meta),
        identity_b=llama_cpp_identity(diff.b.meta),
        speed_chart=bar_chart(ratios, ref=1.0, label_width=360) if ratios else "",
    )
    write_atomic(target, lambda p: p.write_text(html, encoding="utf-8"))
    return target
