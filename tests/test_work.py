"""Work is a verdict (issue 29 item 4): every Result counts the work its steps did, baselines store it, the `work`
check fails a cell that does more of it than its baseline, and the `full-checkpoint` fault fails `work` and
nothing else."""

import importlib
import json
import shutil

import pytest
import yaml

from harness.backends.choose import backend_factories
from harness.execute import ExecOptions, Executor
from harness.result import WORK_COUNTERS, Result, Work
from harness.running import run_suites
from harness.suites import load_suite
from harness.verdict.baselines import BaselineStore, default_root
from tests.skips import require_model

CELL = {"models": ["tiny-hybrid"], "modes": ["seq"], "specs": ["draft-simple"], "backends": ["inproc"]}
"""A hybrid target (rollback by checkpoint) drafted by a draft model: every counter moves but partial rollbacks."""


def executor_for(fault=None):
    require_model("tiny-hybrid")
    return Executor(ExecOptions(backends=backend_factories(), engine={"fault": fault}, kv_scan="request"))


@pytest.fixture(scope="module")
def clean():
    """The fault-free executor of this module: it runs each cell on first use and remembers it, so the tests that
    judge the same clean cell against baselines of their own (edited copies) run it once and judge it each time."""
    return executor_for()


def run(executor, root=None, update=False, narrowing=None):
    """Judge the quicksort cells of `narrowing` (CELL by default) run by `executor` against the baselines under
    `root` (the committed ones by default)."""
    store = BaselineStore(root or default_root(), update=update)
    verdicts = run_suites([(load_suite("quicksort"), narrowing or CELL)], executor, store)
    return verdicts, executor


def by_check(verdicts, name):
    return [r for _, _, _, r in verdicts if r.name == name]


def test_work_round_trips_and_counts_none_apart_from_zero():
    w = Work.zero()
    w.add("ckpt_created_bytes", 10)
    assert Work.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert not Work().counted() and Work.from_dict({"prompt_read": 3}).counted()
    assert Work.from_dict(None) == Work() and Result().work == Work()
    assert set(w.counters()) == set(WORK_COUNTERS) and set(w.to_dict()) == {*WORK_COUNTERS, "ckpt_sizes"}
    w.steps = {"verifications": [[4, -1, 1, 10, 1, 10], [2, 2, 0, 0, 0, 0]], "decodes": 1, "prompt_batches": [0]}
    assert Work.from_dict(json.loads(json.dumps(w.to_dict()))) == w  # llama-server's steps, stored with the run
    w.steps = None
    w.checkpoint("prompt", 18, 58720)
    assert Work.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert w.to_dict()["ckpt_sizes"] == [{"kind": "prompt", "n_tokens": 18, "bytes": 58720}]


def test_the_engine_counts_every_request_s_work_and_a_clean_run_passes_work(clean):
    verdicts, executor = run(clean)
    work = by_check(verdicts, "work")
    assert work and all(r.passed and r.not_run is None for r in work), [r.message for r in work]
    for cell in [c for c in executor.runs() if (c.cell.backend, c.cell.mode) == ("inproc", "seq")]:  # CELL's
        for o in cell.outcomes:
            w = o.result.work
            assert w.prompt_read == len(o.result.prompt_tokens) and w.prompt_reused == 0
            if cell.cell.spec == "draft-simple":
                assert w.ckpt_created == o.result.spec_stats["ckpt_created"] > 0
                assert w.ckpt_restored == o.result.spec_stats["ckpt_restored"] > 0
                assert w.ckpt_created_bytes > 0 and w.draft_decoded > w.prompt_read
                assert w.target_decoded > w.prompt_read + len(o.result.tokens) - 1
            else:
                assert w.target_decoded == w.prompt_read + len(o.result.tokens) - 1 or o.result.stop_reason == "eos"


