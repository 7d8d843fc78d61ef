"""`specharness calibrate`: measure the noise floor of a (model, backend, device) and write its tolerances.

Logically equivalent runs must produce the same tokens, but not the same bits: a verification batch of
k+1 tokens, another micro-batch split, or slots sharing one batch (par) run other CPU kernels than a
one-token decode. This measures, on a clean build, how far that moves the logits. The reference is the
`seq`, non-speculative run of each prompt (every case of every suite that runs the model, a chat's
first turn, greedy, as long as the suite runs it); every other cell of the suites' matrix for this backend
(every mode × every speculative
config, plus a 7-token micro-batch split) is an equivalent run. Over the positions before the first token
divergence of each pair it records, per position, test-backend-ops' NMSE, KL, max |Δ| and the change of
the top1−top2 margin, and the reference's margin wherever an equivalent run's token flipped.

Tolerances are SAFETY × the largest value measured (never below MINIMUM): `nmse` bounds the pooled NMSE of
a run, `kl` its mean KL, `max_abs` the 95th percentile of its per-position max |Δ|, and `near_tie` — the
largest margin noise can flip — bounds the margin change and every flip seen. `repeats` whole measurements
give the spread a re-measurement may show (par on llama-server depends on request timing).

Acceptance: per speculative config, the largest difference of a request's accepted / drafted or accepted /
generated between runs that serve the requests in the same order (the repeats of each variant, and the
7-token micro-batch split against seq) and, for drafters that keep no state between requests, between
modes (par and no-kv-unified against seq); its tolerance is SAFETY × that.
"""

import argparse
import datetime
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from harness import MODES, __version__
from harness.backends.choose import backend_factories
from harness.checks.acceptance import Acceptance
from harness.errors import HarnessError, Unservable
from harness.execute import ExecOptions, Executor, serve_config
from harness.execute.run_options import DEFAULT_SUITE
from harness.matrix import BACKEND_NAMES, Cell, cells, spec_preset
from harness.models import model_key, resolve
from harness.paths import write_atomic
from harness.result.logits import Tolerances, compare, max_abs_quantile
from harness.suites import Case, Suite, load_suite, suite_files
from harness.verdict.baselines import output_digest
from harness.verdict.noise import RANGE, calibration_path, calibration_root, logits_count
from harness.verdict.triage import at, gap

SAFETY = 2.0
"""Tolerance = SAFETY × the largest value measured between equivalent runs."""
MINIMUM = {"nmse": 1e-9, "kl": 1e-9, "max_abs": 1e-5, "near_tie": 1e-4}
"""Floors for bit-exact measurements (float32 rounding of a log-probability is ~1e-7 nats)."""
SPREAD_FLOOR = 0.1
"""A re-measurement may differ by the observed spread × 2, and at least by this fraction."""
SPECS = {
    "inproc": ["none", "scripted-accept", "draft-simple", "ngram-mod", "ngram-map-k", "draft-mtp"],
    "server": [
        "none",
        "draft-simple",
        "ngram-mod",
        "ngram-map-k",
        "draft-mtp",
        "draft-eagle3",
        "draft-dflash",
        "draft-dspark",
    ],
}
"""The speculative configs of each backend's equivalent runs (`scripted-accept` drafts the reference's own
output, so every draft is accepted: only the batch shape changes), each where the model can serve it
(draft-simple with a draft model, draft-mtp with an MTP block, the draft heads -eagle3 / -dflash / -dspark with
the model's generated head). A cell where a known defect moves tokens or logits, or acceptance, is measured only
for what that defect leaves alone (`variants`): EAGLE3's acceptance collapses when slots verify together
(docs/upstream-defects.md row 14), and measuring that defect as noise would set a tolerance that excuses it."""
UBATCH = 7


def prompts(model: str) -> list[Case]:
    """The calibration prompts: every case of every suite whose matrix names `model` (a chat's first turn),
    greedy, as long as that suite runs it for the model (a case generating to the context end, `n_predict`
    -1, is left out); each distinct prompt once. A model no suite names (a
    model file of your own) takes the cases of the default suite, `quicksort`."""
    cases, seen = [], set()
    suites = [load_suite(str(path)) for path in suite_files()]
    named = [s for s in suites if any(model in block["models"] for block in s.matrix)]
    for suite in named or [s for s in suites if s.name == DEFAULT_SUITE]:
        for c in suite.cases:
            case = suite.cell_case(c, model)
            if case.sampling.n_predict < 0:  # runs to the context end by design (draft-budget's ctx_end_*)
                continue
            case = replace(
                case,
                name=f"{suite.name}.{case.name}",
                turns=case.turns[:1],
                sampling=replace(case.sampling, temperature=0.0, seed=None),
            )
            key = (
                case.prompt,
                tuple(case.turns),
                case.sampling.n_predict,
                repr(case.sampling.json_schema),
                case.sampling.grammar,
            )
            if key not in seen:
                seen.add(key)
                cases.append(case)
    return cases


