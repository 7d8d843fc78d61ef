"""Builds whose sampled verification is wrong while greedy output is untouched are caught by a default run: the
`sampling` suite on llama-server exits 1 on such a build, through `lossless`'s count of seeded sampled divergences
(harness/checks/seeded.py). The control, the same suite on the unmodified build passing, is the default pytest's
own suites/sampling.yaml items on llama-server (the same build, suite and verdict rules; a separate
`specharness run` of it here repeated them, 53 s of the warm pytest).

The faulty build is tests/seeded.py's `seeded-sampled-verify`: common/sampling.cpp accepts a drafted token when it
is the target's most probable token, whatever the sampler drew. llama-server gives no logits of verified tokens, so
no single divergence proves it; the group's count against the measured noise rate does. Both builds go through the
build cache (the faulty one compiles common/sampling.cpp alone when the compiler cache holds the rest)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from seeded import extra_draw_server, sampled_verify_server, server_suite_run

from harness.backends.build import BuildInfo
from harness.checks import seeded

COUNT = re.compile(
    r"(\d+) of (\d+) seeded sampled draws \(distinct cell, case and seed; rounds replaying a seed count once\) of "
    r"sampling's \d+ speculative server cells diverged from the non-speculative output: the measured noise rate "
    r"\(<= [\d.]+\) makes that p = (\S+) < "
)
GREEDY_CASE = "w1_greedy_dry"
"""The suite's case at temperature 0 (a chat: its keys are w1_greedy_dry.turn<N>)."""

pytestmark = pytest.mark.long  # a sampling run of 24 cells on llama-server: about a minute on 2 cores


@pytest.fixture(scope="module")
def faulty_build() -> BuildInfo:
    return sampled_verify_server()


def sampling_run(build: BuildInfo, out: Path) -> tuple[int, list[dict], str]:
    """`specharness run --suite sampling --backend server --server-bin BUILD`: (exit code, checks.json, console)."""
    proc, checks = server_suite_run(build.server_bin, "sampling", out, timeout=1200)
    return proc.returncode, checks, proc.stdout + proc.stderr


def failing(checks: list[dict]) -> list[dict]:
    """The failing verdicts no known llama.cpp defect explains."""
    return [c for c in checks if not c["passed"] and "known_failure" not in c["evidence"]]


def test_a_build_whose_sampled_verification_is_wrong_fails_the_default_sampling_run_by_its_count(
    faulty_build, tmp_path, tiny_models
):
    code, checks, console = sampling_run(faulty_build, tmp_path / "run")
    assert code == 1, console[-3000:]
    failed = failing(checks)
    # only the sampled verification is wrong: nothing crashes, the greedy case keeps every verdict
    assert {c["check"] for c in failed} <= {"lossless", "distribution"}, sorted({c["check"] for c in failed})
    assert not [c for c in failed if c["case"].startswith(GREEDY_CASE)]
    lossless = [c for c in failed if c["check"] == "lossless"]
    assert lossless, "no lossless failure: the divergences were reported only"
    for verdict in lossless:
        count = COUNT.search(verdict["message"])
        assert count, verdict["message"]
        diverged, compared = int(count.group(1)), int(count.group(2))
        evidence = verdict["evidence"]
        assert (diverged, compared) == (evidence["group_diverged"], evidence["group_compared"])
        assert evidence["group_p_value"] < seeded.ALPHA and "reported_only" not in evidence
        assert len(evidence["group_divergences"]) == diverged
    assert "lossless" in console and "seeded sampled draws" in console  # the console's verdict lines say it too


def test_a_build_that_draws_once_more_after_a_rejection_fails_the_sampling_run_by_its_count_only(tmp_path, tiny_models):
    """The extra-draw class (tests/seeded.py EXTRA_DRAW): the output keeps the target's distribution, so
    `distribution` passes, and the seeded tokens move, so the count of seeded sampled divergences fails `lossless`."""
    code, checks, console = sampling_run(extra_draw_server(), tmp_path / "run")
    assert code == 1, console[-3000:]
    failed = failing(checks)
    assert {c["check"] for c in failed} == {"lossless"}, sorted({(c["check"], c["message"][:80]) for c in failed})
    assert all(COUNT.search(c["message"]) for c in failed), failed[0]["message"]
