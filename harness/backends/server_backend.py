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

With the KV scan on, every request's slot is saved after the request and scanned (harness.kv.scan). The scan judges
only the request's own state: with several slots each request is pinned to a slot (`id_slot`) that no other
request gets before its save (SlotPool: a slot is lent to one request at a time and comes back after the save),
and the saved token list must hold the request's prompt and returned tokens (`slot_ownership`). A saved state
that is not provably the request's own is recorded as `kv_scan = {"judged": False, "reason": ...}`: not judged,
never a pass or a failure (llama-server's `--cache-idle-slots`, on by default, clears the idle slots of a unified
KV cache whenever a task starts, so a slot can be found empty at its save); so is a save llama-server refused or
did not answer while it lives on (the request completed; a save the process died in is the request's crash).
In `seq` (one slot, not unified, one request at a time, saved before the next is sent) nothing else can empty or
take the slot: one holding fewer cells than the request's prompt and returned tokens lost them (`lost_cells`,
kept as `kv_scan["lost"]`), which `kv-healthy` fails."""

from __future__ import annotations

import itertools
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import requests

from harness.backends import server_batches, server_work
from harness.backends.base import ServeConfig, SpeedMeter, StallMeter, request_deadline
from harness.backends.build import BuildInfo, ensure_server
from harness.backends.client import (
    COMPLETION_FIELDS,
    ConnectionLost,
    LlamaClient,
    RequestTimedOut,
    ServerError,
    completion_payload,
    local,
)
from harness.backends.flags import server_version
from harness.backends.process import LogDir, free_log_name, invalid_batch_in_log
from harness.backends.server import LlamaServer
from harness.backends.server_checkpoints import ELSEWHERE, Ledger
from harness.backends.server_rescore import PrefixHistory
from harness.backends.server_slots import SlotPool, lost_cells, slot_ownership
from harness.backends.slots_watch import SlotsWatch
from harness.errors import HarnessError
from harness.kv.parse import OtherFormatVersion
from harness.kv.scan import layout_from_model, scan_file
from harness.result import Result
from harness.result.logits import PositionLogits, from_server_probs
from harness.suites.request import Request, Sampling

CRASH_GRACE_S = 5.0
"""How long a dropped connection may take to show up as a process exit."""
ANSWERED_GRACE_S = 0.5
"""How long an HTTP error answer (a 5xx with llama-server's error body) may take to show up as a process exit: the
process was alive to write it (llama-server answers a failed task and goes on; an abort answers nothing), so this
is only a short look for an exit that raced it. Every `context_full` answer of a filled KV cache waits this long,
under the session's lock: 5 s each was most of a kv-fill cell's time."""
LAUNCH_WAIT_S = 5.0
"""How long a request waits before its launch for other finished requests' slots to be saved (`_launch`)."""
LAUNCH_POLL_S = 0.002
METRICS_TIMEOUT_S = 10.0
"""How long the /slots and /metrics reads around a batch may take (they answer between decodes)."""
_batches = itertools.count(1)
"""Batch ids, unique in the process (a cell's requests may be served by several sessions)."""


def gpu_layers(build: BuildInfo) -> str | None:
    """`-ngl` for a build: `all` on a GPU build (cuda, metal, ...: every layer of the target and the draft on the
    device, said explicitly rather than left to llama-server's `auto`, which `-fit off` makes the same today but a
    later default may not), None on a CPU build (no flag: llama-server warns that it ignores it)."""
    return None if build.backend == "cpu" else "all"


class ServerBackend:
    """Serves models with llama-server; `build` None means the default CPU build of the vendored tree.

    `run_dir` receives one log file per server start (a temp dir when None: LogDir). `fields` are extra
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
        (commit plus a digest when the tree is modified) and compiler, and on a GPU build how many layers it
        offloads (`gpu_layers`: all, `-ngl all`). Not the binary's path: it is machine-specific, and these values go
        into committed baselines."""
        self.build = self.build or ensure_server()
        offload = gpu_layers(self.build)
        return {
            "device": self.build.backend,
            "llama_cpp_commit": self.build.commit,
            "source_identity": self.build.source_identity,
            "compiler": self.build.compiler,
            **({"gpu_layers": offload} if offload else {}),
        }

    def open(self, config: ServeConfig) -> ServerSession:
        """Start llama-server for `config` and wait until it is healthy."""
        self.build = self.build or ensure_server()
        logs = LogDir(self.run_dir, "specharness-server-")
        session = ServerSession(config, self.build, logs, self.request_timeout, self.fields, self.server_options)
        session.start()
        return session


class ServerSession:
    """A model served by llama-server in one mode; restarts the server after a crash."""

    def __init__(
        self,
        config: ServeConfig,
        build: BuildInfo,
        logs: LogDir,
        request_timeout: float,
        fields: dict[str, Any],
        server_options: dict[str, Any],
    ):
        self.config = config
        self.build = build
        self.logs = logs
        self.run_dir = logs.path
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
        self._stalls: dict[LlamaServer, tuple[str, int | None]] = {}
        """Servers this session killed because a slot stalled → for how long (StallMeter's words) and the slot
        (None: the server as a whole)."""
        self._lock = threading.Lock()
        self._closed = False
        self._saves = itertools.count()
        self.unscannable: str | None = None
        """Why this build's slot files cannot be scanned (another format version), once found."""
        self.pool = SlotPool(config.n_slots) if config.n_slots > 1 and "id_slot" not in fields else None
        self._launched: set[int] = set()
        """Slots whose request was sent and whose state is not saved yet (see `_launch`)."""
        self._launched_cond = threading.Condition()
        """Lends each request its slot (None: one slot, served one request at a time, or the caller's `id_slot`)."""
        self.slots_dir = self.run_dir / "slots"
        """llama-server's --slot-save-path: the KV scan's slot files and `save_slot`'s."""
        self.slots_dir.mkdir(parents=True, exist_ok=True)
        if config.kv_scan != "off":
            self.layout = layout_from_model(config.model)

    def start(self) -> None:
        """(Re)start the server with a fresh port and a new log file in run_dir (kept when the start fails: the
        error names it)."""
        self.starts += 1
        log = free_log_name(self.run_dir, f"llama-server-{self.config.mode}")
        options = dict(self.server_options)
        options["slot_save_path"] = self.slots_dir
        options.setdefault("verbosity", server_work.VERBOSITY)  # the checkpoint lines `work` counts
        options.setdefault("metrics", True)  # the counters `metrics-agree` compares with the answers
        options.setdefault("gpu_layers", gpu_layers(self.build))  # every layer on the GPU of a GPU build
        self.checkpoints = Ledger()  # a new process: no checkpoint of it seen made yet
        self.prefixes = PrefixHistory()  # ... and no slot holding anything
        try:
            self.server = LlamaServer.from_config(self.config, self.build.server_bin, log_path=log, **options).start()
        except BaseException:
            self.logs.cite(log)
            raise

    def run(self, requests: list[Request]) -> list[Result]:
        """One Result per request, in order: one at a time in `seq`, n_slots at a time otherwise. Each batch (one
        request in `seq`, all of them otherwise) is measured by /metrics around it (`Result.metrics`)."""
        if self.config.n_slots == 1:
            return [self._measured(lambda r=r: [self._serve(r)])[0] for r in requests]
        pool = ThreadPoolExecutor(max_workers=self.config.n_slots, thread_name_prefix="llama-client")
        try:
            return self._measured(lambda: list(pool.map(self._serve, requests)))
        except BaseException:
            self.close()  # in-flight requests fail fast instead of running to completion
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _measured(self, serve: Callable[[], list[Result]]) -> list[Result]:
        """`serve()`'s results, each with what llama-server's /metrics counters moved by over the batch (read with
        every slot idle before and after; unmeasured, with the reason, where the server changed or did not
        answer)."""
        before, why = self._counters()
        results = serve()
        after, why_after = self._counters()
        measured: dict[str, Any] = {"batch": next(_batches), "requests": len(results)}
        if before is None or after is None or before[0] is not after[0]:
            measured["unmeasured"] = why or why_after or "llama-server was restarted during the batch"
        else:
            measured["delta"] = {k: v - before[1].get(k, 0.0) for k, v in after[1].items()}
        for result in results:
            result.metrics = measured
        return results

    def _counters(self) -> tuple[tuple[LlamaServer, dict] | None, str | None]:
        """(the server, its /metrics counters) read once every slot is idle, or (None, why not)."""
        with self._lock:
            server = self.server
        if server is None or not server.alive:
            return None, "llama-server was not running"
        client = LlamaClient(server.url, METRICS_TIMEOUT_S)
        try:
            if not client.all_idle(METRICS_TIMEOUT_S):
                return None, f"a slot was still processing {METRICS_TIMEOUT_S:.0f} s after the batch"
            return (server, client.metrics()), None
        except (ConnectionLost, ServerError, RequestTimedOut) as err:
            return None, f"/metrics: {err}"

    def _serve(self, request: Request) -> Result:
        with self._lock:
            if not self.server.alive:  # it died after its last answer
                self._restart(self.server)
            server = self.server
        deadline = request_deadline(request, self.config.n_ctx, self.speed.slowest, self.stall.prompt_token_s)
        started = time.monotonic()
        lent: list[int] = []  # the slot the pool lent this request, once its prompt is known
        held: list[int] = []  # what the slot holds afterwards, as far as the harness knows

        def pin(prompt: list[int]) -> int | None:
            if self.pool is None:
                return None
            lent.append(self.pool.acquire(prompt))
            self._launch(server, lent[0])
            return lent[0]

        log_start = server_work.mark(server.log_path)
        try:
            client = LlamaClient(server.url, self.request_timeout)
            with self.watch.tracking() as on_prompt:
                result = client.complete(
                    request,
                    n_probs=self.config.logit_top_k,
                    fields=self.fields,
                    deadline_s=deadline,
                    on_prompt=on_prompt,
                    pin=pin,
                )
            if result.ok:
                logged = server_work.task_log(result, server.log_path, log_start, server_work.verbosity_of(server))
                result.work = server_work.work_of(result, logged)
                if logged is not None:
                    geo = server_batches.geometry(Path(server.log_path))
                    result.split_rollbacks = server_batches.of_request(logged, geo, result.slot_id)
                    if result.work.steps is not None:
                        result.work.steps["places"] = server_batches.places(logged, result.slot_id)
                    with self._lock:
                        result.stale_checkpoint = self.checkpoints.follow(
                            result.slot_id, result.prompt_tokens, logged.messages, logged.lines
                        )
                        self.prefixes.record(result, any(ELSEWHERE.search(m) for m in logged.messages))
                self.speed.record(len(result.tokens), time.monotonic() - started)
                self.stall.record(result)
                held = result.prompt_tokens + result.tokens
            if self.config.kv_scan != "off" and result.ok and result.slot_id >= 0 and self.unscannable is None:
                result.kv_scan = self._scan_slot(server, client, result, lent[0] if lent else None)
            return result
        except (ConnectionLost, ServerError) as err:
            return self._failed(server, err, request, lent[0] if lent else None)
        except RequestTimedOut:
            reason = f"timeout: {_case(request)} did not finish within its deadline of {deadline:.1f} s"
            with self._lock:
                self._killed.setdefault(server, reason)
                self._restart(server, kill=True)
            return Result(stop_reason="timeout", error=f"{reason}; llama-server was killed and restarted")
        finally:
            if lent:
                with self._launched_cond:
                    self._launched.discard(lent[0])
                    self._launched_cond.notify_all()
                self.pool.release(lent[0], held)

    def save_slot(self, slot_id: int) -> dict:
        """The slot's state saved by llama-server (`POST /slots/{id}?action=save`, once the slot is idle) into a file
        of this session's --slot-save-path: its answer (`n_saved` tokens, `n_written` bytes) with `state`, the
        file `restore_slot` takes (here or in another session, while this one is open); `{"error": ...}` when
        llama-server refused."""
        path = self.slots_dir / f"saved-slot{slot_id}-{next(self._saves)}.bin"
        client = LlamaClient(self.server.url, self.request_timeout)
        client.slot_idle(slot_id)
        try:
            return {**client.save_slot(slot_id, path.name), "state": path}
        except (ServerError, ConnectionLost, RequestTimedOut) as err:
            return {"error": f"POST /slots/{slot_id}?action=save: {err}"}

    def rescore(self, prefix: list[int], tail: list[int], n_probs: int) -> PositionLogits | None:
        """The top-`n_probs` log-probabilities after `tail`'s last token, computed with `prefix` cached in slot 0
        and `tail` as one batch (harness.backends.server_rescore): `prefix` sent first with `cache_prompt` off (a
        fresh, repeatable prefix), then prefix + tail with it on, one token generated greedily, whose
        probabilities a request's first token always carries. None where llama-server did not answer both."""
        client = LlamaClient(self.server.url, self.request_timeout)
        greedy = Sampling(n_predict=0, temperature=0.0)
        try:
            if prefix:
                client.completion(completion_payload(prefix, greedy, 0, {"id_slot": 0, "cache_prompt": False}))
            payload = completion_payload(
                [*prefix, *tail], replace(greedy, n_predict=1), n_probs, {"id_slot": 0, "cache_prompt": bool(prefix)}
            )
            data = client.completion(payload)
        except (ServerError, ConnectionLost, RequestTimedOut):
            return None
        rows = from_server_probs(data.get("completion_probabilities", [])[:1])
        reused = data.get("timings", {}).get("cache_n")
        if not rows or not len(rows[0].top_ids) or (prefix and reused != len(prefix)):
            return None  # no probabilities, or the tail was not the one batch asked for
        return rows[0]

    def restore_slot(self, slot_id: int, state: Path, erase: bool = False) -> dict:
        """Restore a `save_slot` state into the slot (`POST /slots/{id}?action=restore`; the file is copied into this
        session's --slot-save-path first when another session saved it); `erase`: erase the slot first
        (`action=erase`: its sequence leaves the target and draft contexts). llama-server's answer (`n_restored`
        tokens, `n_read` bytes), or `{"error": ...}` when it refused."""
        if state.parent != self.slots_dir:
            shutil.copyfile(state, self.slots_dir / state.name)
        client = LlamaClient(self.server.url, self.request_timeout)
        action = "erase" if erase else "restore"
        self.checkpoints.forget(slot_id)  # the slot's checkpoints now come from the state file
        self.prefixes.forget(slot_id)
        try:
            if erase:
                client.erase_slot(slot_id)
                action = "restore"
            return client.restore_slot(slot_id, state.name)
        except (ServerError, ConnectionLost, RequestTimedOut) as err:
            return {"error": f"POST /slots/{slot_id}?action={action}: {err}"}

    def _launch(self, server: LlamaServer, slot: int) -> None:
        """Mark `slot` launched, after waiting (a few seconds at most) until no other launched slot is idle on a
        unified KV cache that is scanned: llama-server clears the idle slots of a unified cache whenever it starts
        a task (`--cache-idle-slots`), so a request that finished but whose slot is not saved yet (its answer on
        the way, or its save) would lose its state to this launch. What still slips through (a slot finishing
        between the look at /slots and the launch) is found empty at its save and not judged."""
        if self.config.kv_scan != "off" and self.config.kv_unified:
            until = time.monotonic() + LAUNCH_WAIT_S
            while time.monotonic() < until:
                with self._launched_cond:
                    others = self._launched - {slot}
                if not others:
                    break
                try:
                    answer = local("GET", f"{server.url}/slots", timeout=max(0.05, until - time.monotonic()))
                    idle = {s.get("id") for s in answer.json() if not s.get("is_processing")}
                except (requests.RequestException, ValueError, AttributeError, TypeError):
                    break  # the requests in flight will say what happened
                with self._launched_cond:
                    if not (idle & (self._launched - {slot})):
                        break
                    self._launched_cond.wait(LAUNCH_POLL_S)  # an answer on its way, or a save: soon done
        with self._launched_cond:
            self._launched.add(slot)

    def _scan_slot(self, server: LlamaServer, client: LlamaClient, result: Result, lent: int | None) -> dict | None:
        """Save the slot's state and scan it; an unhealthy file is kept in run_dir/slots as evidence. A state that
        is not provably the request's own (`slot_ownership`; a request served on another slot than the one lent)
        is not judged: `{"judged": False, "reason": ...}`; nor is one llama-server did not save (an error answer or
        no answer to the save while the process lives on: the request completed, only its scan failed). A save
        the process died in raises, as the request's crash (`_failed`). A build that saves slots in a format
        version the scanner does not read (another llama.cpp) is not scanned: None, said once on stderr, and
        `kv-healthy` does not apply to its requests."""
        slot_id = result.slot_id
        if lent is not None and slot_id != lent:
            return {"judged": False, "reason": f"served on slot {slot_id}, not on slot {lent} it was pinned to"}
        name = f"slot{slot_id}-{next(self._saves)}.bin"
        client.slot_idle(slot_id)  # else the save may wait among the deferred tasks for another slot's release
        try:
            client.save_slot(slot_id, name)
        except (ServerError, ConnectionLost, RequestTimedOut) as err:
            grace = ANSWERED_GRACE_S if isinstance(err, ServerError) else CRASH_GRACE_S
            if server.wait_exit(grace) is not None:  # the process died: a crash of the request (`_failed`)
                raise ConnectionLost(f"POST /slots/{slot_id}?action=save: {err}") from err
            return {"judged": False, "reason": f"the slot was not saved: POST /slots/{slot_id}?action=save: {err}"}
        path = self.slots_dir / name
        try:
            report = scan_file(path, layout=self.layout)
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
        foreign = slot_ownership(report.token_ids, result)
        # seq: one slot, saved right after its own request with nothing else on the server, and not unified (no
        # idle-slot clearing): a slot shorter than the request lost cells, which no other request explains
        seq = foreign is not None and report.token_ids is not None and self.config.mode == "seq"
        lost = lost_cells(report.token_ids, result) if seq else None
        if foreign is not None and lost is None:
            path.unlink()
            return {"judged": False, "reason": foreign}
        verdict = report.brief()
        if lost is not None:
            verdict["lost"] = lost
        if verdict["healthy"] and lost is None:
            path.unlink()
        else:
            verdict["file"] = str(self.logs.cite(path))
        return verdict

    def _failed(self, server: LlamaServer, err: Exception, request: Request, slot: int | None = None) -> Result:
        """A dropped connection or a 5xx: `crashed` if the process ended, else a plain error; `timeout` when
        this session killed the server because its slots stalled (the request on the stalled slot, or every one
        when the server as a whole stalled), an error saying so when it killed it because of another request
        (past its deadline, or on another slot that stalled). `slot`: the slot the request was pinned to."""
        with self._lock:
            if server in self._stalls:
                why, stalled = self._stalls[server]
                if stalled is None or slot is None or stalled == slot:
                    return Result(
                        stop_reason="timeout",
                        error=f"timeout: {_case(request)} {why}; llama-server was killed and restarted",
                    )
                return Result(stop_reason="error", error=f"cut off: llama-server was restarted because it {why}")
            if server in self._killed:
                return Result(
                    stop_reason="error", error=f"cut off: llama-server was restarted because {self._killed[server]}"
                )
            grace = ANSWERED_GRACE_S if isinstance(err, ServerError) else CRASH_GRACE_S
            if server.wait_exit(grace) is None:  # answered with an error: on the slot it was pinned to (or the one)
                served_on = slot if slot is not None else (0 if self.config.n_slots == 1 else -1)
                return Result(stop_reason="error", error=_explained(err, server), slot_id=served_on)
            report = server.crash_report()
            self.logs.cite(server.log_path)
            self._restart(server)
        return Result(stop_reason="crashed", error=report)

    def _stalled(self, server: LlamaServer, why: str, slot: int | None = None) -> None:
        """The watch saw no token returned for the stall window (on `slot`, or on the server as a whole: None):
        kill and restart the server; the requests in flight on it end `timeout` (`_failed`)."""
        with self._lock:
            self._stalls.setdefault(server, (why, slot))
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
        """Stop the server; the session cannot be used afterwards. Its temp dir (no run_dir given) goes, with the
        states `save_slot` wrote there, unless a message cited a file in it (LogDir)."""
        self._closed = True
        self.watch.close()
        if self.server is not None:
            self.server.stop()
        self.logs.close()

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