def test_full_checkpoint_fails_work_naming_the_bytes_and_nothing_else():
    verdicts, _ = run(executor_for("full-checkpoint"))
    failing = {r.name for _, _, _, r in verdicts if not r.passed}
    assert failing == {"work"}, [(r.name, r.message) for _, _, _, r in verdicts if not r.passed]
    failed = [r for r in by_check(verdicts, "work") if not r.passed]
    assert all("ckpt_created_bytes" in r.message and "ckpt_restored_bytes" in r.message for r in failed)
    assert all(r.evidence["counters"] == ["ckpt_created_bytes", "ckpt_restored_bytes"] for r in failed)
    assert all(r.is_verdict for _, _, _, r in verdicts if r.name != "work" and r.not_run is None)
    # the whole state (attention cells too) grows with the sequence: the checkpoint-size rule sees it as well
    assert all(
        any("a speculative checkpoint of" in f and "grows with the sequence" in f for f in r.failures) for r in failed
    )


def _sizes_of(model, *requests):
    """checkpoint_sizes over requests given as lists of (kind, n_tokens, bytes), one per round."""
    from types import SimpleNamespace

    from harness.checks.work import checkpoint_sizes
    from harness.matrix import Cell

    ctx = SimpleNamespace(cell=Cell("server", "seq", "draft-mtp", model), case="turn2")
    outcomes = [
        SimpleNamespace(round=i, result=Result(work=Work(ckpt_sizes=[list(c) for c in r])))
        for i, r in enumerate(requests)
    ]
    return checkpoint_sizes(ctx, outcomes)


def test_a_partial_checkpoint_that_grows_with_the_sequence_fails_and_one_of_fixed_size_passes(tiny_models):
    """llama-server's PARTIAL_ONLY checkpoints of a target without a sliding-window cache hold fixed-size state: within
    a request, one size at every position passes, a later larger one fails naming both (ggml-org/llama.cpp PR #28873:
    the draft context's whole KV carried; the strict expected failure `server-partial-checkpoint-holds-draft-kv` is
    the same rule on llama-server's own output), a change without growth says `differs`, kinds are compared apart,
    and requests are not compared with each other (a restored slot's checkpoint lacks the draft context: #28619)."""
    fixed = [("prompt", 34, 58720), ("prompt", 184, 58720)]
    assert _sizes_of("tiny-hybrid", fixed, [("speculative", 40, 117440), ("speculative", 90, 117440)])[0] == []
    assert _sizes_of("tiny-hybrid", [("prompt", 132, 117440)], [("prompt", 85, 58720)])[0] == []  # slot-restore
    lines, evidence = _sizes_of("tiny-hybrid", [("prompt", 34, 68198), ("prompt", 184, 110080)], fixed[:1])
    assert lines == [
        "turn2 round 0: a prompt checkpoint of 107.5 KiB at 184 tokens against 66.6 KiB at 34 tokens in the same "
        "request: a partial checkpoint grows with the sequence"
    ]
    assert evidence["checkpoint_sizes"]["prompt"] == [(34, 58720), (34, 68198), (184, 110080)]
    lines, _ = _sizes_of("tiny-hybrid", fixed[:1], [("prompt", 34, 68198), ("prompt", 90, 58720)])
    assert lines == [
        "turn2 round 1: a prompt checkpoint of 57.3 KiB at 90 tokens against 66.6 KiB at 34 tokens in the same "
        "request: a partial checkpoint differs with the sequence"
    ]


def test_checkpoint_sizes_are_not_compared_on_a_model_with_a_sliding_window(monkeypatch, tiny_models):
    """Gemma 3's partial checkpoint holds its sliding-window cache, which grows with the sequence up to the window:
    there sizes are not compared, and the evidence says why."""
    work_check = importlib.import_module("harness.checks.work")  # the package exports the check function `work`
    monkeypatch.setattr(work_check, "sliding_window", lambda model: 512)
    lines, evidence = _sizes_of("tiny-hybrid", [("prompt", 34, 68198), ("prompt", 184, 110080)])
    assert lines == [] and "sliding-window cache (512 positions)" in evidence["checkpoint_sizes_not_compared"]


