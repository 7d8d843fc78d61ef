"""One trial: a candidate served on the same backend and build as the run, its failing check evaluated, and
whether the *same* signature still fails (not any failure).

A trial runs the candidate's one-cell suite in a fresh executor (fresh sessions, as the run had: a server or
worker per cell), with the run's options; the check's reference cells (spec `none` for `lossless`, `seq` for
`mode-invariant`) run on demand in the same executor. A nondeterministic failure is judged k of n: the trial
repeats until k runs show the signature (it holds) or that can no longer happen (it does not).

`baseline` and `acceptance` compare with what is stored for the original case, which says nothing about a
smaller one: a candidate other than the original is judged against a baseline that the reference
configuration records for it first (the run's options without `--fault`; for llama-server, the vendored build
instead of `--server-bin` / `--source`), as the stored one was recorded with the harness's own build.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness.backends.build import BuildInfo, ensure_server
from harness.backends.choose import backend_factories
from harness.checks import evaluate_cell
from harness.checks.base import CheckResult
from harness.errors import HarnessBug
from harness.execute import CellRun, Executor
from harness.execute.run_options import exec_options
from harness.shrink.candidate import Candidate
from harness.signatures import signature_of
from harness.verdict.baselines import BaselineStore, default_root


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
    verdict: CheckResult | None
    run: CellRun
    executor: Executor
    harness_error: str | None = None

    def shows(self, signature: str) -> bool:
        return signature in self.signatures


@dataclass
class Trial:
    """Runs of one candidate; `holds` when the signature reproduced as often as the policy asks."""

    candidate: Candidate
    attempts: list[Attempt] = field(default_factory=list)
    holds: bool = False

    def showing(self, signature: str) -> Attempt | None:
        """The last attempt that showed the signature (what a reproducer is written from)."""
        return next((a for a in reversed(self.attempts) if a.shows(signature)), None)


BASELINE_CHECKS = ("baseline", "acceptance")
"""Checks that compare with the baseline stored for the original case."""


def reference_of(options: argparse.Namespace, server_bin: Path | None, source: Path | None, backend: str) -> str | None:
    """What the reference configuration of a run's cell differs in from the run's (`without --fault`, `the
    vendored llama-server`); None when the run's configuration is the reference itself."""
    if backend == "server":
        return "the vendored llama-server" if server_bin or source else None
    return "without --fault" if options.fault else None


class Runner:
    """Serves candidates with a stored run's options on one backend and build (llama-server is built, or found
    in the cache, once for every trial). `origin`: the original case, judged against the stored baselines."""

    def __init__(
        self,
        options: argparse.Namespace,
        server_bin: Path | None,
        source: Path | None,
        signature: str,
        policy: Policy,
        logs: Path | None = None,
        origin: Candidate | None = None,
    ):
        self.options = options
        self.server_bin, self.source = server_bin, source
        self.signature = signature
        self.policy = policy
        self.logs = Path(logs or tempfile.mkdtemp(prefix="specharness-shrink-"))
        self.origin = origin
        self.count = 0
        self.rate: tuple[int, int] | None = None
        """(runs that showed the signature, runs) of the original case, measured before shrinking."""
        self._build: BuildInfo | None = None
        self._references: dict[Candidate, BaselineStore] = {}

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

    def _serve(self, candidate: Candidate, reference: bool = False) -> tuple[CellRun, Executor]:
        """The candidate's cell served with the run's options (`reference`: the reference configuration's)."""
        backend = candidate.cell.backend
        if reference and backend == "server":
            backends = backend_factories(None, None, self.logs, build=ensure_server())
        else:
            backends = self._backends(backend)
        options = exec_options(self.options, backends)
        options.spec_overrides = {**options.spec_overrides, **dict(candidate.spec)}
        if reference:
            options.engine = {**options.engine, "fault": None}
        executor = Executor(options)
        return executor.run(candidate.materialize(), candidate.cell), executor

    def baselines(self, candidate: Candidate) -> BaselineStore:
        """The stored baselines for the original case (and for checks that do not read them); for a smaller
        case of a `baseline` / `acceptance` failure, a store the reference configuration recorded it in."""
        if candidate.check not in BASELINE_CHECKS or candidate == self.origin:
            return BaselineStore(default_root())
        if candidate not in self._references:
            reference = reference_of(self.options, self.server_bin, self.source, candidate.cell.backend)
            if reference is None:
                raise HarnessBug("a baseline-relative shrink without a reference configuration (require_shrinkable)")
            root = self.logs / "baselines" / str(len(self._references))
            run, executor = self._serve(candidate, reference=True)
            recording = BaselineStore(root, update=True)
            if run.fault is None:
                evaluate_cell(run, executor, recording, list(BASELINE_CHECKS), "specharness shrink", [candidate.key])
            self._references[candidate] = BaselineStore(root)
        return self._references[candidate]

    def attempt(self, candidate: Candidate) -> Attempt:
        """Run the candidate once and evaluate its check."""
        self.count += 1
        run, executor = self._serve(candidate)
        if run.fault is not None:  # the harness could not serve the candidate: no verdict, no signature
            return Attempt([], None, run, executor, harness_error=run.harness_error or run.fault)
        store = self.baselines(candidate)
        results = [
            r for _, r in evaluate_cell(run, executor, store, [candidate.check], "specharness shrink", [candidate.key])
        ]
        faults = [r for r in results if r.harness_error is not None]
        if faults:
            return Attempt([], None, run, executor, harness_error=faults[0].harness_error)
        results = [r for r in results if r.is_verdict]
        records = [{"error": o.result.error, "stop_reason": o.result.stop_reason} for o in run.of_case(candidate.key)]
        failed = [r for r in results if not r.passed]
        return Attempt([signature_of(r, records) for r in failed], failed[0] if failed else None, run, executor)

    def trial(self, candidate: Candidate, policy: Policy | None = None) -> Trial:
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
