"""The in-process backend: our own engine on llama-cpp-python, behind the Backend protocol.

The engine runs in a worker process (`harness.engine.worker`), one per session: a model load per cell,
as before, but an abort, a segfault or an OOM kill inside llama.cpp ends only the worker. The requests it
had not finished become `crashed` Results naming the assert (with the log tail), exactly like a crashed
llama-server; the next `run` starts a fresh worker and reloads the model. The worker counts its steps in
shared memory: when the count stops moving for the stall window (StallMeter), or a batch is past its
deadline, the worker is killed and its unfinished requests end as `timeout`. Workers fork from a server
process that has already imported llama.cpp, so starting one costs milliseconds, not an interpreter start.
"""

import functools
import multiprocessing
import multiprocessing.connection

# RawArray's module, loaded with this one: a second copy (pytester restores sys.modules between tests and the
# next RawArray imports it again) makes objects pickle can no longer match to their class
import multiprocessing.sharedctypes  # noqa: F401
import sys
import time
from pathlib import Path

from harness.backends.base import ServeConfig, SpeedMeter, StallMeter, request_deadline
from harness.backends.process import LogDir, crash_report, free_log_name
from harness.engine import ContextParams
from harness.engine.drafters.scripted import from_script
from harness.engine.logging import is_verbose
from harness.engine.spec_config import SpecConfig
from harness.engine.worker import PROMPT, STEPS, EngineArgs, serve
from harness.errors import HarnessBug, HarnessError, LlamaAbort, Unservable
from harness.result import Result
from harness.result.logits import PositionLogits
from harness.suites.request import Request

OPEN_TIMEOUT_S = 300.0
"""Model load and context creation in the worker (a multi-GB model on a slow disk included)."""
STOP_GRACE_S = 5.0
PROGRESS_POLL_S = 0.25
"""How often the parent looks at the worker's step count while it waits for results."""
QUIET = ("quiet",)
"""What `_receive` returns when the worker, still running, sent nothing in time."""
WHO = "the in-process engine's worker"


def context_params(config: ServeConfig) -> ContextParams:
    """The engine's context options for a serve config (`seq` = 1 slot; `par` = unified KV)."""
    return ContextParams(
        n_ctx=config.n_ctx,
        n_batch=config.n_batch,
        n_ubatch=config.n_ubatch,
        parallel=config.n_slots,
        kv_unified=config.kv_unified,
        flash_attn=config.flash_attn,
        cache_type_k=config.cache_type_k,
        cache_type_v=config.cache_type_v,
        threads=config.threads,
        seed=config.seed,
        repack=config.repack,
        context_shift=config.context_shift,
    )


def spec_config(config: ServeConfig) -> SpecConfig:
    """The engine's speculative options from llama-server style names plus the in-process extras."""
    options = dict(config.engine)
    drafters = options.pop("drafters", [])
    options.pop("slot_save", None)
    script = options.pop("script", None)
    spec = SpecConfig.from_options({**config.spec, "spec-draft-model": config.draft_model, **options})
    spec.drafters = list(drafters) + ([from_script(script["kind"], script["outputs"])] if script else [])
    return spec


