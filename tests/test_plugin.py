"""The pytest plugin on a scratch suites directory: ids, a malformed suite, baselines workflow."""

import io

import pandas as pd
import pytest

GOOD = """\
suite: good
matrix: {modes: [seq, no-kv-unified], specs: [none], models: [tiny-dense]}
sampling: {n_predict: 8}
checks: [no-crash, mode-invariant]
cases:
  - {name: hello, prompt: "Hello"}
"""
BAD = """\
suite: bad
cases:
  - name: broken
    promt: "typo in the key"
"""


@pytest.fixture(scope="module", autouse=True)
def parquet_engine_loaded():
    """pytester restores `sys.modules` after each test, dropping what the test imported; pandas' parquet
    engine registers pyarrow extension types when first imported, and a second import in this process
    fails. Loaded here, before any pytester snapshot, it stays."""
    pd.DataFrame({"x": [1]}).to_parquet(io.BytesIO())


@pytest.fixture
def project(pytester, tiny_models):
    pytester.makeconftest('pytest_plugins = ["harness.pytest_plugin"]\n')
    suites = pytester.mkdir("suites")
    (suites / "good.yaml").write_text(GOOD)
    return pytester


def test_items_are_named_case_mode_spec_model_backend(project):
    result = project.runpytest("suites", "--collect-only", "-q")
    assert "suites/good.yaml::good[hello-seq-none-tiny-dense-inproc]" in result.outlines
    assert "suites/good.yaml::good[hello-no-kv-unified-none-tiny-dense-inproc]" in result.outlines


def test_malformed_suite_is_one_failing_item_and_the_others_still_run(project):
    (project.path / "suites" / "bad.yaml").write_text(BAD)
    result = project.runpytest("suites", "-q")
    result.assert_outcomes(passed=2, failed=1)
    errors = [line for line in result.outlines if "bad.yaml:4:" in line]
    assert errors and "cases.0.promt: unknown field 'promt'" in errors[0]


def test_options_narrow_the_matrix(project):
    result = project.runpytest("suites", "-q", "--mode", "seq")
    result.assert_outcomes(passed=1)


def test_bad_narrowing_option_is_a_usage_error(project):
    result = project.runpytest("suites", "-q", "--mode", "bogus")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert any("unknown mode 'bogus'" in line for line in result.errlines)


def test_report_option_writes_the_run_directory_with_its_html_report(project):
    result = project.runpytest("suites", "-q", "--report", "out")
    result.assert_outcomes(passed=2)
    out = project.path / "out"
    assert {"results.json", "checks.json", "run.json", "vocab.json", "junit.xml", "index.html"} <= {
        p.name for p in out.iterdir()
    }
    assert any(
        line == f"specharness report: {out / 'index.html'}" or line.endswith("out/index.html")
        for line in result.outlines
    )
    import json

    meta = json.loads((out / "run.json").read_text())
    assert meta["tool"] == "pytest" and meta["command"].startswith("pytest suites")
    assert [c["status"] for c in meta["cells"]] == ["done", "done"]
    assert "All 3 check verdicts passed" in (out / "index.html").read_text()


def test_shard_option_keeps_a_part_of_the_cells(project):
    first = project.runpytest("suites", "-q", "--shard", "1/2", "--collect-only")
    second = project.runpytest("suites", "-q", "--shard", "2/2", "--collect-only")
    ids = lambda r: {line for line in r.outlines if "::" in line}  # noqa: E731
    assert len(ids(first)) == len(ids(second)) == 1 and ids(first) != ids(second)
    bad = project.runpytest("suites", "-q", "--shard", "3/2")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR


@pytest.mark.workflows
def test_report_under_xdist_merges_the_workers_parts_into_one_run(project):
    import json

    two_models = GOOD.replace("models: [tiny-dense]", "models: [tiny-dense, tiny-hybrid]")
    (project.path / "suites" / "good.yaml").write_text(two_models)
    result = project.runpytest_subprocess("suites", "-q", "-n", "2", "--dist", "loadgroup", "--report", "out")
    result.assert_outcomes(passed=4)
    out = project.path / "out"
    assert not (out / ".workers").exists() and (out / "index.html").is_file()
    meta = json.loads((out / "run.json").read_text())
    assert sorted((c["id"], c["status"]) for c in meta["cells"]) == sorted(
        (f"{mode}-none-{model}-inproc", "done")
        for mode in ("seq", "no-kv-unified")
        for model in ("tiny-dense", "tiny-hybrid")
    )
    records = json.loads((out / "results.json").read_text())
    assert len(records) == 4 and all(r["error"] is None for r in records)
    assert "All 6 check verdicts passed" in (out / "index.html").read_text()


