"""The catch matrix: every fault switch is caught by the check expected for its bug class. (That runs with
no fault report no failure is what `pytest suites/` itself shows, in the same session.)"""

from harness.engine.faults import FAULTS
from harness.selftest import EXPECTED, catch_matrix


def test_every_fault_is_caught_by_its_expected_check():
    rows = {row.fault: row for row in catch_matrix(clean_runs=0)}
    assert set(rows) == {*FAULTS, "none"}
    for fault in FAULTS:
        assert rows[fault].caught_by & EXPECTED[fault], f"{fault} caught only by {sorted(rows[fault].caught_by)}"
    assert rows["skip-seq-rm-after-restore"].failures["kv-healthy"] > 0
