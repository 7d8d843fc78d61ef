"""A run's calibrations, before anything is judged: each (model, backend) the run serves is looked up on the
run's device and build (`harness.verdict.noise.find`: a `--calibration-dir`, the committed files, the user cache);
one with none is measured once now (`calibrate`, as `specharness calibrate` measures it) and kept in the user
cache, never in a committed file. The lines it returns are the run's header."""

import time
from collections.abc import Callable
from pathlib import Path

from harness.calibration.measure import calibrate
from harness.calibration.store import write_cache
from harness.errors import HarnessError
from harness.execute import Executor
from harness.matrix import Cell
from harness.verdict.noise import device_key, find, where


def shown(path: Path) -> str:
    """A path as the header prints it: under the home directory as `~/...`."""
    try:
        return f"~/{path.relative_to(Path.home())}"
    except ValueError:
        return str(path)


def device_line(backend: str, env: dict) -> str:
    """The header line of a backend's device: where its kernels run and, on a GPU build, that every layer is
    offloaded (`-ngl all`, and `--spec-draft-ngl all` for a draft model: harness.backends.server_backend.gpu_layers)."""
    device = env.get("device", "cpu")
    what = "llama-server" if backend == "server" else "in-process engine"
    if env.get("llama_cpp_commit"):
        build = f" {str(env['llama_cpp_commit'])[:10]}"
    else:
        build = f" (llama-cpp-python {env['llama_cpp_python']})" if env.get("llama_cpp_python") else ""
    if env.get("gpu_layers"):
        offload = f"-ngl {env['gpu_layers']}: every layer on the GPU, a draft model's too (--spec-draft-ngl)"
    else:
        offload = "no GPU offload" if device == "cpu" else "layers as llama.cpp places them"
    return f"device: {what}{build} on {device} ({offload})"


def ensure(
    jobs: list,
    executor: Executor,
    root_of: Callable[[object], Path | None],
    server_bin: Path | None = None,
    source: Path | None = None,
    measure: bool = True,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Make sure each (model, backend) of `jobs` ((suite, cell) pairs) is calibrated on the run's device and build:
    `root_of(suite)` is where that suite's checks look first. A missing calibration is measured now when `measure`
    (else its verdicts use the default floor and the run's notes say `uncalibrated`). Each line is said as it
    happens and returned: first `device: ...` for each backend (`device_line`), then `calibration: cached ...` for
    one the user cache holds, `calibrated ... now (N s), cached in ...` for one measured now; a committed one says
    nothing."""
    lines, seen, devices = [], set(), set()
    for suite, cell in jobs:
        root = root_of(suite)
        if (cell.model, cell.backend, root) in seen:
            continue
        seen.add((cell.model, cell.backend, root))
        try:
            env = executor.environment(Cell(cell.backend, "seq", "none", cell.model))
        except HarnessError:  # the backend cannot be had (a build that fails): its cells say so, as without this
            continue
        if cell.backend not in devices:
            devices.add(cell.backend)
            lines.append(device_line(cell.backend, env))
            say(lines[-1])
        on = f"{cell.backend}/{device_key(env)}"
        path = find(cell.model, cell.backend, env, root)
        if path is not None:
            if where(path) == "cached":
                lines.append(f"calibration: cached: {cell.model} on {on} ({shown(path)})")
                say(lines[-1])
            continue
        if not measure:
            continue
        say(f"calibrating {cell.model} on {on} (no calibration for this device and build; once, then cached)")
        started = time.monotonic()
        try:
            data = calibrate(cell.model, cell.backend, server_bin=server_bin, source=source)
        except HarnessError as err:
            lines.append(f"calibration of {cell.model} on {on} failed: {err}; its verdicts use the default floor")
            say(lines[-1])
            continue
        written = write_cache(data, env)
        lines.append(
            f"calibrated {cell.model} on {on} now ({time.monotonic() - started:.0f} s), cached in {shown(written)}"
        )
        say(lines[-1])
    return lines
