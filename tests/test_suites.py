"""Suite files: the shipped suites load; malformed ones give one line naming file, line and field."""

from pathlib import Path

import pytest
import yaml

from harness.errors import HarnessError
from harness.matrix import Cell, cells, spec_preset
from harness.suites import load_suite, parse_suite, suite_files, yamltext

GOOD = """\
suite: demo
cases:
  - name: one
    prompt: hello
"""


def test_every_shipped_suite_loads():
    names = {load_suite(str(p)).name for p in suite_files()}
    assert {"quicksort", "w1", "categories", "repeat", "grammar-json", "kv-fill", "sampling"} <= names


def test_quicksort_is_the_field_report_suite():
    suite = load_suite("quicksort")
    assert [c.name for c in suite.cases] == ["C", "Java", "Python"]
    assert suite.rounds == ["seq", "seq", "par"]
    assert suite.cases[0].prompt.startswith("Write a quicksort demo in C.")


@pytest.mark.parametrize(
    "text, line, field",
    [
        (GOOD.replace("prompt: hello", "promt: hello"), 4, "cases.0.promt"),
        (GOOD + "    sampling: {n_predict: many}\n", 5, "cases.0.sampling.n_predict"),
        (GOOD.replace("suite: demo", "suite: Demo Suite"), 1, "suite"),
        (GOOD + "matrix: {modes: [sequential]}\n", 5, "matrix.modes.0"),
        ("suite: demo\ncases: [\n", 3, None),
    ],
)
def test_malformed_suite_names_file_line_and_field(tmp_path, text, line, field):
    path = tmp_path / "demo.yaml"
    path.write_text(text)
    with pytest.raises(HarnessError) as err:
        load_suite(str(path))
    message = str(err.value)
    assert message.startswith(f"{path}:{line}:") and "\n" not in message
    if field:
        assert f": {field}:" in message