def test_a_baseline_without_work_is_not_run_and_update_records_it(tmp_path, clean):
    root = tmp_path / "baselines"
    shutil.copytree(default_root() / "quicksort", root / "quicksort")
    for path in (root / "quicksort").glob("*--tiny-hybrid--inproc--cpu.json"):
        data = json.loads(path.read_text())
        data.pop("work", None)
        path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root)
    work = by_check(verdicts, "work")
    assert work and all(r.not_run and "no work in the baseline" in r.not_run for r in work)
    assert all("--update-baselines" in r.not_run for r in work)
    run(clean, root=root, update=True)
    stored = json.loads((root / "quicksort" / "C--tiny-hybrid--inproc--cpu.json").read_text())["work"]
    assert stored["seq/draft-simple"][0]["ckpt_created"] > 0 and "output" in stored["seq/draft-simple"][0]
    verdicts, _ = run(clean, root=root)
    assert all(r.passed and r.not_run is None for r in by_check(verdicts, "work"))


def java_baseline(tmp_path, backend="inproc"):
    """A copy of quicksort's baselines under tmp_path: (its root, the Java tiny-hybrid file of `backend`, its data),
    for a test to edit and judge a run against."""
    root = tmp_path / "baselines"
    shutil.copytree(default_root() / "quicksort", root / "quicksort")
    path = root / "quicksort" / f"Java--tiny-hybrid--{backend}--cpu.json"
    return root, path, json.loads(path.read_text())


@pytest.mark.parametrize("key", ["no-kv-unified/none"])
def test_more_work_than_the_baseline_fails_naming_counter_and_request(tmp_path, clean, key):
    root, path, data = java_baseline(tmp_path)
    # the baseline's round 1 decoded one token less for the same prompt and output: the run does more work
    # (a baseline row whose prompt_read differs is another prompt, and is not compared)
    data["work"][key][1]["target_decoded"] -= 1
    path.write_text(json.dumps(data))
    mode = key.split("/")[0]
    verdicts, _ = run(clean, root=root, narrowing={**CELL, "modes": [mode], "specs": ["none"]})
    failed = [(k, r) for _, k, _, r in verdicts if r.name == "work" and not r.passed]
    assert [k for k, _ in failed] == ["Java"]
    assert "target_decoded" in failed[0][1].message and "Java round 1" in failed[0][1].message


def test_a_baseline_row_of_another_prompt_length_is_not_compared(tmp_path, clean):
    """A row whose prompt (read + reused) is not the request's prompt is another prompt (an earlier reply differed
    where the row was recorded): its counts are not like with like, so the request is left out, never failed."""
    root, path, data = java_baseline(tmp_path)
    data["work"]["no-kv-unified/none"][1]["prompt_read"] -= 1
    path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root, narrowing={**CELL, "modes": ["no-kv-unified"], "specs": ["none"]})
    java = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert java and java[0].passed and java[0].evidence["not_compared"] == 1


def test_outside_seq_a_request_that_met_another_prompt_cache_is_not_compared(tmp_path, clean):
    """llama-server lends a par request any slot, whose cache may hold its prompt: such a request's counts are chance
    (measured on Gemma and tiny-hybrid); in seq they are not, and a prompt read again fails there."""
    root, path, data = java_baseline(tmp_path)
    for key in ("par/none", "seq/none"):
        row = data["work"][key][1]
        row["prompt_read"], row["prompt_reused"] = row["prompt_read"] - 18, 18  # the baseline met a cached prompt
    path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root, narrowing={**CELL, "modes": ["seq", "par"], "specs": ["none"]})
    java = {c.mode: r for _, k, c, r in verdicts if r.name == "work" and k == "Java"}
    assert java["par"].passed and java["par"].evidence["not_compared"] == 1
    assert not java["seq"].passed and "prompt_read" in java["seq"].message


