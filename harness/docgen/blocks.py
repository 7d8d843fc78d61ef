"""The generated blocks of hand-written pages (the README's and the site index's default job)."""

import re
from collections.abc import Callable
from pathlib import Path

from harness.docgen.common import ROOT, _code

BLOCKS = ("README.md", "docs/index.md")
"""Hand-written pages with generated blocks: `<!-- generated: NAME -->` ... `<!-- /generated -->`."""
_BLOCK = re.compile(r"(<!-- generated: (?P<name>[a-z-]+) -->)\n(?P<text>.*?)(<!-- /generated -->)", re.S)


def _names(values: list[str], plain: tuple[str, ...] = ()) -> str:
    """`a`, `b` and `c` (the `plain` words after them, not as code)."""
    coded = [_code(v) for v in values] + list(plain)
    return coded[0] if len(coded) == 1 else ", ".join(coded[:-1]) + " and " + coded[-1]


def default_job_block() -> str:
    """What the default job (`specharness run` without `--suite`) serves, block by block of its suite's matrix."""
    from harness.execute.run_options import DEFAULT_SUITE
    from harness.matrix import cells
    from harness.suites import load_suite

    suite = load_suite(DEFAULT_SUITE, ROOT / "suites")
    blocks = suite.matrix if isinstance(suite.matrix, list) else [suite.matrix]
    lines = []
    for block in blocks:
        specs = [s for s in block["specs"] if s != "none"]
        plain = ("no speculation",) if "none" in block["specs"] else ()
        lines.append(
            f"- {_names(block['models'])} on {_names(block['backends'])} in {_names(block['modes'])}: "
            + _names(specs, plain)
        )
    n = len(cells(suite.matrix, {}))
    return (
        f"The default job is the [`{DEFAULT_SUITE}`](reference/suites.md#{DEFAULT_SUITE}) suite, {len(suite.cases)} "
        f"cases in {n} cells:\n\n" + "\n".join(lines)
    )


GENERATED_BLOCKS: dict[str, Callable[[], str]] = {"default-job": default_job_block}
"""Each generated block of the hand-written pages and the function that renders it."""


def _with_blocks(text: str, page: str) -> str:
    """`text` with its generated blocks rendered anew (links made relative to `page`)."""

    def fill(m: re.Match) -> str:
        body = GENERATED_BLOCKS[m["name"]]()
        if page == "README.md":
            body = body.replace("](reference/", "](docs/reference/")
        return f"{m.group(1)}\n{body}\n{m.group(4)}"

    return _BLOCK.sub(fill, text)


def stale_blocks(root: Path = ROOT) -> list[str]:
    """The hand-written pages whose generated blocks differ from what the code renders now."""
    return [p for p in BLOCKS if (root / p).read_text() != _with_blocks((root / p).read_text(), p)]


def write_blocks(root: Path = ROOT) -> None:
    for page in BLOCKS:
        text = (root / page).read_text()
        if _with_blocks(text, page) != text:
            (root / page).write_text(_with_blocks(text, page))
