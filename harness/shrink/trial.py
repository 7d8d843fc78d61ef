"""One trial: a candidate served on the same backend and build as the run, its failing check evaluated, and
whether the *same* signature still fails (not any failure).

A trial runs the candidate's one-cell suite in a fresh executor (fresh sessions, as the run had: a server or
worker per cell), with the run's options; the check's reference cells (spec `none` for `lossless`, `seq` for
`mode-invariant`) run on demand in the same executor. A nondeterministic failure is judged k of n: the trial
repeats until k runs show the signature (it holds) or that can no longer happen (it does not).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from harness import detok as detokenizers
from harness.backends.build import BuildInfo, ensure_server
from harness.backends.choose import backend_factories
from harness.baselines import BaselineStore, default_root
from harness.checks import evaluate
from harness.checks.base import CheckContext, CheckResult
from harness.errors import HarnessBug
from harness.execute import CellRun, Executor
from harness.runner import exec_options
from harness.shrink.candidate import Candidate
from harness.signatures import signature_of


@dataclass(frozen=True)
class Policy:
    """A trial holds when at least `k` of `n` runs show the signature (1 of 1: a deterministic failure)."""

    k: int = 1
    n: int = 1

    def __str__(self) -> str:
        return f"{self.k} of {self.n}"


@dataclass
class Attempt:
    """One run of a candidate: the verdict of its check, the signatures of its failures, the cell runs."""

    signatures: list[str]
    verdict: Optional[CheckResult]
    run: CellRun
    executor: Executor
    harness_error: Optional[str] = None

    def shows(self, signature: str) -> bool:
        return signature in self.signatures


@dataclass
class Trial:
    """Runs of one candidate; `holds` when the signature reproduced as often as the policy asks."""

    candidate: Candidate
    attempts: list[Attempt] = field(default_factory=list)
    holds: bool = False

    def showing(self, signature: str) -> Optional[Attempt]:
        """The last attempt that showed the signature (what a reproducer is written from)."""
        return next((a for a in reversed(self.attempts) if a.shows(signature)), None)


class Runner:
    """Serves candidates with a stored run's options on one backend and build (llama-server is built, or found
    in the cache, once for every trial)."""

    def __init__(self, options: argparse.Namespace, server_bin: Optional[Path], source: Optional[Path],
                 signature: str, policy: Policy, logs: Optional[Path] = None):
        self.options = options
        self.server_bin, self.source = server_bin, source
        self.signature = signature
        self.policy = policy
        self.logs = Path(logs or tempfile.mkdtemp(prefix="specharness-shrink-"))
        self.count = 0
        self._build: Optional[BuildInfo] = None

    def build(self) -> BuildInfo:
        """The llama-server every trial serves with (the run's, or --server-bin / --source)."""
        if self._build is None:
            self._build = ensure_server(source=self.source, server_bin=self.server_bin)
        return self._build

    def spec_overrides(self) -> dict:
        """The run's `--spec-*` options (llama-server names)."""
        return exec_options(self.options, {}).spec_overrides

    def _backends(self, backend: str) -> dict:
        build = self.build() if backend == "server" else None
        return backend_factories(self.server_bin, self.source, self.logs, build=build)

    def attempt(self, candidate: Candidate) -> Attempt:
        """Run the candidate once and evaluate its check."""
        self.count += 1
        options = exec_options(self.options, self._backends(candidate.cell.backend))
        options.spec_overrides = {**options.spec_overrides, **dict(candidate.spec)}
        executor = Executor(options)
        suite = candidate.materialize()
        run = executor.run(suite, candidate.cell)
        if run.harness_error is not None:
            return Attempt([], None, run, executor, harness_error=run.harness_error)
        detok = detokenizers.for_model(candidate.cell.model) or str if run.error is None else str
        ctx = CheckContext(run, candidate.key, executor, BaselineStore(default_root()), detok, "specharness shrink")
        try:
            results = evaluate(ctx, [candidate.check])
        except HarnessBug as err:
            return Attempt([], None, run, executor, harness_error=str(err))
        records = [{"error": o.result.error, "stop_reason": o.result.stop_reason} for o in run.of_case(candidate.key)]
        failed = [r for r in results if not r.passed]
        return Attempt([signature_of(r, records) for r in failed], failed[0] if failed else None, run, executor)

    def trial(self, candidate: Candidate, policy: Optional[Policy] = None) -> Trial:
        """Run the candidate until `policy` (default: the runner's) decides whether the signature holds."""
        policy = policy or self.policy
        trial = Trial(candidate)
        shown = 0
        for i in range(policy.n):
            attempt = self.attempt(candidate)
            trial.attempts.append(attempt)
            shown += attempt.shows(self.signature)
            if shown >= policy.k or shown + (policy.n - i - 1) < policy.k:
                break
        trial.holds = shown >= policy.k
        return trial
