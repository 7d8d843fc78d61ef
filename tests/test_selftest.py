"""The catch matrix under control: every fault switch is caught by its expected check with its expected
evidence, the same plan without a fault reports no failure at all, and no run is a harness error. One
item per row of the matrix (the rows are independent runs of the plan), so pytest-xdist spreads them."""

import pytest

from harness.engine.faults import FAULTS
from harness.selftest import EXPECTED, run_plan

BATCH_REJECTED = "error: llama.cpp rejected the batch as invalid (inconsistent sequence positions)"
DUPLICATES = "kv-healthy: duplicate cells"
DISTINCT = {  # the failure signatures each fault shows on the plan (harness.signatures): one per defect, except
    # where one defect shows two ways — an off-by-one rollback leaves duplicate cells behind a hybrid model's
    # checkpoint and an invalid batch on a dense one; stale drafts lower acceptance and, in kv-fill, never fill
    # the context far enough to drop a draft
    "skip-seq-rm-after-restore": [DUPLICATES],
    "no-sampler-restore": ["lossless: hard divergence"],
    "no-penalty-restore": ["lossless: hard divergence"],
    "keep-drafts-on-decode-failure": [BATCH_REJECTED],
    "rollback-off-by-one": [BATCH_REJECTED, DUPLICATES],
    "partial-checkpoint-only": [DUPLICATES],
    "stale-draft-context": ["acceptance: fell against baseline", "exercised: spec_stats.draft_dropped totals N over "
                            "the cell (expected at least N): the path it counts never ran"],
    "shared-drafter-state": ["acceptance: fell against baseline"],
}


def test_every_fault_has_its_expected_evidence():
    assert set(EXPECTED) == set(FAULTS) == set(DISTINCT)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_fault_is_caught_by_its_expected_check_and_evidence(fault):
    row = run_plan(fault)
    assert not row.harness_errors, row.harness_errors
    caught = {name for name, n in row.caught.items() if n}
    assert caught, f"{fault} not caught by its expected evidence; failures: {row.failures}"
    assert row.distinct == DISTINCT[fault]
    if fault == "skip-seq-rm-after-restore":
        assert row.caught["kv-healthy"] > 0
    if fault == "shared-drafter-state":  # one slot has no other slot to share with
        assert not [c for c in row.failing_cells if c.startswith("seq-")], row.failing_cells


def test_the_same_plan_without_a_fault_is_clean():
    row = run_plan(None)
    assert not row.harness_errors, row.harness_errors
    assert not any(row.failures.values()), f"false positives on the clean selftest plan: {row.failures}"
    assert row.distinct == []
