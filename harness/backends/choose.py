"""The backends a run can use, by name, with the options that pick a llama-server build."""

from collections.abc import Callable
from pathlib import Path

from harness.backends.base import Backend
from harness.backends.inproc import InprocBackend


def backend_factories(
    server_bin: Path | None = None, source: Path | None = None, run_dir: Path | None = None, build=None
) -> dict[str, Callable[[], Backend]]:
    """name → factory; `server` serves `build` (a BuildInfo) when given, else builds (or reuses) llama-server
    from `source` unless `server_bin` is given. Process logs go to `run_dir/server-logs` and
    `run_dir/engine-logs` (temp dirs when `run_dir` is None)."""

    def server() -> Backend:
        from harness.backends.build import ensure_server
        from harness.backends.server_backend import ServerBackend

        return ServerBackend(
            build=build or ensure_server(source=source, server_bin=server_bin),
            run_dir=run_dir / "server-logs" if run_dir else None,
        )

    def inproc() -> Backend:
        return InprocBackend(run_dir / "engine-logs" if run_dir else None)

    return {"inproc": inproc, "server": server}