IN_ORDER = "in-order"
"""The variant that sends the requests one at a time (every other sends them all at once)."""


NUMERIC_CHECKS = {"lossless", "mode-invariant", "baseline", "repeat-identical", "logits-close"}
"""The checks whose failures a defect shows as moved tokens or logits: a cell where a known defect does so is no
measure of numerical noise."""


def defect_of(
    cell: Cell, checks: set[str] | frozenset[str] = frozenset(NUMERIC_CHECKS), entries: list | None = None
) -> str | None:
    """The known llama.cpp defect (suites/known-failures.yaml, or `entries` already read from it) that moves what
    `checks` judge in `cell` (by default its tokens or logits), whichever suite and llama.cpp version: such a cell
    is no measure of that noise (an intermittent flip of the defect measured as noise would raise the near-tie
    floor and excuse it)."""
    if entries is None:
        from harness.suites import suites_dir
        from harness.verdict.known_failures import FILE_NAME
        from harness.verdict.known_failures import load as load_known

        entries = load_known(suites_dir() / FILE_NAME)
    return next((e.id for e in entries if set(checks) & set(e.check) and e.shows_in(cell)), None)


@dataclass(frozen=True)
class Variant:
    """One run equivalent to the seq / none reference, and what it measures."""

    name: str
    cell: Cell
    serve: dict
    logits: bool = True
    """Whether its logits and flips count toward the floor: False where a known defect moves tokens or logits."""
    acceptance: bool = True
    """Whether its requests' acceptance counts toward the spread: False where a known defect moves acceptance itself.
    Under a known defect of tokens or logits it counts (on the requests whose output equals the other run's, as the
    `acceptance` check compares): measured 2026-12-02, llama-server draft-dspark's acceptance moves under concurrency
    with the output unchanged on requests that took no step of that defect (quicksort's Python request in
    no-kv-unified: 14/50 -> 12/56 in 2 of 10 rounds sent at once, no partial rollback from a micro-batch ahead of
    another in 20 more), so requests without the step are no sample of the noise the check meets."""


def specs_of(backend: str, model: str) -> list[str]:
    """The speculative configs calibration measures for `model` on `backend`: SPECS, then every other one a suite
    judges the `acceptance` of on this model and backend (so no such cell is judged by the uncalibrated default),
    each where the model can serve it."""
    suites = [load_suite(str(path)) for path in suite_files()]
    judged = [
        cell.spec
        for suite in suites
        if "acceptance" in suite.checks  # the check's name, as suites and known-failures.yaml write it
        for cell in cells(suite.matrix, {"models": [model]})
        if cell.backend == backend and spec_preset(cell.spec).speculative
    ]
    return [s for s in dict.fromkeys([*SPECS[backend], *judged]) if _servable(Cell(backend, "seq", s, model))]


def variants(backend: str, model: str, only: list[str] | None = None) -> list[Variant]:
    """Every run equivalent to the seq / none reference (of the `only` specs where given): every mode × spec
    (`specs_of`), each spec with a 7-token micro-batch
    split, and each drafter that learns across requests once more with the requests sent one at a time (served in
    a fixed order, which its acceptance depends on). Where a known defect moves tokens or logits (`defect_of`) the
    run's logits are left out (its acceptance counts, on the requests of the same output); where
    one moves acceptance, its acceptance is left out; a run left with nothing to measure is not served."""
    specs = [s for s in specs_of(backend, model) if only is None or s in only]
    out = [
        (f"{mode}/{spec}", Cell(backend, mode, spec, model), {})
        for mode in MODES
        for spec in specs
        if (mode, spec) != ("seq", "none")
    ]
    out += [
        (f"seq/{spec}/n_ubatch={UBATCH}", Cell(backend, "seq", spec, model), {"n_ubatch": UBATCH}) for spec in specs
    ]
    out += [
        (f"seq/{spec}/{IN_ORDER}", Cell(backend, "seq", spec, model), {})
        for spec in specs
        if spec_preset(spec).learns_across_requests
    ]
    from harness.suites import suites_dir
    from harness.verdict.known_failures import FILE_NAME
    from harness.verdict.known_failures import load as load_known

    entries = load_known(suites_dir() / FILE_NAME)  # once for every variant
    kept = []
    for name, cell, serve in out:
        numeric = defect_of(cell, entries=entries) is not None
        acceptance = defect_of(cell, {"acceptance"}, entries) is None
        if not numeric or (spec_preset(cell.spec).speculative and acceptance):
            kept.append(Variant(name, cell, serve, logits=not numeric, acceptance=acceptance))
    return kept


