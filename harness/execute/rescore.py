"""Scoring a run's outputs after the fact, in sessions of an executor's backends: the logits a backend withheld
(`Rescorer`) and the probability of each returned token under its sampler chain (`TokenScorer`)."""

import atexit
from dataclasses import replace

from harness.backends.server_rescore import replay_of, shape_of
from harness.matrix import Cell
from harness.result import Result
from harness.result.cellrun import CellRun, Outcome  # noqa: F401 - the executor's products, imported from here too
from harness.result.logits import PositionLogits
from harness.suites import Suite
from harness.suites.request import Request, Sampling


class Rescorer:
    """The logits of a run at one position, recomputed in the configuration that produced its tokens, where a backend
    withheld them. Sessions open on first use (a cell's own serve config: on llama-server the run's command line,
    speculation flags included) and close on exit.

    - llama-server (any cell): through the server itself, in the batch shape the run computed the position in
      (harness.backends.server_rescore: the prompt cache holds the batch's prefix, the batch's rows up to the
      position go as one prompt batch, the first generated token carries its probabilities). llama-server at
      0c1e570 returns no probabilities for any token a verification step emits (upstream #27972); this gives them
      back from the server, not from another configuration. Each row says how it was computed (`how`).
    - a llama-server build that runs the engine's own libllama (the vendored CPU build links llama-cpp-python's
      libraries: the same code on the same CPU): the request's batches replayed through that libllama, with the
      cell's context options, as its log lists them (harness.backends.server_rescore.Replay): its prompt batches,
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
        """Position `pos` of a llama-server request re-scored through a server of the cell's command line, in the
        batch shape its log says the run computed it in (None where the log does not say)."""
        shape = shape_of(result, pos)
        if shape is None or pos >= len(result.tokens) + 1:
            return None
        sequence = [*result.prompt_tokens, *result.tokens]
        prefix, tail = sequence[: shape.start], sequence[shape.start : shape.start + shape.row + 1]
        replay = replay_of(result, pos) if self._engine_libllama() else None
        key = (suite.name, cell, tuple(sequence[: shape.start + shape.row + 1]), replay is not None)
        if key not in self.cache:
            top_k = self.executor.options.logit_top_k
            if replay is not None:
                scored, how = self._engine(suite, cell).replay_row(replay.decodes, replay.row, top_k), replay.describe()
            else:
                scored, how = self._session(suite, cell).rescore(prefix, tail, top_k), shape.describe(len(prefix))
            self.cache[key] = None if scored is None else replace(scored, how=how)
        return self.cache[key]

    def _engine_libllama(self) -> bool:
        """Whether the llama-server build runs the engine's libllama (the vendored CPU build links it)."""
        build = getattr(self.executor._backend("server"), "build", None)
        return bool(build is not None and build.backend == "cpu" and build.linked_libraries)

    def _engine(self, suite: Suite, cell: Cell):
        """An engine serving the server cell's context options (its speculative options too: they size the
        recurrent snapshots, `n_rs_seq`, as llama-server's), nothing else."""
        key = (suite.name, cell, "engine")
        if key not in self.sessions:
            config = self.executor._config(suite, cell)
            engine = {k: v for k, v in config.engine.items() if k not in ("fault", "script", "slot_save")}
            config = replace(config, kv_scan="off", logit_top_k=0, engine=engine)
            self.sessions[key] = self.executor._backend("inproc").open(config)
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
