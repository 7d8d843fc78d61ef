"""`specharness build`: build (or find in the cache) llama-server for a source tree and backend."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from harness.argtypes import accept_cmake_definitions
from harness.backends.build import (
    BACKENDS,
    cached_server,
    ensure_server,
    extracted_source,
    installed_version,
    vendored_source,
)
from harness.errors import HarnessError


def cmd_build(args: argparse.Namespace) -> int:
    """Build or reuse llama-server and print where it is (`--json`: the whole BuildInfo)."""
    started = time.monotonic()
    if args.release and args.source:
        raise HarnessError("give --source DIR or --release VERSION, not both")
    if args.cached_only:
        return _report_cached(args)
    source = vendored_source(args.release) if args.release else args.source
    info = ensure_server(source, args.backend, args.cmake_arg, args.jobs, server_bin=args.server_bin)
    if args.json:
        print(json.dumps(dict(info.to_json(), cached=info.cached), indent=1))
        return 0
    how = "cached" if info.cached else f"built in {info.build_seconds:.0f} s"
    print(f"llama-server  {info.server_bin}")
    print(f"commit        {info.source_identity} ({info.backend}, {how}, {time.monotonic() - started:.1f} s)")
    return 0


def _report_cached(args: argparse.Namespace) -> int:
    """`--cached-only`: print the cached build, or say in one line that there is none (exit 1); nothing is
    downloaded or compiled."""
    release = args.release or (None if args.source else installed_version())
    source = extracted_source(release) if release else args.source
    info = cached_server(source, args.backend, args.cmake_arg) if source is not None else None
    if info is None:
        what = f"llama-cpp-python {release}'s llama.cpp" if release else str(args.source)
        print(f"no cached llama-server of {what} ({args.backend}): build it with this command without --cached-only")
        return 1
    print(f"llama-server  {info.server_bin}")
    print(f"commit        {info.source_identity} ({info.backend}, cached)")
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
