"""`specharness bench`: the tables it derives, workload selection, and a real side-by-side run written as
bench.json and bench.html. Speeds are measured, never asserted here (docs/benchmarks.md holds them)."""

import json

import pytest

from harness.bench import costs, speed
from harness.bench.speed import Config, Measured, Sample
from harness.cli import main
from harness.errors import HarnessError


def _samples(speeds: list[float], drafted: int = 0, accepted: int = 0, drafts=None) -> Measured:
    return Measured([Sample(r, 100, 1000 * 100 / v, 0.0, drafted, accepted, drafts) for r, v in enumerate(speeds)])


def test_tables_speedup_over_no_spec_and_inproc_over_server_ratio():
    workloads = speed.select_workloads(["quicksort.C", "quicksort.Java"])
    measured = {}
    for w, scale in (("quicksort.C", 1.0), ("quicksort.Java", 2.0)):
        measured[("gemma3-270m", w, Config("inproc", "none", 0))] = _samples([50 * scale, 60 * scale, 40 * scale])
        measured[("gemma3-270m", w, Config("server", "none", 0))] = _samples([50 * scale] * 3)
        measured[("gemma3-270m", w, Config("inproc", "ngram-mod", 0))] = _samples([100 * scale] * 3, 40, 30, 10)
        measured[("gemma3-270m", w, Config("server", "ngram-mod", 0))] = _samples([125 * scale] * 3, 40, 30)
    rows, aggregate = speed.tables(measured, workloads, 3)
    row = {(r["workload"], r["engine"], r["spec"]): r for r in rows}
    c_none = row[("quicksort.C", "inproc", "none")]
    assert c_none["tok_s"] == pytest.approx(50) and (c_none["tok_s_min"], c_none["tok_s_max"]) == pytest.approx(
        (40, 60)
    )
    assert c_none["spread_pct"] == pytest.approx(40)
    assert c_none["ratio"] == pytest.approx(1.0) and c_none["speedup"] == pytest.approx(1.0)
    assert (c_none["ratio_min"], c_none["ratio_max"]) == pytest.approx((0.8, 1.2))
    mod = row[("quicksort.C", "inproc", "ngram-mod")]
    assert mod["speedup"] == pytest.approx(2.0) and mod["ratio"] == pytest.approx(0.8)
    assert mod["acceptance"] == pytest.approx(0.75) and mod["accepted_per_draft"] == pytest.approx(3.0)
    assert row[("quicksort.C", "server", "ngram-mod")]["accepted_per_draft"] is None  # the server does not count drafts
    agg = {(r["group"], r["engine"], r["spec"]): r for r in aggregate}
    # per repeat: 200 tokens over the two workloads' times, then the median over repeats
    assert agg[("quicksort", "inproc", "none")]["tok_s"] == pytest.approx(200 / (100 / 50 + 100 / 100))
    assert agg[("all", "inproc", "ngram-mod")]["drafted"] == 80
    assert speed.parity(aggregate, workloads) == []  # two of the three quicksort prompts: no verdict
    held = {(p["spec"], p["holds"]) for p in speed.parity(aggregate, speed.select_workloads(["quicksort"]))}
    assert held == {("none", True), ("ngram-mod", False)}  # 1.0 ≥ 1.0 holds; 0.8 < 1.0 misses


def test_inproc_over_server_ratio_is_paired_within_each_repeat():
    workloads = speed.select_workloads(["quicksort.C"])
    # the machine slowed down in repeat 2 for both engines: the medians' ratio (60 / 50) would call the
    # engine 20 % faster, while within every repeat it was 20 % slower or at best even
    measured = {
        ("gemma3-270m", "quicksort.C", Config("inproc", "none", 0)): _samples([40, 60, 80]),
        ("gemma3-270m", "quicksort.C", Config("server", "none", 0)): _samples([50, 50, 100]),
    }
    rows, _ = speed.tables(measured, workloads, 3)
    inproc = next(r for r in rows if r["engine"] == "inproc")
    assert inproc["tok_s"] == pytest.approx(60)
    assert inproc["ratio"] == pytest.approx(0.8) and (inproc["ratio_min"], inproc["ratio_max"]) == pytest.approx(
        (0.8, 1.2)
    )
    one_sided = {
        **measured,
        ("gemma3-270m", "quicksort.C", Config("server", "none", 0)): Measured([Sample(1, 100, 2000.0, 0, 0, 0, None)]),
    }
    rows, _ = speed.tables(one_sided, workloads, 3)  # repeats the server did not finish are left out
    assert next(r for r in rows if r["engine"] == "inproc")["ratio"] == pytest.approx(1.2)