def test_outside_seq_round_counters_are_compared_only_on_the_baseline_s_rounds(tmp_path, clean):
    """In par the split of the drafts into rounds may vary (llama-server: the same 68 drafts with 2, 3 and 4 partial
    rollbacks): a request's checkpoints and rollbacks are compared only when its rounds are known to be the
    baseline's (the engine reports them, `spec_cycles`), else not, counted as `rounds_not_compared`."""
    from harness.checks.work import _same_rounds

    root, path, data = java_baseline(tmp_path)
    data["work"]["par/draft-simple"][1]["ckpt_created"] -= 1  # the baseline's round 1 created one checkpoint less
    path.write_text(json.dumps(data))
    narrowing = {**CELL, "modes": ["par"]}
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    (java,) = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert not java.passed and "ckpt_created" in java.message and "Java round 1" in java.message
    data["work"]["par/draft-simple"][1]["rounds"] = 10**6  # rounds other than this run's: not comparable
    path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    (java,) = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert java.passed and java.evidence["rounds_not_compared"] == 1
    server = {"draft_n": 68, "draft_n_accepted": 54}  # llama-server's /completion reports no rounds
    assert not _same_rounds(server, {"draft_n": 68, "draft_n_accepted": 54})
    assert _same_rounds({"draft_n": 0}, {"draft_n": 0})  # nothing drafted: no rounds to split
    assert _same_rounds({**server, "spec_cycles": 20}, {"draft_n": 68, "draft_n_accepted": 54, "rounds": 20})
    assert not _same_rounds({**server, "spec_cycles": 20}, {"draft_n": 68, "draft_n_accepted": 53})


def test_in_seq_round_counters_are_compared_only_where_the_drafter_proposed_as_in_the_baseline(tmp_path, clean):
    """A drafter's near-ties flip with the CPU's kernels (Gemma's q2_k drafter drafted 91 against 87 on an AVX2-only
    machine, same output, 22 partial rollbacks against 19): a request whose drafted count is not its row's has other
    rounds, so its checkpoints and rollbacks are not compared (`other_drafts` says so); with the row's drafts they
    are, and one checkpoint more than the row fails."""
    root, path, data = java_baseline(tmp_path)
    row = data["work"]["seq/draft-simple"][1]
    row["ckpt_created"] -= 1  # the baseline's round 1 created one checkpoint less
    path.write_text(json.dumps(data))
    narrowing = {**CELL, "modes": ["seq"]}
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    (java,) = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert not java.passed and "ckpt_created" in java.message and "Java round 1" in java.message
    row["draft_n"] += 4  # the same request drafted four tokens more where it was recorded
    path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    (java,) = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert java.passed and java.evidence["rounds_not_compared"] == 1
    assert java.evidence["other_drafts"] == [
        f"Java round 1: drafted draft_n {row['draft_n'] - 4} against {row['draft_n']} in the baseline"
    ]
    row["prompt_read"], row["prompt_reused"] = row["prompt_read"] - 1, 1  # not a round counter: still compared
    path.write_text(json.dumps(data))
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    (java,) = [r for _, k, _, r in verdicts if r.name == "work" and k == "Java"]
    assert not java.passed and "prompt_read" in java.message


def test_outside_seq_llama_server_s_checkpoint_counts_are_not_compared(tmp_path, clean):
    """llama-server fills its batch with the slots' tokens in turn, so outside seq where a prompt breaks (and so how
    many prompt checkpoints it makes) depends on the other slots (small-batch par: 2 against 1, same output): its
    checkpoint counters are not compared there (`rounds_not_compared`), in seq they are."""
    root, path, data = java_baseline(tmp_path, backend="server")
    for key in ("par/none", "seq/none"):
        row = data["work"][key][1]
        row["ckpt_created"], row["ckpt_created_bytes"] = row["ckpt_created"] - 1, 0  # one prompt checkpoint less
    path.write_text(json.dumps(data))
    narrowing = {**CELL, "backends": ["server"], "modes": ["seq", "par"], "specs": ["none"]}
    verdicts, _ = run(clean, root=root, narrowing=narrowing)
    java = {c.mode: r for _, k, c, r in verdicts if r.name == "work" and k == "Java"}
    assert java["par"].passed and java["par"].evidence["rounds_not_compared"] >= 1
    assert not java["seq"].passed and "ckpt_created" in java["seq"].message


