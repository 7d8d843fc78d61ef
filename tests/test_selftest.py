"""The catch matrix: every fault switch is caught by the check expected for its bug class, and a run with
no fault reports no failure at all."""

from harness.engine.faults import FAULTS
from harness.selftest import EXPECTED, catch_matrix


def test_every_fault_is_caught_by_its_expected_check_and_clean_runs_are_clean():
    rows = {row.fault: row for row in catch_matrix(clean_runs=1)}
    assert set(rows) == {*FAULTS, "none"}
    for fault in FAULTS:
        assert rows[fault].caught_by & EXPECTED[fault], f"{fault} caught only by {sorted(rows[fault].caught_by)}"
    assert rows["skip-seq-rm-after-restore"].failures["kv-healthy"] > 0
    assert rows["none"].caught_by == set(), rows["none"].failures