def _servable(cell: Cell) -> bool:
    """Whether the cell's model has what its speculative type needs (the executor's own test)."""
    try:
        serve_config(cell, ExecOptions(backends={}))
    except Unservable:
        return False
    return True


def _suite(name: str, model: str, serve: dict) -> Suite:
    rounds = ["seq"] if name.endswith(IN_ORDER) else ["par"]
    return Suite(name=name, path=None, cases=prompts(model), matrix=[], checks=[], serve=serve, rounds=rounds)


def measure(model: str, backend: str, executor: Executor, only: list[str] | None = None) -> dict:
    """One measurement: per variant (of the `only` specs where given), the statistics of its logits against the
    reference's."""
    reference_suite = _suite("calibrate", model, {})
    reference = executor.run(reference_suite, Cell(backend, "seq", "none", model))
    if reference.fault or reference.crash:  # the same reading of a cell's end as harness.checks.evaluate
        raise HarnessError(f"calibration reference run failed: {reference.fault or reference.crash}")
    results = {}
    for variant in variants(backend, model, only):
        name = variant.name
        own = variant.serve or name.endswith(IN_ORDER)
        suite = _suite(f"calibrate-{name.replace('/', '-')}", model, variant.serve) if own else reference_suite
        run = executor.run(suite, variant.cell)
        if run.fault or run.crash:
            raise HarnessError(f"calibration run {name} failed: {run.fault or run.crash}")
        results[name] = _pair_stats(reference, run, variant)
    return results


def _pair_stats(reference, run, variant: Variant | None = None) -> dict:
    """NMSE / KL / max |Δ| / margin change over the shared prefix of each case, and the flips (`logits: false` where
    a known defect moves them: then `_largest` leaves them out), and each request's acceptance counters with its
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
    if not spec_preset(run.cell.spec).speculative or not variant.acceptance:
        return []
    return list(run.outcomes)


def _acceptance_gap(a: dict, b: dict) -> float:
    """The largest difference of a request's accepted / drafted or accepted / generated between two runs (each
    variant's measurement: `acceptance` {case: [drafted, accepted, generated]} and `outputs` {case: digest}), over
    the requests both counted that made the same output: as the `acceptance` check compares (a request whose
    output moved drafts from another history)."""
    gaps = [0.0]
    same = {c for c in a["acceptance"].keys() & b["acceptance"].keys() if _output(a, c) == _output(b, c)}
    for case in same:
        x, y = (Acceptance(*a["acceptance"][case]), Acceptance(*b["acceptance"][case]))
        gaps += [abs(x.rate - y.rate), abs(x.per_generated - y.per_generated)]
    return max(gaps)


def _output(measured: dict, case: str) -> str | None:
    """The output digest a variant's measurement stored for `case` (None in a file written before they were)."""
    return measured.get("outputs", {}).get(case)


