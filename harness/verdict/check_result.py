"""What a check returns: its verdict on one case of one cell (passed, failed, not run, harness error) with its
evidence. The checks (harness.checks) make them; the known failures, the signatures, bisect and the reports read
them."""

from dataclasses import dataclass, field
from typing import Any

DID_NOT_COMPLETE = " did not complete: "
"""How a failure line says a request did not complete (`exercised`; a known failure's `shortfall` reads it)."""


@dataclass
class CheckResult:
    """A check's verdict on one case of one cell, with its evidence (counts, rates, divergences).

    `failures` holds one line per failing request (or other failing item) when the check judges several:
    a known llama.cpp defect excuses the verdict only if its evidence explains every one of them."""

    name: str
    passed: bool
    message: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    not_run: str | None = None
    """Why the check gave no verdict (it does not apply to the case, or what it needs is missing); `passed` is
    then True (nothing failed) but the result is no pass: `status` says "not run"."""
    harness_error: str | None = None
    """A harness fault kept the check from judging (its message or traceback): never a verdict, never excused by
    a known failure; `specharness run` exits 3 and the pytest item is an ERROR. `not_run` says so too."""

    @property
    def status(self) -> str:
        """`passed`, `failed`, `not run` or `harness error`."""
        if self.harness_error is not None:
            return "harness error"
        if self.not_run is not None:
            return "not run"
        return "passed" if self.passed else "failed"

    @property
    def is_verdict(self) -> bool:
        """Whether the software under test earned this result (passed or failed)."""
        return self.not_run is None and self.harness_error is None


NO_OUTPUT = "no request of the case completed (no-crash says why)"
NOT_SPECULATIVE = "the cell does not speculate"


def not_run(name: str, reason: str) -> CheckResult:
    """A check that gave no verdict, and why (recorded and reported, never a pass)."""
    return CheckResult(name, True, f"not run: {reason}", not_run=reason)


def harness_fault(name: str, error: str) -> CheckResult:
    """A check a harness fault kept from judging (`error`: one line or a traceback)."""
    first = (error.strip().splitlines() or ["harness error"])[-1 if "Traceback" in error else 0]
    return CheckResult(
        name, True, f"harness error: {first}", not_run=f"harness error: {first}", harness_error=error.strip()
    )
