"""The catch matrix under control: every fault switch is caught by its expected check with its expected
evidence, the same plan without a fault reports no failure at all, and no run is a harness error."""

from harness.engine.faults import FAULTS
from harness.selftest import EXPECTED, catch_matrix


def test_every_fault_is_caught_by_its_expected_check_and_the_clean_plan_is_clean():
    rows = catch_matrix(clean_runs=0)
    by_fault = {row.fault: row for row in rows}
    assert set(by_fault) == {*FAULTS, "none"} and set(EXPECTED) == set(FAULTS)
    assert not [(r.fault, r.harness_errors) for r in rows if r.harness_errors]
    clean = by_fault["none"]
    assert not any(clean.failures.values()), f"false positives on the clean selftest plan: {clean.failures}"
    for fault in FAULTS:
        caught = {name for name, n in by_fault[fault].caught.items() if n}
        assert caught, f"{fault} not caught by its expected evidence; failures: {by_fault[fault].failures}"
    assert by_fault["skip-seq-rm-after-restore"].caught["kv-healthy"] > 0
