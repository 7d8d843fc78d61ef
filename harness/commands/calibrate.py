"""`specharness calibrate`: measure the noise floor of a (model, backend, device) and write its tolerances (the
measurement, its tolerances and the files: harness.calibration; reading them: harness.verdict.noise)."""

import argparse
import json
from pathlib import Path

from harness.calibration import calibrate, merged, within_spread, write
from harness.errors import HarnessError
from harness.matrix import BACKEND_NAMES
from harness.models import model_key, resolve
from harness.verdict.noise import calibration_path, calibration_root


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
            data = calibrate(
                model, backend, args.repeats, args.server_bin, args.source, only=only, repeat_all=args.repeat_all
            )
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
    p.add_argument(
        "--repeat-all",
        action="store_true",
        help="serve every variant in every repeat (default: only those of several slots; one-slot ones carry over)",
    )
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