LOG = """\
0.02.612.900 D que  process_new_: processing task, id = 1
0.02.612.950 I slot      release: id  0 | task 0 | stop processing: n_tokens = 149, truncated = 0
0.02.612.988 I slot launch_slot_: id  0 | task 1 | processing task, is_child = 0
0.02.613.100 I slot launch_slot_: id  1 | task 2 | processing task, is_child = 0
0.02.730.380 D slot   operator(): id  0 | task 1 | main/do_checkpoint = yes, pos_min = 17, pos_max = 17
0.02.730.382 I slot create_check: id  0 | task 1 | created context checkpoint 1 of 32 (pos_min = 17, pos_max = 17, \
n_tokens = 18, size = 0.056 MiB)
0.02.900.100 D slot handle_last_: id  0 | task 1 | slot decode token, id=1193, n_ctx = 512, n_tokens = 22, \
truncated = 0
0.02.945.290 D slot   operator(): id  0 | task 1 | created speculative checkpoint (pos_min = 21, pos_max = 21, \
n_tokens = 22, size = 0.112 MiB, draft = 0.056 MiB)
0.02.945.300 D slot   operator(): id  1 | task 2 | created speculative checkpoint (pos_min = 21, pos_max = 21, \
n_tokens = 22, size = 0.112 MiB, draft = 0.056 MiB)
0.02.945.400 D slot handle_last_: id  0 | task 1 | generate_draft: id=1193, #tokens=23, #draft=4, pos_next=23
0.02.981.602 D slot   operator(): id  0 | task 1 | add accepted tokens: sampled=1193, ids.size=5, n_draft=4
0.02.981.650 D slot handle_last_: id  0 | task 1 | generate_draft: id=1193, #tokens=28, #draft=4, pos_next=28
0.02.981.700 D slot   operator(): id  0 | task 1 | add accepted tokens: sampled=1193, ids.size=2, n_draft=4
0.02.981.750 D slot handle_last_: id  0 | task 1 | generate_draft: id=1193, #tokens=30, #draft=4, pos_next=30
0.02.990.446 D slot   operator(): id  0 | task 1 | restoring speculative checkpoint (pos_min = 26, pos_max = 26, \
size = 116936)
0.02.990.500 D slot handle_last_: id  0 | task 1 | generate_draft: id=1193, #tokens=30, #draft=2, pos_next=30
0.02.990.600 D slot   operator(): id  0 | task 1 | add accepted tokens: sampled=1193, ids.size=3, n_draft=2
0.03.130.018 I slot   operator(): id  0 | task 1 | restored context checkpoint (pos_min = 17, pos_max = 17, \
n_tokens = 18, n_past = 18, size = 0.112 MiB)
0.03.989.679 I slot      release: id  0 | task 1 | stop processing: n_tokens = 149, truncated = 0
0.03.990.000 D slot   operator(): id  0 | task 3 | created speculative checkpoint (pos_min = 1, pos_max = 1, \
n_tokens = 2, size = 0.112 MiB, draft = 0.056 MiB)
"""
"""llama-server's own lines at -lv 5 (from a quicksort run at 0c1e570), with a slot beside it and the next task."""


