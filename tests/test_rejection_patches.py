"""Rejection sampling that does not keep the target's distribution is caught by `distribution` on llama-server
itself, not only on the in-process engine's fault switches (harness/commands/selftest.py
DISTRIBUTION_PART): each of four
one-edit patches of llama.cpp b11434 (the first tag with `--spec-draft-sampling probabilistic`) makes the
statistical suite's tiny-dense seq draft-simple-probabilistic server cell exit 1 by `distribution`, and the
unpatched b11434 build passes the same run. And the one known defect of b11434's rejection sampling (its stream
rewound by a speculative checkpoint restore: known failure server-rejection-rng-rewound-on-checkpoint-restore) fails
the tiny-hybrid cell, while b11434 with the upstream report's one-line patch passes it.

The sample is DISTRIBUTION_PART's: `sampling-distribution`'s two cases at temperature 0.5 (at temperature 1 the
wrong-temperature q is the right one), 1536 tokens each, end-of-generation ignored. The patches mirror the engine's
faults of the same names (harness/engine/faults.py; `over-accept-0.5` its graded fault at ε 0.5), built from the
tag's tree as `b11434-<name>` through the build cache (tests/seeded.py `seeded_tree` with `source`; the compiler
cache serves every object but the edited file's).

The statistical job's (marker `statistical`: the default pytest deselects it); skipped there unless llama-server
b11434 is in the build cache (`.ci/statistical` builds it with STATISTICAL_TAG=b11434)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from seeded import seeded_tree

from harness.backends.build import BuildInfo, cached_server, ensure_server
from harness.backends.build.tags import extracted_tag_source, tag_cmake_args
from harness.errors import HarnessError

ROOT = Path(__file__).resolve().parents[1]
TAG = "b11434"
SUITE = ROOT / "suites" / "statistical" / "sampling-distribution.yaml"
SAMPLING = {"temperature": 0.5, "n_predict": 1536, "ignore_eos": True}
"""Every case's sampling (harness/commands/selftest.py DISTRIBUTION_PART): a sample on which each patch fails the
check."""
CELL = ["--backend", "server", "--mode", "seq", "--spec", "draft-simple-probabilistic", "--model", "tiny-dense"]
NOT_TARGET = "not draws from the target's distribution"


def _tag_build() -> BuildInfo | None:
    """The cached llama-server of TAG (what `specharness build --tag TAG --cached-only` finds), else None."""
    tree = extracted_tag_source(TAG)
    try:
        return cached_server(tree, "cpu", tag_cmake_args(TAG)) if tree is not None else None
    except HarnessError:
        return None


TAG_BUILD = _tag_build()
pytestmark = [
    pytest.mark.statistical,  # each run serves and scores two 1536-token outputs, about 40 s a patch
    pytest.mark.long,
    pytest.mark.skipif(
        TAG_BUILD is None,
        reason=f"llama-server {TAG} is not in the build cache (.ci/statistical builds it with STATISTICAL_TAG={TAG}; "
        f"or `specharness build --tag {TAG}`)",
    ),
]

SAMPLING_CPP = "common/sampling.cpp"
SPECULATIVE_CPP = "common/speculative.cpp"
PATCHES: dict[str, tuple[str, dict[str, str]]] = {
    # common_sampler_sample_and_accept_n_rejection: accept whenever p_x > 0, not with probability min(1, p/q)
    "lenient-accept": (
        SAMPLING_CPP,
        {
            "        if (q_x > 0.0f && (p_x >= q_x || uni(gsmpl->rng) < p_x / q_x)) {\n": (
                "        if (p_x > 0.0f) { // seeded bug: lenient acceptance\n"
            )
        },
    ),
    # the engine's graded fault over-accept=0.5 (harness/engine/faults.py GRADED): accept with probability
    # min(1, 1.5 p/q), not min(1, p/q) (the bench measured 0.21 of total variation per token on tiny-dense at 512)
    "over-accept-0.5": (
        SAMPLING_CPP,
        {
            "        if (q_x > 0.0f && (p_x >= q_x || uni(gsmpl->rng) < p_x / q_x)) {\n": (
                "        if (q_x > 0.0f && (1.5f * p_x >= q_x || uni(gsmpl->rng) < 1.5f * p_x / q_x)) { // seeded bug\n"
            )
        },
    ),
    # the residual redraw's uniform in [0, 1), not in [0, sum): past the residual's mass it takes the last token
    "residual-unnormalised": (
        SAMPLING_CPP,
        {
            "            float u = uni(gsmpl->rng) * sum;\n": (
                "            float u = uni(gsmpl->rng); // seeded bug: not scaled by the residual's sum\n"
            )
        },
    ),
    # draft-simple drafts at the target's temperature (spec_retune) but keeps q, its candidates' probabilities, at
    # temperature 1: softmax of logit * temp (the temperature sampler divided the logits by temp; candidates are
    # sorted, so the first has the largest logit). The n_max line after it tells draft-simple's from draft-mtp's.
    "q-wrong-temperature": (
        SPECULATIVE_CPP,
        {
            (
                "                if (dp.result_q) {\n"
                "                    dp.result_q->emplace_back(cur_p->data, cur_p->data + cur_p->size);\n"
                "                }\n"
                "\n"
                "                if ((params.n_max <= (int) result.size()) ||\n"
            ): (
                "                if (dp.result_q) {\n"
                "                    // seeded bug: q at temperature 1, not at the temperature the draft sampled with\n"
                "                    auto & q = dp.result_q->emplace_back(cur_p->data, cur_p->data + cur_p->size);\n"
                "                    float s = 0.0f;\n"
                "                    for (auto & e : q) { s += (e.p = expf((e.logit - q[0].logit) * dp.temp)); }\n"
                "                    for (auto & e : q) { e.p /= s; }\n"
                "                }\n"
                "\n"
                "                if ((params.n_max <= (int) result.size()) ||\n"
            )
        },
    ),
}
"""name -> (file, edits) of each patch of b11434 (each edited text found exactly once in its file)."""


def patched_server(name: str) -> BuildInfo:
    """llama-server of b11434 with patch `name`, built once as `b11434-<name>` (the tree `llama.cpp-b11434-<name>`)."""
    file, edits = PATCHES[name]
    tree = seeded_tree(edits, name, "tests/test_rejection_patches.py", file=file, source=extracted_tag_source(TAG))
    return ensure_server(source=tree)


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    """sampling-distribution.yaml with every case's sampling at SAMPLING (the cases' own seeds kept)."""
    data = yaml.safe_load(SUITE.read_text())
    data["sampling"] = {**data["sampling"], **SAMPLING}
    for case in data["cases"]:
        assert set(case.get("sampling", {})) <= {"seed"}, case  # nothing else may override SAMPLING
    path = tmp_path_factory.mktemp("statistical") / SUITE.name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def distribution_run(
    suite: Path, build: BuildInfo, out: Path, model: str = "tiny-dense"
) -> tuple[int, list[dict], str]:
    """`specharness run` of the seq draft-simple-probabilistic server cell of `model` (tiny-dense) on `build`:
    (exit code, checks.json, console)."""
    cell = [*CELL[:-1], model]
    argv = ["run", "--suite", str(suite), *cell, "--server-bin", str(build.server_bin), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    checks = json.loads((out / "checks.json").read_text()) if (out / "checks.json").is_file() else []
    return proc.returncode, checks, proc.stdout + proc.stderr


def distribution_verdicts(checks: list[dict], model: str = "tiny-dense") -> list[dict]:
    """The `distribution` verdicts of the cell of `model` (one per case)."""
    cell = {"backend": "server", "mode": "seq", "spec": "draft-simple-probabilistic", "model": model}
    return [c for c in checks if c["check"] == "distribution" and all(c[k] == v for k, v in cell.items())]


def p_values(build: str, verdicts: list[dict]) -> str:
    """One line per case: the build, the case and its Kolmogorov-Smirnov p (shown with `pytest -s`)."""
    return "\n".join(f"{build} {c['case']}: p = {c['evidence']['p_value']:.3g}" for c in verdicts)


@pytest.mark.parametrize("patch", list(PATCHES))
def test_rejection_sampling_that_moves_the_distribution_fails_distribution(patch, suite, tmp_path, tiny_models):
    code, checks, console = distribution_run(suite, patched_server(patch), tmp_path / "run")
    assert code == 1, console[-3000:]
    failed = [c for c in checks if not c["passed"]]
    # only the distribution moves: nothing crashes, speculation ran, and `distribution` says why, on the cell
    assert {c["check"] for c in failed} == {"distribution"}, [(c["check"], c["message"]) for c in failed]
    assert failed == [c for c in distribution_verdicts(checks) if not c["passed"]], failed
    assert all(NOT_TARGET in c["message"] for c in failed), [c["message"] for c in failed]
    print(p_values(f"{TAG}-{patch}", distribution_verdicts(checks)))


def test_rejection_sampling_of_b11434_keeps_the_target_distribution(suite, tmp_path, tiny_models):
    code, checks, console = distribution_run(suite, TAG_BUILD, tmp_path / "run")
    assert code == 0, console[-3000:]
    verdicts = distribution_verdicts(checks)
    assert verdicts and all(c["passed"] for c in verdicts), [c["message"] for c in verdicts]
    print(p_values(TAG, verdicts))


RNG_FIX = "rng-not-restored"
RNG_FIX_EDITS = {
    "    dst->rng        = src->rng;\n": (
        "    // dst->rng is not restored: the rejection-sampling stream keeps running across a checkpoint restore\n"
    )
}
"""The proposed patch of known failure server-rejection-rng-rewound-on-checkpoint-restore (common/sampling.cpp's
common_sampler_copy; docs/upstream-reports/patches/server-rejection-rng-rewound-on-checkpoint-restore.diff)."""


def test_b11434_rewinds_the_rejection_rng_on_a_checkpoint_restore_and_the_proposed_patch_fixes_it(
    suite, tmp_path, tiny_models
):
    """tiny-hybrid rolls a partial acceptance back through the speculative checkpoint, which restores the sampler
    with its rejection-sampling stream (common_sampler_copy copies `rng`): b11434 fails `distribution` on that cell;
    b11434 with the one-line patch of the upstream report passes it."""
    tree = seeded_tree(
        RNG_FIX_EDITS, RNG_FIX, "tests/test_rejection_patches.py", file=SAMPLING_CPP, source=extracted_tag_source(TAG)
    )
    code, checks, console = distribution_run(suite, TAG_BUILD, tmp_path / "b11434", model="tiny-hybrid")
    verdicts = distribution_verdicts(checks, "tiny-hybrid")
    assert code == 1 and any(not c["passed"] and NOT_TARGET in c["message"] for c in verdicts), console[-3000:]
    print(p_values(TAG, verdicts))
    code, checks, console = distribution_run(suite, ensure_server(source=tree), tmp_path / "fixed", model="tiny-hybrid")
    verdicts = distribution_verdicts(checks, "tiny-hybrid")
    assert code == 0 and verdicts and all(c["passed"] for c in verdicts), console[-3000:]
    print(p_values(f"{TAG}-{RNG_FIX}", verdicts))
