"""The catch matrix under control: every fault switch is caught by its expected check with its expected
evidence, the same plan without a fault reports no failure at all, and no run is a harness error. One
item per row of the matrix; the rows run on one xdist worker, the clean row first, and share the cells without
speculation it served (harness.commands.selftest.Unspeculated), as `specharness selftest` does."""

import os
from pathlib import Path

import pytest

from harness.backends.base import ServeConfig
from harness.backends.inproc import spec_config
from harness.commands.selftest import (
    DISTRIBUTION_PART,
    EXPECTED,
    FAULT_PLAN,
    PLAN,
    ROUNDS,
    Unspeculated,
    load_parts,
    run_plan,
)
from harness.engine.faults import FAULTS
from harness.matrix import cells
from harness.suites import load_suite

pytestmark = pytest.mark.xdist_group("selftest")


@pytest.fixture(scope="module")
def shared():
    return Unspeculated()


DUPLICATES = "kv-healthy: duplicate cells"
NOT_DRAWS = (
    "distribution: the returned tokens are not draws from the target's distribution: Kolmogorov-Smirnov D = N over N "
    "tokens of N outputs, p = N < N (mean PIT N, N expected"
)
TAIL_NOT_DRAWS = (  # caught by a tail count of the transforms (issue 61)
    "distribution: the returned tokens are not draws from the target's distribution: N of N tokens of N outputs with "
    "a transform in [N, N) (N expected), p = N < N (mean PIT N, N …"
)
DISTINCT = {  # the failure signatures each fault shows on the plan (harness.signatures): one per defect. An
    # off-by-one rollback is the same signature where llama.cpp refuses the next batch (dense: the cache holds
    # its first position) and where its check does not look (hybrid: the scan finds the duplicate cells); stale
    # drafts are one in quicksort (the draft context's orphans, acceptance a consequence) and in kv-fill (the
    # draft context fills with them and drafting stops: the scan taken then)
    "skip-seq-rm-after-restore": [DUPLICATES],
    "no-sampler-restore": ["lossless: hard divergence"],
    "no-penalty-restore": ["lossless: hard divergence"],
    "keep-drafts-on-decode-failure": ["kv-healthy: holes"],
    "rollback-off-by-one": [DUPLICATES],
    "partial-checkpoint-only": [DUPLICATES],
    "stale-draft-context": ["kv-healthy: orphans in the draft context"],
    "shared-drafter-state": ["acceptance: fell against baseline"],
    # echo's Kotlin, served after Python and Rust on one slot, drafts from their n-grams: 24 drafted, none accepted
    "ngram-cache-kept-across-requests": [
        "acceptance: fell against baseline",
        "spec-ran: N tokens drafted, none accepted",
    ],
    "full-checkpoint": ["work: more work than the baseline in ckpt_created_bytes, ckpt_restored_bytes"],
    # a wrong MTP row moves tiny-hybrid-mtp's drafts a little (its head weighs the row at 0.1): C decodes more in seq,
    # and accepts fewer than its baseline (draft-mtp's acceptance tolerance is 0 since tiny-hybrid-mtp's calibration);
    # its MTP context decodes more too (draft_decoded counts the MTP context's decodes since 2026-11-26, session 10);
    # its partial rollbacks follow its other drafts, which `work` leaves to `acceptance` (OTHER_DRAFTS, 2026-12-05)
    "mtp-wrong-row": [
        "acceptance: fell against baseline",
        "work: more work than the baseline in target_decoded, draft_decoded",
    ],
    # a stale recurrent state: a hard divergence where the logits before it still agree, drift where they do not
    "stale-partial-rollback": ["lossless: hard divergence", "lossless: drift divergence"],
    # rejection sampling that leaves the target's distribution: both cases of the statistical part fail the KS test,
    # or, the residual not renormalised (its draws pile up in the chain's tail), the count of transforms in the top 5 %
    "lenient-accept": [NOT_DRAWS],
    "residual-unnormalised": [TAIL_NOT_DRAWS],
    "q-wrong-temperature": [NOT_DRAWS],
    "rejection-rng-rewound": [NOT_DRAWS],
    # a whole draft's bonus token from the row before, in every draft-simple cell of the plan: greedy outputs leave the
    # non-speculative ones (hard where the logits before agree; drift or unexplained after earlier wrong tokens), the
    # JSON grammar's output breaks, and sampling-close's close drafts emit tokens outside the chain's support
    "bonus-wrong-row": [
        "lossless: hard divergence",
        "lossless: unexplained divergence",
        "lossless: drift divergence",
        "distribution: N of N returned tokens are outside the chain's support beyond what numerics moves (a logit "
        "raise above the near-tie floor N nats, calibrated (calibration/tiny-…",
        "grammar-valid: invalid output",
    ],
    # one draw too many after a mismatch: every seeded sampled request of tiny-dense's sample-and-match cells diverges;
    # the logits there differ in the last bits (a verification batch against a one-token decode), so no single
    # divergence is proven (`unexplained`) and the group's count fails (harness.checks.seeded)
    "extra-draw-after-reject": ["lossless: unexplained divergence"],
    # the heads' faults, on quicksort's seq draft-eagle3 / draft-dflash cells of tiny-hybrid-mtp (their own part): a
    # stale boundary drafts worse; layers in reverse order make EAGLE3 draft otherwise, more target decodes for as
    # many accepted in some requests; a drafted block left in the head's cache makes llama.cpp refuse the next batch
    "eagle3-stale-boundary": ["acceptance: fell against baseline"],
    "head-wrong-layer": ["work: more work than the baseline in target_decoded, draft_decoded"],
    "head-draft-left-in-cache": [
        "error: the draft head's context refused the target's batch: llama.cpp rejected the batch as invalid "
        "(inconsistent sequence positions)"
    ],
}
OWN_PART_ONLY = {
    "mtp-wrong-row": "draft-mtp",
    "stale-partial-rollback": "draft-mtp",
    "shared-drafter-state": "ngram-map-k",
    "ngram-cache-kept-across-requests": "ngram-cache",
    "lenient-accept": "draft-simple-probabilistic",
    "residual-unnormalised": "draft-simple-probabilistic",
    "q-wrong-temperature": "draft-simple-probabilistic",
    "rejection-rng-rewound": "draft-simple-probabilistic",
    "eagle3-stale-boundary": "draft-eagle3",
    "head-wrong-layer": "draft-eagle3",
    "head-draft-left-in-cache": "draft-dflash",
}
"""Faults only one drafter reaches (draft-mtp's drafter and its partial rollback; the fault switches of ngram-map-k /
-k4v and ngram-cache are read by those drafters alone, harness/engine/speculative.py; the rejection faults but
`extra-draw-after-reject` act only in rejection sampling, which only the -probabilistic presets verify by): the
selftest plan's cells run none of them, so with the fault on they serve what the clean row serves, and the fault's
test runs its own part alone (the plan's cells are those of the clean row). `extra-draw-after-reject` also acts in
sample-and-match, which the plan's draft-simple cells verify by: it runs the plan too."""
DISTRIBUTION_FAULTS = ("lenient-accept", "residual-unnormalised", "q-wrong-temperature")


