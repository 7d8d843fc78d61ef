"""Failure signatures: how many distinct problems a red run has, and where each shows.

Stages, each its own module, each importing only the ones before it (and nothing of harness.report, which
uses them): `signature` (a failing verdict → its signature, or the failure it only restates), `group` (a
stored run's verdicts → one Failure per signature, with its consequences), `pattern` (per Failure, where the
run's axes failed, passed or did not run, and the one-line reading), `text` (the console lines).
"""

from harness.signatures.group import Failure, group, headline
from harness.signatures.pattern import Pattern, failure_patterns
from harness.verdict.signature import Signature, classify, normalise, of_error, signature_of

__all__ = [
    "Failure",
    "Pattern",
    "Signature",
    "classify",
    "failure_patterns",
    "group",
    "headline",
    "normalise",
    "of_error",
    "signature_of",
]
