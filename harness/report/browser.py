"""A report in a real headless browser: Debian's chromium driven by Playwright for Python.

The browser is the system's (`apt-get install chromium`), never one Playwright downloads. Used by the
browser tests and by `specharness bench report`.
"""

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness.errors import HarnessError

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """The system chromium (`$SPECHARNESS_CHROMIUM` overrides), None when there is none."""
    override = os.environ.get("SPECHARNESS_CHROMIUM")
    if override:
        return override if Path(override).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def unavailable() -> str | None:
    """Why a report cannot be opened in a browser here (None when it can)."""
    if chromium_path() is None:
        return "no chromium on PATH (apt-get install chromium)"
    import importlib.util

    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install playwright)"
    return None


@dataclass
class Loaded:
    """A report open in the browser."""

    page: object
    """The Playwright page."""
    load_ms: float
    """Navigation start to the end of the load event, as the browser measured it."""
    painted_ms: float
    """Navigation start to the first frame drawn after the load event (style, layout and paint included)."""
    console_errors: list[str] = field(default_factory=list)
    """Console errors and uncaught exceptions while loading."""


@contextlib.contextmanager
def open_report(path: Path, width: int = 1280, height: int = 900) -> Iterator[Loaded]:
    """Load a local HTML file in headless chromium; HarnessError when no browser can be used."""
    reason = unavailable()
    if reason:
        raise HarnessError(f"cannot open {path} in a browser: {reason}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(Path(path).resolve().as_uri(), wait_until="load")
            load_ms = page.evaluate(
                "() => { const n = performance.getEntriesByType('navigation')[0];"
                " return n.loadEventEnd - n.startTime; }"
            )
            painted_ms = page.evaluate(
                "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(performance.now()))))"
            )
            yield Loaded(page, float(load_ms), float(painted_ms), errors)
        finally:
            browser.close()