def acceptance_spread(measurements: list[dict]) -> dict:
    """Per speculative config, the largest acceptance difference between equivalent runs, and the tolerances
    (SAFETY × it) the `acceptance` check uses:

    - `tolerance`: the same cell in the same request order, as against a baseline: repeats of a variant
      and the n_ubatch split against seq (other kernel numerics, as on another CPU); for a drafter that
      learns across requests, only repeats of the variant that sends the requests one at a time (its drafts
      are a function of the token history, which numerics do not change, and of the order);
    - `tolerance_concurrent`: the same, for requests sent all at once — a drafter that learns across
      requests then depends on the order llama-server happens to serve them in: repeats of every variant;
    - `tolerance_modes` (drafters without state between requests): par / no-kv-unified against seq, where
      the batch a slot shares changes a draft model's numerics."""
    out = {}
    specs = {name.split("/")[1] for m in measurements for name, v in m.items() if "acceptance" in v}
    for spec in sorted(specs):
        learns = spec_preset(spec).learns_across_requests
        ours = sorted({name for m in measurements for name, v in m.items() if name.split("/")[1] == spec})
        seq, ubatch, in_order = f"seq/{spec}", f"seq/{spec}/n_ubatch={UBATCH}", f"seq/{spec}/{IN_ORDER}"

        def gap(pairs: list[tuple[dict, str, dict, str]]) -> float:
            """The largest gap over (measurement, variant, measurement, variant) pairs where both counted requests."""
            counted = [
                (a[x], b[y]) for a, x, b, y in pairs if "acceptance" in a.get(x, {}) and "acceptance" in b.get(y, {})
            ]
            return round(max([_acceptance_gap(u, v) for u, v in counted], default=0.0), 4)

        repeats = {
            n: gap([(m, n, m2, n) for i, m in enumerate(measurements) for m2 in measurements[i + 1 :]]) for n in ours
        }
        split = gap([(m, ubatch, m, seq) for m in measurements])
        spread = {"repeat_spread": max(repeats.values(), default=0.0), "ubatch_spread": split}
        if learns:
            spread["in_order_spread"] = repeats.get(in_order, 0.0)
            fixed, concurrent = spread["in_order_spread"], max(spread["repeat_spread"], split)
        else:
            modes = [n for n in ours if n.split("/")[0] != "seq"]
            spread["mode_spread"] = gap([(m, n, m, seq) for m in measurements for n in modes])
            fixed = concurrent = max(spread["repeat_spread"], split)
            spread["tolerance_modes"] = round(SAFETY * max(fixed, spread["mode_spread"]), 4)
        out[spec] = refuse_unfailable(
            {
                **spread,
                "tolerance": round(SAFETY * fixed, 4),
                "tolerance_concurrent": round(SAFETY * concurrent, 4),
            }
        )
    return out


def refuse_unfailable(tolerances: dict) -> dict:
    """A spec's acceptance tolerances with each one no drop could fail (≥ noise.RANGE: a fraction lies in [0, 1])
    refused: null, with the reason under `refused` (the check then says "not judged: noise exceeds the range").
    Measured: llama-server ngram-mod with the requests sent at once on tiny-dense (2 × 1.0) and tiny-hybrid
    (2 × 0.5625): the shared n-gram table makes the serving order decide everything."""
    out = dict(tolerances)
    for key in ("tolerance", "tolerance_concurrent", "tolerance_modes"):
        value = out.get(key)
        if value is not None and value >= RANGE:
            out[key] = None
            out.setdefault("refused", {})[key] = (
                f"{key} {value:.3g} ≥ {RANGE:g}, the range of a fraction: no drop could fail it"
            )
    return out


def _largest(measured: dict) -> dict:
    """The largest value of each statistic over every variant whose logits count (flips count toward the
    near-tie floor; a variant under a known defect of tokens or logits, `logits: false`, does not count)."""
    counted = [v for v in measured.values() if logits_count(v)]
    flips = [f["reference_gap"] for v in counted for f in v["flips"]]
    unbounded = any(g is None for g in flips)
    return {
        "nmse": max((v["nmse_max"] for v in counted), default=0.0),
        "kl": max((v["kl_mean_max"] for v in counted), default=0.0),
        "max_abs": max((v["max_abs_p95_max"] for v in counted), default=0.0),
        "near_tie": max([0.0] + [v["margin_delta_max"] for v in counted] + [g for g in flips if g is not None]),
        "unbounded_flip": unbounded,
    }


def tolerances_of(largest: dict) -> dict:
    """The tolerances a measurement sets (SAFETY × largest, at least MINIMUM)."""
    tol = {k: max(SAFETY * largest[k], MINIMUM[k]) for k in ("nmse", "kl", "max_abs", "near_tie")}
    return {**asdict(Tolerances()), **{k: v for k, v in tol.items() if k != "near_tie"}, "near_tie": tol["near_tie"]}


