"""The measurements of a (model, backend): the reference and every equivalent run, each served on fresh sessions
(side by side: harness.calibration.serving), and per run the statistics of its logits against the reference's;
`calibrate` makes the content of a calibration file from them.

Over the positions before the first token divergence of each pair it records, per position, test-backend-ops'
NMSE, KL, max |Δ| and the change of the top1−top2 margin, and the reference's margin wherever an equivalent
run's token flipped. `repeats` whole measurements give the spread a re-measurement may show (par on llama-server
depends on request timing).
"""

import datetime
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from harness import __version__
from harness.backends.choose import backend_factories
from harness.calibration.seeded import seeded_counts, seeded_servings
from harness.calibration.serving import Servings
from harness.calibration.tolerances import (
    SAFETY,
    SPREAD_FLOOR,
    acceptance_spread,
    largest_of,
    tolerances_of,
)
from harness.calibration.variants import IN_ORDER, UBATCH, Variant, prompts, specs_of, variants
from harness.errors import HarnessError
from harness.matrix import Cell
from harness.models import resolve
from harness.result.logits import WINDOW_MAX, compare, larger_curves, max_abs_quantile, window_largest
from harness.suites import Suite
from harness.verdict.baselines import output_digest
from harness.verdict.triage import at, gap


def _suite(name: str, cases: list, serve: dict) -> Suite:
    """A serving's suite: the cases sent at once (the one variant that asked for the seq round, in-order, is not
    served: `same_serving`), each prompt read whole. With llama-server's prompt cache a prompt goes on from the
    state an earlier one left where they share a prefix, which measures the cache's logic, not numerics: the
    `checkpoints` suite's prompts are made to restore context checkpoints, and measured 2026-12-07 with the cache
    on, tiny-hybrid's `seq/*/n_ubatch=7` variants restored the stale checkpoint of the known defect
    server-stale-context-checkpoint (case `back` flipped its first token at a margin of 0.29 nats: a near-tie floor
    of 0.58) and tiny-recurrent's moved its logits by up to 0.029 nats. What the cache changes in numerics, the rest
    of a prompt read in another batch, is the `n_ubatch=7` split's to measure."""
    return Suite(
        name=name, path=None, cases=cases, matrix=[], checks=[], serve=serve, rounds=["par"], prompt_cache=False
    )


def timing_dependent(variant: Variant) -> bool:
    """Whether a variant's logits and acceptance can change from one fresh serving to the next: several slots
    (`par`, `no-kv-unified`) share batches in the order requests happen to arrive. A one-slot (`seq`) variant is a
    function of its command line and its prompts (with one slot a session sends one request at a time, in order,
    whatever the round: harness.backends.server_backend.ServerSession.run). Measured 2026-12-04 on llama-server
    (CPU, tiny-dense, two fresh measurements): all 9 `seq` variants (the `n_ubatch=7` and `in-order` ones
    included) bit-identical, 7 of the 8 `par` / `no-kv-unified` ones different; the in-process engine's committed
    files measured every variant of both repeats identical."""
    return variant.cell.mode != "seq"


def same_serving(variant: Variant) -> str | None:
    """The variant whose serving `variant` is, where it is another's: `seq/<spec>/in-order` is `seq/<spec>` (a
    one-slot session serves one request at a time, in order, whatever the round: ServerSession.run, the engine's
    one slot). Every committed calibration file (8 models × 2 backends, 36 such pairs) measured the two identical,
    statistics, acceptance and outputs alike, so it is not served twice."""
    if variant.name.endswith(f"/{IN_ORDER}") and variant.cell.mode == "seq":
        return variant.name[: -len(f"/{IN_ORDER}")]
    return None


@dataclass(frozen=True)
class Serving:
    """One serving of a measurement: `variant` in whole measurement `repeat`, as `suite` and `cell`."""

    repeat: int
    variant: Variant
    suite: Suite
    cell: Cell


def servings(every: list[Variant], cases: list, repeats: int, repeat_all: bool) -> list[Serving]:
    """What `repeats` measurements serve of `every` variant (`variants`): every variant in the first,
    in a repeat only those whose serving depends on timing (`timing_dependent`; every one with `repeat_all`): the
    others' statistics carry over; none that is another's serving (`same_serving`). Longest first, so the last
    of the servings side by side end together: a variant that drafts with a model or head, then one slot."""
    reference_suite = _suite("calibrate", cases, {})
    out = []
    for repeat in range(repeats):
        for variant in every:
            if same_serving(variant) or (repeat and not (repeat_all or timing_dependent(variant))):
                continue
            own = variant.serve and _suite(f"calibrate-{variant.name.replace('/', '-')}", cases, variant.serve)
            out.append(Serving(repeat, variant, own or reference_suite, variant.cell))
    return sorted(out, key=lambda s: (not s.cell.spec.startswith("draft-"), s.cell.mode != "seq"))


