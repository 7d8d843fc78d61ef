"""Interrupting a specharness process in a given phase: by state, never after a guessed time.

The process appends every phase it enters to SPECHARNESS_PHASE_FILE and, with SPECHARNESS_HOLD_PHASE, stops
at the start of that phase until a signal comes (harness.interrupt); a test waits for the phase in the
file, then signals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness.interrupt import HOLD_PHASE, PHASE_FILE

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 600.0
"""A generous bound on reaching a phase (a cold build, a busy machine); the test fails, never sleeps, past it."""


def _default_signals() -> None:
    """The child starts with Ctrl-C handled, whatever this process inherited (a background job of a
    non-interactive shell ignores SIGINT, and an ignored signal stays ignored across exec)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def spawn(
    args: list[str],
    phases: Path,
    hold: str | None = None,
    env: dict | None = None,
    module: str = "harness.cli",
    **kw,
) -> subprocess.Popen:
    """`python -m harness.cli ARGS` (or `module`) as a process of its own, recording its phases in `phases`
    and holding at `hold` (NAME or NAME:N) when given; stdout and stderr together, as text."""
    env = {**os.environ, **(env or {}), PHASE_FILE: str(phases)}
    env.pop(HOLD_PHASE, None)
    if hold:
        env[HOLD_PHASE] = hold
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=kw.pop("cwd", REPO),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_signals,
        **kw,
    )


def entered(phases: Path) -> list[str]:
    """The phases entered so far, in order."""
    try:
        return phases.read_text().splitlines()
    except FileNotFoundError:
        return []


def wait_for_phase(proc: subprocess.Popen, phases: Path, name: str, n: int = 1) -> None:
    """Until the process has entered phase `name` `n` times (held there when SPECHARNESS_HOLD_PHASE says so);
    fails with the process's output when it ends first."""
    deadline = time.monotonic() + WAIT_S
    while entered(phases).count(name) < n:
        if proc.poll() is not None:
            raise AssertionError(
                f"exited {proc.returncode} before phase {name} #{n} (phases: {entered(phases)}):\n"
                + proc.stdout.read()[-3000:]
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"phase {name} #{n} not reached in {WAIT_S:.0f} s (phases: {entered(phases)})")
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen, sig: int = signal.SIGINT, group: bool = False) -> tuple[int, str]:
    """Send `sig` (`group`: to the process's group, as a terminal's Ctrl-C); (exit status, output) once the
    process has ended."""
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        output = proc.communicate(timeout=300)[0]
    except subprocess.TimeoutExpired as err:
        proc.kill()
        raise AssertionError(
            f"still running 300 s after {signal.Signals(sig).name}:\n" + proc.communicate()[0][-3000:]
        ) from err
    return proc.returncode, output


def left_behind(path: Path) -> list[str]:
    """Processes that still use something under `path` (a llama-server or an engine worker logs there, a
    server saves slots there): their command lines."""
    path = str(Path(path).resolve())
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if proc.name != str(os.getpid()) and (path in cmdline or any(link.startswith(path) for link in links)):
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found
