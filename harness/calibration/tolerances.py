"""From measurements to tolerances: SAFETY × the largest value measured between equivalent runs (never below
MINIMUM), the acceptance spread per speculative config, and the comparison and merge with a committed file.

Tolerances: `nmse` bounds the pooled NMSE of a run, `kl` its mean KL, `max_abs` the 95th percentile of its
per-position max |Δ|, and `near_tie` — the largest margin noise can flip — bounds the margin change and every
flip seen. Acceptance: per speculative config, the largest difference of a request's accepted / drafted or
accepted / generated between runs that serve the requests in the same order (the repeats of each variant, and
the 7-token micro-batch split against seq) and, for drafters that keep no state between requests, between modes
(par and no-kv-unified against seq); its tolerance is SAFETY × that.
"""

import json
from dataclasses import asdict

from harness.calibration.variants import IN_ORDER, UBATCH
from harness.checks.acceptance import Acceptance
from harness.checks.seeded import noise_bound
from harness.matrix import spec_preset
from harness.result.logits import Tolerances, larger_curves
from harness.verdict.noise import MINIMUM_NEAR_TIE, RANGE, SAFETY, logits_count

MINIMUM = {"nmse": 1e-9, "kl": 1e-9, "max_abs": 1e-5, "near_tie": MINIMUM_NEAR_TIE}
"""Floors for bit-exact measurements (float32 rounding of a log-probability is ~1e-7 nats)."""
SPREAD_FLOOR = 0.1
"""A re-measurement may differ by the observed spread × 2, and at least by this fraction."""


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


def largest_of(measured: dict) -> dict:
    """The largest value of each statistic over every variant whose logits count (flips count toward the
    near-tie floor; a variant under a known defect of tokens or logits, `logits: false`, does not count)."""
    counted = [v for v in measured.values() if logits_count(v)]
    flips = [f["reference_gap"] for v in counted for f in v["flips"]]
    unbounded = any(g is None for g in flips)
    return {
        "windows": larger_curves(*(v.get("windows", {}) for v in counted)),
        "nmse": max((v["nmse_max"] for v in counted), default=0.0),
        "kl": max((v["kl_mean_max"] for v in counted), default=0.0),
        "max_abs": max((v["max_abs_p95_max"] for v in counted), default=0.0),
        "near_tie": max([0.0] + [v["margin_delta_max"] for v in counted] + [g for g in flips if g is not None]),
        "unbounded_flip": unbounded,
    }


def tolerances_of(largest: dict, windows: dict[str, list[float]] | None = None) -> dict:
    """The tolerances a measurement sets (SAFETY × largest, at least MINIMUM), each window curve's too."""
    tol = {k: max(SAFETY * largest[k], MINIMUM[k]) for k in ("nmse", "kl", "max_abs", "near_tie")}
    curves = {k: [max(SAFETY * x, MINIMUM[k]) for x in v] for k, v in (windows or {}).items()}
    return {
        **asdict(Tolerances()),
        **{k: v for k, v in tol.items() if k != "near_tie"},
        "windows": curves,
        "near_tie": tol["near_tie"],
    }


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
    _raise_tolerances(out, committed)
    for spec, old in committed.get("acceptance", {}).items():
        if spec in out.get("acceptance", {}):
            out["acceptance"][spec] = _larger_acceptance(out["acceptance"][spec], old)
    if "seeded" in committed:
        out["seeded"] = _noisier_seeded(out.get("seeded"), committed["seeded"], new["backend"])
    earlier = committed.get("machines") or [
        {"measured_on": committed.get("measured_on"), "largest": committed.get("largest")}
    ]
    out["machines"] = earlier + [{"measured_on": new["measured_on"], "largest": new["largest"]}]
    out["method"] += (
        "; merged (--merge): each tolerance is the largest of these measurements' "
        f"({len(out['machines'])} machines, see `machines`)"
    )
    return out


def _raise_tolerances(out: dict, other: dict) -> None:
    """Raise each logits tolerance of `out` (a file's content) to `other`'s where that is larger, the window
    curves element by element (and `windows`, the measured curves they are SAFETY × of)."""
    for key, value in other["tolerances"].items():
        if isinstance(value, float) and isinstance(out["tolerances"].get(key), float):
            out["tolerances"][key] = max(out["tolerances"][key], value)
    mine, theirs = out["tolerances"].get("windows", {}), other["tolerances"].get("windows", {})
    if mine or theirs:
        out["tolerances"]["windows"] = larger_curves(mine, theirs)
        out["windows"] = larger_curves(out.get("windows", {}), other.get("windows", {}))


def _noisier_seeded(mine: dict | None, old: dict, backend: str) -> dict:
    """The seeded noise of two measurements, per mode the one with the larger rate bound (as every tolerance is
    the larger of two machines')."""
    if mine is None:
        return old
    out = json.loads(json.dumps(mine))
    for mode, kn in old.get("by_mode", {}).items():
        now = out["by_mode"].get(mode)
        if now is None or noise_bound(backend, mode, tuple(kn)) > noise_bound(backend, mode, tuple(now)):
            out["by_mode"][mode] = kn
            out.setdefault("bound", {})[mode] = old.get("bound", {}).get(mode)
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
    _raise_tolerances(out, part)
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
