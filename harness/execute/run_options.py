"""The `run` command's options and what other commands reuse of them: the option types, the run directory,
the defaults a stored run's options override (`shrink`, `repro`), and the executor options they make.

Not a command module: `run`, `shrink`, `bisect` and the pytest plugin import it (the import contracts in
pyproject.toml; docs/architecture.md)."""

import argparse
import secrets
import time
from pathlib import Path

from harness.argtypes import count, seconds
from harness.backends.base import KV_SCAN, STALL_FLOOR_S
from harness.engine.faults import FAULTS, GRADED, check_fault
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.execute.executor import ExecOptions
from harness.matrix import SPEC_PRESETS
from harness.suites.rollback_options import CHECKPOINT_KINDS, STRATEGIES

DEFAULT_SUITE = "quicksort"
SPEC_PARAMS = [
    f
    for f in SpecConfig.__dataclass_fields__.values()
    if f.name.startswith("spec_") and f.name not in ("spec_type", "spec_draft_model")
]
"""The `--spec-*` options (numbers, and the draft KV cache types), named exactly like llama-server's flags."""


def fault_name(text: str) -> str:
    """An argparse type: a fault switch's name, or a graded fault's NAME=ε (harness.engine.faults)."""
    try:
        return check_fault(text)
    except HarnessError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def new_run_dir(parent: Path) -> Path:
    """A fresh run directory `<parent>/<UTC time>-<random>`."""
    return parent / (time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3))


def prepare_out(out: Path) -> Path:
    """Create the run directory up front; refuse a file, an unwritable place or an existing results.json."""
    if (out / "results.json").exists():
        raise HarnessError(
            f"{out / 'results.json'} already exists (choose another --out; results are never overwritten)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").touch()
        (out / ".write-test").unlink()
    except OSError as err:
        raise HarnessError(f"cannot write the run directory {out}: {err.strerror}") from None
    return out


