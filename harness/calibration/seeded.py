"""The seeded noise rate of a device, measured in the calibration pass (harness.checks.seeded counts against it).

Where verification is sample-and-match, a seeded sampled request returns the non-speculative request's tokens
except where numerical noise in the verification batch moves a draw across a boundary. How often that happens is
a property of the device and the build: its kernels and the batch shapes they take. Calibration measures it for
the model, in each mode, as the check counts it: the `sampling` suite's seeded sampled cases (temperature 0.7,
repetition penalties, one under a JSON grammar) repeated with `SEEDS` fresh seeds each, served with a
sample-and-match drafter that drafts with a model (`draft-simple`, else `draft-mtp`, else the first one the
model serves) and without speculation, one request at a time (the suite's rounds); a draw is one (cell, case,
seed) and diverged when its tokens differ (`harness.checks.seeded.draws`). The calibration file keeps
(diverged, draws) per mode under `seeded`; `harness.checks.seeded.measured_noise` reads it back on that device.
"""

from dataclasses import replace

from harness import MODES
from harness.checks.seeded import draws, noise_bound, seeded_keys
from harness.errors import HarnessError
from harness.matrix import Cell, spec_preset
from harness.suites import Suite, load_suite

SUITE = "sampling"
"""The suite whose seeded sampled cases are measured (the one the committed NOISE was measured with)."""
SEEDS = 10
"""Fresh seeds per case: 2 cases × 10 = 20 draws per mode, about 45 s of a tiny model's calibration on 2 busy CPU
cores. Few draws bound the rate loosely (0 of 20: 13.9 %), so the count pools them with the committed draws where
they agree and uses them alone only where they refute the committed rate (harness.checks.seeded.device_counts)."""
SEED_STRIDE = 7919
"""Seed step between repetitions (a prime, as `specharness bench seeded` steps)."""
DRAFTERS = ("draft-simple", "draft-mtp")
"""The drafters preferred for the measurement: they draft with a model, so sampled text gets drafts (an n-gram
drafter rarely drafts on sampled text, and an undrafted request measures no verification batch)."""


def suite_of(seeds: int = SEEDS) -> Suite:
    """The `sampling` suite's seeded sampled cases (no chat, temperature > 0, a fixed seed), each repeated `seeds`
    times with seed + SEED_STRIDE·i, in the suite's own rounds' first (one request at a time)."""
    base = load_suite(SUITE)
    keep = [c for c in base.cases if not c.is_chat and not c.sampling.greedy and not c.sampling.random_seed]
    cases = [
        replace(case, name=f"{case.name}-s{i}", sampling=replace(case.sampling, seed=_seed(case) + SEED_STRIDE * i))
        for i in range(seeds)
        for case in keep
    ]
    return replace(base, name="calibrate-seeded", cases=cases, matrix=[], rounds=[base.rounds[0]])


def _seed(case) -> int:
    return case.sampling.seed if case.sampling.seed is not None else 42


def drafter(specs: list[str]) -> str | None:
    """The sample-and-match drafter measured, of the speculative configs calibration serves the model with."""
    kept = [s for s in specs if spec_preset(s).options and spec_preset(s).keeps_seeded_tokens]  # no scripted one
    return next((s for s in DRAFTERS if s in kept), kept[0] if kept else None)


def seeded_servings(model: str, backend: str, specs: list[str], seeds: int = SEEDS) -> list[tuple[Suite, Cell]]:
    """What the seeded measurement serves (`seeded_counts` reads their runs in this order): per mode, the seeded
    suite with the sample-and-match drafter, then without speculation; none where the model has no such drafter."""
    spec = drafter(specs)
    if spec is None:
        return []
    suite = suite_of(seeds)
    return [(suite, Cell(backend, mode, s, model)) for mode in MODES for s in (spec, "none")]


def seeded_counts(model: str, backend: str, servings: list[tuple[Suite, Cell]], runs: list, seeds: int = SEEDS):
    """The calibration file's `seeded` from `seeded_servings`'s runs: per mode (diverged, draws) of `model`'s
    seeded sampled draws on this device, with the drafter and the method; None where nothing was served."""
    if not servings:
        return None
    for run in runs:
        failed = run.fault or run.crash or run.error
        if failed:
            raise HarnessError(f"seeded calibration run {run.cell.id} failed: {failed.splitlines()[0]}")
    suite, spec = servings[0][0], servings[0][1].spec
    keys = seeded_keys(suite, model)
    by_mode = {}
    for mine, reference in zip(runs[::2], runs[1::2], strict=True):
        found = draws(mine, reference, keys)
        by_mode[mine.cell.mode] = [sum(d.diverged for d in found), len(found)]
    return {
        "spec": spec,
        "by_mode": by_mode,
        "bound": {mode: round(noise_bound(backend, mode, tuple(kn)), 6) for mode, kn in by_mode.items()},
        "method": (
            f"the {SUITE} suite's seeded sampled cases × {seeds} fresh seeds (seed + {SEED_STRIDE}·i), served with "
            f"{spec} and without speculation, one request at a time; a draw is a distinct (cell, case, seed), "
            "diverged when its tokens differ from the non-speculative request's; bound: one-sided 95 % "
            "Clopper-Pearson"
        ),
    }
