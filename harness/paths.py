"""Where specharness keeps its cache (models, builds) and its generated reports."""

import os
import tempfile
from collections.abc import Callable
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


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp_path)` on a temp file beside `path`, then move it onto `path`: readers never see a
    half-written file, and a failed write leaves the old one untouched."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
