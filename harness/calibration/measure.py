"""One measurement of a (model, backend): the reference and every equivalent run served on one executor, and per
run the statistics of its logits against the reference's; `calibrate` repeats it on fresh sessions and makes
the content of a calibration file.

Over the positions before the first token divergence of each pair it records, per position, test-backend-ops'
NMSE, KL, max |Δ| and the change of the top1−top2 margin, and the reference's margin wherever an equivalent
run's token flipped. `repeats` whole measurements give the spread a re-measurement may show (par on llama-server
depends on request timing).
"""

import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from harness import __version__
from harness.backends.choose import backend_factories
from harness.calibration.seeded import measure_seeded
from harness.calibration.tolerances import (
    SAFETY,
    SPREAD_FLOOR,
    acceptance_spread,
    largest_of,
    tolerances_of,
)
from harness.calibration.variants import IN_ORDER, UBATCH, Variant, prompts, specs_of, variants
from harness.errors import HarnessError
from harness.execute import ExecOptions, Executor
from harness.matrix import Cell
from harness.models import resolve
from harness.result.logits import compare, max_abs_quantile
from harness.suites import Suite
from harness.verdict.baselines import output_digest
from harness.verdict.triage import at, gap


def _suite(name: str, cases: list, serve: dict) -> Suite:
    rounds = ["seq"] if name.endswith(IN_ORDER) else ["par"]
    return Suite(name=name, path=None, cases=cases, matrix=[], checks=[], serve=serve, rounds=rounds)


def timing_dependent(variant: Variant) -> bool:
    """Whether a variant's logits and acceptance can change from one fresh serving to the next: several slots
    (`par`, `no-kv-unified`) share batches in the order requests happen to arrive. A one-slot (`seq`) variant is a
    function of its command line and its prompts (with one slot a session sends one request at a time, in order,
    whatever the round: harness.backends.server_backend.ServerSession.run). Measured 2026-12-04 on llama-server
    (CPU, tiny-dense, two fresh measurements): all 9 `seq` variants (the `n_ubatch=7` and `in-order` ones
    included) bit-identical, 7 of the 8 `par` / `no-kv-unified` ones different; the in-process engine's committed
    files measured every variant of both repeats identical."""
    return variant.cell.mode != "seq"


def measure(
    model: str,
    backend: str,
    executor: Executor,
    only: list[str] | None = None,
    first: dict | None = None,
    reference=None,
) -> dict:
    """One measurement: per variant (of the `only` specs where given), the statistics of its logits against the
    reference's. A repeat (`first`: the first measurement, `reference`: its reference run) serves again only the
    variants whose serving depends on timing (`timing_dependent`) and carries the others' statistics over."""
    cases = prompts(model)
    reference_suite = _suite("calibrate", cases, {})
    if reference is None:
        reference = executor.run(reference_suite, Cell(backend, "seq", "none", model))
    if reference.fault or reference.crash:  # the same reading of a cell's end as harness.checks.evaluate
        raise HarnessError(f"calibration reference run failed: {reference.fault or reference.crash}")
    if reference.error:  # the model or the backend could not be had: nothing to measure against
        raise HarnessError(f"calibration reference run failed: {reference.error.splitlines()[0]}")
    results = {}
    for variant in variants(backend, model, only):
        name = variant.name
        if first is not None and name in first and not timing_dependent(variant):
            results[name] = first[name]
            continue
        own = variant.serve or name.endswith(IN_ORDER)
        suite = _suite(f"calibrate-{name.replace('/', '-')}", cases, variant.serve) if own else reference_suite
        run = executor.run(suite, variant.cell)
        if run.fault or run.crash:
            raise HarnessError(f"calibration run {name} failed: {run.fault or run.crash}")
        results[name] = _pair_stats(reference, run, variant)
    results[REFERENCE] = reference
    return results


REFERENCE = "\0reference"
"""measure()'s key for its reference run (taken out by `calibrate`, never written)."""


def _pair_stats(reference, run, variant: Variant | None = None) -> dict:
    """NMSE / KL / max |Δ| / margin change over the shared prefix of each case, and the flips (`logits: false` where
    a known defect moves them: then `largest_of` leaves them out), and each request's acceptance counters with its
    output (the requests `variant.acceptance` counts)."""
    rows, runs, flips = [], [], []
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
        **({} if variant is None or variant.logits else {"logits": False}),
        **({"acceptance": acceptance, "outputs": outputs} if acceptance else {}),
    }


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
) -> dict:
    """Measure `repeats` times on fresh sessions; the content of the calibration file (of the `only` specs'
    variants where given: `partial`, to be merged into a committed file). A repeat serves again only the variants
    whose serving depends on timing (`timing_dependent`; every variant with `repeat_all`), reusing the first
    measurement's reference run. With `seeded` (not for a partial file), the seeded noise rate is measured in the
    same pass, on the last repeat's executor (harness.calibration.seeded)."""
    info = resolve(model)
    if only:
        known = specs_of(backend, model)
        unknown = [s for s in only if s not in known]
        if unknown:
            raise HarnessError(
                f"calibrate --spec {unknown[0]}: not a speculative config {model} is measured with on {backend} "
                f"(use one of: {', '.join(known)})"
            )
    measurements, env, reference = [], {}, None
    for _ in range(repeats):
        executor = Executor(ExecOptions(backends=backend_factories(server_bin, source, logs), kv_scan="off"))
        first = None if repeat_all or not measurements else measurements[0]
        measured = measure(model, backend, executor, only, first, None if first is None else reference)
        reference = measured.pop(REFERENCE)
        measurements.append(measured)
        env = executor.environment(Cell(backend, "seq", "none", model))
    noise = measure_seeded(model, backend, executor, specs_of(backend, model)) if seeded and not only else None
    served = [v.name for v in variants(backend, model, only) if repeat_all or timing_dependent(v)]
    largest = [largest_of(m) for m in measurements]
    overall = {k: max(lg[k] for lg in largest) for k in ("nmse", "kl", "max_abs", "near_tie")}
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
            "margin); acceptance: per spec, tolerance = "
            f"{SAFETY:g} x the largest difference of a request's accepted/drafted or accepted/generated "
            "between runs of the same cell in the same request order (repeats and the n_ubatch split; for "
            "drafters that learn across requests, repeats with the requests sent one at a time), "
            "tolerance_concurrent the same with requests sent at once, tolerance_modes (drafters without "
            "state between requests) also between modes; a drop that one token undoes always passes"
        ),
        "tolerances": tolerances_of(overall),
        "acceptance": acceptance_spread(measurements),
        "spread": spread,
        "largest": overall,
        "measured": measurements[0],
        "repeats": [{k: lg[k] for k in overall} for lg in largest],
        **({"repeated": served} if repeats > 1 else {}),
        **({"seeded": noise} if noise is not None else {}),
    }