def test_a_known_failure_for_a_cpu_feature_this_cpu_lacks_is_reported_skipped_with_its_reason(project):
    """On a CPU without the entry's feature the item is skipped through a marker, and pytest places that
    report at the item's line: a None line was an INTERNALERROR that ended the whole session."""
    (project.path / "suites" / "known-failures.yaml").write_text(
        "- id: needs-a-flag\n  suites: [good]\n  backend: inproc\n  modes: [seq]\n  specs: [none]\n"
        "  models: [tiny-dense]\n  check: no-crash\n"
        "  cpu_flags: [no-cpu-has-this-flag]\n  evidence: 'x'\n  measured: ['x']\n  wider: ['y']\n"
        "  versions: [0c1e570]\n  upstream: none\n  reason: a demo\n"
    )
    result = project.runpytest("-p", "no:xdist", "-rs", "suites/known-failures.yaml")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs-a-flag shows only on a CPU with no-cpu-has-this-flag*"])
    assert "INTERNALERROR" not in result.stdout.str()


def _unservable_suite(project, tiny_models) -> str:
    """A suite whose only cell the harness cannot serve: the engine asked to roll a hybrid model back with seq_rm
    (a configuration the harness refuses: a harness fault), with a known-failure entry covering it."""
    model = "tiny-hybrid"
    (project.path / "suites" / "unservable.yaml").write_text(
        "suite: unservable\n"
        f"matrix: {{backends: [inproc], modes: [seq], specs: [draft-simple], models: [{model}]}}\n"
        "engine: {rollback: seq-rm}\n"
        "sampling: {n_predict: 4}\n"
        "checks: [no-crash, lossless]\n"
        "cases:\n  - {name: hello, prompt: Hello}\n"
    )
    (project.path / "suites" / "known-failures.yaml").write_text(
        "- id: a-demo-defect\n  suites: [unservable]\n  backend: inproc\n  modes: [seq]\n  specs: [draft-simple]\n"
        f"  models: [{model}]\n  check: no-crash\n"
        "  evidence: 'could not be served'\n  measured: ['round 0: the cell could not be served']\n"
        "  wider: ['round 0: killed']\n  versions: [0c1e570]\n  upstream: none\n  reason: a demo\n"
    )
    return model


def test_a_harness_error_is_an_error_never_a_failure_or_an_xfail_even_in_a_known_failure_item(project, tiny_models):
    _unservable_suite(project, tiny_models)
    result = project.runpytest("-p", "no:xdist", "suites/unservable.yaml", "suites/known-failures.yaml")
    result.assert_outcomes(errors=2)
    out = result.stdout.str()
    assert "rollback seq-rm cannot roll back" in out and "harness error (a fault of specharness" in out
    assert "XFAIL" not in out and "xfailed" not in out and "Traceback" not in out


def test_a_model_named_by_model_that_is_unavailable_is_an_error_with_its_fix_not_a_skip(project, monkeypatch):
    from harness import pytest_plugin
    from harness.models import ModelUnavailable

    def unavailable(name, **kw):
        raise ModelUnavailable(f"{name} needs the [real] extra: pip install -e '.[real]'")

    monkeypatch.setattr(pytest_plugin, "resolve", unavailable)
    named = project.runpytest("-p", "no:xdist", "suites/good.yaml", "--model", "tiny-dense", "--mode", "seq")
    named.assert_outcomes(errors=1)
    assert "--model tiny-dense was asked for, but tiny-dense needs the [real] extra" in named.stdout.str()
    unnamed = project.runpytest("-p", "no:xdist", "suites/good.yaml", "--mode", "seq")
    unnamed.assert_outcomes(skipped=1)


def test_an_intermittent_known_failure_is_served_again_before_it_counts_as_gone(project):
    """`tries: 2`: its cells are served a second time, afresh, when the first serving did not reproduce it; a
    defect that never shows is still a strict failure (XPASS), one that shows is XFAIL."""
    entry = (
        "- id: a-demo-defect\n  suites: [good]\n  backend: inproc\n  modes: [seq]\n  specs: [none]\n"
        "  models: [tiny-dense]\n  check: no-crash\n  tries: 2\n"
        "  evidence: '{evidence}'\n  measured: ['{measured}']\n"
        "  wider: ['round 0: killed']\n  versions: [0c1e570]\n  upstream: none\n  reason: a demo\n"
    )
    known = project.path / "suites" / "known-failures.yaml"
    known.write_text(entry.format(evidence="never printed", measured="never printed"))
    gone = project.runpytest("-p", "no:xdist", "suites/known-failures.yaml", "-rX")
    gone.assert_outcomes(failed=1)
    assert "[XPASS(strict)]" in gone.stdout.str()
    known.write_text(entry.replace("tries: 2", "tries: 6").format(evidence="x", measured="x"))
    bad = project.runpytest("-p", "no:xdist", "suites/known-failures.yaml")
    assert "known-failures.yaml: entry 0: 6 is greater than the maximum of 5" in bad.stderr.str()


def test_a_case_a_known_failure_explains_has_its_reason_as_failure_text_not_a_traceback(project):
    """pytest asks an xfailed item for its failure text too (no report shows it: they show the reason): the
    reason's one line, not a traceback of the plugin formatted from its source (0.17 s a case, measured on the
    ~98 known-failure cases of a default run, docs/benchmarks.md)."""
    items, _ = project.inline_genitems("suites/good.yaml")
    try:
        pytest.xfail("a-demo-defect: a demo")
    except pytest.xfail.Exception:
        info = pytest.ExceptionInfo.from_current()
    assert items[0].repr_failure(info) == "a-demo-defect: a demo"
