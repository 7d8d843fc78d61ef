"""The `specharness` command line: thin, each subcommand delegates to the module of its concern."""

import argparse
import importlib
import os
import sys
import traceback

from harness import __version__, interrupt
from harness.errors import HarnessError

COMMANDS = (
    ("harness.commands.run", ("run",)),
    ("harness.report.cli", ("report", "diff")),
    ("harness.models.cli", ("models",)),
    ("harness.commands.kvscan", ("scan",)),
    ("harness.backends.build.cli", ("build",)),
    ("harness.bisect.cli", ("bisect",)),
    ("harness.shrink.cli", ("shrink", "repro")),
    ("harness.mutate.cli", ("mutate",)),
    ("harness.commands.selftest", ("selftest",)),
    ("harness.commands.calibrate", ("calibrate",)),
    ("harness.bench.cli", ("bench",)),
    ("harness.commands.scaffold", ("init",)),
)
"""Each module of a concern and the subcommands it adds, in the order `--help` lists them. Only the module of the
command being run is imported (the others' imports cost a `specharness run` about 0.9 s, 2026-12-07); help, a
missing or unknown command and the docs import every one."""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with one subcommand per concern (each module adds its own): all of them, or only the
    one `argv` runs (its first word that is not an option) when a module adds it."""
    parser = argparse.ArgumentParser(
        prog="specharness",
        description="Determinism and regression harness for speculative decoding in llama.cpp.",
    )
    parser.add_argument("--version", action="version", version=f"specharness {__version__}")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp's own log output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = next((word for word in argv or [] if not word.startswith("-")), None)
    chosen = [module for module, names in COMMANDS if command in names] or [module for module, _ in COMMANDS]
    for module in chosen:
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script (no command = `run`); returns the process exit status."""
    program = argv is None  # the process's own command (the console script, `python -m harness.cli`)
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        args = build_parser([*argv, "run"]).parse_args([*argv, "run"])
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