def _context():
    """The multiprocessing context of the workers: fork from a server process that preloaded the engine."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["harness.engine.worker"])
    return ctx


def _start_without_main(process) -> None:
    """Start a worker without the parent's `__main__`: multiprocessing re-runs the parent's main module in
    the child (by name or by file), which the worker never needs and which may not exist as a file (a
    script on stdin) or may have changed on disk since the parent started."""
    main = sys.modules["__main__"]
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if hasattr(main, k)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        process.start()
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


class InprocSession:
    """An Engine serving one model in one mode, in a worker process that is restarted after a crash."""

    def __init__(self, config: ServeConfig, logs: LogDir):
        self.config = config
        self.logs = logs
        self.speed = SpeedMeter()
        self.stall = StallMeter(config.stall_s)
        self.args = EngineArgs(
            config.model,
            context_params(config),
            spec_config(config),
            config.logit_top_k,
            config.kv_scan,
            keep_slot_states=bool(config.engine.get("slot_save")),
        )
        self.process = None
        self.conn = None
        self.log_path: Path | None = None
        self.starts = 0
        self._start()

    def _start(self) -> None:
        """Start a worker and open the engine in it; HarnessError (one line) when that fails."""
        self.starts += 1
        self.log_path = free_log_name(self.logs.path, f"engine-{self.config.mode}")
        ctx = _context()
        self.conn, child = ctx.Pipe()
        self.progress = ctx.RawArray("q", 2)
        self.process = ctx.Process(
            target=serve,
            args=(child, str(self.log_path), is_verbose(), self.progress),
            daemon=True,
            name="specharness-engine",
        )
        _start_without_main(self.process)
        child.close()
        self.conn.send(("open", self.args))
        try:
            reply = self._receive(OPEN_TIMEOUT_S)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the model loads
            self._kill()
            raise
        if reply is not None and reply[0] == "ready":
            return
        self.logs.cite(self.log_path)
        if reply is QUIET:
            why = f"{WHO} did not load {self.config.model.name} within {OPEN_TIMEOUT_S:.0f} s (log: {self.log_path})"
        elif reply is None:
            self.process.join(STOP_GRACE_S)
            why = crash_report(WHO, self.process.exitcode, self.log_path).split("\n")[0] + " (while loading the model)"
        else:
            why = reply[1]
        self._kill()
        if reply is not None and reply[0] == "bug":
            raise HarnessBug(why)
        if reply is None:  # the worker died loading the model: llama.cpp aborted (an assert, a fatal signal)
            raise LlamaAbort(why)
        raise HarnessError(why)

    def _receive(self, timeout: float):
        """The next message; QUIET when the worker sent nothing within `timeout`, None when it ended
        (waiting on the process too: a worker that dies does not always close the pipe's other end at once)."""
        try:
            ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], max(0.0, timeout))
            if not ready:
                return QUIET
            if self.conn not in ready and not self.conn.poll():
                return None
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def run(self, requests: list[Request]) -> list[Result]:
        """One Result per request, in order; requests the worker did not finish end `crashed` or `timeout`."""
        if self.process is None or not self.process.is_alive():
            self._kill()
            self._start()
        self.conn.send(("run", list(requests)))
        try:
            return self._results(requests)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM mid-batch: the worker is killed, not waited for
            self._kill()
            raise

    def _results(self, requests: list[Request]) -> list[Result]:
        """The worker's answers to the `run` just sent (see `run`)."""
        results: list[Result | None] = [None] * len(requests)
        budget = self._budget(requests)
        started = last = time.monotonic()
        steps = self.progress[STEPS]
        while True:
            prompt_tokens = self.progress[PROMPT]
            window = self.stall.window(prompt_tokens)
            message = self._receive(min(PROGRESS_POLL_S, min(started + budget, last + window) - time.monotonic()))
            now = time.monotonic()
            if message is None:
                return self._crashed(results)
            if message is QUIET:
                if now >= started + budget:
                    return self._timed_out(
                        requests,
                        results,
                        f"did not finish within its deadline ({budget:.1f} s for this batch of {len(requests)})",
                    )
                if self.progress[STEPS] != steps:
                    steps, last = self.progress[STEPS], now
                elif now >= last + window:
                    return self._timed_out(
                        requests, results, f"got no token for {now - last:.1f} s ({self.stall.explain(prompt_tokens)})"
                    )
                continue
            last = now
            if message[0] == "result":
                results[message[1]] = result = message[2]
                if result.ok:
                    self.speed.record(len(result.tokens), now - started)
                    self.stall.record(result)
            elif message[0] == "done":
                return results
            else:
                self._kill()
                if message[0] == "bug":
                    raise HarnessBug(message[1])
                raise HarnessError(message[1])

    def save_slot(self, slot_id: int) -> dict:
        """The state the slot's last request left (the engine's `save_slot`; its `state` goes to `restore_slot`, of
        this session or another); `error` when there is none or the worker is gone."""
        return self._ask(("save", slot_id))

    def restore_slot(self, slot_id: int, state, erase: bool = False) -> dict:
        """Restore a `save_slot` state into the slot (target and draft contexts); `erase`: forget what it held
        first. The engine's answer, or `error`."""
        return self._ask(("restore", slot_id, state, erase))

    def score(self, pairs: list[tuple[Request, Result]]) -> list[dict]:
        """Each (request, result)'s tokens scored under the request's sampler chain by this session's model
        (harness.engine.score); HarnessError when the worker cannot answer."""
        answer = self._ask(("score", pairs))
        if "error" in answer:
            raise HarnessError(f"scoring the outputs failed: {answer['error']}")
        return answer["scores"]

    def joint_law(self, sampling, prompt: list[int], k: int, min_mass: float) -> dict:
        """The exact law of the first k tokens after `prompt` under `sampling`'s chain, by this session's model
        (harness.engine.joint); HarnessError when the worker cannot answer."""
        answer = self._ask(("joint_law", sampling, prompt, k, min_mass))
        if "error" in answer:
            raise HarnessError(f"computing the exact law failed: {answer['error']}")
        return answer

    def replay_row(self, decodes: list, row: int, top_k: int) -> PositionLogits:
        """Row `row` of the last of a llama-server request's replayed decodes, by this session's target
        (harness.engine.score.replay_row); HarnessError when the worker cannot answer."""
        answer = self._ask(("replay_row", decodes, row, top_k))
        if "error" in answer:
            raise HarnessError(f"re-scoring a batch row failed: {answer['error']}")
        return answer["row"]

    def _ask(self, message: tuple) -> dict:
        if self.process is None or not self.process.is_alive():
            return {"error": f"{WHO} is not running (it ended after its last request)"}
        self.conn.send(message)
        reply = self._receive(OPEN_TIMEOUT_S)
        if reply is None:
            self.process.join(STOP_GRACE_S)
            return {"error": crash_report(WHO, self.process.exitcode, self.logs.cite(self.log_path)).split("\n")[0]}
        if reply is QUIET:
            self._kill()
            return {"error": f"{WHO} did not answer a slot {message[0]} within {OPEN_TIMEOUT_S:.0f} s"}
        if reply[0] == "bug":
            self._kill()
            raise HarnessBug(reply[1])
        if reply[0] != "answer":
            self._kill()
            raise HarnessError(reply[1])
        return reply[1]

    def _budget(self, requests: list[Request]) -> float:
        """Seconds the worker gets for a `run` call before its unfinished requests end `timeout`: each
        request's deadline (`request_deadline`), the slots serving them `n_slots` at a time."""
        slowest, per_prompt_token = self.speed.slowest, self.stall.prompt_token_s
        deadlines = [request_deadline(r, self.config.n_ctx, slowest, per_prompt_token) for r in requests]
        deadlines.sort(reverse=True)
        return sum(deadlines[:: self.config.n_slots])

    def _timed_out(self, requests: list[Request], results: list[Result | None], why: str) -> list[Result]:
        """The worker overran or stalled: it is killed, what it finished stays, the rest ends `timeout`."""
        self._kill()
        return [
            r
            if r is not None
            else Result(
                stop_reason="timeout",
                error=(f"timeout: case {q.tag or 'the request'} {why}; the in-process engine's worker was killed"),
            )
            for q, r in zip(requests, results, strict=False)
        ]

    def _crashed(self, results: list[Result | None]) -> list[Result]:
        """The worker died: what it finished stays, the rest becomes `crashed` with its exit and log tail."""
        self.process.join(STOP_GRACE_S)
        error = crash_report(WHO, self.process.exitcode, self.logs.cite(self.log_path))
        self._kill()
        return [r if r is not None else Result(stop_reason="crashed", error=error) for r in results]

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_GRACE_S)
        if self.conn is not None:
            self.conn.close()
        self.process = self.conn = None

    def close(self) -> None:
        """Close the engine and let the worker exit (killed if it does not within a few seconds); its temp log
        dir goes unless a message cited a log in it (LogDir)."""
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(("close",))
            except OSError:
                pass
            self.process.join(STOP_GRACE_S)
        self._kill()
        self.logs.close()


