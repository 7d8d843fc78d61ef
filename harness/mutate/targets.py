"""What a campaign mutates: files of a llama.cpp tree and, within each, the lines that are speculative code.

The default (`DEFAULT_TARGETS`) is llama.cpp's speculative path: all of common/speculative.cpp, the functions of
common/sampling.cpp that speculation calls (accept, clone, copy, sample, sample_and_accept_n), and the lines of
tools/server/server-context.cpp that mention drafts, checkpoints, acceptance or `seq_rm`. Lines that only log are
never mutated (a changed log line cannot change what a request returns), nor are compile-time assertions (a mutant
there does not compile or emits the same code), comments and preprocessor lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.errors import HarnessError

SAMPLING_FUNCTIONS = (
    "common_sampler_accept",
    "common_sampler_clone",
    "common_sampler_copy",
    "common_sampler_sample",
    "common_sampler_sample_and_accept_n",
)
"""The functions of common/sampling.cpp that the speculative path calls (llama-server's verification and its
checkpoint save and restore of the sampler)."""

SERVER_SPECULATIVE = re.compile(r"spec|draft|ckpt|checkpoint|accept|seq_rm", re.IGNORECASE)
"""A line of tools/server/server-context.cpp that belongs to speculation: speculative state, drafts, checkpoints,
acceptance, seq_rm (361 of its 5,559 lines at 0c1e570)."""

LOG_START = re.compile(r"^\s*(SLT_|SRV_|QUE_|SPC_|LOG_|LOG\(|GGML_LOG_|LLAMA_LOG_|fprintf\s*\(|printf\s*\(|std::cerr)")
"""The first line of a statement that only logs (llama-server's SLT_* / SRV_* / QUE_* macros, speculative.cpp's SPC_*,
common's LOG_*)."""

COMPILE_TIME = re.compile(r"^\s*static_assert\s*\(")
"""The first line of a compile-time assertion: a mutant there does not compile, or emits the same object code."""

NOT_CODE = re.compile(r"^\s*(//|#|$)")


@dataclass(frozen=True)
class Target:
    """One file (relative to the tree's root) and the lines of it that may be mutated (None: every line)."""

    file: str
    select: str = "all"
    """How the lines are chosen: `all`, `functions:a,b`, `matching:REGEX` or `lines:A-B,C-D`."""

    def lines(self, tree: Path) -> list[int]:
        """The 1-based line numbers of `file` in `tree` this target mutates, log-only lines left out."""
        path = tree / self.file
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            raise HarnessError(f"{path} cannot be read: is {tree} a llama.cpp tree with {self.file}?") from None
        chosen = self._chosen(text)
        left_out = log_only_lines(text) | statement_lines(text, COMPILE_TIME)
        return [n for n in chosen if n not in left_out and not NOT_CODE.match(text[n - 1])]

    def _chosen(self, text: list[str]) -> list[int]:
        kind, _, arg = self.select.partition(":")
        if kind == "all":
            return list(range(1, len(text) + 1))
        if kind == "functions":
            return [n for name in arg.split(",") for n in function_lines(text, name, self.file)]
        if kind == "matching":
            pattern = re.compile(arg, re.IGNORECASE)
            return [n for n, line in enumerate(text, 1) if pattern.search(line)]
        if kind == "lines":
            return [n for a, b in ranges(arg) for n in range(a, min(b, len(text)) + 1)]
        raise HarnessError(f"unknown line selection {self.select!r} (all, functions:..., matching:..., lines:A-B)")

    def describe(self) -> str:
        return self.file if self.select == "all" else f"{self.file} ({self.select})"


DEFAULT_TARGETS = (
    Target("common/speculative.cpp"),
    Target("common/sampling.cpp", "functions:" + ",".join(SAMPLING_FUNCTIONS)),
    Target("tools/server/server-context.cpp", "matching:" + SERVER_SPECULATIVE.pattern),
)


def parse_target(text: str) -> Target:
    """`--target FILE[:A-B[,C-D...]]`: a file of the tree, whole or in line ranges."""
    file, _, spans = text.partition(":")
    if not file or file.startswith("/") or ".." in Path(file).parts:
        raise HarnessError(f"--target {text}: name a file relative to the llama.cpp tree, e.g. common/speculative.cpp")
    if not spans:
        return Target(file)
    ranges(spans, f"--target {text}")
    return Target(file, f"lines:{spans}")


def ranges(spans: str, what: str = "line ranges") -> list[tuple[int, int]]:
    """`A-B,C,D-E` as (first, last) pairs, 1-based and inclusive."""
    out = []
    for span in spans.split(","):
        first, _, last = span.partition("-")
        try:
            a, b = int(first), int(last or first)
        except ValueError:
            raise HarnessError(f"{what}: {span!r} is not a line range (A-B or A)") from None
        if a < 1 or b < a:
            raise HarnessError(f"{what}: {span!r} is not a line range (1 <= A <= B)")
        out.append((a, b))
    return out


def function_lines(text: list[str], name: str, file: str = "") -> list[int]:
    """The lines of every definition of the function `name` (llama.cpp's style: the signature starts at column 0
    and the body ends at the next `}` in column 0); the signature lines are left out."""
    start = re.compile(rf"^[A-Za-z].*[\s*&]{re.escape(name)}\s*\(")
    found: list[int] = []
    n = 0
    while n < len(text):
        if start.match(text[n]) and not text[n].rstrip().endswith(";"):
            body = next((i for i in range(n, len(text)) if text[i].rstrip().endswith("{")), None)
            end = next((i for i in range(body or n, len(text)) if text[i].startswith("}")), None)
            if body is not None and end is not None:
                found += range(body + 2, end + 1)  # 1-based: the lines between the braces
                n = end
        n += 1
    if not found:
        raise HarnessError(f"{file or 'the file'} defines no function {name}: is it a llama.cpp tree of this era?")
    return found


def log_only_lines(text: list[str]) -> set[int]:
    """The 1-based lines of statements that only log: from a LOG_START line to the line ending its statement."""
    return statement_lines(text, LOG_START)


def statement_lines(text: list[str], start: re.Pattern) -> set[int]:
    """The 1-based lines of the statements whose first line `start` matches, to the line ending each (`;`)."""
    lines: set[int] = set()
    n = 0
    while n < len(text):
        if start.match(text[n]):
            end = n
            while end < len(text) - 1 and not text[end].rstrip().endswith(";"):
                end += 1
            lines.update(range(n + 1, end + 2))
            n = end
        n += 1
    return lines
