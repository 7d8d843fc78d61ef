"""Reports of runs: the run directory's files (`files`), its views (`html`: index.html, `junit`:
junit.xml), and reports across run directories (`diff`, `history`, `merge`)."""

from pathlib import Path

from harness.report.files import RunDir, check_records, describe_run, frame, records, write_run
from harness.report.html import write_index
from harness.report.junit import write_junit

__all__ = ["RunDir", "check_records", "describe_run", "frame", "publish", "records", "write_run"]


def publish(run_dir: Path) -> Path:
    """(Re-)render a run directory's `junit.xml` and `index.html` from its stored files; returns index.html."""
    run = RunDir.load(run_dir)
    write_junit(run)
    return write_index(run)