def _check_reference(reference) -> None:
    """The reference run's end, read as harness.checks.evaluate reads a cell's: nothing to measure against."""
    if reference.fault or reference.crash:
        raise HarnessError(f"calibration reference run failed: {reference.fault or reference.crash}")
    if reference.error:  # the model or the backend could not be had
        raise HarnessError(f"calibration reference run failed: {reference.error.splitlines()[0]}")


def measurements_of(every: list[Variant], repeats: int, plan: list[Serving], runs: list, reference) -> list[dict]:
    """Per measurement, per variant (in the order of `every`: `variants`), the statistics of its run against the
    reference's: served in that measurement, else carried over from the first, or the statistics of the serving it is
    (`same_serving`)."""
    served: list[dict] = [{} for _ in range(repeats)]
    for serving, run in zip(plan, runs, strict=True):
        if run.fault or run.crash:
            raise HarnessError(f"calibration run {serving.variant.name} failed: {run.fault or run.crash}")
        served[serving.repeat][serving.variant.name] = _pair_stats(reference, run, serving.variant)
    out = []
    for measured in served:
        whole = {}
        for variant in every:
            name = same_serving(variant) or variant.name
            whole[variant.name] = measured.get(name, served[0].get(name))
        out.append(whole)
    return out


def _pair_stats(reference, run, variant: Variant | None = None) -> dict:
    """NMSE / KL / max |Δ| / margin change over the shared prefix of each case, and the flips (`logits: false` where
    a known defect moves them: then `largest_of` leaves them out), and each request's acceptance counters with its
    output (the requests `variant.acceptance` counts)."""
    rows, runs, flips, windows = [], [], [], {}
    for ref in reference.outcomes:
        other = next(o for o in run.outcomes if o.case == ref.case)
        a, b = ref.result, other.result
        if not (a.ok and b.ok):
            raise HarnessError(f"calibration request {ref.case} failed: {a.error or b.error}")
        same = next(
            (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
            min(len(a.tokens), len(b.tokens)),
        )
        comparison = compare(a.logits[:same], b.logits[:same])
        if comparison.n_compared:
            runs.append(
                {
                    "nmse": comparison.nmse,
                    "kl_mean": comparison.kl_mean,
                    "max_abs_p95": max_abs_quantile(comparison, 0.95),
                    "max_abs": comparison.max_abs,
                }
            )
            windows = larger_curves(windows, window_largest(comparison))
        for pos in comparison.per_position["position"]:
            x, y = at(a.logits, pos), at(b.logits, pos)
            if x.margin is not None and y.margin is not None and x.top_ids[0] == y.top_ids[0]:
                rows.append(abs(x.margin - y.margin))
        if same < min(len(a.tokens), len(b.tokens)) and (x := at(a.logits, same)) is not None:
            flip = gap(x, a.tokens[same], b.tokens[same])
            flips.append(
                {
                    "case": ref.case,
                    "index": same,
                    "reference_gap": None if flip is None else round(flip, 6),
                    **({"split_rollback_before": step} if (step := b.split_rollback_before(same)) else {}),
                }
            )
    frame = pd.DataFrame(runs)
    counted = _acceptance_counted(run, variant or Variant("", run.cell, {}))
    acceptance = {
        o.case: [
            o.result.spec_stats.get("draft_n", 0),
            o.result.spec_stats.get("draft_n_accepted", 0),
            len(o.result.tokens),
        ]
        for o in counted
    }
    outputs = {o.case: output_digest(o.result.tokens) for o in counted}
    deltas = np.array(rows) if rows else np.zeros(1)
    return {
        "runs": len(runs),
        "positions": len(rows),
        "nmse_max": float(frame["nmse"].max()) if runs else 0.0,
        "kl_mean_max": float(frame["kl_mean"].max()) if runs else 0.0,
        "max_abs_p95_max": float(frame["max_abs_p95"].max()) if runs else 0.0,
        "max_abs_max": float(frame["max_abs"].max()) if runs else 0.0,
        "margin_delta_max": float(deltas.max()),
        "margin_delta_p99": float(np.quantile(deltas, 0.99)),
        "flips": flips,
        "windows": windows,
        **({} if variant is None or variant.logits else {"logits": False}),
        **({"acceptance": acceptance, "outputs": outputs} if acceptance else {}),
    }


def _without_windows(variant: dict) -> dict:
    """A variant's statistics as the file keeps them: its window curves are in the file's `windows` (their largest
    over every variant), not per variant (64 values × 3 statistics each)."""
    return {k: v for k, v in variant.items() if k != "windows"}


def _acceptance_counted(run, variant: Variant) -> list:
    """The requests of `run` whose acceptance counts toward the spread (`Variant.acceptance`): every one of a
    speculative run, none under a known defect of acceptance."""
    if not run.cell.preset.speculative or not variant.acceptance:
        return []
    return list(run.outcomes)


def calibrate(
    model: str,
    backend: str,
    repeats: int = 2,
    server_bin: Path | None = None,
    source: Path | None = None,
    logs: Path | None = None,
    only: list[str] | None = None,
    repeat_all: bool = False,
    seeded: bool = True,
    jobs: int | None = None,
) -> dict:
    """Measure `repeats` times on fresh sessions; the content of the calibration file (of the `only` specs'
    variants where given: `partial`, to be merged into a committed file). A repeat serves again only the variants
    whose serving depends on timing (`timing_dependent`; every variant with `repeat_all`), reusing the first
    measurement's reference run. With `seeded` (not for a partial file), the seeded noise rate is measured in the
    same pass (harness.calibration.seeded). Every serving after the reference's is served `jobs` at a time
    (harness.calibration.serving; default: as many as the cores hold servers)."""
    info = resolve(model)
    known = specs_of(backend, model)  # once: it reads every suite
    if only:
        unknown = [s for s in only if s not in known]
        if unknown:
            raise HarnessError(
                f"calibrate --spec {unknown[0]}: not a speculative config {model} is measured with on {backend} "
                f"(use one of: {', '.join(known)})"
            )
    cases = prompts(model)
    every = variants(backend, model, only, known)  # once: each Cell is made here, with its preset (harness.matrix)
    plan = servings(every, cases, repeats, repeat_all)
    seeded_plan = seeded_servings(model, backend, known) if seeded and not only else []
    backend_obj = backend_factories(server_bin, source, logs)[backend]()
    pool = Servings(backend, backend_obj, jobs)
    first = (_suite("calibrate", cases, {}), Cell(backend, "seq", "none", model))
    reference, runs = pool.serve(first, [(s.suite, s.cell) for s in plan] + seeded_plan, _check_reference)
    env = pool.environment(first[1])
    measurements = measurements_of(every, repeats, plan, runs[: len(plan)], reference)
    noise = seeded_counts(model, backend, seeded_plan, runs[len(plan) :])
    served = [v.name for v in every if (repeat_all or timing_dependent(v)) and not same_serving(v)]
    largest = [largest_of(m) for m in measurements]
    overall = {k: max(lg[k] for lg in largest) for k in ("nmse", "kl", "max_abs", "near_tie")}
    windows = larger_curves(*(lg["windows"] for lg in largest))
    if any(lg["unbounded_flip"] for lg in largest):
        raise HarnessError(
            f"an equivalent run of {model} on {backend} flipped a token the reference ranks "
            "beyond its top-k: that is no near-tie but a logic bug; fix it before calibrating"
        )
    spread = {
        k: max(SPREAD_FLOOR, 2 * (max(lg[k] for lg in largest) - min(lg[k] for lg in largest)) / overall[k])
        if overall[k] > 0
        else SPREAD_FLOOR
        for k in overall
    }
    return {
        "model": model,
        "backend": backend,
        "device": env["device"],
        "model_sha256": info.sha256,
        "environment": {k: v for k, v in env.items() if k != "model_sha256"},
        "harness_version": __version__,
        "measured_on": datetime.date.today().isoformat(),
        "command": f"specharness calibrate --model {model} --backend {backend} --repeats {repeats}"
        + (f" --spec {','.join(only)} --merge" if only else "")
        + (" --repeat-all" if repeat_all else "")
        + " --write",
        **({"partial": list(only)} if only else {}),
        "method": (
            f"reference: seq, no speculation; equivalent runs: {len(measurements[0])} variants "
            f"(modes x speculative configs, n_ubatch {UBATCH}); prompts: the {len(prompts(model))} "
            f"distinct cases of the suites that run this model (chats: first turn), greedy, n_predict as "
            f"the suites run them; tolerance = {SAFETY:g} x the largest value over "
            f"{repeats} measurements (a repeat serves again the variants of several slots, whose serving depends on "
            "timing; a one-slot variant's statistics carry over: bit-identical when served again; "
            "nmse: pooled NMSE of a run; kl: mean KL of a run; max_abs: p95 of "
            "the per-position max |dlogprob|; near_tie: the largest top1-top2 margin change or flipped "
            f"margin; windows: for n = 1..{WINDOW_MAX} compared positions, the largest nmse / kl / max_abs over "
            "any n consecutive compared positions of a case, which bound a comparison of n positions); "
            "acceptance: per spec, tolerance = "
            f"{SAFETY:g} x the largest difference of a request's accepted/drafted or accepted/generated "
            "between runs of the same cell in the same request order (repeats and the n_ubatch split; for "
            "drafters that learn across requests, repeats with the requests sent one at a time), "
            "tolerance_concurrent the same with requests sent at once, tolerance_modes (drafters without "
            "state between requests) also between modes; a drop that one token undoes always passes"
        ),
        "tolerances": tolerances_of(overall, windows),
        "acceptance": acceptance_spread(measurements),
        "spread": spread,
        "largest": overall,
        "windows": windows,
        "measured": {name: _without_windows(v) for name, v in measurements[0].items()},
        "repeats": [{k: lg[k] for k in overall} for lg in largest],
        **({"repeated": served} if repeats > 1 else {}),
        **({"seeded": noise} if noise is not None else {}),
    }
