"""`specharness scan`: list the cells of a llama.cpp state blob or file and check them (the scanner itself is
harness/kv/scan.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.errors import HarnessError
from harness.kv.parse import KINDS
from harness.kv.report import ScanReport
from harness.kv.scan import scan_file


def add_parser(subparsers) -> None:
    """Register `specharness scan`."""
    p = subparsers.add_parser(
        "scan",
        help="list the cells of a llama.cpp state blob or file and check them",
        description="Parse a llama.cpp state (whole-context blob, seq blob, .ggsq / llama-server slot file, "
        ".ggsn session file) and report duplicate positions, orphans past a known length, holes and "
        "recurrent tails. Exit status 1 when the cache is unhealthy.",
    )
    p.add_argument("file", type=Path, help="the state blob or file")
    p.add_argument(
        "--model", help="the model the state came from, a registry name or a .gguf path (facts the blob does not store)"
    )
    p.add_argument("--kind", choices=KINDS, default="auto", help="what the file is (default: from its magic)")
    p.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="SEQ=LEN",
        help="sequence SEQ holds LEN tokens: cells at positions >= LEN are orphans (repeatable; default for "
        ".ggsq and slot files: the file's own token count)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--cells", action="store_true", help="also list every cell")
    p.set_defaults(func=_cmd_scan)


def _parse_expect(items: list[str]) -> dict[int, int] | None:
    """`--expect SEQ=LEN` values; None without any, so a sequence file's own token count applies."""
    if not items:
        return None
    out = {}
    for item in items:
        seq, _, length = item.partition("=")
        try:
            out[int(seq)] = int(length)
        except ValueError:
            raise HarnessError(f"--expect wants SEQ=LEN with two integers, not '{item}'") from None
    return out


def _cmd_scan(args: argparse.Namespace) -> int:
    from harness.models import resolve

    model = None
    if args.model:
        model = Path(args.model) if Path(args.model).is_file() else resolve(args.model, make=False).path
    report = scan_file(args.file, model=model, kind=args.kind, expected_len=_parse_expect(args.expect))
    if args.json:
        print(json.dumps(report.to_dict(cells=args.cells), indent=2))
    else:
        _render(report, args.cells)
    return 0 if report.healthy else 1


def _render(report: ScanReport, cells: bool) -> None:
    """Print the report: what the file is, a table per part and sequence, every cell (`--cells`), the damage."""
    from rich.console import Console

    console = Console()
    facts = [report.framing, f"{report.size} bytes"]
    facts += [
        f"{k} {v}"
        for k, v in (("arch", report.arch), ("seq", report.seq_id), ("tokens", report.tokens))
        if v is not None
    ]
    console.print(f"[bold]{report.source}[/]: {', '.join(facts)}")
    console.print(f"layout: {report.layout.describe()}")
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(_sequences_table(report))
    if cells:
        console.print(_cells_table(report))
    if report.healthy:
        console.print("[green]healthy[/]")
        return
    for line in _damage(report):
        console.print(line)


def _sequences_table(report: ScanReport):
    """Per part and sequence: cells, position range, duplicates, orphans and holes."""
    from collections import Counter

    from rich.table import Table

    dups = Counter((d[0], d[2]) for d in report.duplicates for _ in range(d[4] - 1))
    orphans = Counter((o[0], o[2]) for o in report.orphans)
    holes = Counter((h[0], h[2]) for h in report.holes for _ in range(h[4] - h[3] + 1))
    table = Table("part", "seq", "cells", "pos range", "duplicates", "orphans", "holes")
    for part in report.parts:
        for seq, info in part.sequences().items():
            extra = info["cells"] - 1 if part.kind == "rs" else dups[part.name, seq]
            table.add_row(
                part.name,
                str(seq),
                str(info["cells"]),
                f"{info['pos_min']}..{info['pos_max']}",
                str(extra),
                str(orphans[part.name, seq]),
                str(holes[part.name, seq]),
            )
        if not part.n_cells:
            table.add_row(part.name, "-", "0", "-", "0", "0", "0")
    return table


def _cells_table(report: ScanReport):
    """Every cell: part, stream, position and sequence ids."""
    from rich.table import Table

    listing = Table("part", "stream", "pos", "seq ids")
    for part in report.parts:
        for stream, pos, seqs in part.cells():
            listing.add_row(part.name, str(stream), str(pos), ",".join(map(str, seqs)))
    return listing


def _damage(report: ScanReport) -> list[str]:
    """The UNHEALTHY line with the totals, then the first ten of each kind of damage."""
    totals = ", ".join(
        f"{v} {k.replace('_', ' ')}"
        for k, v in report.totals.items()
        if k in ("duplicate_cells", "orphans", "missing_positions", "duplicate_tails") and v
    )
    lines = [f"[red]UNHEALTHY[/]: {totals}"]
    lines += [
        f"  duplicate: {part} stream {stream} seq {seq} pos {pos} x{count}"
        for part, stream, seq, pos, count in report.duplicates[:10]
    ]
    lines += [
        f"  orphan: {part} stream {stream} seq {seq} pos {pos} (expected < {report.expected_len[seq]})"
        for part, stream, seq, pos in report.orphans[:10]
    ]
    lines += [
        f"  hole: {part} stream {stream} seq {seq} pos {first}..{last} missing"
        for part, stream, seq, first, last in report.holes[:10]
    ]
    lines += [
        f"  duplicate recurrent tails: seq {seq} has {count} cells" for seq, count in report.duplicate_tails.items()
    ]
    return lines
