"""Scoring a run's outputs after the fact, in sessions of an executor's backends: the logits a backend withheld
(`Rescorer`) and the probability of each returned token under its sampler chain (`TokenScorer`)."""

import atexit
from dataclasses import replace

import numpy as np

from harness.backends.inproc import context_params, spec_config
from harness.backends.replay_tool import ReplayTool
from harness.backends.server_rescore import replay_of, shape_of
from harness.engine.engine import target_params
from harness.errors import HarnessError
from harness.matrix import Cell
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome  # noqa: F401 - the executor's products, imported from here too
from harness.result.logits import PositionLogits, capture
from harness.suites import Suite
from harness.suites.request import Request, Sampling

TOOL_BY = "llama-replay, linked with this llama-server build's libraries"
TOOL_CHECK_NATS = 1e-4
"""How far `llama-replay`'s log-probabilities may be from those llama-server logged for the same row before the
re-scorer refuses the tool for that request: llama-server prints float32 log-probabilities of a float32 softmax,
the tool's are computed from the same row in float64 (measured: docs/internals/triage.md)."""


def _request(result: Result) -> tuple:
    return (result.slot_id, tuple(result.prompt_tokens), tuple(result.tokens))


class Rescorer:
    """The logits of a run at one position, recomputed in the configuration that produced its tokens, where a backend
    withheld them. Sessions open on first use (a cell's own serve config: on llama-server the run's command line,
    speculation flags included) and close on exit.

    - llama-server (any cell): through the server itself, in the batch shape the run computed the position in
      (harness.backends.server_rescore: the prompt cache holds the batch's prefix, the batch's rows up to the
      position go as one prompt batch, the first generated token carries its probabilities). llama-server at
      0c1e570 returns no probabilities for any token a verification step emits (upstream #27972); this gives them
      back from the server, not from another configuration. Each row says how it was computed (`how`).
    - a llama-server build whose log tells the request's batches: they are replayed with the cell's context
      options through the libraries the build runs: the engine's, where the build links them (the vendored CPU
      build links llama-cpp-python's libraries: the same code on the same CPU), else the build's `llama-replay`
      (harness.backends.replay_tool), first checked on a row the server logged (TOOL_CHECK_NATS). The replay
      (harness.backends.server_rescore.Replay): a reused prefix in the batches that computed it, its prompt batches,
      each step's rows with logits on every row and the rejected ones cut back, then the batch that computed the
      position. llama-server's prompt cache gives a verification row with fewer rows and one output row, from a
      prefix computed in one batch; a repacked quantized matrix multiplies 4 rows at a time from 4 rows on and a
      recurrent state depends on the batches it was computed in, so that moves a row by up to 0.05 nats where the
      run's batches did not (the `numerics` suite's flips).
    - the in-process engine without speculation: a decode of the same prefix in the same cell (one request with
      the prompt and the output before the position, one token generated, its top-k logged).
    - the in-process engine with speculation: nothing (None). It logs every verification row itself, so a missing
      row is one it did not compute, and a plain decode would give the reference's view, not the run's."""

    def __init__(self, executor):
        self.executor = executor  # the Executor whose backends, serve configs and runs it uses
        self.sessions: dict[tuple[str, Cell], object] = {}
        self.cache: dict[tuple, PositionLogits | None] = {}
        self.tools: dict[tuple, ReplayTool] = {}
        self.tool_checks: dict[tuple, str] = {}
        """Per request: how `llama-replay` reproduced a row the server logged ('; checked ...' / '; refused ...')."""

    def score(self, suite: Suite, cell: Cell, result: Result, pos: int) -> PositionLogits | None:
        if self.executor.options.logit_top_k <= 0 or pos > len(result.tokens):
            return None
        if cell.backend == "server":
            return self._through_server(suite, cell, result, pos)
        if cell.spec != "none":
            return None
        prompt = [*result.prompt_tokens, *result.tokens[:pos]]
        key = (suite.name, cell, tuple(prompt))
        if key not in self.cache:
            session = self._session(suite, cell)
            scored = session.run([Request(prompt=prompt, sampling=Sampling(n_predict=1, temperature=0.0))])[0]
            self.cache[key] = scored.logits[0] if scored.ok and scored.logits else None
        return self.cache[key]

    def _through_server(self, suite: Suite, cell: Cell, result: Result, pos: int) -> PositionLogits | None:
        """Position `pos` of a llama-server request re-scored with the libraries its build runs, in the batches its
        log says the run made (the engine where the build links the engine's libllama, else the build's
        `llama-replay`, checked first on a row the server logged); else through a server of the cell's command
        line, in the batch shape of the position (None where the log does not say)."""
        shape = shape_of(result, pos)
        if shape is None or pos >= len(result.tokens) + 1:
            return None
        sequence = [*result.prompt_tokens, *result.tokens]
        replay = replay_of(result, pos)
        via = "server" if replay is None else "engine" if self._engine_libllama() else "tool"
        if via == "tool" and self._tool(suite, cell) is None:
            via = "server"
        key = (suite.name, cell, tuple(sequence[: shape.start + shape.row + 1]), via)
        if key not in self.cache:
            top_k = self.executor.options.logit_top_k
            scored, refused = None, ""
            if via == "engine":
                scored, how = self._engine(suite, cell).replay_row(replay.decodes, replay.row, top_k), replay.describe()
            elif via == "tool":
                scored, how, refused = self._by_tool(suite, cell, result, pos, replay)
            if scored is None:
                prefix, tail = sequence[: shape.start], sequence[shape.start : shape.start + shape.row + 1]
                scored, how = self._session(suite, cell).rescore(prefix, tail, top_k), shape.describe(len(prefix))
                how += f" ({refused})" if refused else ""
            self.cache[key] = None if scored is None else replace(scored, how=how)
        return self.cache[key]

    def _tool(self, suite: Suite, cell: Cell) -> ReplayTool | None:
        """The build's `llama-replay` with the cell's context options, or None where the build has none."""
        build = getattr(self.executor._backend("server"), "build", None)
        if build is None or build.replay_bin is None:
            return None
        key = (suite.name, cell, "tool")
        if key not in self.tools:
            config = self._engine_config(suite, cell)
            params = target_params(context_params(config), spec_config(config))
            self.tools[key] = ReplayTool(build.replay_bin, config.model, params)
        return self.tools[key]

    def _by_tool(self, suite: Suite, cell: Cell, result: Result, pos: int, replay) -> tuple:
        """(the row, how, '') from the build's `llama-replay`, or (None, '', why it was refused)."""
        refused = self._tool_refusal(suite, cell, result, pos)
        if refused:
            return None, "", refused
        try:
            row = self._tool(suite, cell).row(replay.decodes, replay.row)
        except HarnessError as err:
            return None, "", f"refused llama-replay: {err}"
        checked = self.tool_checks[(suite.name, cell, *_request(result))]
        return capture(row, self.executor.options.logit_top_k), replay.describe(TOOL_BY) + checked, ""

    def _tool_refusal(self, suite: Suite, cell: Cell, result: Result, pos: int) -> str:
        """'' when `llama-replay` reproduces a row the server logged for this request (the latest before `pos`
        whose batches the log lists, the first token's at least) within TOOL_CHECK_NATS, else why it is not used.
        Checked once per request."""
        request = (suite.name, cell, *_request(result))
        if request not in self.tool_checks:
            self.tool_checks[request] = self._tool_check(suite, cell, result, pos)
        found = self.tool_checks[request]
        return found.removeprefix("; ") if found.startswith("; refused") else ""

    def _tool_check(self, suite: Suite, cell: Cell, result: Result, pos: int) -> str:
        """'; checked ...' or '; refused ...': the largest difference between the tool's log-probabilities and
        the server's own at the top-k the server logged, at the latest logged position before `pos`."""
        for q in reversed(range(min(pos, len(result.logits)))):
            logged = result.logits[q]
            replay = replay_of(result, q) if len(logged.top_ids) else None
            if replay is None:
                continue
            try:
                row = self._tool(suite, cell).row(replay.decodes, replay.row).astype(np.float64)
            except HarnessError as err:
                return f"; refused llama-replay: {err}"
            peak = row.max()
            log_probs = row[logged.top_ids] - (peak + np.log(np.exp(row - peak).sum()))
            delta = float(np.abs(log_probs - (logged.top_logits.astype(np.float64) - logged.log_z)).max())
            said = f"position {q}, which the server logged: largest |Δ log p| {delta:.2g} nats"
            said += f" over its top {len(logged.top_ids)}"
            if delta > TOOL_CHECK_NATS:
                return f"; refused llama-replay: it does not reproduce {said} (> {TOOL_CHECK_NATS:g}, TOOL_CHECK_NATS)"
            return f"; checked on {said}"
        return "; refused llama-replay: the request has no position the server logged whose batches its log lists"

    def _engine_libllama(self) -> bool:
        """Whether the llama-server build runs the engine's libllama (the vendored CPU build links it)."""
        build = getattr(self.executor._backend("server"), "build", None)
        return bool(build is not None and build.backend == "cpu" and build.linked_libraries)

    def _engine_config(self, suite: Suite, cell: Cell):
        """The cell's serve config with only the context options that shape its rows: no faults, scripts, slot
        saves, scans or logging."""
        config = self.executor._config(suite, cell)
        engine = {k: v for k, v in config.engine.items() if k not in ("fault", "script", "slot_save")}
        return replace(config, kv_scan="off", logit_top_k=0, engine=engine)

    def _engine(self, suite: Suite, cell: Cell):
        """An engine serving the server cell's context options (its speculative options too: they size the
        recurrent snapshots, `n_rs_seq`, as llama-server's), nothing else."""
        key = (suite.name, cell, "engine")
        if key not in self.sessions:
            self.sessions[key] = self.executor._backend("inproc").open(self._engine_config(suite, cell))
        return self.sessions[key]

    def _session(self, suite: Suite, cell: Cell):
        session = self.sessions.get((suite.name, cell))
        if session is None:
            backend = self.executor._backend(cell.backend)
            session = self.sessions[(suite.name, cell)] = backend.open(self.executor._config(suite, cell))
        return session

    def __enter__(self) -> "Rescorer":
        return self

    def __exit__(self, *exc) -> None:
        for session in self.sessions.values():
            session.close()


