"""Option types the commands share (argparse `type=` functions and parser tweaks); no harness imports, so any
command can use them."""

import argparse
import re


def csv(value: str | None) -> list[str] | None:
    """A comma-separated option as a list (None when not given)."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def count(minimum: int):
    """An argparse type: an integer of at least `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got '{text}'")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got '{text}'")
    return value


CMAKE_DEFINITION = re.compile(r"-[DU][A-Za-z_]")
"""A CMake cache definition (-DX=Y) or removal (-UX)."""


def accept_cmake_definitions(parser: argparse.ArgumentParser) -> None:
    """Let `--cmake-arg -DX=Y` parse: argparse takes every word starting with '-' for an option (and
    then complains that --cmake-arg has no value), so words that look like CMake -D/-U arguments are
    classified as values instead. This parser has no option starting with -D or -U. A stray -DX=Y
    without --cmake-arg is still refused (as an unrecognized argument)."""
    classify = getattr(parser, "_parse_optional", None)
    if classify is None:  # argparse internals changed: only --cmake-arg=-DX=Y works then
        return

    def parse_optional(arg_string: str):
        return None if CMAKE_DEFINITION.match(arg_string) else classify(arg_string)

    parser._parse_optional = parse_optional
