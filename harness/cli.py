"""The `specharness` command line: thin, each subcommand delegates to the module of its concern."""

import argparse
import os
import sys
import traceback

from harness import __version__, interrupt
from harness.errors import HarnessError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subcommand per concern (each module adds its own)."""
    from harness.backends.build import cli as build_cli
    from harness.bench import cli as bench_cli
    from harness.bisect import cli as bisect_cli
    from harness.commands import calibrate, scaffold, selftest
    from harness.commands import kvscan as kvscan_cli
    from harness.commands import run as runner
    from harness.models import cli as models_cli
    from harness.mutate import cli as mutate_cli
    from harness.report import cli as report_cli
    from harness.shrink import cli as shrink_cli

    parser = argparse.ArgumentParser(
        prog="specharness",
        description="Determinism and regression harness for speculative decoding in llama.cpp.",
    )
    parser.add_argument("--version", action="version", version=f"specharness {__version__}")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's own log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (
        runner,
        report_cli,
        models_cli,
        kvscan_cli,
        build_cli,
        bisect_cli,
        shrink_cli,
        mutate_cli,
        selftest,
        calibrate,
        bench_cli,
        scaffold,
    ):
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script (no command = `run`); returns the process exit status."""
    program = argv is None  # the process's own command (the console script, `python -m harness.cli`)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args([*argv, "run"])
    args.command_line = ["specharness", *argv]
    from harness.engine.logging import set_llama_verbose

    set_llama_verbose(args.verbose)
    try:
        with interrupt.handled(until_exit=program):  # Ctrl-C and SIGTERM: every `finally` runs; exit 130 / 143
            interrupt.phase("planning")
            status = int(args.func(args) or 0)
        return interrupt.status() if interrupt.received() else status  # never lose an interrupt
    except HarnessError as err:
        print(f"specharness: error: {err}", file=sys.stderr)
        return interrupt.status() if interrupt.received() else 2
    except KeyboardInterrupt:
        print("specharness: interrupted", file=sys.stderr)
        return interrupt.status()
    except BrokenPipeError:  # `specharness ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # a bug of ours: exit 3 (a harness error), never 1, which a caller reads as a verdict
        traceback.print_exc()
        why = f"{type(err).__name__}: {err}"
        print(f"specharness: harness error: {why} (a bug of specharness: please report it)", file=sys.stderr)
        return interrupt.status() if interrupt.received() else EXIT_HARNESS_BUG


EXIT_HARNESS_BUG = 3
"""The exit status of a command stopped by an exception of the harness itself (as `run`'s harness errors):
exit 1 means failing verdicts (`run`) or an unhealthy cache (`scan`), so a traceback must not exit 1."""


if __name__ == "__main__":
    sys.exit(main())