def test_every_fault_has_its_expected_evidence():
    assert set(EXPECTED) == set(FAULTS) == set(DISTINCT)


def test_the_plan_runs_none_of_the_drafters_whose_faults_skip_it():
    """What lets these faults' tests skip the plan: none of its cells drafts with draft-mtp (the only type whose
    rollback is `partial` by default), ngram-map-k / -k4v or ngram-cache, and each fault's own part does."""
    assert set(OWN_PART_ONLY) <= set(FAULT_PLAN)
    specs = [spec for _, only in PLAN for spec in only["specs"]]
    assert not [spec for spec in specs for drafter in OWN_PART_ONLY.values() if drafter in spec]
    for fault, drafter in OWN_PART_ONLY.items():
        assert [only for _, only in FAULT_PLAN[fault] if any(drafter in spec for spec in only["specs"])]


def test_the_plan_serves_one_seq_round_and_shared_drafter_state_its_par_round():
    """The selftest serves quicksort and sampling one `seq` round (`ROUNDS`), `shared-drafter-state`'s part the par
    round it is caught in: each a prefix of the suite's `run_order`, so round r is sent as the baselines' stored
    round r, and each cell (and the cell without speculation it is compared with) one way in the whole plan (the
    executor serves a cell of a suite once)."""
    parts = PLAN + [part for fault_parts in FAULT_PLAN.values() for part in fault_parts]
    served = {}
    for (name, _), (suite, only) in zip(parts, load_parts(parts), strict=True):
        full = load_suite(name).rounds
        assert suite.rounds == full[: len(suite.rounds)], (name, suite.rounds, full)
        assert "run_order" not in only
        for cell in cells(suite.matrix, only):
            for c in (cell, cell.reference(spec="none")):
                assert served.setdefault((name, c), suite.rounds) == suite.rounds, (name, c.id)
    assert [suite.rounds for suite, _ in load_parts(PLAN) if suite.name in ROUNDS] == [["seq"], ["seq"]]
    assert "par" in load_parts(FAULT_PLAN["shared-drafter-state"])[0][0].rounds


def test_a_part_with_sampling_serves_every_case_with_it_and_one_suite_takes_one_sampling():
    """The rejection faults' part: the statistical suite (found below suites/ by its relative name) with every case at
    the part's temperature, length and ignore_eos. The executor keys a run by suite name and cell, so the selftest
    gives a suite one `sampling` in all its parts (the clean row serves them in one executor)."""
    parts = PLAN + [part for fault_parts in FAULT_PLAN.values() for part in fault_parts]
    ((suite, only),) = load_parts([DISTRIBUTION_PART])
    assert suite.name == "sampling-distribution" and "sampling" not in only
    assert {(c.sampling.temperature, c.sampling.n_predict, c.sampling.ignore_eos) for c in suite.cases} == {
        (0.5, 1536, True)
    }
    assert {c.sampling.seed for c in suite.cases} == {c.sampling.seed for c in load_suite(DISTRIBUTION_PART[0]).cases}
    samplings = {}
    for name, only in parts:
        assert samplings.setdefault(name, only.get("sampling")) == only.get("sampling"), name


