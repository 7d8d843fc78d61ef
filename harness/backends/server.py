"""One llama-server process: flags mapped one to one from fields, loopback only, its own log file.

Modelled on llama.cpp's tools/server/tests/utils.py: start, wait on /health, stop. The process gets
its own process group so stop() can SIGTERM then SIGKILL everything it started; stop() also runs
on context-manager exit (exceptions, Ctrl-C) and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from harness.backends.base import ServeConfig, default_threads
from harness.backends.build import require_executable
from harness.backends.client import local
from harness.backends.flags import fit_to_build, server_flags, server_version
from harness.backends.process import ABORT_LINES, LogDir, abort_line, crash_report, describe_exit
from harness.errors import HarnessError, LlamaAbort
from harness.llama import log as llama_log
from harness.llama.defaults import NO_BACKTRACE

HOST = "127.0.0.1"
STOP_GRACE_S = 5.0
_RUNNING: set[LlamaServer] = set()


@dataclass(eq=False)
class LlamaServer:
    """A llama-server process; each field below the binary maps onto one command-line flag."""

    server_bin: Path
    model: Path  # -m
    draft_model: Path | None = None  # -md
    ctx_size: int = 4096  # -c
    batch_size: int = 2048  # -b
    ubatch_size: int = 512  # -ub
    parallel: int = 1  # -np
    kv_unified: bool = False  # --kv-unified / --no-kv-unified
    flash_attn: str = "off"  # -fa
    cache_type_k: str = "f16"  # -ctk
    cache_type_v: str = "f16"  # -ctv
    threads: int = field(default_factory=default_threads)  # -t
    gpu_layers: str | None = None  # -ngl, and --spec-draft-ngl with a draft model (None: llama-server's default)
    seed: int = 42  # -s
    repack: bool = True  # --no-repack when False
    context_shift: bool = False  # --context-shift / --no-context-shift
    server_only: dict = field(default_factory=dict)  # --ctx-checkpoints, --checkpoint-min-step, --cache-ram N
    spec: dict = field(default_factory=dict)  # --<key> <value> for every speculative option
    cache_prompt: bool = True  # --no-cache-prompt when False
    slot_save_path: Path | None = None  # --slot-save-path
    metrics: bool = False  # --metrics
    warmup: bool = True  # --no-warmup when False
    port: int | None = None  # --port; None picks a free loopback port
    log_path: Path | None = None  # stdout + stderr; None = a file in a temp dir that stop() removes (LogDir)
    verbosity: int | None = None  # -lv (None: llama-server's default)
    start_timeout: float = 60.0  # seconds for /health to answer 200
    env: dict = field(default_factory=dict)  # added to the process's environment (not a flag)

    process: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _logs: LogDir | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, config: ServeConfig, server_bin: Path, **options) -> LlamaServer:
        """The server for a ServeConfig: `seq` = one slot, `par` = N slots sharing one KV stream,
        `no-kv-unified` = N slots with a KV stream each. `options` sets the remaining fields."""
        return cls(
            server_bin=server_bin,
            model=config.model,
            draft_model=config.draft_model,
            ctx_size=config.n_ctx,
            batch_size=config.n_batch,
            ubatch_size=config.n_ubatch,
            parallel=config.n_slots,
            kv_unified=config.kv_unified,
            flash_attn=config.flash_attn,
            cache_type_k=config.cache_type_k,
            cache_type_v=config.cache_type_v,
            threads=config.threads,
            seed=config.seed,
            repack=config.repack,
            context_shift=config.context_shift,
            server_only=config.server_only,
            spec=dict(config.spec),
            env=dict(config.env),
            **options,
        )

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The llama-server command line for the current fields (port must be set)."""
        cmd = [
            str(self.server_bin),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "-m",
            str(self.model),
            "-c",
            str(self.ctx_size),
            "-b",
            str(self.batch_size),
            "-ub",
            str(self.ubatch_size),
            "-np",
            str(self.parallel),
            "--kv-unified" if self.kv_unified else "--no-kv-unified",
            "-fa",
            self.flash_attn,
            "-ctk",
            self.cache_type_k,
            "-ctv",
            self.cache_type_v,
            "-t",
            str(self.threads),
            "-s",
            str(self.seed),
        ]
        if self.draft_model:
            cmd += ["-md", str(self.draft_model)]
        if self.gpu_layers is not None:
            flags = server_flags(self.server_bin)
            cmd += ["-ngl", self.gpu_layers]
            draft_ngl = next((f for f in ("--spec-draft-ngl", "-ngld") if f in flags), None)
            if self.draft_model and draft_ngl:
                cmd += [draft_ngl, self.gpu_layers]
        for key, value in self.spec.items():
            cmd += _spec_flag(key, value)
        if not self.repack and "--no-repack" in server_flags(self.server_bin):  # older builds always repack
            cmd.append("--no-repack")
        if self.context_shift:
            cmd.append("--context-shift")
        elif "--no-context-shift" in server_flags(self.server_bin):  # older builds shift by default
            cmd.append("--no-context-shift")
        for flag, value in self.server_only.items():
            cmd += [flag, str(value)]
        if not self.cache_prompt:
            cmd.append("--no-cache-prompt")
        if self.slot_save_path:
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        if self.metrics:
            cmd.append("--metrics")
        if not self.warmup:
            cmd.append("--no-warmup")
        if self.verbosity is not None and "-lv" in server_flags(self.server_bin):  # older builds: their default
            cmd += ["-lv", str(self.verbosity)]
        if "-fit" in server_flags(self.server_bin):
            cmd += ["-fit", "off"]  # otherwise -c may be shrunk to fit free device memory
        return fit_to_build(cmd, server_flags(self.server_bin), server_version(self.server_bin))

    # ------------------------------------------------------------------------------ life cycle

    def start(self) -> LlamaServer:
        """Start the process and wait until /health says ok; HarnessError (one line) otherwise."""
        require_executable(self.server_bin)
        if not Path(self.model).is_file():
            raise HarnessError(f"model file {self.model} does not exist")
        if self.port is None:
            self.port = free_port()
        elif not port_is_free(self.port):
            raise HarnessError(f"port {self.port} on {HOST} is already in use")
        if self.log_path is None:
            self._logs = LogDir(None, "specharness-server-")
            self.log_path = self._logs.path / "llama-server.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}  # flags only
        env.setdefault(NO_BACKTRACE, "1")
        env.update(self.env)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _RUNNING.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self._cite_log()
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                reason = self._startup_failure()
                raise LlamaAbort(reason) if self._aborted() else HarnessError(reason)
            try:
                if local("GET", f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            time.sleep(0.1)
        raise HarnessError(f"llama-server was not ready within {self.start_timeout:g} s (log: {self.log_path})")

    def _startup_failure(self) -> str:
        """One line saying why the process exited before becoming healthy: the model it could not load, the
        line llama.cpp aborted with (a warm-up decode can abort: the log then ends with a backtrace), else its
        error lines (level E: the first says what failed, the last what llama-server made of it), else the log's
        last line that is no debug line (at `-lv 5` debug lines go on after the error: a context's destructor)."""
        try:
            text = llama_log.read(self.log_path)
        except OSError:
            text = ""
        lines = text.splitlines()
        messages = [m.strip() for m in llama_log.messages(text)]
        reason = _first_line_with("\n".join(messages), ("error loading model", "failed to load model"))
        if reason:
            return f"llama-server could not load model {self.model}: {reason} (log: {self.log_path})"
        errors = [m for line, m in zip(lines, messages, strict=True) if m and llama_log.level(line) == "error"]
        said = [m for line, m in zip(lines, messages, strict=True) if m and llama_log.level(line) != "debug"]
        why = abort_line(text)
        if not why and errors:
            why = errors[0] if len(errors) == 1 else f"{errors[0]} … {errors[-1]}"
        why = why or (said or ["no output"])[-1]
        return f"llama-server {describe_exit(self.process.returncode)} during start-up: {why} (log: {self.log_path})"

    def _aborted(self) -> bool:
        """Whether llama.cpp itself ended the process during start-up (a finding, LlamaAbort): a fatal signal
        (an assert's SIGABRT, a segfault) or an abort line in its log. An exit with a status and no abort line is
        llama-server refusing its command line or model (a flag it lacks, a file it cannot read): ours to fix."""
        if self.process.returncode is not None and self.process.returncode < 0:
            return True
        try:
            text = llama_log.read(self.log_path)
        except OSError:
            return False
        return any(pattern.search(text) for pattern in ABORT_LINES[:2])  # an assert or a C++ terminate

    def stop(self, kill: bool = False) -> None:
        """SIGTERM the process group, SIGKILL it after a grace period (`kill`: SIGKILL at once, for a
        process that no longer answers, even a stopped one); safe to call repeatedly. The server stays on the
        list the interpreter's exit stops until it has exited (a second Ctrl-C may cut this wait short)."""
        if self.process is not None and self.process.returncode is None:
            for sig in (signal.SIGKILL,) if kill else (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    self.process.wait(timeout=STOP_GRACE_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        _RUNNING.discard(self)
        if self._logs is not None and (self.process is None or self.process.returncode is not None):
            self._logs.close()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------ inspection

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status once the process has ended within `timeout` seconds, else None."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def crash_report(self) -> str:
        """How the process ended, the abort line and the end of its log (for a Result's `error`)."""
        return crash_report("llama-server", self.process.returncode, self._cite_log())

    def _cite_log(self) -> Path | None:
        """The log, kept past stop() because a message names it."""
        if self._logs is not None:
            self._logs.cite()
        return self.log_path


def _spec_flag(key: str, value) -> list[str]:
    """`--key value` for a speculative option; True = bare flag, False/None = left out, lists comma-joined."""
    flag = "--" + key.lstrip("-")
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return [flag, str(value)]


def _first_line_with(text: str, needles: tuple[str, ...]) -> str:
    """The rest of the first line containing one of `needles`, from that needle on."""
    for line in text.splitlines():
        for needle in needles:
            if needle in line:
                return line[line.index(needle) :].strip()
    return ""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could bind `port` on the loopback interface (SO_REUSEADDR, as llama-server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()
