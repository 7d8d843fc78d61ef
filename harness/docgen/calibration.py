"""The calibration tables (`calibration.md`), from `fixtures/calibration/*.json`."""

import json

from harness.docgen.common import ROOT, _code, _header, _table


def _num(value: float) -> str:
    return "0" if value == 0 else f"{value:.3g}"


def calibration_page() -> str:
    files = sorted((ROOT / "fixtures" / "calibration").glob("*.json"))
    data = [json.loads(p.read_text()) for p in files]
    out = [_header("Calibration", "`fixtures/calibration/*.json`")]
    out.append(
        "`specharness calibrate` measures, per (model, backend, device), how far logits move between logically "
        "equivalent runs: the `seq`, non-speculative run against every other mode, speculative config and a "
        "7-token micro-batch split. Each tolerance is 2 × the largest value measured (never below a float32 "
        "floor); how they are used: [Triage](../internals/triage.md). Each file records the command and date that "
        "measured it, both below.\n"
    )
    out.append(
        "## Devices and the user cache\n\n"
        "A file is keyed by the model, the backend and the device class of the build (`cpu`, `cuda`, `metal`, `gpu`: "
        "`environment()['device']`), so a CUDA build never reads a CPU calibration. The committed files below are "
        "for CI's reproducibility. `specharness run` looks each (model, backend) it serves up in a "
        "`--calibration-dir`, then the committed files, then the user cache (`harness.verdict.noise.find`); where "
        "none has it, it measures it once before judging (`harness.calibration.ensure`, the same measurement as "
        "`specharness calibrate`), writes it atomically to the user cache, "
        "`<cache>/calibration/<model>--<backend>--<device key>--<build>.json` (`device key`: the device class and a "
        "digest of the CPU or GPU that runs the kernels, `harness.verdict.noise.device_key`; `build`: a digest of "
        "the build facts, so another llama.cpp is measured again), and its header says `calibrated MODEL on "
        "BACKEND/DEVICE now (N s), cached in PATH`; a later run says `calibration: cached`. A run never writes a "
        "committed file; `--no-auto-calibrate` (or `SPECHARNESS_AUTO_CALIBRATE=0`, which the project's test session "
        "sets) judges such a model by the default floor instead, and the pytest "
        "plugin never measures (a model without a calibration is judged by the default floor, and the session's "
        "`run.json` lists it under `uncalibrated`).\n\n"
        "A repeat (`--repeats`, default 2) serves again only the variants whose serving depends on timing, several "
        "slots sharing batches (`harness.calibration.measure.timing_dependent`: `par` and `no-kv-unified`), against "
        "the first measurement's reference; a one-slot (`seq`) variant is a function of its command line and "
        "prompts and carries over (measured bit-identical when served again; `--repeat-all` serves every one).\n"
    )
    out.append("## Tolerances\n")
    rows = []
    for d in data:
        t = d["tolerances"]
        rows.append(
            [
                _code(d["model"]),
                d["backend"],
                d["device"],
                _num(t["near_tie"]),
                _num(t["max_abs"]),
                _num(t["nmse"]),
                _num(t["kl"]),
                _num(t.get("top1_agreement", 1)),
                d.get("measured_on", ""),
                str(len(d.get("machines", [])) or 1),
            ]
        )
    out.append(
        _table(
            [
                "model",
                "backend",
                "device",
                "near-tie floor (nats)",
                "p95 max \\|Δ\\| (nats)",
                "NMSE",
                "mean KL",
                "top-1 agreement",
                "measured on",
                "machines merged",
            ],
            rows,
        )
    )
    out.append("## Measured in `seq`: is speculation bit-exact?\n")
    out.append(
        "Over the `seq` variants (each speculative config, and the 7-token micro-batch split) against `seq` without "
        "speculation: the largest single |Δ| of a logged log-probability, the largest change of a top-1 − top-2 "
        "margin, the variants whose max |Δ| is exactly 0 and the top-1 tokens that flipped. Whether a model counts "
        "as bit-identical under speculation in `seq`, and so whether a proven near-tie in its `seq` cells is "
        "excused, is read from these measurements (`harness.verdict.noise`; "
        "[the policy](../internals/triage.md#one-policy-for-every-token-comparison)).\n"
    )
    from harness.verdict.noise import logits_count

    rows = []
    for d in data:
        seq = {k: v for k, v in d["measured"].items() if k.startswith("seq/") and logits_count(v)}
        exact = sorted(k for k, v in seq.items() if v.get("max_abs_max", 1) == 0)
        rows.append(
            [
                _code(d["model"]),
                d["backend"],
                str(len(seq)),
                _num(max((v.get("max_abs_max", 0) for v in seq.values()), default=0)),
                _num(max((v.get("margin_delta_max", 0) for v in seq.values()), default=0)),
                ", ".join(_code(k) for k in exact) if exact else "none",
                str(sum(len(v.get("flips", [])) for v in seq.values())),
            ]
        )
    out.append(
        _table(
            ["model", "backend", "seq variants", "max \\|Δ\\|", "max margin change", "variants exactly 0", "flips"],
            rows,
        )
    )
    out.extend(_windows_section(data))
    out.extend(_acceptance_section(data))
    out.extend(_near_tie_section(data))
    out.extend(_refused_section(data))
    out.append("## Commands\n")
    out.append(
        _table(
            ["file", "command", "measured on"],
            [
                [_code(p.relative_to(ROOT)), _code(d.get("command", "")), d.get("measured_on", "")]
                for p, d in zip(files, data, strict=True)
            ],
        )
    )
    return "\n".join(out)