STATISTICAL = os.environ.get("SPECHARNESS_STATISTICAL")
"""The statistical job (.ci/statistical sets SPECHARNESS_STATISTICAL=1) serves the rejection-sampling part: two
1536-token outputs per cell, about 25-47 s a fault and 50 s of the clean row, a sample the default pytest leaves to
that job as it leaves suites/statistical."""
STATISTICAL_SUITE = DISTRIBUTION_PART[0]
STATISTICAL_FAULTS = [f for f, parts in FAULT_PLAN.items() if any(name == STATISTICAL_SUITE for name, _ in parts)]
statistical_only = pytest.mark.statistical  # a 1536-token rejection-sampling sample: deselected by default


def clean_parts(statistical: bool) -> list:
    """The selftest plan and every fault's part, the rejection-sampling parts alone or without them."""
    parts = PLAN + [part for fault_parts in FAULT_PLAN.values() for part in fault_parts]
    parts = [part for i, part in enumerate(parts) if part not in parts[:i]]
    return [part for part in parts if (part[0] == STATISTICAL_SUITE) == statistical]


@pytest.mark.parametrize(
    "statistical", [pytest.param(False, id="default"), pytest.param(True, id="statistical", marks=statistical_only)]
)
def test_the_same_plan_without_a_fault_is_clean(shared, statistical):
    row = run_plan(None, load_parts(clean_parts(statistical)), shared=shared)
    assert not row.harness_errors, row.harness_errors
    assert not any(row.failures.values()), f"false positives on the clean selftest plan: {row.failures}"
    assert row.distinct == []


def test_the_clean_row_is_the_plan_and_every_faults_part_split_in_two():
    """The two clean rows together serve what `specharness selftest`'s clean row serves, and the default one holds
    every part but the rejection-sampling sample's."""
    assert STATISTICAL_FAULTS == [
        "lenient-accept",
        "residual-unnormalised",
        "q-wrong-temperature",
        "rejection-rng-rewound",
    ]
    default, statistical = clean_parts(False), clean_parts(True)
    parts = PLAN + [part for fault_parts in FAULT_PLAN.values() for part in fault_parts]
    assert sorted(map(repr, default + statistical)) == sorted({repr(p) for p in parts})
    assert statistical and all(name == STATISTICAL_SUITE for name, _ in statistical)


def test_a_fault_switch_leaves_a_cell_without_speculation_as_it_is():
    """What lets the rows share those cells: the engine reads a fault only through its speculation, which a cell
    without speculation does not create (harness/engine/scheduler.py), whatever fault its options name."""
    for fault in FAULTS:
        config = spec_config(ServeConfig(model=Path("m.gguf"), mode="seq", engine={"fault": fault}))
        assert config.fault == fault and not config.enabled


@pytest.mark.parametrize(
    "fault", [pytest.param(f, marks=statistical_only) if f in STATISTICAL_FAULTS else f for f in FAULTS]
)
def test_the_fault_is_caught_by_its_expected_check_and_evidence(fault, shared):
    own = load_parts(FAULT_PLAN[fault]) if fault in OWN_PART_ONLY else None
    row = run_plan(fault, own, shared)
    assert not row.harness_errors, row.harness_errors
    caught = {name for name, n in row.caught.items() if n}
    assert caught, f"{fault} not caught by its expected evidence; failures: {row.failures}"
    assert row.distinct == DISTINCT[fault]
    if fault in ("skip-seq-rm-after-restore", "stale-draft-context"):  # the scan itself, not only a consequence
        assert row.caught["kv-healthy"] > 0
    if OWN_PART_ONLY.get(fault) == "draft-mtp":  # its own part: the seq draft-mtp cell of the MTP hybrid
        assert row.failing_cells == {"seq-draft-mtp-tiny-hybrid-mtp-inproc"}, row.failing_cells
    if fault == "shared-drafter-state":  # one slot has no other slot to share with
        assert not [c for c in row.failing_cells if c.startswith("seq-")], row.failing_cells
    if fault == "rejection-rng-rewound":  # the rejection-sampling cell of the hybrid (a checkpoint restore)
        assert row.failing_cells == {"seq-draft-simple-probabilistic-tiny-hybrid-inproc"}, row.failing_cells
    if fault in DISTRIBUTION_FAULTS:  # both cases of the one rejection-sampling cell
        assert row.failing_cells == {"seq-draft-simple-probabilistic-tiny-dense-inproc"}, row.failing_cells
        assert row.caught["distribution"] == 2
    if fault == "extra-draw-after-reject":  # every mode of tiny-dense; the plan's hybrid restores the sampler
        assert row.failing_cells == {f"{m}-draft-simple-tiny-dense-inproc" for m in ("seq", "par", "no-kv-unified")}
