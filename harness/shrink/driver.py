"""The shrink passes over a failing case, each keeping a reduction only while the same signature still fails.

Order (cheap and far-reaching first): the model (the tiny model of the same kind before a real one), the
other requests in flight and the rounds, the chat turns (then the failing turn as one token prompt),
n_predict (first to the first divergent token), the prompt's tokens (ddmin), n_predict again, the drafter's
options, the slots, n_ctx / n_batch / n_ubatch. Every trial is one line of progress and of `shrink-log.jsonl`;
Ctrl-C, SIGTERM or the time limit stop it with the smallest failing case found so far.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from harness.errors import HarnessError
from harness.models import resolve
from harness.repro.legs import tokenize
from harness.shrink.candidate import SERVE_KEYS, Candidate
from harness.shrink.ddmin import ddmin, smallest
from harness.shrink.trial import BASELINE_CHECKS, Runner, Trial

TINY = {"dense": "tiny-dense", "hybrid": "tiny-hybrid", "recurrent": "tiny-recurrent"}
"""The tiny model tried first for a real model of each kind."""
SERVE_DEFAULTS = {"n_ctx": 4096, "n_batch": 2048, "n_ubatch": 512}
SERVE_FLOOR = {"parallel": 1, "n_ctx": 16, "n_batch": 1, "n_ubatch": 1}
SPEC_FLOOR = {
    "spec-draft-n-max": 1,
    "spec-draft-n-min": 0,
    "spec-ngram-simple-size-n": 1,
    "spec-ngram-simple-size-m": 1,
    "spec-ngram-map-k-size-n": 1,
    "spec-ngram-map-k-size-m": 1,
    "spec-ngram-map-k-min-hits": 1,
    "spec-ngram-map-k4v-size-n": 1,
    "spec-ngram-map-k4v-size-m": 1,
    "spec-ngram-map-k4v-min-hits": 1,
    "spec-ngram-mod-n-match": 1,
    "spec-ngram-mod-n-min": 1,
    "spec-ngram-mod-n-max": 1,
}
"""The smallest value tried for each integer drafter option; `spec-draft-p-min` is tried at 0 (off)."""


class TimeUp(Exception):
    """The shrink's time limit passed: stop with the smallest case found."""