def exec_options(args: argparse.Namespace, backends: dict) -> ExecOptions:
    """The executor options of `run`'s arguments (or of a stored run's, `shrink`): slots, draft model,
    `--spec-*` overrides, in-process engine options, KV scan, logit logging, stall floor."""
    spec_overrides = {
        f.name.replace("_", "-"): getattr(args, f.name) for f in SPEC_PARAMS if getattr(args, f.name) is not None
    }
    engine = {
        "rollback": args.rollback,
        "fault": args.fault,
        "checkpoint_flags": args.checkpoint_flags,
        "checkpoint_attempts": args.checkpoint_attempts,
    }
    return ExecOptions(
        backends=backends,
        parallel=args.parallel,
        draft_model=args.draft_model,
        spec_overrides=spec_overrides,
        engine=engine,
        kv_scan=args.kv_scan,
        logit_top_k=args.logit_top_k,
        stall_s=args.stall_s,
    )


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of `specharness run` (what a stored run's `options` in run.json name)."""
    p.add_argument(
        "--suite",
        action="append",
        metavar="NAME",
        help=f"suite name or file, repeatable (default {DEFAULT_SUITE}; with --suites-dir, its suites)",
    )
    p.add_argument(
        "--suites-dir",
        type=Path,
        metavar="DIR",
        help="a directory of your own suites: they add to (same name: replace) the installed ones; their "
        "baselines are fixtures/baselines beside DIR (`specharness init` writes one)",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="NAME|PATH",
        help="registry name or .gguf path, repeatable (default: the suite's models)",
    )
    p.add_argument("--mode", help="comma-separated: seq,par,no-kv-unified (default: the suite's modes)")
    p.add_argument("--backend", help="comma-separated: inproc,server (default: the suite's backends)")
    p.add_argument(
        "--spec",
        metavar="CONFIG[,CONFIG...]",
        help=f"speculative configs, each one of {', '.join(SPEC_PRESETS)} or `a+b` chained (default: the suite's)",
    )
    p.add_argument(
        "--cell",
        action="append",
        metavar="ID",
        help="only this cell, by its id as the report names it (MODE-SPEC-MODEL-BACKEND, e.g. "
        "par-draft-simple-tiny-dense-server), repeatable; with the other choices, the cells both keep",
    )
    p.add_argument("--draft-model", metavar="NAME|PATH", help="draft model for draft-simple (default <model>-draft)")
    p.add_argument("--rollback", default="auto", choices=STRATEGIES, help="in-process rollback strategy (default auto)")
    p.add_argument(
        "--fault",
        type=fault_name,
        metavar="FAULT",
        help=f"switch on one fault of the in-process speculative engine: one of {', '.join(sorted(FAULTS))}, or a "
        f"graded one as NAME=ε ({', '.join(GRADED)})",
    )
    p.add_argument(
        "--checkpoint-flags",
        default="partial",
        choices=sorted(CHECKPOINT_KINDS),
        help="in-process checkpoints: PARTIAL_ONLY state (default) or the full state",
    )
    p.add_argument(
        "--checkpoint-attempts",
        type=count(0),
        default=3,
        help="in-process: failed replays after which a slot stops speculating (default 3)",
    )
    for f in SPEC_PARAMS:
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(f.default),
            metavar="TYPE" if isinstance(f.default, str) else "N",
            help=f"as llama-server (default {f.default})",
        )
    p.add_argument("--server-bin", type=Path, metavar="PATH", help="llama-server binary to use instead of building one")
    p.add_argument("--source", type=Path, metavar="DIR", help="llama.cpp tree to build llama-server from")
    p.add_argument("--parallel", type=count(1), default=4, help="slots in par and no-kv-unified modes (default 4)")
    p.add_argument("--repeat", type=count(1), default=1, help="run every suite's rounds this many times")
    p.add_argument("--update-baselines", action="store_true", help="write baselines from this run")
    p.add_argument(
        "--baselines-dir",
        type=Path,
        metavar="DIR",
        help="read (and with --update-baselines write) baselines here (default: fixtures/baselines beside the suites)",
    )
    p.add_argument(
        "--baselines-range",
        metavar="bA..bB",
        type=baselines_range,
        help="read (and with --update-baselines write) the baselines kept for these llama.cpp versions "
        "(`<case>--...@bA..bB.json`: what legitimately changed from the version-free ones); without it a run reads "
        "the narrowest kept range that covers its llama.cpp, else the version-free file",
    )
    p.add_argument(
        "--calibration-dir",
        type=Path,
        metavar="DIR",
        help="read calibration files here first (written by `specharness calibrate --calibration-dir`)",
    )
    p.add_argument(
        "--kv-scan",
        default="request",
        choices=KV_SCAN,
        help="scan KV state after every request (default), also after every speculative step, or off",
    )
    p.add_argument("--logit-top-k", type=count(0), default=10, help="top-k logits logged per position (0 = off)")
    p.add_argument(
        "--stall-s",
        type=seconds,
        metavar="S",
        help=f"floor of the stall window: a request with no token for that long ends `timeout` "
        f"(default {STALL_FLOOR_S:g}; a suite's `serve: stall_s` wins; see docs/internals/backends.md, Deadlines)",
    )
    p.add_argument("--out", metavar="DIR", help="run directory (default reports/<run-id>)")
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="run the I-th of N balanced parts of the cells (merge with `specharness report --merge`)",
    )


def run_defaults() -> dict:
    """The `run` options' defaults: what a stored run's `options` (only those it changed) are laid over."""
    p = argparse.ArgumentParser(add_help=False)
    add_run_options(p)
    return vars(p.parse_args([]))


def baselines_range(text: str) -> str:
    """`--baselines-range`: a llama.cpp version item (bA..bB, bN, a commit), checked."""
    import argparse

    from harness.backends.build.versions import parse_item

    try:
        parse_item(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text