def test_suite_name_must_match_its_file(tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(GOOD)
    with pytest.raises(HarnessError, match="must match the file name"):
        load_suite(str(path))


def test_unknown_field_names_the_key_and_the_closest_known_one(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text(GOOD + "dedline_s: 5\n")
    with pytest.raises(HarnessError, match=r":5: dedline_s: unknown field 'dedline_s' \(did you mean 'deadline_s'\?\)"):
        load_suite(str(path))


def test_deadline_and_accept_expectations_are_suite_and_case_settings():
    suite = parse_suite(
        "suite: d\ndeadline_s: 2.5\nexpect_accepts: false\ncases:\n  - {name: a, prompt: x}\n"
        "  - {name: b, prompt: y, expect_accepts: true}\n"
    )
    assert suite.deadline_s == 2.5 and [c.expect_accepts for c in suite.cases] == [False, True]
    assert suite.cases[0].request(suite.deadline_s).deadline_s == 2.5
    assert parse_suite(GOOD).deadline_s is None and parse_suite(GOOD).cases[0].expect_accepts


def test_vars_format_the_prompt_and_sampling_defaults_merge():
    suite = parse_suite(
        "suite: d\nsampling: {n_predict: 7}\ncases:\n  - {name: a, prompt: 'x {v}', vars: {v: 1},"
        " sampling: {temperature: 0.5}}\n"
    )
    case = suite.cases[0]
    assert case.prompt == "x 1" and case.sampling.n_predict == 7 and case.sampling.temperature == 0.5


def test_matrix_expands_and_leaves_scripted_configs_out_of_server_cells_and_synthetic_ones_out_of_inproc():
    matrix = {
        "backends": ["inproc", "server"],
        "modes": ["seq"],
        "specs": ["none", "scripted-reject", "synth-reject"],
        "models": ["tiny-dense"],
    }
    got = cells(matrix)
    assert Cell("server", "seq", "scripted-reject", "tiny-dense") not in got
    assert Cell("inproc", "seq", "synth-reject", "tiny-dense") not in got
    assert len(got) == 4
    assert cells(matrix, {"backends": ["inproc"], "specs": None})[0].id == "seq-none-tiny-dense-inproc"


def test_spec_presets_chain_with_plus_and_reject_unknown_names():
    chained = spec_preset("draft-simple+ngram-mod")
    assert chained.options["spec-type"] == "draft-simple,ngram-mod"
    with pytest.raises(HarnessError, match="unknown spec config"):
        spec_preset("magic")
    for name in ("synth-reject+ngram-mod", "none+ngram-mod", "scripted-reject+ngram-mod"):  # not a --spec-type
        with pytest.raises(HarnessError, match="only presets named after their --spec-type combine"):
            spec_preset(name)


@pytest.mark.parametrize(
    "extra, line, field",
    [
        ("checks: [no-crash, lossles]\n", 5, "checks.1"),
        ("matrix:\n  specs: [none, draft-simpel]\n", 6, "matrix.specs.1"),
    ],
)
def test_unknown_check_or_spec_names_are_errors_with_their_line(tmp_path, extra, line, field):
    path = tmp_path / "demo.yaml"
    path.write_text(GOOD + extra)
    with pytest.raises(HarnessError, match=rf"^{path}:{line}: {field}: unknown name"):
        load_suite(str(path))


def test_prompt_vars_that_do_not_fit_are_errors_with_their_line(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_text("suite: demo\ncases:\n  - name: one\n    prompt: 'int main() { return {x}; }'\n    vars: {y: 1}\n")
    with pytest.raises(HarnessError, match=rf"^{path}:4: cases.0.prompt: cannot fill in vars"):
        load_suite(str(path))


def test_non_utf8_suite_file_is_one_line_error(tmp_path):
    path = tmp_path / "demo.yaml"
    path.write_bytes(b"suite: demo\xff\n")
    with pytest.raises(HarnessError, match="not UTF-8 text"):
        load_suite(str(path))


def test_the_fast_yaml_reader_gives_pyyaml_s_safe_data_and_its_error_wording():
    """harness.suites.yamltext reads with libyaml where PyYAML has it: every shipped suite and the known-failures file
    read the same as `yaml.safe_load`; a broken text fails with the pure-Python loader's words and line."""
    shipped = sorted((Path(__file__).resolve().parent.parent / "suites").glob("*.yaml"))
    assert shipped
    for path in shipped:
        text = path.read_text()
        assert yamltext.load(text) == yaml.safe_load(text), path.name
    for bad in ("a: [1, 2", "a: b: c", "- x\ny: 1"):
        with pytest.raises(yaml.YAMLError) as pyyaml:
            yaml.safe_load(bad)
        with pytest.raises(yaml.YAMLError) as ours:
            yamltext.load(bad)
        assert str(ours.value) == str(pyyaml.value)


def test_per_cell_seeds_give_every_cell_its_own_seed_and_refuse_checks_that_compare_draws(tmp_path):
    """`seeds: per-cell`: each cell sends the case's seed plus its id's CRC-32 (the same in every run; a random or
    unset seed stays as it is), the default sends it as written; a per-cell suite with `lossless` (which compares a
    cell's draw with the non-speculative cell's of the same seed) is refused in one line naming the field."""
    base = (
        "suite: demo\nsampling: {temperature: 0.7, seed: 5}\nmatrix: {specs: [draft-simple]}\n"
        "checks: [no-crash, distribution]\ncases:\n"
    )
    per_cell = parse_suite(
        base.replace("suite: demo\n", "suite: demo\nseeds: per-cell\n") + "  - {name: a, prompt: x}\n"
    )
    shared = parse_suite(base + "  - {name: a, prompt: x}\n")
    mine = cells(per_cell.matrix)
    seeds = [per_cell.sent_case(per_cell.cases[0], c).sampling.seed for c in mine]
    assert len(mine) > 1 and len(set(seeds)) == len(mine) and 5 not in seeds
    assert seeds == [per_cell.sent_case(per_cell.cases[0], c).sampling.seed for c in mine]  # reproducible
    assert {shared.sent_case(shared.cases[0], c).sampling.seed for c in mine} == {5}
    random = parse_suite(
        base.replace("seed: 5", "seed: -1").replace("suite: demo\n", "suite: demo\nseeds: per-cell\n")
        + "  - {name: a, prompt: x}\n"
    )
    assert random.sent_case(random.cases[0], mine[0]).sampling.seed == -1
    path = tmp_path / "demo.yaml"
    path.write_text(
        base.replace("suite: demo\n", "suite: demo\nseeds: per-cell\n").replace("distribution]", "lossless]")
        + "  - {name: a, prompt: x}\n"
    )
    with pytest.raises(HarnessError) as err:
        load_suite(str(path))
    assert str(err.value).startswith(f"{path}:2: seeds: per-cell") and "lossless" in str(err.value)
    assert "\n" not in str(err.value)
