"""`llama-replay` (harness/data/llama-replay.cpp, harness.backends.replay_tool): one row of logits recomputed through
the libraries a llama-server build links, in the batches a request was computed in, for builds whose libllama the
engine does not run (a tag, a bisect step, a CUDA build).

Real llama-server, real tiny GGUF models, the vendored build's tool (linked with the engine's own libraries, so the
engine's `replay_row` is its oracle): the tool must be bit-identical to it, pick every token a verification step
emitted, reproduce every row the server logged, and the re-scorer must use it where the engine cannot and refuse it
where it does not reproduce the server.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import numerics_stand_in, quicksort

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.build.replay_build import build_replay, replay_link
from harness.backends.inproc import InprocBackend, context_params, spec_config
from harness.backends.replay_tool import ReplayTool
from harness.backends.server_backend import ServerBackend
from harness.backends.server_rescore import replay_of
from harness.engine.engine import target_params
from harness.execute.rescore import TOOL_CHECK_NATS, Rescorer
from harness.matrix import Cell
from harness.models import resolve
from harness.result.logits import capture

pytestmark = pytest.mark.xdist_group("server-rescore")

TOP_K = 10


def _tool(build, config: ServeConfig) -> ReplayTool:
    return ReplayTool(build.replay_bin, config.model, target_params(context_params(config), spec_config(config)))


def _random_decodes(rng: random.Random, slots: int) -> tuple[list[dict], int]:
    """A request's decodes as server_rescore.Replay lists them: two prompt batches, then four steps of 1-4 rows with
    some cut back and other slots' stand-ins before and after; the row of the last decode to read."""
    seq = rng.randrange(slots)
    tokens = [rng.randrange(1, 200) for _ in range(40)]
    decodes = [
        {"seq": seq, "start": 0, "tokens": tokens[:13], "every_row": False, "keep": 13, "before": [], "after": []},
        {"seq": seq, "start": 13, "tokens": tokens[13:19], "every_row": False, "keep": 19, "before": [], "after": []},
    ]
    start = 19
    for _ in range(4):
        n = rng.randrange(1, 5)
        others = [[s, rng.randrange(1, 4), True] for s in range(slots) if s != seq and rng.random() < 0.5]
        kept = rng.randrange(1, n + 1)
        rows = tokens[start : start + n]
        decodes.append(
            {"seq": seq, "start": start, "tokens": rows, "every_row": n > 1, "keep": start + kept}
            | {"before": others[:1], "after": others[1:]}
        )
        start += kept
    last = decodes[-1]
    return decodes, rng.randrange(len(last["tokens"])) if last["every_row"] else len(last["tokens"]) - 1


