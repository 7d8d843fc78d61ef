"""The counted work (results.json `work`) beside acceptance and speed-up: `diff` (per cell, per generated token, a
counter that grew flagged), the report's performance table and case sections, the run summary table, and `bench`
(its rows, table and page). Stored runs are written here from records (no model runs): cheap."""

import json
from pathlib import Path
from types import SimpleNamespace

from report_helpers import parse_html
from rich.console import Console

from harness.bench import page, speed
from harness.bench.speed import Sample
from harness.cli import main
from harness.commands.run import summary_table
from harness.matrix import Cell
from harness.report.diff import compare
from harness.report.files import RunDir, write_files
from harness.report.html import render_index
from harness.report.work import text, totals
from harness.result import WORK_COUNTERS, Result, Timings, Work

ENGINE = {"backend": "inproc", "model": "tiny-hybrid", "mode": "seq", "spec": "draft-simple", "suite": "quicksort"}
SERVER = {**ENGINE, "backend": "server"}
ENGINE_WORK = {
    "target_decoded": 96,
    "prompt_read": 20,
    "prompt_reused": 0,
    "ckpt_created": 4,
    "ckpt_created_bytes": 4 * 262144,
    "ckpt_restored": 2,
    "ckpt_restored_bytes": 2 * 262144,
    "partial_rollbacks": 0,
    "draft_decoded": 80,
}
SERVER_WORK = {**ENGINE_WORK, "target_decoded": None, "draft_decoded": None}


def record(cell: dict, case: str, work: dict, n: int = 64) -> dict:
    return {
        **cell,
        "case": case,
        "repeat": 0,
        "tokens": list(range(100, 100 + n)),
        "text": "",
        "stop_reason": "limit",
        "error": None,
        "slot_id": 0,
        "prompt_n": 20,
        "timings": {"prompt_n": 20, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 100.0},
        "spec_stats": {"draft_n": 40, "draft_n_accepted": 30},
        "kv_scan": None,
        "work": work,
    }


def stored_run(path: Path, rows: list[dict]) -> Path:
    verdicts = [
        {**{k: r[k] for k in ("suite", "case", "model", "backend", "mode", "spec")}, "check": "work", "passed": True}
        | {"message": "", "evidence": {}}
        for r in rows
    ]
    write_files(path, rows, verdicts, {}, {}, {"format": 1, "cells": [], "backends": {}, "models": {}})
    return path


def test_diff_flags_the_work_counter_that_grew_per_generated_token(tmp_path, capsys):
    a = stored_run(
        tmp_path / "a", [record(ENGINE, c, ENGINE_WORK) for c in ("C", "Java")] + [record(SERVER, "C", SERVER_WORK)]
    )
    more = {**ENGINE_WORK, "ckpt_created": 5, "ckpt_created_bytes": 5 * 262144, "prompt_reused": 20}
    b = stored_run(
        tmp_path / "b",
        [record(ENGINE, "C", more), record(ENGINE, "Java", ENGINE_WORK)] + [record(SERVER, "C", SERVER_WORK)],
    )
    diff = compare(RunDir.load(a), RunDir.load(b))
    cells = {p["cell"]: p["work"] for p in diff.performance}
    engine = cells["quicksort seq-draft-simple-tiny-hybrid-inproc"]
    # 8 → 9 checkpoints over 128 generated tokens; more prompt reused is work saved, never flagged
    assert engine["grew"] == ["ckpt_created", "ckpt_created_bytes"]
    by = {c["counter"]: c for c in engine["counters"]}
    assert (by["ckpt_created"]["a"], by["ckpt_created"]["b"]) == (8, 9)
    assert by["ckpt_created"]["b_per_token"] == 9 / 128 and by["target_decoded"]["a_per_token"] == 1.5
    server = cells["quicksort seq-draft-simple-tiny-hybrid-server"]
    assert server["grew"] == [] and server["a"]["target_decoded"] is None  # llama-server counts no decodes
    assert [p["cell"] for p in diff.more_work] == ["quicksort seq-draft-simple-tiny-hybrid-inproc"]
    assert not diff.regressed  # shown, not judged: the `work` check is the verdict

    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "cells doing more work per generated token (1" in out and "checkpoints created" in out
    assert "8 → 9 (128 → 128 tokens)" in out and "1 cells with more work per generated token" in out
    table = parse_html((b / "diff.html").read_text()).find(id="work-table")
    grew = {r.attrs["data-cell"]: r.attrs["data-grew"] for r in table.find_all("tr") if "data-cell" in r.attrs}
    assert grew == {
        "quicksort seq-draft-simple-tiny-hybrid-inproc": "ckpt_created,ckpt_created_bytes",
        "quicksort seq-draft-simple-tiny-hybrid-server": "",
    }
    row = next(r for r in table.find_all("tr") if r.attrs.get("data-grew"))
    assert row.find("td", data_counter="ckpt_created").text == "0.0625 → 0.0703 (+12%)"
    assert row.find("td", data_counter="target_decoded").text == "1.5 → 1.5"

    # the same work per generated token over twice the tokens did not grow; back to A's work flags nothing
    twice = {k: 2 * v for k, v in ENGINE_WORK.items()}
    c = stored_run(tmp_path / "c", [record(ENGINE, case, twice, n=128) for case in ("C", "Java")])
    assert not compare(RunDir.load(a), RunDir.load(c)).more_work
    assert main(["diff", str(b), str(a)]) == 0 and "0 cells with more work" in capsys.readouterr().out


