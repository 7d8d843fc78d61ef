"""Which llama.cpp a backend runs, on upstream's build-number line (tag bN = build N).

A known failure is a statement about the versions it was measured in (harness/verdict/known_failures.py
`versions`), so a
run needs the version of each backend's llama.cpp: a tag's build says its tag; a llama-server that reports an
upstream build number (`--version`: "version: N (hash)", what a build from a llama.cpp clone says) is build N; the
llama.cpp vendored in a llama-cpp-python release (the engine, and the default llama-server) is the commit the
release pins, placed between the two tags around it. Anything else (a tree without a tag or a history of its own,
a fork's fixture history) is of unknown version.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

OLDEST_TAG = 9093
"""The oldest tag the package index serves (b9093); a smaller build number is a history of its own, not upstream's."""

VENDORED = {
    "0.3.36": ("0c1e57098bba43ac29e6e3b677cdceebdd22334f", 11311, 11321),
}
"""llama-cpp-python release -> (the llama.cpp commit it vendors, the tag before it, the tag after it). Placed by
comparing the vendored tree with the trees of the tags around it (docs/release-b11311-vs-b11434.md)."""


@dataclass(frozen=True)
class LlamaVersion:
    """A llama.cpp version as an interval of upstream build numbers: exact for a tag, between two tags for a
    commit between them; `lo` None for unknown."""

    label: str
    lo: int | None = None
    hi: int | None = None
    commit: str = ""

    @property
    def known(self) -> bool:
        return self.lo is not None

    def within(self, lo: int, hi: int) -> bool:
        return self.known and lo <= self.lo and self.hi <= hi

    def at_or_after(self, number: int) -> bool:
        return self.known and self.lo >= number

    def __str__(self) -> str:
        return self.label


UNKNOWN = LlamaVersion("unknown")


def tag_version(tag: str) -> LlamaVersion:
    n = int(tag[1:])
    return LlamaVersion(tag, n, n, tag)


def commit_version(commit: str) -> LlamaVersion:
    """The version of a vendored commit (its full hash or a prefix of 7 or more characters), else UNKNOWN."""
    for _, (full, before, after) in VENDORED.items():
        if len(commit) >= 7 and full.startswith(commit.lower()):
            return LlamaVersion(f"{full[:7]} (between b{before} and b{after})", before + 1, after - 1, full)
    return UNKNOWN


def release_version(release: str) -> LlamaVersion:
    """The llama.cpp vendored in llama-cpp-python `release`."""
    pinned = VENDORED.get(release)
    return commit_version(pinned[0]) if pinned else LlamaVersion(f"llama-cpp-python {release} (not placed)")


def version_line(text: str) -> LlamaVersion:
    """From llama-server's `--version` ("version: N (hash)", or "version: 0.6.0-dev (build N, commit hash)" in newer
    builds): an upstream build number, else UNKNOWN."""
    found = re.search(r"version: (\d+) \((\w+)\)", text) or re.search(r"\(build (\d+), commit (\w+)\)", text)
    if not found:
        return UNKNOWN
    number, commit = int(found.group(1)), found.group(2)
    if commit.startswith("b") and commit[1:] == found.group(1):
        return tag_version(commit)
    by_commit = commit_version(commit)
    if by_commit.known:
        return by_commit
    return LlamaVersion(f"b{number} ({commit})", number, number, commit) if number >= OLDEST_TAG else UNKNOWN


def build_version(info) -> LlamaVersion:
    """The version of a llama-server build (harness/backends/build/entry.py BuildInfo)."""
    from harness.backends.flags import server_version

    if getattr(info, "tag", ""):
        return tag_version(info.tag)
    by_commit = commit_version(info.commit)
    if by_commit.known:
        return by_commit
    try:
        return version_line(server_version(Path(info.server_bin)))
    except Exception:  # noqa: BLE001 - a binary that cannot say its version is of unknown version
        return UNKNOWN


def engine_version() -> LlamaVersion:
    """The version of the llama.cpp in the installed llama-cpp-python (the in-process engine's)."""
    import importlib.metadata

    try:
        return release_version(importlib.metadata.version("llama-cpp-python"))
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN


def parse_item(item: str) -> tuple[int, int] | str:
    """One `versions` item of a known failure: 'bA..bB' or 'bA' -> (A, B); a commit prefix -> itself (matched by
    commit; also placed on the tag line when it is a vendored commit)."""
    m = re.fullmatch(r"b(\d+)(?:\.\.b(\d+))?", item)
    if m:
        a = int(m.group(1))
        return a, int(m.group(2) or a)
    m = re.fullmatch(r"([0-9a-f]{7,40})(?:\.\.b(\d+))?", item)
    if m:
        placed = commit_version(m.group(1))
        if m.group(2):
            if not placed.known:
                raise ValueError(f"'{item}': {m.group(1)} is not a commit placed on the tag line (VENDORED)")
            return placed.lo, int(m.group(2))
        return m.group(1)
    raise ValueError(f"'{item}' is not a version: write bN, bA..bB, a commit (7+ hex digits) or COMMIT..bN")


def covers(items: tuple[str, ...], version: LlamaVersion) -> bool:
    """Whether a known failure measured in `items` applies to `version`."""
    for item in items:
        parsed = parse_item(item)
        if isinstance(parsed, str):
            if version.commit and version.commit.startswith(parsed):
                return True
        elif version.within(*parsed):
            return True
    return False


def planned_versions(server_bin: Path | None = None, source: Path | None = None) -> dict[str, LlamaVersion]:
    """backend name -> the version it will run, from the options alone (before anything is built or started):
    `--server-bin`'s own build or `--version`, `--source`'s tag or commit, else the vendored llama.cpp."""
    from harness.backends.build.ensure import prebuilt_server
    from harness.backends.build.sources import source_identity, tag_of
    from harness.errors import HarnessError

    engine = engine_version()
    try:
        if server_bin is not None:
            server = build_version(prebuilt_server(Path(server_bin)))
        elif source is not None:
            tag = tag_of(Path(source))
            server = tag_version(tag) if tag else commit_version(source_identity(Path(source)).commit)
        else:
            server = engine
    except HarnessError:  # not a llama-server, or not a tree: the run says so where it serves; no version here
        server = UNKNOWN
    return {"server": server, "inproc": engine}


def environment_version(env: dict) -> LlamaVersion:
    """The version of the llama.cpp behind a backend's `environment()` (what a baseline records): a tag's build
    names its tag as its commit, a vendored commit is placed, llama-cpp-python names its release."""
    commit = str(env.get("llama_cpp_commit") or "")
    if re.fullmatch(r"b\d+", commit):
        return tag_version(commit)
    if commit:
        return commit_version(commit)
    if env.get("llama_cpp_python"):
        return release_version(str(env["llama_cpp_python"]))
    return UNKNOWN


def narrowest_covering(ranges: dict[str, object], version: LlamaVersion) -> object | None:
    """Of `ranges` (a `versions` item -> anything), the value of the narrowest item that covers `version`."""
    best = None
    for item, value in ranges.items():
        try:
            parsed = parse_item(item)
        except ValueError:
            continue
        if isinstance(parsed, str):
            width = 0 if version.commit and version.commit.startswith(parsed) else None
        else:
            width = parsed[1] - parsed[0] if version.within(*parsed) else None
        if width is not None and (best is None or width < best[0]):
            best = (width, value)
    return best[1] if best else None
