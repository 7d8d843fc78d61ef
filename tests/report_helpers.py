"""Helpers for the report tests: a scratch checkout, a tiny HTML tree, the system browser."""

import contextlib
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
VOID = {"meta", "br", "input", "img", "link", "hr", "col", "source", "wbr"}


@contextlib.contextmanager
def inside(path: Path):
    """Run a block with `path` as the working directory."""
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def make_checkout(root: Path) -> Path:
    """A scratch copy of the project's suites, baselines and pytest setup (the real ones stay untouched)."""
    for name in ("suites", "fixtures"):
        shutil.copytree(REPO / name, root / name)
    for name in ("conftest.py", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    return root


class Node:
    """An HTML element: tag, attributes, children, text."""

    def __init__(self, tag: str, attrs: dict, parent: Optional["Node"]):
        self.tag, self.attrs, self.parent, self.children, self.parts = tag, attrs, parent, [], []

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    def iter(self):
        yield self
        for child in self.children:
            yield from child.iter()

    def find_all(self, tag: str | None = None, **attrs) -> list["Node"]:
        """Elements by tag and attributes (`class_` matches one class of the element)."""
        out = []
        for node in self.iter():
            if tag and node.tag != tag:
                continue
            ok = True
            for key, value in attrs.items():
                if key == "class_":
                    ok &= value in (node.attrs.get("class") or "").split()
                else:
                    ok &= node.attrs.get(key.replace("_", "-")) == value
            if ok:
                out.append(node)
        return out

    def find(self, tag: str | None = None, **attrs) -> "Node":
        found = self.find_all(tag, **attrs)
        assert found, f"no <{tag} {attrs}>"
        return found[0]


class _Builder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.node = Node("#root", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.node)
        self.node.children.append(node)
        self.node.parts.append(node)
        if tag not in VOID:
            self.node = node

    def handle_endtag(self, tag):
        node = self.node
        while node.parent is not None and node.tag != tag:
            node = node.parent
        if node.parent is not None:
            self.node = node.parent

    def handle_data(self, data):
        self.node.parts.append(data)


def parse_html(text: str) -> Node:
    builder = _Builder()
    builder.feed(text)
    return builder.root


def browser_or_skip() -> None:
    """Make sure Debian's chromium and Playwright are there (installing chromium with apt when missing and
    possible); skip the test with the reason otherwise."""
    from harness.report.browser import chromium_path, unavailable

    for step in (
        ["apt-get", "install", "-y", "-q", "chromium"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium"],
    ):
        if chromium_path() is not None or not shutil.which("apt-get"):
            break
        subprocess.run(step, capture_output=True, timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    reason = unavailable()
    if reason:
        print(f"browser test skipped: {reason}")
        pytest.skip(reason)