def test_report_shows_the_work_beside_acceptance_and_speedup(tmp_path):
    rows = [record(ENGINE, c, ENGINE_WORK) for c in ("C", "Java")] + [record(SERVER, "C", SERVER_WORK)]
    run = RunDir.load(stored_run(tmp_path / "r", rows))
    perf = parse_html(render_index(run)).find(id="performance")
    assert "work (counted" in perf.find("thead").text
    shown = [td.text for td in perf.find_all("td", class_="work")]
    assert shown == [
        "1.50 target dec/tok · ckpt 8 / 2.0 MiB, 4 restored / 1.0 MiB · 0 partial rollbacks · "
        "prompt 40 read / 0 reused · 1.25 draft dec/tok",
        "ckpt 4 / 1.0 MiB, 2 restored / 512 KiB · 0 partial rollbacks · prompt 20 read / 0 reused",
    ]
    old = [{k: v for k, v in r.items() if k != "work"} for r in rows]  # written before work was recorded
    assert text(totals(old)) == "not counted" and text(totals(old[:1] + rows[1:2])) == "not counted"


def _cell_run(cell: Cell, works: list[Work]) -> SimpleNamespace:
    outcomes = [
        SimpleNamespace(
            case=f"c{i}",
            round=0,
            result=Result(tokens=list(range(64)), stop_reason="limit", timings=Timings(predicted_n=64), work=w),
        )
        for i, w in enumerate(works)
    ]
    return SimpleNamespace(cell=cell, suite=SimpleNamespace(name="quicksort"), outcomes=outcomes)


def test_run_summary_table_has_a_work_column():
    runs = [
        _cell_run(Cell("inproc", "seq", "draft-simple", "tiny-hybrid"), [Work(**ENGINE_WORK)] * 2),
        _cell_run(Cell("server", "seq", "draft-simple", "tiny-hybrid"), [Work(**SERVER_WORK)]),
        _cell_run(Cell("server", "seq", "none", "tiny-hybrid"), [Work()]),  # an older build: nothing counted
    ]
    console = Console(record=True, width=400)
    console.print(summary_table(runs, []))
    lines = console.export_text().splitlines()
    assert "work" in lines[2]
    assert "1.50 dec/tok · ckpt 8 / 2.0 MiB, 4 restored" in next(line for line in lines if "inproc" in line)
    assert "│ ckpt 4 / 1.0 MiB, 2 restored  " in next(line for line in lines if "server" in line)
    assert "not counted" in next(line for line in lines if "none" in line)


def test_bench_rows_carry_the_work_per_repeat_and_per_generated_token(tmp_path):
    def sample(repeat: int, ckpt: int, counted: bool = True) -> Sample:
        work = {**ENGINE_WORK, "ckpt_created": ckpt} if counted else dict.fromkeys(WORK_COUNTERS)
        return Sample(repeat, 64, 100.0, 0.0, 40, 30, 10, work)

    row = speed.summarize({}, [[sample(0, 4), sample(0, 6)], [sample(1, 5), sample(1, 5)]])
    assert row["work"]["ckpt_created"] == 10 and row["work"]["target_decoded"] == 192
    assert row["work_per_token"]["target_decoded"] == 1.5 and row["work_per_token"]["ckpt_created"] == 10 / 128
    server = speed.summarize({}, [[sample(0, 4, counted=False)]])
    assert server["work"]["target_decoded"] is None and server["work_per_token"]["ckpt_created"] is None
    assert page.work_text(row) == "1.50 dec/tok · ckpt 10 / 2.0 MiB, 4 restored"
    assert page.work_text({"predicted_n": 1}) == "—"  # a bench.json written before work was measured
    key = {"engine": "inproc", "spec": "draft-simple", "logits": 0, "model": "tiny-hybrid"}
    data = {
        "started": "",
        "command": "specharness bench",
        "machine": {},
        "environment": {},
        "skipped": {},
        "parity": [],
        "costs": {},
        "aggregate": [{**row, **key, "group": "all", "speedup": 1.2, "ratio": None}],
        "rows": [{**row, **key, "workload": "quicksort.C", "speedup": 1.2, "ratio": None, "errors": []}],
    }
    doc = parse_html(page.write_html(tmp_path, data).read_text())
    for table in ("aggregate-table", "rows-table"):
        assert "work per repeat" in doc.find(id=table).find("thead").text
        assert doc.find(id=table).find("td", class_="work").text.startswith("1.50 target dec/tok · ckpt 10 / 2.0 MiB")
    assert json.loads(json.dumps(row))["work_per_token"]["draft_decoded"] == 160 / 128
