"""Where specharness keeps its cache (models, builds) and its generated reports."""

import json
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


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines log, oldest first: a missing file is none, a line cut short by a kill is
    ignored (the bisect log, a mutation campaign's mutants)."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def append_jsonl(path: Path, record: dict) -> None:
    """One record at the end of a JSON-lines log (values JSON cannot hold written as text)."""
    with open(path, "a") as log:
        log.write(json.dumps(record, default=str) + "\n")
