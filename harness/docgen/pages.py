"""The driver: every generated page (`PAGES`), rendering them, comparing them with the committed ones, and
`python -m harness.docgen`."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from harness.docgen.blocks import stale_blocks, write_blocks
from harness.docgen.calibration import calibration_page
from harness.docgen.checks import checks_page
from harness.docgen.cli import cli_page
from harness.docgen.common import COMMAND, OUT
from harness.docgen.faults import faults_page
from harness.docgen.known_failures import known_failures_page
from harness.docgen.models import models_page
from harness.docgen.suite_format import suite_format_page
from harness.docgen.suites import suites_page

PAGES: dict[str, Callable[[], str]] = {
    "cli.md": cli_page,
    "suite-format.md": suite_format_page,
    "suites.md": suites_page,
    "checks.md": checks_page,
    "faults.md": faults_page,
    "known-failures.md": known_failures_page,
    "calibration.md": calibration_page,
    "models.md": models_page,
}
"""Each generated page (a file of docs/reference/) and the function that renders it."""


def render() -> dict[str, str]:
    """Every generated page's text, by file name."""
    return {name: page().rstrip("\n") + "\n" for name, page in PAGES.items()}


def stale(out: Path = OUT) -> list[str]:
    """The pages under `out` that differ from what the code generates now (missing ones included)."""
    pages = render()
    return [n for n, text in pages.items() if not (out / n).is_file() or (out / n).read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the documentation's generated reference pages.")
    parser.add_argument("--out", type=Path, default=OUT, help="directory to write into (default docs/reference)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page differs")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale(args.out) + stale_blocks()
        if differ:
            print(f"docs: stale generated pages: {', '.join(differ)}; regenerate with `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (args.out / name).write_text(text)
    if args.out == OUT:
        write_blocks()
    print(f"wrote {len(PAGES)} pages into {args.out}")
    return 0
