"""Delta debugging: the smallest failing sublist (Zeller and Hildebrandt's ddmin) and the smallest failing
integer. `fails` runs a trial; the caller (shrink.driver.Shrinker) memoizes trials and keeps the smallest
failing case found so far, so an interrupt loses nothing. Tested on known predicates in tests/test_ddmin.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool], min_size: int = 1) -> list[T]:
    """A 1-minimal failing sublist of `items` (order kept) of at least `min_size` items: no single chunk of
    the last partition can be removed without the failure going away. `items` itself must fail."""
    current, n = list(items), 2
    while len(current) > min_size:
        n = min(n, len(current))
        chunks = _split(current, n)
        for i in range(n):
            complement = [x for j, chunk in enumerate(chunks) if j != i for x in chunk]
            if len(chunks[i]) >= min_size and n > 2 and fails(chunks[i]):  # n == 2: the complement test covers it
                current, n = chunks[i], 2
                break
            if len(complement) >= min_size and fails(complement):
                current, n = complement, max(n - 1, 2)
                break
        else:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current


def _split(items: list[T], n: int) -> list[list[T]]:
    """`items` in `n` contiguous chunks of nearly equal length."""
    out, start = [], 0
    for i in range(n):
        end = start + (len(items) - start) // (n - i)
        out.append(items[start:end])
        start = end
    return out


def smallest(low: int, high: int, fails: Callable[[int], bool]) -> int:
    """The smallest value in [low, high] that fails, by bisection (`high` fails; the failure is taken to
    persist above its smallest value, as larger budgets run the same steps further)."""
    while low < high:
        mid = (low + high) // 2
        if fails(mid):
            high = mid
        else:
            low = mid + 1
    return high