def test_counts_that_differ_between_repeats_are_averaged_and_flagged():
    learning = [[Sample(0, 100, 2000.0, 0.0, 0, 0, 0)], [Sample(1, 100, 1000.0, 0.0, 60, 50, 10)]]
    row = speed.summarize({}, learning)  # ngram-mod's pool drafts nothing on the first request, then learns
    assert row["counts_vary"] and (row["drafted"], row["accepted"]) == (30, 25)
    assert row["accepted_per_draft"] == pytest.approx(5.0) and row["tok_s"] == pytest.approx(75.0)
    steady = speed.summarize({}, [[Sample(r, 100, 1000.0, 0.0, 6, 5, 2)] for r in range(3)])
    assert not steady["counts_vary"] and steady["drafted"] == 6


def test_workloads_by_group_id_or_name_and_unknown_names_refused():
    every = speed.all_workloads()
    assert [w.id for w in every if w.group == "w1"] == [f"w1.iterative.turn{i}" for i in range(1, 5)]
    assert len(speed.select_workloads(["w1"])) == 4
    assert [w.id for w in speed.select_workloads(["summarize", "quicksort.C"])] == [
        "categories.summarize",
        "quicksort.C",
    ]
    turn3 = speed.select_workloads(["w1.iterative.turn3"])[0]
    assert len(turn3.turns) == 3 and turn3.prompt is None
    with pytest.raises(HarnessError, match="unknown workload nope"):
        speed.select_workloads(["nope"])


def test_bench_runs_both_engines_side_by_side_and_never_overwrites(tmp_path, capsys, tiny_models):
    out = tmp_path / "bench"
    argv = [
        "bench",
        "--model",
        "tiny-dense",
        "--workload",
        "quicksort.C,w1.iterative.turn2",
        "--spec",
        "none,ngram-mod",
        "--repeat",
        "1",
        "--no-costs",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "aggregate" in printed and "inproc/server" in printed and "dec/tok" in printed
    data = json.loads((out / "bench.json").read_text())
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == data["rows"]
    assert len(data["rows"]) == 2 * 2 * 2 and not any(r["errors"] for r in data["rows"])
    by = {(r["workload"], r["engine"], r["spec"]): r for r in data["rows"]}
    for workload in ("quicksort.C", "w1.iterative.turn2"):
        inproc, server = by[(workload, "inproc", "ngram-mod")], by[(workload, "server", "ngram-mod")]
        # the same greedy tokens and the same n-gram drafts on both engines
        assert (inproc["predicted_n"], inproc["drafted"], inproc["accepted"]) == (
            server["predicted_n"],
            server["drafted"],
            server["accepted"],
        )
        assert inproc["tok_s"] > 0 and inproc["ratio"] > 0
        # the counted work beside them: the engine counts its decodes (every generated token, drafts included),
        # llama-server none (neither its timings nor its -lv 5 lines give them), both their prompt tokens
        assert (
            inproc["work_per_token"]["target_decoded"] >= 1
            and server["work"]["target_decoded"] >= server["predicted_n"]
        )
        for row in (inproc, server):
            assert row["work"]["prompt_read"] + row["work"]["prompt_reused"] > 0
    html = (out / "bench.html").read_text()
    assert 'id="aggregate-table"' in html and "<svg" in html and "target dec/tok" in html
    assert 'src="http' not in html and 'href="http' not in html  # self-contained
    before = (out / "bench.json").read_bytes()
    assert main(argv) == 2
    assert "already exists" in capsys.readouterr().err
    assert (out / "bench.json").read_bytes() == before


def test_skipped_model_spec_pairs_are_not_served(tiny_models):
    from harness.backends.choose import backend_factories

    measured = speed.run_speed(
        ["tiny-dense"],
        ["inproc"],
        ["none", "draft-simple"],
        [0],
        speed.select_workloads(["quicksort.C"]),
        1,
        8,
        backend_factories(None, None),
        warn=print,
        progress=print,
        skip=(("tiny-dense", "draft-simple"),),
    )
    assert {(r["engine"], r["spec"]) for r in measured["rows"]} == {("inproc", "none")}


def test_state_copy_share_counts_the_checkpoints_of_a_hybrid_run(tiny_models):
    row = costs.state_copies("tiny-hybrid", "draft-simple", n_predict=48)
    assert row["tokens"] == 48 and row["copies"] > 0  # checkpoints of the hybrid's recurrent state
    assert 0 < row["copy_ms"] < row["wall_ms"] and 0 < row["share_pct"] < 100