def calibrate(
    model: str,
    backend: str,
    repeats: int = 2,
    server_bin: Path | None = None,
    source: Path | None = None,
    logs: Path | None = None,
    only: list[str] | None = None,
) -> dict:
    """Measure `repeats` times on fresh sessions; the content of the calibration file (of the `only` specs'
    variants where given: `partial`, to be merged into a committed file)."""
    info = resolve(model)
    if only:
        known = specs_of(backend, model)
        unknown = [s for s in only if s not in known]
        if unknown:
            raise HarnessError(
                f"calibrate --spec {unknown[0]}: not a speculative config {model} is measured with on {backend} "
                f"(use one of: {', '.join(known)})"
            )
    measurements, env = [], {}
    for _ in range(repeats):
        executor = Executor(ExecOptions(backends=backend_factories(server_bin, source, logs), kv_scan="off"))
        measurements.append(measure(model, backend, executor, only))
        env = executor.environment(Cell(backend, "seq", "none", model))
    largest = [_largest(m) for m in measurements]
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
        + " --write",
        **({"partial": list(only)} if only else {}),
        "method": (
            f"reference: seq, no speculation; equivalent runs: {len(measurements[0])} variants "
            f"(modes x speculative configs, n_ubatch {UBATCH}); prompts: the {len(prompts(model))} "
            f"distinct cases of the suites that run this model (chats: first turn), greedy, n_predict as "
            f"the suites run them; tolerance = {SAFETY:g} x the largest value over "
            f"{repeats} measurements (nmse: pooled NMSE of a run; kl: mean KL of a run; max_abs: p95 of "
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
    }


def write(data: dict, root: Path | None = None) -> Path:
    """Write a calibration file atomically; returns its path."""
    path = calibration_path(model_key(data["model"]), data["backend"], data["device"], root)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n"))
    return path


def within_spread(new: dict, committed: dict) -> list[str]:
    """The tolerances of `new` that exceed `committed`'s by more than its stated spread (empty: the committed
    floor holds for this measurement). A smaller one is no finding: a floor merged over several machines
    (`--merge`) is as large as the noisiest of them."""
    out = []
    for key, spread in committed["spread"].items():
        old, now = committed["tolerances"][key], new["tolerances"][key]
        if now - old > spread * old:
            out.append(f"{key}: {now:.3g} vs committed {old:.3g} (allowed spread {spread:.0%})")
    return out


def merged(new: dict, committed: dict) -> dict:
    """`new` with every tolerance (logits and acceptance) raised to the committed one where that is larger:
    a floor that holds on each machine it was measured on (another CPU runs other SIMD kernels, with other
    rounding noise). `machines` lists each measurement's date and largest values. A `partial` measurement (of some
    specs: `--spec`) adds its variants and specs to the committed file and keeps everything else of it."""
    if new.get("partial"):
        return _added(new, committed)
    out = json.loads(json.dumps(new))
    for key, value in committed["tolerances"].items():
        if isinstance(value, float) and key in out["tolerances"]:
            out["tolerances"][key] = max(out["tolerances"][key], value)
    for spec, old in committed.get("acceptance", {}).items():
        if spec in out.get("acceptance", {}):
            out["acceptance"][spec] = _larger_acceptance(out["acceptance"][spec], old)
    earlier = committed.get("machines") or [
        {"measured_on": committed.get("measured_on"), "largest": committed.get("largest")}
    ]
    out["machines"] = earlier + [{"measured_on": new["measured_on"], "largest": new["largest"]}]
    out["method"] += (
        "; merged (--merge): each tolerance is the largest of these measurements' "
        f"({len(out['machines'])} machines, see `machines`)"
    )
    return out


def _larger_acceptance(mine: dict, old: dict) -> dict:
    """One spec's acceptance tolerances, each the larger of two measurements' (a refused one, None, stays refused:
    no larger value exists)."""
    mine = dict(mine)
    for key in ("tolerance", "tolerance_concurrent", "tolerance_modes"):
        if key in old and key in mine:
            both = (mine[key], old[key])
            mine[key] = None if None in both else max(both)
            if mine[key] is None and key not in mine.get("refused", {}):
                mine.setdefault("refused", {})[key] = old.get("refused", {}).get(key, "refused")
    return refuse_unfailable(mine)