def test_a_server_request_s_work_comes_from_its_timings_and_its_own_task_s_lines(tmp_path):
    from harness.backends import server_work
    from harness.result import Timings

    log = tmp_path / "llama-server.log"
    log.write_text("0.00.000.001 I main: startup\n" + LOG)
    start = len("0.00.000.001 I main: startup\n")
    result = Result(slot_id=0, timings=Timings(prompt_n=4, cache_n=18))
    w = server_work.work_of(result, server_work.task_log(result, log, start))
    mib = round(0.056 * 1024 * 1024) + round(0.112 * 1024 * 1024)
    assert (w.prompt_read, w.prompt_reused) == (4, 18)
    assert (w.ckpt_created, w.ckpt_created_bytes) == (2, mib)
    assert w.ckpt_sizes == [["prompt", 18, round(0.056 * 1024 * 1024)], ["speculative", 22, round(0.112 * 1024 * 1024)]]
    assert (w.ckpt_restored, w.ckpt_restored_bytes) == (2, 116936 + round(0.112 * 1024 * 1024))
    assert w.partial_rollbacks == 1  # 1 of 4 drafts accepted, no restore
    assert w.target_decoded == 4 + 1 + 5 + 5 + 5 + 3  # the prompt, a decode, 3 drafts of 4 and a replay of 2
    assert w.draft_decoded is None  # llama-server does not log the draft context's decodes per request
    assert w.steps == {
        "verifications": [
            [4, 4, 1, round(0.112 * 1024 * 1024), 0, 0],
            [4, 1, 0, 0, 0, 0],
            [4, -1, 0, 0, 1, 116936],
            [2, 2, 0, 0, 0, 0],
        ],
        "decodes": 1,
        "prompt_batches": [18],
        "prompt_restored": [1, round(0.112 * 1024 * 1024)],
        # every generation batch in order, [rows, tokens it emitted]: a decode, two verifications, a restored one
        # (nothing emitted) and its replay (harness.backends.server_rescore reads them)
        "batches": [[1, 1], [5, 5], [5, 2], [5, 0], [3, 3]],
    }
    # a server not started at -lv 5
    quiet = server_work.work_of(result, server_work.task_log(result, log, start, verbosity=None))
    assert quiet.ckpt_created is None and quiet.prompt_read == 4 and quiet.steps is None


def test_llama_server_requests_count_their_checkpoints_and_pass_work(clean):
    verdicts, executor = run(clean, narrowing={**CELL, "backends": ["server"]})
    assert all(r.passed and r.not_run is None for r in by_check(verdicts, "work"))
    (cell,) = [c for c in executor.runs() if c.cell.spec == "draft-simple" and c.cell.backend == "server"]
    for o in cell.outcomes:
        w = o.result.work
        assert w.ckpt_created > 1 and w.ckpt_created_bytes > 0  # the prompt's, then one per drafted step
        assert w.ckpt_restored > 0 and w.ckpt_restored_bytes > 0
        assert w.target_decoded > w.prompt_read + len(o.result.tokens) - 1  # drafts and replays decoded too
        assert len(w.steps["verifications"]) > 1 and w.steps["prompt_batches"]


def _work_gaps() -> list[str]:
    """Every default suite's clean run under `--backend inproc,server` (its default matrix) where `work` would be
    not run without a documented reason: the suite does not list `work` and its description does not say why; a case
    `cannot_judge` names a reason for that the suite's description does not explain (it names `work`); or a cell
    whose requests complete (no known crash of llama.cpp covers it) has no work rows in its baseline file.
    """
    from harness.checks.work import cannot_judge
    from harness.matrix import cells, narrowing
    from harness.running import known_failures
    from harness.suites import case_keys, suite_files

    crashes = [k for k in known_failures()[0] if "no-crash" in k.check]
    root, gaps = default_root(), []
    for path in suite_files():
        suite = load_suite(str(path))
        if "work" not in suite.checks:
            if "No `work` check" not in yaml.safe_load(path.read_text()).get("description", ""):
                gaps.append(f"{suite.name}: `work` is not in its checks, and its description does not say why")
            continue
        for cell in cells(suite.matrix, narrowing(backends=["inproc", "server"])):
            if any(k.covers(suite.name, cell) for k in crashes):
                continue  # a known llama.cpp crash: no output, `work` says so
            for case in suite.cases:
                why = cannot_judge(suite, suite.cell_case(case, cell.model))
                if why:
                    if "`work`" not in yaml.safe_load(path.read_text()).get("description", ""):
                        gaps.append(f"{suite.name}/{case.name}: not run ({why}), undocumented in its description")
                    continue
                for key in case_keys(case):
                    file = root / suite.name / f"{key}--{cell.model}--{cell.backend}--cpu.json"
                    rows = json.loads(file.read_text()).get("work", {}) if file.exists() else {}
                    if f"{cell.mode}/{cell.spec}" not in rows:
                        gaps.append(f"{suite.name} {key} {cell.id}: no work rows in {file.name}")
    return gaps


