"""`specharness models list|make`: show the registry, build the generated models."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Column, Table

from harness.models.registry import list_models, make


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n else "-"


def cmd_list(args: argparse.Namespace) -> int:
    """`specharness models list [--json]`: every registry entry (builds missing generated models)."""
    models = list_models()
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=1))
        return 0
    table = Table("name", "arch", "kind", "size", "sha256", Column("path", overflow="fold"))
    for m in models:
        table.add_row(m.name, m.arch, m.kind, _size(m.size), m.sha256[:12] or "-", str(m.path))
    # a file or a pipe keeps whole names and paths (`models list | grep`), not rich's 80 columns
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def cmd_make(args: argparse.Namespace) -> int:
    """`specharness models make [NAME...]`: build the named models (default: every generated one)."""
    for m in make(args.names or None):
        print(f"{m.name}  {m.sha256}  {m.path}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness models` with its `list` and `make` subcommands."""
    p = sub.add_parser("models", help="list the model registry or build the generated models")
    models_sub = p.add_subparsers(dest="models_command", metavar="SUBCOMMAND", required=True)
    p_list = models_sub.add_parser("list", help="show every registry model (builds missing tiny models)")
    p_list.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p_list.set_defaults(func=cmd_list)
    p_make = models_sub.add_parser("make", help="build generated models (default: all of them)")
    p_make.add_argument("names", nargs="*", metavar="NAME", help="registry names (default: every generated model)")
    p_make.set_defaults(func=cmd_make)