WINDOW_SIZES = (1, 2, 4, 8, 16, 32, 64)


def _windows_section(data: list[dict]) -> list[str]:
    """Each file's tolerance curves over n compared positions (`tolerances.windows`) beside its whole-case bound."""
    from harness.result.logits import WINDOW_MAX

    out = ["## Bounds over n positions\n"]
    out.append(
        "The tolerances above bound a case's whole comparison, a mean or pooled value over tens of positions. A "
        "comparison of few positions (llama-server logs no logits for the tokens a verification step emits; triage "
        "compares the positions before a divergence) spreads far wider: its bound is measured for its size. "
        "Calibration records, for n = 1 to "
        f"{WINDOW_MAX}, the largest NMSE (pooled), mean KL and p95 of max |Δ| over any n consecutive compared "
        "positions of a case, over every variant; the tolerance is 2 × that (merged over machines), and a "
        "comparison of n positions is judged by it or by the whole-case tolerance where that is larger "
        "(`harness.result.logits.Tolerances.for_positions`; beyond the curve, its last value). A file without "
        "curves judges every comparison by the whole-case values.\n"
    )
    rows = []
    for d in data:
        curves = d["tolerances"].get("windows", {})
        for stat in ("kl", "nmse", "max_abs"):
            curve = curves.get(stat)
            if not curve:
                continue
            at = [_num(curve[n - 1]) if n <= len(curve) else "—" for n in WINDOW_SIZES]
            rows.append([_code(d["model"]), d["backend"], stat, _num(d["tolerances"][stat]), *at])
    head = ["model", "backend", "statistic", "whole case", *(f"n={n}" for n in WINDOW_SIZES)]
    out.append(_table(head, rows) if rows else "No committed file holds curves yet.\n")
    return out


def _acceptance_section(data: list[dict]) -> list[str]:
    """Each file's `acceptance`: the measured spreads per speculative config and the tolerances the check uses."""
    out = ["## Acceptance spread\n"]
    out.append(
        "Per speculative config, how far a request's acceptance (accepted / drafted and accepted / generated, the "
        "larger difference) moved between equivalent runs: between repeats of one variant, between the 7-token "
        "micro-batch split and seq, between par / no-kv-unified and seq (drafters without state between requests), "
        "and between repeats of the variant that sends the requests one at a time (drafters that learn across "
        "requests); then the three tolerances the `acceptance` check uses: against the baseline's same request "
        "(`tolerance`), the same for rounds whose requests are sent all at once (`sent at once`), and a par / "
        "no-kv-unified request against the same request in seq (`against seq`). Null: refused (below). Only requests "
        "that made the same output in both runs count (as the check compares). Which configs: every one a suite "
        "judges the acceptance of on that model and backend (`harness.calibration.variants.specs_of`). "
        "A variant where a known defect moves tokens or logits (suites/known-failures.yaml) counts its acceptance "
        "(same outputs only) "
        "and none of its logits; one where a known defect moves acceptance itself is not measured.\n"
    )

    def cell(v: dict, key: str) -> str:
        if key not in v:
            return "—"
        return "null" if v[key] is None else _num(float(v[key]))

    rows = []
    for d in data:
        for spec, v in sorted(d.get("acceptance", {}).items()):
            keys = ("repeat_spread", "ubatch_spread", "mode_spread", "in_order_spread", "tolerance")
            more = [cell(v, "tolerance_concurrent"), cell(v, "tolerance_modes")]
            rows.append([_code(d["model"]), d["backend"], _code(spec), *(cell(v, k) for k in keys), *more])
    head = ["model", "backend", "spec", "repeats", "n_ubatch 7", "modes", "one at a time", "tolerance"]
    out.append(_table([*head, "sent at once", "against seq"], rows))
    return out


