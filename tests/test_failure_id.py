"""`specharness shrink` / `repro` take the failure ID the console and the report print
(`suite[case-mode-spec-model-backend]`), whose case, spec and model names contain dashes."""

import json

import pytest

from harness.errors import HarnessError
from harness.shrink.cli import Origin, take_failure_id
from harness.shrink.failure_id import FailureId, parse


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "categories[code_python-par-draft-simple-tiny-hybrid-server]",
            FailureId("categories", "code_python", "par", "draft-simple", "tiny-hybrid", "server"),
        ),
        (
            "kv-fill[sorts.turn3-no-kv-unified-ngram-map-k4v-tiny-dense-inproc]",
            FailureId("kv-fill", "sorts.turn3", "no-kv-unified", "ngram-map-k4v", "tiny-dense", "inproc"),
        ),
        (  # a pytest node ID, with the check the console prints after it
            "suites/eog.yaml::eog[last-draft-seq-none-gemma3-270m-server] [lossless]",
            FailureId("eog", "last-draft", "seq", "none", "gemma3-270m", "server"),
        ),
        (  # a case named like a mode
            "x[seq-par-seq-none-tiny-recurrent-server]",
            FailureId("x", "seq-par", "seq", "none", "tiny-recurrent", "server"),
        ),
    ],
)
def test_a_printed_failure_id_is_read_back_into_its_parts(text, expected):
    assert parse(text) == expected


def test_a_model_named_by_the_run_is_known_too():
    records = [{"model": "my-model-q4"}]
    assert parse("s[c-seq-none-my-model-q4-server]", records).model == "my-model-q4"
    with pytest.raises(HarnessError, match="names no known model before '-server'"):
        parse("s[c-seq-none-my-model-q4-server]")


@pytest.mark.parametrize(
    "text, message",
    [
        ("categories[code_python-par-draft-simple-tiny-hybrid-cuda]", "ends in no backend"),
        ("categories[code_python-fast-draft-simple-tiny-hybrid-server]", "cannot read the case, mode and spec"),
        ("categories[code_python", "cannot read the failure ID"),
    ],
)
def test_an_unreadable_failure_id_is_a_one_line_error(text, message):
    with pytest.raises(HarnessError, match=message) as err:
        parse(text)
    assert "\n" not in str(err.value)


def _run_dir(tmp_path):
    verdict = {"suite": "categories", "case": "code_python", "mode": "par", "spec": "draft-simple"}
    checks = [
        {**verdict, "model": "tiny-hybrid", "backend": "server", "check": "no-crash", "passed": False, "message": "m"},
        {**verdict, "model": "tiny-dense", "backend": "server", "check": "no-crash", "passed": False, "message": "m"},
    ]
    (tmp_path / "checks.json").write_text(json.dumps(checks))
    (tmp_path / "results.json").write_text("[]")
    (tmp_path / "run.json").write_text("{}")
    return checks


def test_shrink_and_repro_accept_the_printed_failure_id(tmp_path):
    from harness.cli import build_parser

    checks = _run_dir(tmp_path)
    for command in ("shrink", "repro"):
        args = build_parser().parse_args(
            [command, "categories[code_python-par-draft-simple-tiny-hybrid-server]", "--from-run", str(tmp_path)]
        )
        assert take_failure_id(args, checks) == "categories"
        assert (args.case, args.mode, args.spec, args.model, args.backend) == (
            "code_python",
            "par",
            "draft-simple",
            "tiny-hybrid",
            "server",
        )
    args = build_parser().parse_args(
        ["repro", "categories[code_python-par-draft-simple-tiny-hybrid-server]", "--from-run", str(tmp_path)]
    )
    origin = Origin(args, "reproduce")
    assert origin.cell.model == "tiny-hybrid" and origin.describe.startswith(
        "categories[code_python-par-draft-simple-tiny-hybrid-server] no-crash"
    )


def test_a_failure_id_and_a_contradicting_flag_or_suite_are_refused(tmp_path):
    from harness.cli import build_parser

    _run_dir(tmp_path)
    args = build_parser().parse_args(
        ["repro", "categories[code_python-par-draft-simple-tiny-hybrid-server]", "--from-run", str(tmp_path)]
        + ["--model", "tiny-dense"]
    )
    with pytest.raises(HarnessError, match="--model tiny-dense contradicts the failure ID"):
        Origin(args, "reproduce")
    args = build_parser().parse_args(
        ["repro", "kv-fill[code_python-par-draft-simple-tiny-hybrid-server]", "--from-run", str(tmp_path)]
    )
    with pytest.raises(HarnessError, match="did not fail in suite 'kv-fill'.*it failed in: categories"):
        Origin(args, "reproduce")
    args = build_parser().parse_args(["repro", "--from-run", str(tmp_path)])
    with pytest.raises(HarnessError, match="name the failing case: its failure ID"):
        Origin(args, "reproduce")


def test_without_an_id_the_flags_still_work(tmp_path):
    from harness.cli import build_parser

    _run_dir(tmp_path)
    args = build_parser().parse_args(
        ["repro", "--from-run", str(tmp_path), "--case", "code_python", "--model", "tiny-dense"]
    )
    assert Origin(args, "reproduce").cell.model == "tiny-dense"
