"""A fresh virtual environment that sees the packages of the environment running the tests.

`python -m venv --system-site-packages` shows the base interpreter's packages, which are not the running
environment's when the tests run inside a virtual environment themselves (a newcomer's `.venv`): the installed
wheel then dies with `ModuleNotFoundError: No module named 'rich'`. Instead the new environment gets a `.pth`
file naming the running environment's site-packages directories: its own packages come first, the running
environment's after them (as directories only: their `.pth` files, such as an editable install of this
checkout, are not processed)."""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path

PTH = "_outer_environment.pth"


def outer_site_packages() -> list[str]:
    """The running environment's site-packages directories (a venv's own, and the base's where it sees them)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def make_venv(path: Path, with_pip: bool = True) -> Path:
    """Create the environment at `path`; returns its `bin` directory."""
    cmd = [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    python = path / "bin" / "python"
    inner = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    (Path(inner) / PTH).write_text("".join(f"{d}\n" for d in outer_site_packages()))
    return path / "bin"


if __name__ == "__main__":
    make_venv(Path(sys.argv[1]), with_pip=False)