def _near_tie_section(data: list[dict]) -> list[str]:
    """The numbers docs/near-tie-policy.md's rule reads: the speculative `seq` variants that decide whether a
    proven near-tie is excused in `seq`, and each mode's near-tie floor (harness.verdict.noise)."""
    from harness.verdict import noise

    out = ["## The near-tie floor per mode\n"]
    out.append(
        "The speculative `seq` variants served as the cells serve them (not `seq/none`, not the `n_ubatch=7` "
        "split), whose largest max |Δ| decides whether a proven near-tie is excused in `seq` "
        "(`harness.verdict.noise.seq_bit_exact`), in-process `seq/scripted-accept` alone (it accepts every draft: "
        "only the "
        "batch shape changes), and the near-tie floor of the file and of each mode (`NoiseFloor.for_mode`: "
        f"{noise.SAFETY:g} × the largest margin change or flipped margin in that mode, at least "
        f"{noise.MINIMUM_NEAR_TIE:g}, at most the file's). The rule: [Near-tie policy](../near-tie-policy.md).\n"
    )
    rows = []
    for d in data:
        measured = d["measured"]
        served = [
            v["max_abs_max"]
            for k, v in measured.items()
            if k.startswith("seq/") and k.split("/")[1] != "none" and noise.is_default_batch(k)
        ]
        floor = noise.from_data(d, d["model"])
        accept = measured.get("seq/scripted-accept", {}).get("max_abs_max")
        rows.append(
            [
                _code(d["model"]),
                d["backend"],
                _num(max(served, default=0)),
                "—" if accept is None else _num(accept),
                "no" if floor.seq_bit_exact else "yes",
                _num(floor.near_tie),
                *(_num(floor.for_mode(m).near_tie) for m in ("seq", "par", "no-kv-unified")),
            ]
        )
    head = ["model", "backend", "seq speculative max \\|Δ\\|", "`seq/scripted-accept`", "near-tie excused in seq"]
    out.append(_table([*head, "floor: file", "seq", "par", "no-kv-unified"], rows))
    return out


def _refused_section(data: list[dict]) -> list[str]:
    """The acceptance tolerances calibration refused (≥ harness.verdict.noise.RANGE: no drop could fail them)."""
    from harness.verdict import noise

    out = ["## Refused acceptance tolerances\n"]
    out.append(
        f"An acceptance fraction lies in [0, 1], so a tolerance ≥ {noise.RANGE:g} lets every drop pass: calibration "
        "writes it as null with the reason, and a committed value that large loads as refused "
        "(`harness.verdict.noise.acceptance_of`); that comparison is then *not run: not judged: noise exceeds the "
        "range*. "
        "The refused ones, and each file's largest tolerance kept:\n"
    )
    rows = []
    for d in data:
        refused, kept = [], 0.0
        for spec, v in sorted(d.get("acceptance", {}).items()):
            for key in noise.ACCEPTANCE_KEYS.values():
                raw = v.get(key, v["tolerance"])
                if raw is None or float(raw) >= noise.RANGE:
                    refused.append(f"{_code(spec)} `{key}` {'null' if raw is None else _num(float(raw))}")
                else:
                    kept = max(kept, float(raw))
        rows.append([_code(d["model"]), d["backend"], "; ".join(refused) or "none", _num(kept)])
    out.append(_table(["model", "backend", "refused", "largest kept"], rows))
    return out