class Shrinker:
    """Runs the passes; `best` (and `best_trial`) is the smallest candidate that still fails."""

    def __init__(
        self, runner: Runner, start: Trial, log: Path, say: Callable[[str], None], time_limit: float | None = None
    ):
        self.runner = runner
        self.best, self.best_trial = start.candidate, start
        self.kept: list[Trial] = [start]
        """The trials of the steps that held, in order: the original first, `best_trial` last."""
        self.first = start.candidate
        self.log, self.say = log, say
        self.started = time.monotonic()
        self.deadline = self.started + time_limit if time_limit else None
        self.seen: dict[Candidate, bool] = {start.candidate: True}
        self.stopped: str | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fails(self, candidate: Candidate, what: str) -> bool:
        """Whether `candidate` still fails with the signature (memoized); a failing one becomes `best`."""
        if candidate in self.seen:
            return self.seen[candidate]
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeUp()
        trial = self.runner.trial(candidate)
        self.seen[candidate] = trial.holds
        shown = [
            a.signatures[0] if a.signatures else ("harness error" if a.harness_error else "passed")
            for a in trial.attempts
        ]
        self.say(
            f"shrink: trial {self.runner.count} [{self.elapsed():.0f} s] {what}: "
            + ("still fails" if trial.holds else f"no ({shown[-1]})")
        )
        with open(self.log, "a") as f:
            f.write(
                json.dumps(
                    {
                        "trial": self.runner.count,
                        "seconds": round(self.elapsed(), 1),
                        "what": what,
                        "holds": trial.holds,
                        "seen": shown,
                        "candidate": candidate.to_json(),
                    }
                )
                + "\n"
            )
        if trial.holds:
            self.best, self.best_trial = candidate, trial
            self.kept.append(trial)
        return trial.holds

    # ------------------------------------------------------------------------------------------ passes

    def run(self) -> Candidate:
        """Every pass in order; stops early (keeping `best`) on Ctrl-C, SIGTERM or the time limit."""
        try:
            for step in (
                self.model,
                self.in_flight,
                self.turns,
                self.n_predict,
                self.prompt,
                self.n_predict,
                self.drafter,
                self.serve,
            ):
                step()
        except KeyboardInterrupt:
            self.stopped = "interrupted"
        except TimeUp:
            self.stopped = "time limit"
        return self.best

    def model(self) -> None:
        cell = self.best.cell
        kind = resolve(cell.model).kind
        tiny = TINY.get(kind)
        if tiny and cell.model != tiny and self.runner.options.draft_model is None:
            self.fails(self.best.with_(cell=cell.reference(model=tiny)), f"model {tiny} instead of {cell.model}")

    def in_flight(self) -> None:
        best = self.best
        if best.companions:
            if not self.fails(best.with_(companions=()), "no other requests in flight"):
                ddmin(
                    list(best.companions),
                    lambda c: self.fails(
                        self.best.with_(companions=tuple(c)), f"other requests {len(c)}: {', '.join(c)}"
                    ),
                )
        if len(self.best.rounds) > 1:
            self.fails(self.best.with_(rounds=self.best.rounds[:1]), "one round")

    def turns(self) -> None:
        best = self.best
        if best.turn is None:
            return
        earlier = list(best.sent_turns()[:-1])
        if earlier and not self.fails(best.with_(turns=(best.turn,)), "only the failing turn"):
            ddmin(
                earlier,
                lambda kept: self.fails(
                    self.best.with_(turns=(*kept, self.best.turn)), f"turns {[t + 1 for t in (*kept, self.best.turn)]}"
                ),
            )
        tokens = self._prompt_tokens()
        if tokens:
            self.fails(self.best.with_(prompt=tuple(tokens)), f"the failing turn as a prompt of {len(tokens)} tokens")

    def _prompt_tokens(self) -> list[int] | None:
        """The failing request's prompt as token ids: as the backend evaluated it, or a completion prompt
        tokenized here (a crashed request reports none)."""
        best = self.best
        for attempt in reversed(self.best_trial.attempts):
            for run in attempt.executor.runs():
                done = next((o for o in run.of_case(best.key) if o.result.prompt_tokens), None)
                if done is not None:
                    return list(done.result.prompt_tokens)
        case = next(c for c in best.load_suite().cases if c.name == best.case)
        if case.is_chat:
            return None
        return tokenize(resolve(best.cell.model).path, case.prompt)

    def n_predict(self) -> None:
        best = self.best
        if best.n_predict == 1:
            return
        attempt = self.best_trial.showing(self.runner.signature)
        first = (attempt.verdict.evidence.get("first_divergence") or {}) if attempt and attempt.verdict else {}
        if isinstance(first.get("index"), int) and first["index"] + 1 < best.n_predict:
            self.fails(
                best.with_(n_predict=first["index"] + 1), f"n_predict {first['index'] + 1} (to the first divergence)"
            )
        high = self.best.n_predict if self.best.n_predict > 0 else 4096
        smallest(1, high, lambda n: n == high or self.fails(self.best.with_(n_predict=n), f"n_predict {n}"))

    def prompt(self) -> None:
        if self.best.prompt is None:
            tokens = self._prompt_tokens()
            if not tokens or not self.fails(
                self.best.with_(prompt=tuple(tokens)), f"the prompt as {len(tokens)} token ids"
            ):
                return
        ddmin(
            list(self.best.prompt),
            lambda kept: self.fails(self.best.with_(prompt=tuple(kept)), f"prompt {len(kept)} tokens"),
        )

    def drafter(self) -> None:
        preset = self.best.cell.preset
        options = {**preset.options, **self.runner.spec_overrides(), **dict(self.best.spec)}
        for name, value in options.items():
            if name == "spec-draft-p-min" and value:
                self.fails(self.best.with_spec(name, 0.0), f"{name} 0")
            elif name in SPEC_FLOOR and isinstance(value, int) and value > SPEC_FLOOR[name]:
                smallest(
                    SPEC_FLOOR[name],
                    value,
                    lambda v, name=name, value=value: (
                        v == value or self.fails(self.best.with_spec(name, v), f"{name} {v}")
                    ),
                )

    def serve(self) -> None:
        suite = self.best.load_suite()
        names = [n for n in SERVE_KEYS if n != "parallel" or self.best.cell.mode != "seq"]
        for name in names:
            value = self.best.serve_value(
                name, suite, self.runner.options.parallel if name == "parallel" else SERVE_DEFAULTS[name]
            )
            if value > SERVE_FLOOR[name]:
                smallest(
                    SERVE_FLOOR[name],
                    value,
                    lambda v, name=name, value=value: (
                        v == value or self.fails(self.best.with_serve(name, v), f"{name} {v}")
                    ),
                )


def require_shrinkable(check: str, reference: str | None) -> None:
    """`baseline` and `acceptance` compare with what is stored for the original case: a smaller case needs a
    reference configuration to record its own (trial.Runner.baselines), which a run of the reference
    configuration itself (no --fault in-process, the vendored llama-server) does not have (`reference`:
    trial.reference_of)."""
    if check in BASELINE_CHECKS and reference is None:
        raise HarnessError(
            f"a `{check}` failure compares with the baseline stored for the original case, and this "
            "run has no other configuration to record one for a smaller case (no --fault; llama-server "
            "without --server-bin / --source): shrink a comparison within the run instead (--check "
            "lossless, mode-invariant, kv-healthy, no-crash)"
        )