def test_every_default_suite_judges_work_or_documents_why_not():
    """The acceptance line of issue 29 item 4, checked on the files: every default suite lists `work`, a case it
    cannot judge by design (sampled, or requests that may fail by design) is documented in the suite's description,
    and every other cell of the default matrix on both backends has its work rows in the baseline, so a clean run
    compares (`work` is not run with "no work in the baseline" nowhere)."""
    gaps = _work_gaps()
    assert not gaps, f"{len(gaps)} gaps, e.g.:\n" + "\n".join(gaps[:20])


STEPS = [[4, 4, 1, 117440, 0, 0], [4, -1, 1, 117440, 1, 116936], [2, 2, 0, 0, 0, 0], [3, 1, 0, 0, 0, 0]]
"""A llama-server request's verification batches (harness.result.Work.steps): a draft of 4 all accepted, one of 4
restored (its replay verifies 1 accepted draft and the target's token: 2), and a draft of 3 rolled back partially
(inside the hybrid's snapshots: no checkpoint)."""


def _steps_work(verifications=STEPS, prompt_batches=(0,), reused=0, decodes=2):
    w = Work(prompt_read=22 - reused, prompt_reused=reused, ckpt_sizes=[["prompt", 18, 58720]])
    w.steps = {
        "verifications": [list(v) for v in verifications],
        "decodes": decodes,
        "prompt_batches": list(prompt_batches),
        "prompt_restored": [0, 0],
    }
    return w


def test_steps_give_the_rounds_and_the_counts_of_each_part():
    from harness.checks.work import steps_of

    s = steps_of(_steps_work())
    assert s["rounds"] == [(4, 4), (4, 1), (3, 1)]  # the replay is no round; the restored one accepted 1
    assert s["speculative"] == {
        "ckpt_created": 2,
        "ckpt_created_bytes": 2 * 117440,
        "ckpt_restored": 1,
        "ckpt_restored_bytes": 116936,
        "partial_rollbacks": 1,
        "target_decoded": 2 + 5 + 5 + 3 + 4,
    }
    assert s["prompt"] == {
        "prompt_read": 22,
        "ckpt_created": 1,
        "ckpt_created_bytes": 58720,
        "ckpt_restored": 0,
        "ckpt_restored_bytes": 0,
    }
    assert steps_of(Work.zero()) is None  # the engine logs no steps: its own counters and spec_cycles judge it


def _seq_ctx(mode, mine, theirs, tokens=(1, 2, 3)):
    """A CheckContext stand-in: this cell's requests (Work per round) in `mode`, seq's in `theirs`."""
    from types import SimpleNamespace

    from harness.matrix import Cell

    def outcomes(works):
        return [
            SimpleNamespace(round=i, result=Result(tokens=list(tokens), prompt_tokens=[5, 6], work=w))
            for i, w in enumerate(works)
        ]

    ctx = SimpleNamespace(
        cell=Cell("server", mode, "draft-simple", "tiny-hybrid"),
        case="C",
        other=lambda cell: outcomes(theirs),
        prompt_differs=lambda o, reference: None,
        earlier_replies=lambda cell, r: [],
    )
    return ctx, outcomes(mine)