@functools.cache
def _environment() -> dict:
    """`InprocBackend.environment`, read once per process: the checks ask for it per case and per check, and
    reading the package metadata costs about 4 ms each time here (933 calls in a 165-case quicksort pytest)."""
    import importlib.metadata

    import llama_cpp

    return {
        "device": "gpu" if llama_cpp.llama_supports_gpu_offload() else "cpu",
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
    }


class InprocBackend:
    """`--backend inproc`; `run_dir` receives one engine log per worker start (a temp dir when None: LogDir)."""

    name = "inproc"

    def __init__(self, run_dir: Path | None = None):
        self.run_dir = run_dir

    def environment(self) -> dict:
        """llama-cpp-python's version and whether its build offloads to a GPU."""
        return dict(_environment())

    def open(self, config: ServeConfig) -> InprocSession:
        """A session serving `config`; Unservable when it sets a llama-server-only flag (SERVER_ONLY)."""
        if config.server_only:
            flags = ", ".join(f"{flag} {value}" for flag, value in config.server_only.items())
            raise Unservable(
                f"{flags}: llama-server's context checkpoints and host-RAM prompt cache have no in-process "
                "counterpart (serve the cell with --backend server)"
            )
        return InprocSession(config, LogDir(self.run_dir, "specharness-engine-"))
