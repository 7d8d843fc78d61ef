"""ddmin and the integer search of `specharness shrink` on predicates whose minimal failing input is known: the
result must fail, be 1-minimal (no single item can go), keep order, honour `min_size`, and not run far more trials
than the input is long."""

import pytest

from harness.shrink.ddmin import ddmin, smallest


def counting(predicate):
    """`predicate` with a count of its calls (the trials a shrink would run)."""
    calls = []

    def fails(items):
        calls.append(items)
        return predicate(items)

    return fails, calls


def one_minimal(result, fails) -> bool:
    return all(not fails(result[:i] + result[i + 1 :]) for i in range(len(result)))


@pytest.mark.parametrize("needed", [(3,), (3, 7), (0, 39), (5, 6, 7), (1, 12, 25, 38)])
def test_ddmin_finds_exactly_the_items_the_failure_needs_in_order(needed):
    fails, calls = counting(lambda items: set(needed) <= set(items))
    result = ddmin(list(range(40)), fails)
    assert result == list(needed)
    assert one_minimal(result, fails)
    assert len(calls) <= 40 * len(needed)  # about |needed| log2(40) trials per needed item: never 2^40


def test_ddmin_keeps_a_failure_that_needs_a_contiguous_run_whole():
    run = [10, 11, 12, 13]

    def fails(items):  # the run must appear in a row, as a token sequence a drafter keys on
        return any(list(items[i : i + len(run)]) == run for i in range(len(items)))

    assert ddmin(list(range(30)), fails) == run


def test_ddmin_stops_at_min_size_and_returns_the_input_when_nothing_can_go():
    assert len(ddmin(list(range(20)), lambda items: True, min_size=3)) == 3
    assert ddmin([1, 2], lambda items: len(items) == 2) == [1, 2]


def test_ddmin_result_is_one_minimal_for_a_failure_of_several_alternatives():
    # fails when it holds 2 and 9, or when it holds 17 alone: either answer is 1-minimal, never a mix
    def fails(items):
        return {2, 9} <= set(items) or 17 in items

    result = ddmin(list(range(20)), fails)
    assert result in ([17], [2, 9]) and one_minimal(result, fails)


@pytest.mark.parametrize("threshold", [1, 2, 37, 99, 100])
def test_smallest_finds_the_first_failing_value_in_log_trials(threshold):
    fails, calls = counting(lambda n: n >= threshold)
    assert smallest(1, 100, fails) == threshold
    assert len(calls) <= 7