@pytest.mark.parametrize(
    ("model", "mode"),
    [("tiny-dense-wide-q4_k", "seq"), ("tiny-hybrid-mtp", "par"), ("tiny-hybrid-mtp", "no-kv-unified")],
)
def test_llama_replay_is_bit_identical_to_the_engines_replay_on_the_same_libraries(model, mode):
    """On the vendored build (it links the engine's libllama), the tool's row equals the engine's `replay_row` bit for
    bit (CRC-32 of the full row), stand-ins, cut-backs and recurrent snapshots (n_rs_seq 3) included."""
    build = ensure_server(None, "cpu", [], jobs=None)
    assert build.replay_bin is not None and build.linked_libraries
    # MTP speculation gives the hybrid recurrent snapshots (n_rs_seq 3), as llama-server does: cut-backs roll back
    spec = {"spec-type": "draft-mtp", "spec-draft-n-max": 3} if "mtp" in model else {}
    config = ServeConfig(model=resolve(model).path, mode=mode, n_ubatch=7, spec=spec)
    tool, rng, slots = _tool(build, config), random.Random(41), config.n_slots
    engine = InprocBackend().open(config)
    try:
        for _ in range(6):
            decodes, row = _random_decodes(rng, slots)
            ours = engine.replay_row(decodes, row, TOP_K)
            theirs = tool.row(decodes, row)
            assert capture(theirs, TOP_K).digest == ours.digest, f"{model}: the tool's row differs from the engine's"
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tiny-dense-wide at Q4_K drafted by its f32 copy, four drafts a step (suites/numerics.yaml's CPU stand-in for
    GPU numerics: a verification row's logits differ from the same position decoded alone): the build, the config
    and four requests' Results."""
    build = ensure_server(None, "cpu", [], jobs=None)
    config = numerics_stand_in(TOP_K)
    requests = [quicksort(lang, n_predict=40) for lang in ("C", "Rust", "Java", "Python")]
    with ServerBackend(build, run_dir=tmp_path_factory.mktemp("replay-tool")).open(config) as session:
        results = session.run(requests)
    assert all(r.ok for r in results), [r.error for r in results]
    return build, config, results


def test_llama_replay_picks_every_token_a_verification_emitted_and_reproduces_every_logged_row(served):
    """Every withheld position replayed by the tool has the emitted token on top (a top-1 or an exact tie), and
    every position the server logged itself is reproduced within TOOL_CHECK_NATS (its float32 printing). The
    requests share a 7-token prefix the prompt cache reuses: replayed as one batch instead of in the batches of the
    request that computed it, logged rows moved by up to 0.045 nats on an Intel AMX VM (2026-12-07)."""
    build, config, results = served
    tool = _tool(build, config)
    withheld, logged, worst = 0, 0, 0.0
    for result in results:
        for pos, token in enumerate(result.tokens):
            replay = replay_of(result, pos)
            assert replay is not None, f"position {pos}: the log does not tell its batch"
            row = tool.row(replay.decodes, replay.row).astype(np.float64)
            mine = result.logits[pos] if pos < len(result.logits) else None
            if mine is not None and len(mine.top_ids):
                log_z = row.max() + np.log(np.exp(row - row.max()).sum())
                worst = max(worst, float(np.abs(row[mine.top_ids] - log_z - mine.top_logits).max()))
                logged += 1
                continue
            assert row[token] == row.max(), f"slot {result.slot_id} position {pos}: {token} is not the replay's top-1"
            withheld += 1
    reused = sum(1 for r in results if r.work.steps.get("reused"))
    print(f"{withheld} withheld rows picked, {logged} logged rows reproduced within {worst:.2g} nats, {reused} reuse")
    assert withheld > 20 and logged > 4 and worst <= TOOL_CHECK_NATS
    assert reused >= 1  # a later request's cached prefix, replayed in the batches of the request that computed it


class _Executor:
    """What Rescorer asks of an executor (options.logit_top_k, _backend, _config), over one real server backend."""

    def __init__(self, backend: ServerBackend, config: ServeConfig):
        self.options = SimpleNamespace(logit_top_k=TOP_K)
        self.backend, self.config = backend, config

    def _backend(self, name: str):
        assert name == "server"
        return self.backend

    def _config(self, suite, cell) -> ServeConfig:
        return self.config


def _withheld(result) -> int:
    return next(p for p in range(1, len(result.tokens)) if p >= len(result.logits) or not len(result.logits[p].top_ids))


def test_the_rescorer_replays_with_the_tool_where_the_build_runs_other_libraries_and_refuses_one_off_the_logged_rows(
    served, tmp_path
):
    """A build without the engine's libraries (the vendored build with its link forgotten): the re-scorer answers a
    withheld position with the tool, saying on which logged row it checked it; with that logged row moved by
    0.01 nats the tool does not reproduce the server, and the re-scorer goes through the server instead, saying so."""
    build, config, results = served
    other = replace(build, linked_libraries="")
    suite, cell = SimpleNamespace(name="numerics"), Cell("server", "seq", "draft-simple", "tiny-dense-wide-q4_k")
    result = results[0]
    pos = _withheld(result)
    with Rescorer(_Executor(ServerBackend(other, run_dir=tmp_path), config)) as rescorer:
        row = rescorer.score(suite, cell, result, pos)
    assert "llama-replay" in row.how and "; checked on position" in row.how, row.how
    assert int(row.top_ids[0]) == result.tokens[pos]

    moved = replace(result, logits=list(result.logits))
    checked = max(q for q in range(pos) if q < len(moved.logits) and len(moved.logits[q].top_ids))
    moved.logits[checked] = replace(moved.logits[checked], top_logits=moved.logits[checked].top_logits + 0.01)
    with Rescorer(_Executor(ServerBackend(other, run_dir=tmp_path), config)) as rescorer:
        row = rescorer.score(suite, cell, moved, pos)
    assert row is not None and "re-scored through llama-server" in row.how, row.how
    assert "refused llama-replay: it does not reproduce" in row.how, row.how


def test_the_tools_link_is_llama_servers_with_its_objects_swapped(tmp_path):
    server = ["c++", "-O3", "tools/server/main.cpp.o", "-o", "bin/llama-server", "src/libllama.a", "/x/crt.o", "-lm"]
    argv = replay_link(server, tmp_path / "r.o", tmp_path / "llama-replay")
    assert argv == ["c++", str(tmp_path / "r.o"), "-O3", "-o", str(tmp_path / "llama-replay"), "src/libllama.a"] + [
        "/x/crt.o",
        "-lm",
    ]


def test_a_tree_the_tool_does_not_compile_against_builds_without_it(tmp_path):
    """An old llama.h (a bisect step): the compile fails, the build goes on, the log says why."""
    log = (tmp_path / "build.log").open("w")
    why = build_replay(["c++", "-o", "bin/llama-server"], tmp_path, tmp_path, tmp_path / "out", log, lambda a, c: 1)
    log.close()
    assert why.startswith("llama-replay not built") and why in (tmp_path / "build.log").read_text()