class TokenScorer:
    """The probability of each token a request returned, under the target and the request's sampler chain
    (harness.engine.score), for any backend's results: an in-process engine serving nothing but the scoring (no
    speculation, one slot, no fault switch, the cell's context size), for one model at a time (another model's
    request closes it and opens the next). Scores are cached per (model, prompt, output, sampling)."""

    def __init__(self, executor):
        self.executor = executor  # the Executor whose backends and serve configs it uses
        self.session = None
        self.config = None
        self.cache: dict[tuple, dict] = {}

    def score(self, suite: Suite, cell: Cell, pairs: list[tuple[Request, Result]]) -> list[dict]:
        """Each (request, result)'s scores: {"scores": [[p, below], ...]} (and `impossible_at`), or
        {"unscorable": why}."""
        config = self._plain_config(suite, cell)
        keys = [(config.model, tuple(r.prompt_tokens), tuple(r.tokens), repr(q.sampling)) for q, r in pairs]
        todo = [(k, pair) for k, pair in zip(keys, pairs, strict=True) if k not in self.cache]
        if todo:
            session = self._open(config)
            for (key, _), scored in zip(todo, session.score([pair for _, pair in todo]), strict=True):
                self.cache[key] = scored
        return [self.cache[k] for k in keys]

    def joint_law(self, suite: Suite, cell: Cell, sampling, prompt: list[int], k: int, min_mass: float) -> dict:
        """The exact law of the first k tokens after `prompt` under `sampling`'s chain, by the cell's target
        (harness.engine.joint): {"leaves": [[tokens, probability], ...]} or {"unscorable": why}."""
        return self._open(self._plain_config(suite, cell)).joint_law(sampling, prompt, k, min_mass)

    def _plain_config(self, suite: Suite, cell: Cell):
        """The cell's target served without speculation, one slot, no fault switch, the cell's context size."""
        plain = cell.reference(backend="inproc", spec="none", mode="seq")
        config = self.executor._config(suite, plain)
        engine = {k: v for k, v in config.engine.items() if k not in ("fault", "script", "slot_save")}
        return replace(config, parallel=1, spec={}, draft_model=None, kv_scan="off", logit_top_k=0, engine=engine)

    def _open(self, config):
        """The scoring session for `config` (the open one when it serves the same)."""
        if self.config != config:
            self.close()
            self.session, self.config = self.executor._backend("inproc").open(config), config
            # the worker ignores SIGTERM (the harness stops it itself): multiprocessing's own exit handler
            # would wait for it forever, so the session closes before that handler runs (atexit: LIFO)
            atexit.register(self.close)
        return self.session

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            atexit.unregister(self.close)
        self.session = self.config = None

    def __enter__(self) -> "TokenScorer":
        return self

    def __exit__(self, *exc) -> None:
        pass  # kept open for the next check (close() ends it)
