"""The `server` backend: serve a ServeConfig with a llama-server process, Requests → Results.

    with ServerBackend().open(ServeConfig(model=path, mode="par")) as session:
        results = session.run(requests)

A server that dies during a request (assert → SIGABRT, segfault, SIGKILL, fatal decode error)
turns that request into a Result with `stop_reason="crashed"`; the session starts a fresh server
and goes on with the next request. A server whose slots make no progress for the stall window
(harness.backends.slots_watch, StallMeter) is killed and restarted, and the requests in flight on it end
as `stop_reason="timeout"` naming their cases. A request that has not finished by its deadline
(`request_deadline`: the suite's `deadline_s`, else derived from n_predict and the slowest speed the
session measured) ends as `timeout` too; the server is killed and restarted (requests in flight on it end
as errors saying so) and the next request goes on.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.backends.base import ServeConfig, SpeedMeter, StallMeter, request_deadline
from harness.backends.build import BuildInfo, ensure_server
from harness.backends.client import COMPLETION_FIELDS, ConnectionLost, LlamaClient, RequestTimedOut, ServerError
from harness.backends.flags import server_version
from harness.backends.process import free_log_name, invalid_batch_in_log
from harness.backends.server import LlamaServer
from harness.backends.slots_watch import SlotsWatch
from harness.errors import HarnessError
from harness.kvscan import OtherFormatVersion, layout_from_model, scan_file
from harness.request import Request
from harness.result import Result

CRASH_GRACE_S = 5.0
"""How long a dropped connection or 5xx may take to show up as a process exit."""


class ServerBackend:
    """Serves models with llama-server; `build` None means the default CPU build of the vendored tree.

    `run_dir` receives one log file per server start (a temp dir when None). `fields` are extra
    /completion fields for every request (see client.COMPLETION_FIELDS). `server_options` set the
    LlamaServer fields a ServeConfig has no say on (`cache_prompt`, `metrics`, `slot_save_path`,
    `warmup`, `start_timeout`).
    """

    name = "server"

    def __init__(
        self,
        build: BuildInfo | None = None,
        run_dir: Path | None = None,
        request_timeout: float = 300.0,
        fields: dict[str, Any] | None = None,
        **server_options: Any,
    ):
        self.build = build
        self.run_dir = run_dir
        self.request_timeout = request_timeout
        self.fields = dict(fields or {})
        unknown = set(self.fields) - COMPLETION_FIELDS
        if unknown:
            raise HarnessError(f"unsupported /completion fields {sorted(unknown)}; use {sorted(COMPLETION_FIELDS)}")
        self.server_options = server_options

    def environment(self) -> dict:
        """What produces the outputs: the build's device (cpu, cuda, metal), llama.cpp commit, source identity
        (commit plus a digest when the tree is modified) and compiler. Not the binary's path: it is
        machine-specific, and these values go into committed baselines."""
        self.build = self.build or ensure_server()
        return {
            "device": self.build.backend,
            "llama_cpp_commit": self.build.commit,
            "source_identity": self.build.source_identity,
            "compiler": self.build.compiler,
        }

    def open(self, config: ServeConfig) -> ServerSession:
        """Start llama-server for `config` and wait until it is healthy."""
        self.build = self.build or ensure_server()
        run_dir = Path(self.run_dir) if self.run_dir else Path(tempfile.mkdtemp(prefix="specharness-server-"))
        session = ServerSession(config, self.build, run_dir, self.request_timeout, self.fields, self.server_options)
        session.start()
        return session


class ServerSession:
    """A model served by llama-server in one mode; restarts the server after a crash."""

    def __init__(
        self,
        config: ServeConfig,
        build: BuildInfo,
        run_dir: Path,
        request_timeout: float,
        fields: dict[str, Any],
        server_options: dict[str, Any],
    ):
        self.config = config
        self.build = build
        self.run_dir = run_dir
        self.request_timeout = request_timeout
        self.fields = fields
        self.server_options = server_options
        self.server: LlamaServer | None = None
        self.starts = 0
        self.speed = SpeedMeter()
        self.stall = StallMeter(config.stall_s)
        self.watch = SlotsWatch(lambda: self.server, self.stall, self._stalled)
        self._killed: dict[LlamaServer, str] = {}
        """Servers this session killed on purpose (a request past its deadline) → why."""
        self._stalls: dict[LlamaServer, str] = {}
        """Servers this session killed because their slots stalled → for how long (StallMeter's words)."""
        self._lock = threading.Lock()
        self._closed = False
        self._saves = itertools.count()
        self.unscannable: str | None = None
        """Why this build's slot files cannot be scanned (another format version), once found."""
        if config.kv_scan != "off":
            self.slots_dir = run_dir / "slots"
            self.slots_dir.mkdir(parents=True, exist_ok=True)
            self.layout = layout_from_model(config.model)

    def start(self) -> None:
        """(Re)start the server with a fresh port and a new log file in run_dir."""
        self.starts += 1
        log = free_log_name(self.run_dir, f"llama-server-{self.config.mode}")
        options = dict(self.server_options)
        if self.config.kv_scan != "off":
            options["slot_save_path"] = self.slots_dir
        self.server = LlamaServer.from_config(self.config, self.build.server_bin, log_path=log, **options).start()

    def run(self, requests: list[Request]) -> list[Result]:
        """One Result per request, in order: one at a time in `seq`, n_slots at a time otherwise."""
        if self.config.n_slots == 1:
            return [self._serve(r) for r in requests]
        pool = ThreadPoolExecutor(max_workers=self.config.n_slots, thread_name_prefix="llama-client")
        try:
            return list(pool.map(self._serve, requests))
        except BaseException:
            self.close()  # in-flight requests fail fast instead of running to completion
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _serve(self, request: Request) -> Result:
        with self._lock:
            if not self.server.alive:  # it died after its last answer
                self._restart(self.server)
            server = self.server
        deadline = request_deadline(request, self.config.n_ctx, self.speed.slowest)
        started = time.monotonic()
        try:
            client = LlamaClient(server.url, self.request_timeout)
            with self.watch.tracking() as on_prompt:
                result = client.complete(
                    request,
                    n_probs=self.config.logit_top_k,
                    fields=self.fields,
                    deadline_s=deadline,
                    on_prompt=on_prompt,
                )
            if result.ok:
                self.speed.record(len(result.tokens), time.monotonic() - started)
                self.stall.record(result)
            if self.config.kv_scan != "off" and result.ok and result.slot_id >= 0 and self.unscannable is None:
                result.kv_scan = self._scan_slot(client, result.slot_id)
            return result
        except (ConnectionLost, ServerError) as err:
            return self._failed(server, err, request)
        except RequestTimedOut:
            reason = f"timeout: {_case(request)} did not finish within its deadline of {deadline:.1f} s"
            with self._lock:
                self._killed.setdefault(server, reason)
                self._restart(server, kill=True)
            return Result(stop_reason="timeout", error=f"{reason}; llama-server was killed and restarted")

    def _scan_slot(self, client: LlamaClient, slot_id: int) -> dict | None:
        """Save the slot's state and scan it; an unhealthy file is kept in run_dir/slots as evidence. A build
        that saves slots in a format version the scanner does not read (another llama.cpp) is not scanned: None,
        said once on stderr, and `kv-healthy` does not apply to its requests."""
        name = f"slot{slot_id}-{next(self._saves)}.bin"
        client.save_slot(slot_id, name)
        path = self.slots_dir / name
        try:
            verdict = scan_file(path, layout=self.layout).brief()
        except OtherFormatVersion as err:
            path.unlink()
            with self._lock:
                first, self.unscannable = self.unscannable is None, str(err).split(": ", 1)[1]
            if first:
                print(
                    f"specharness: no KV scan on llama-server {server_version(self.build.server_bin)}: it saves "
                    f"slots in {self.unscannable}",
                    file=sys.stderr,
                )
            return None
        if verdict["healthy"]:
            path.unlink()
        else:
            verdict["file"] = str(path)
        return verdict

    def _failed(self, server: LlamaServer, err: Exception, request: Request) -> Result:
        """A dropped connection or a 5xx: `crashed` if the process ended, else a plain error; `timeout` when
        this session killed the server because its slots stalled, an error saying so when it killed it because
        another request was past its deadline."""
        with self._lock:
            if server in self._stalls:
                return Result(
                    stop_reason="timeout",
                    error=f"timeout: {_case(request)} {self._stalls[server]}; llama-server was killed and restarted",
                )
            if server in self._killed:
                return Result(
                    stop_reason="error", error=f"cut off: llama-server was restarted because {self._killed[server]}"
                )
            if server.wait_exit(CRASH_GRACE_S) is None:
                return Result(stop_reason="error", error=_explained(err, server))
            report = server.crash_report()
            self._restart(server)
        return Result(stop_reason="crashed", error=report)

    def _stalled(self, server: LlamaServer, why: str) -> None:
        """The watch saw no progress for the stall window: kill and restart the server; the requests in flight
        on it end `timeout` (`_failed`)."""
        with self._lock:
            self._stalls.setdefault(server, why)
            self._restart(server, kill=True)

    def _restart(self, server: LlamaServer, kill: bool = False) -> None:
        """Replace `server` (stopped if still running; `kill`: at once, it no longer answers) unless another
        thread already did or we are closed."""
        server.stop(kill=kill)
        if server is self.server and not self._closed:
            self.start()
            if self._closed:  # closed (Ctrl-C) while this thread started the new one
                self.server.stop()

    def close(self) -> None:
        """Stop the server; the session cannot be used afterwards."""
        self._closed = True
        self.watch.close()
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> ServerSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _explained(err: Exception, server: LlamaServer) -> str:
    """An error answer as the Result's error; llama-server's `Invalid input batch.` with llama.cpp's reason
    from the server's log (the sequence's last position X and the batch's first Y), as the engine says it."""
    if isinstance(err, ServerError) and "Invalid input batch" in str(err):
        reason = invalid_batch_in_log(server.log_path)
        if reason:
            return f"{err} {reason}"
    return str(err)


def _case(request: Request) -> str:
    """How errors name a request: its case, when it has a tag."""
    return f"case {request.tag}" if request.tag else "the request"
