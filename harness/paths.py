"""Where specharness keeps its cache (models, builds) and its generated reports."""

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """The cache root: `$SPECHARNESS_CACHE` if set, else the platform's user cache dir."""
    override = os.environ.get("SPECHARNESS_CACHE")
    root = Path(override) if override else Path(platformdirs.user_cache_dir("specharness"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def reports_dir() -> Path:
    """The default parent of run directories: `reports/` in the current working directory."""
    return Path.cwd() / "reports"