def _added(part: dict, committed: dict) -> dict:
    """The committed file with a partial measurement (`calibrate --spec`) added: its variants in `measured`, its
    specs' acceptance tolerances, each logits tolerance and largest value the larger of both, the addition named in
    `method` and listed under `added`; the rest (date, environment, spread, machines) as committed."""
    out = json.loads(json.dumps(committed))
    for key, value in part["tolerances"].items():
        if isinstance(value, float) and isinstance(out["tolerances"].get(key), float):
            out["tolerances"][key] = max(out["tolerances"][key], value)
    for key, value in part["largest"].items():
        out["largest"][key] = max(out["largest"].get(key, 0.0), value)
    acceptance = out.setdefault("acceptance", {})
    for spec, mine in part.get("acceptance", {}).items():
        acceptance[spec] = _larger_acceptance(mine, acceptance[spec]) if spec in acceptance else mine
    out["acceptance"] = dict(sorted(acceptance.items()))
    out["measured"] = {**out.get("measured", {}), **part["measured"]}
    out["added"] = out.get("added", []) + [
        {"specs": part["partial"], "measured_on": part["measured_on"], "command": part["command"]}
    ]
    out["method"] += (
        f"; {', '.join(part['partial'])} added on {part['measured_on']} ({part['command']}): its variants in "
        "`measured`, its acceptance tolerances, each logits tolerance the larger of both"
    )
    return out


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure each (model, backend); print the tolerances; `--write` stores them in fixtures/calibration."""
    models = args.model or ["tiny-dense", "tiny-hybrid", "tiny-recurrent", "gemma3-270m"]
    backends = args.backend.split(",") if args.backend else list(BACKEND_NAMES)
    bad = [b for b in backends if b not in BACKEND_NAMES]
    if bad:
        raise HarnessError(f"unknown backend '{bad[0]}' (use: {', '.join(BACKEND_NAMES)})")
    if args.spec and args.write and not args.merge:
        raise HarnessError(
            "calibrate --spec measures some specs only: add --merge to add them to the committed file "
            "(--write alone would replace it with the part)"
        )
    status = 0
    for model in models:
        resolve(model)
        for backend in backends:
            only = args.spec.split(",") if args.spec else None
            data = calibrate(model, backend, args.repeats, args.server_bin, args.source, only=only)
            committed_path = calibration_path(model_key(model), backend, data["device"], args.calibration_dir)
            tol = data["tolerances"]
            print(
                f"{model} {backend} {data['device']}: near_tie {tol['near_tie']:.3g} nats, nmse {tol['nmse']:.3g}, "
                f"kl {tol['kl']:.3g}, max_abs (p95) {tol['max_abs']:.3g}"
            )
            for spec, acc in data["acceptance"].items():
                print(
                    f"  acceptance {spec}: "
                    + ", ".join(
                        f"{key} {acc.get(key)}"
                        for key in ("tolerance", "tolerance_concurrent", "tolerance_modes")
                        if key in acc
                    )
                )
            if committed_path.is_file():
                committed = json.loads(committed_path.read_text())
                drift = within_spread(data, committed)
                print(
                    f"  committed {committed_path.name}: "
                    + (
                        "holds (no tolerance above it beyond its spread)"
                        if not drift
                        else "EXCEEDED: " + "; ".join(drift)
                    )
                )
                status |= bool(drift) and not args.write
                if args.merge:
                    data = merged(data, committed)
            if only and args.write and not (args.merge and committed_path.is_file()):
                state = "exists" if committed_path.is_file() else "does not exist: calibrate every spec first"
                raise HarnessError(
                    f"calibrate --spec measures some specs only: it adds them to a committed file with --merge "
                    f"({committed_path.name} {state})"
                )
            if args.write:
                print(f"  written: {write(data, args.calibration_dir)}")
    return status


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness calibrate`."""
    p = sub.add_parser("calibrate", help="measure the logit noise floor of equivalent runs and write tolerances")
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME|PATH",
        help="registry name or .gguf, repeatable (default: the tiny models and gemma3-270m)",
    )
    p.add_argument("--backend", help="comma-separated: inproc,server (default both)")
    p.add_argument(
        "--spec",
        metavar="SPEC[,SPEC]",
        help="measure these speculative configs only and add them to the committed file (with --merge --write)",
    )
    p.add_argument("--repeats", type=int, default=2, help="whole measurements, for the spread (default 2)")
    p.add_argument("--server-bin", type=Path, metavar="PATH", help="llama-server binary to use instead of building one")
    p.add_argument("--source", type=Path, metavar="DIR", help="llama.cpp tree to build llama-server from")
    p.add_argument("--write", action="store_true", help=f"write the tolerances into {calibration_root().name}/")
    p.add_argument(
        "--calibration-dir",
        type=Path,
        metavar="DIR",
        help="read and write the calibration files here (a model of your own; `run --calibration-dir`)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep each committed tolerance where it is larger (a floor measured on several machines)",
    )
    p.set_defaults(func=cmd_calibrate)