def test_outside_seq_a_request_with_seq_s_rounds_does_seq_s_work_exactly():
    """Like with like (issue 48 item 2): a par request with seq's output and drafting rounds creates and restores
    the checkpoints seq's same request does. One more checkpoint (at the replay, where the restored one serves) fails
    naming the part, the counters and the request, though each batch has one; drafts that differ, or a prompt read
    from another cache or in other batches, are not compared and the evidence says why."""
    from harness.checks.work import against_seq, per_batch

    seq = [_steps_work(), _steps_work()]
    ctx, mine = _seq_ctx("par", [_steps_work(), _steps_work()], seq)
    assert against_seq(ctx, mine) == (
        [],
        {"against_seq": {"compared": {"speculative": 2, "prompt": 2}, "seq": "seq-draft-simple-tiny-hybrid-server"}},
    )
    extra = [list(v) for v in STEPS]
    extra[2][2:4] = [1, 117440]  # a checkpoint before the replay
    ctx, mine = _seq_ctx("par", [_steps_work(), _steps_work(extra)], seq)
    lines, evidence = against_seq(ctx, mine)
    assert lines == [
        "C round 1: more speculative work than the same request in seq (same output and 3 drafting rounds): "
        "ckpt_created 3 against 2, ckpt_created_bytes 352320 against 234880 (tolerance 0%)"
    ]
    assert per_batch(ctx, mine)[0] == []  # one checkpoint per batch: only seq's counts show it
    other = [list(v) for v in STEPS]
    other[0][1] = 3  # another acceptance: other rounds, not compared; its prompt part still is
    ctx, mine = _seq_ctx(
        "no-kv-unified", [_steps_work(other), _steps_work(reused=18), _steps_work(prompt_batches=[0, 8])], seq + seq[:1]
    )
    lines, evidence = against_seq(ctx, mine)
    assert lines == [] and evidence["against_seq"]["compared"] == {"speculative": 2, "prompt": 1}
    assert set(evidence["against_seq"]["not_compared"]) == {
        "speculative part: its drafts or their acceptance differ from seq's (the drafter's state)",
        "prompt part: it reused another part of its prompt from the slot's cache than in seq",
        "prompt part: its prompt was read in other batches than in seq (the other slots shared them)",
    }
    ctx, mine = _seq_ctx("seq", seq, seq)
    assert against_seq(ctx, mine) == ([], {})  # seq is the reference


def test_a_verification_batch_checkpointed_twice_fails_without_a_reference():
    from harness.checks.work import per_batch

    twice = [list(v) for v in STEPS]
    twice[0][2:4] = [2, 2 * 117440]
    ctx, mine = _seq_ctx("par", [_steps_work(), _steps_work(twice)], [])
    lines, evidence = per_batch(ctx, mine)
    assert lines == [
        "C round 1: 2 speculative checkpoints created for one verification batch where one suffices, in 1 of its 4 "
        "batches (the first: batch 1, 4 drafts)"
    ]
    assert evidence == {"batches_checked": 8}


def test_a_cell_whose_baseline_compared_nothing_passes_only_on_seq_s_comparison():
    """A par cell none of whose requests the baseline could compare (another prompt cache, other drafts) is not run
    unless `against_seq` compared a part of one of its requests: then it passes, saying why the baseline did not."""
    import dataclasses

    from harness.checks.base import not_run
    from harness.checks.work import with_sizes

    nothing = dataclasses.replace(
        not_run("work", "every request met another prompt cache"), evidence={"nothing_compared": True}
    )
    compared = {"against_seq": {"compared": {"speculative": 1, "prompt": 0}}}
    verdict = with_sizes(nothing, [], compared)
    assert verdict.passed and verdict.not_run is None
    assert verdict.evidence["baseline_not_compared"] == "every request met another prompt cache"
    skipped = {"against_seq": {"compared": {"speculative": 0, "prompt": 0}, "not_compared": {"drafts differ": 1}}}
    assert with_sizes(nothing, [], skipped).not_run == "every request met another prompt cache"
    missing = not_run("work", "no work in the baseline x for par/none, re-record with: ...")
    assert with_sizes(missing, [], compared).not_run.startswith("no work in the baseline")  # still to be recorded
