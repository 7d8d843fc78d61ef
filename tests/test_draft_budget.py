"""The draft budget near n_predict and the context end (ggml-org/llama.cpp#10641): the in-process engine caps
a step's draft as llama-server's get_n_draft_max does, pinned by arithmetic and against a real llama-server."""

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.checks import CHECKS
from harness.checks.base import CheckContext
from harness.engine import ContextParams, Engine
from harness.engine.drafters.scripted import Scripted
from harness.engine.spec_config import SpecConfig
from harness.execute import CellRun, Outcome
from harness.matrix import Cell
from harness.models import resolve
from harness.result import Result
from harness.suites import load_suite
from harness.suites.request import Request, Sampling
from harness.verdict.known_failures import load as load_known
from harness.verdict.known_failures import tag

N_CTX = 256
N_MAX = 4
NEAR_END = "Hello " * 200  # 202 prompt tokens: 54 left to the end of a 256-token context


def server_budget(n_prompt: int, n_predict: int, n_ctx: int = N_CTX, n_max: int = N_MAX) -> tuple[list[int], int]:
    """(each step's draft length, tokens returned) of a greedy request whose every draft is accepted whole, as
    llama-server sizes the drafts (tools/server/server-context.cpp, get_n_draft_max: `n_ctx - n_tokens - 2`,
    and `n_remaining - 1` with n_predict set; the drafter's own n_max) and as a request without speculation
    stops: at n_predict, or at the first token sampled with `n_tokens + 1 >= n_ctx` (n_tokens: positions
    decoded by then)."""
    n_tokens, returned, drafts = n_prompt, 1, []  # the first token is sampled after the prompt
    while returned != n_predict and n_tokens + 1 < n_ctx:
        budget = n_ctx - n_tokens - 2
        if n_predict > 0:
            budget = min(budget, n_predict - returned - 1)
        step = min(budget, n_max) if budget > 0 else 0
        if step:
            drafts.append(step)
        for _ in range(step + 1):  # the pending token and the draft are decoded, step + 1 tokens come back
            n_tokens += 1
            returned += 1
            if returned == n_predict or n_tokens + 1 >= n_ctx:
                break
    return drafts, returned


def engine_run(model, request: Request, spec: SpecConfig | None = None):
    with Engine(model.path, ContextParams(n_ctx=N_CTX), spec) as engine:
        return engine.run([request])[0]


def request(n_predict: int, prompt: str = "Write a quicksort demo in C.") -> Request:
    return Request(prompt=prompt, sampling=Sampling(n_predict=n_predict, temperature=0, ignore_eos=True))


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
@pytest.mark.parametrize(
    "n_predict, prompt",
    [(1, None), (2, None), (5, None), (9, None), (-1, NEAR_END)],
    ids=["n_predict_1", "n_predict_2", "n_predict_5", "n_predict_9", "context_end"],
)
def test_every_draft_accepted_the_engine_drafts_what_llama_server_allows_and_returns_the_plain_output(
    tiny_models, name, n_predict, prompt
):
    model = tiny_models[name]
    req = request(n_predict, *([prompt] if prompt else []))
    plain = engine_run(model, req)
    spec = SpecConfig(drafters=[Scripted(plain.tokens, n_max=N_MAX)])
    got = engine_run(model, req, spec)
    drafts, returned = server_budget(len(plain.prompt_tokens), n_predict)
    stats = {"draft_n": 0, "draft_n_accepted": 0, "spec_cycles": 0, "drafted_per_pos": [], **got.spec_stats}
    assert (stats["draft_n"], stats["draft_n_accepted"]) == (sum(drafts), sum(drafts))
    assert stats["spec_cycles"] == len(drafts)
    assert stats["drafted_per_pos"] == [sum(d > k for d in drafts) for k in range(max(drafts, default=0))]
    assert len(plain.tokens) == returned and got.tokens == plain.tokens and got.stop_reason == "limit"
    if n_predict < 0:  # generated to the context end: the last draft was capped by it and accepted whole
        assert len(plain.prompt_tokens) + returned == N_CTX and got.truncated and drafts[-1] < N_MAX


def test_the_budget_arithmetic_caps_at_n_predict_and_at_the_context_end():
    assert server_budget(10, 1) == ([], 1)
    assert server_budget(10, 2) == ([], 2)  # a draft must leave room for the token sampled after it
    assert server_budget(10, 5) == ([3], 5)
    assert server_budget(10, 9) == ([4, 2], 9)
    assert server_budget(N_CTX - 6, -1) == ([4], 6)  # n_tokens 250: 256 - 250 - 2 = 4 fit
    assert server_budget(N_CTX - 2, -1) == ([], 2)  # n_tokens 254: no room for a draft
    assert server_budget(202, -1) == ([4] * 10 + [2], 54)  # NEAR_END: the last draft is capped by the context


@pytest.fixture(scope="module")
def both_backends(tiny_models, tmp_path_factory):
    """Per backend, the results of draft-simple requests near n_predict and the context end (tiny-dense)."""
    model = tiny_models["tiny-dense"]
    config = ServeConfig(
        model=model.path,
        mode="seq",
        n_ctx=N_CTX,
        draft_model=resolve("tiny-dense-draft").path,
        spec={"spec-type": "draft-simple", "spec-draft-n-max": N_MAX},
    )
    requests = [
        request(5),
        request(9),
        request(-1, NEAR_END),
        request(-1, "one two three four five six seven eight nine ten. " * 17),
    ]
    # a stop string the 8th token completes (the whole reply), with n_predict 8: llama-server ends it `word`
    text = engine_run(model, request(8)).text
    requests.append(
        Request(prompt=requests[0].prompt, sampling=Sampling(n_predict=8, temperature=0, ignore_eos=True, stop=[text]))
    )
    out = {}
    backends = {
        "inproc": InprocBackend(),
        "server": ServerBackend(ensure_server(None, "cpu", [], jobs=None), run_dir=tmp_path_factory.mktemp("server")),
    }
    for name, backend in backends.items():
        session = backend.open(config)
        try:
            out[name] = session.run(requests)
        finally:
            session.close()
    return out


def test_the_engine_drafts_and_accepts_what_llama_server_does_near_n_predict_and_the_context_end(both_backends):
    counts = {
        name: [(r.spec_stats["draft_n"], r.spec_stats["draft_n_accepted"]) for r in results]
        for name, results in both_backends.items()
    }
    assert all(r.ok for results in both_backends.values() for r in results)
    assert counts["inproc"] == counts["server"] and all(drafted > 0 for drafted, _ in counts["inproc"])
    assert [len(r.tokens) for r in both_backends["inproc"][:2]] == [5, 9]
    assert [len(r.tokens) for r in both_backends["server"][:2]] == [5, 9]


def test_a_stop_string_completed_by_the_last_allowed_token_ends_the_request_as_word_on_both_backends(both_backends):
    inproc, server = both_backends["inproc"][-1], both_backends["server"][-1]
    assert (len(inproc.tokens), inproc.stop_reason, inproc.text) == (len(server.tokens), "word", server.text)
    assert len(server.tokens) == 8 and server.stop_reason == "word" and server.text == ""  # the stop string is cut


# ------------------------------------------------------------------- known failure server-spec-context-end-early-stop

SERVER = Cell("server", "seq", "draft-simple", "tiny-dense")
ENTRY = next(
    e
    for e in load_known(Path(__file__).resolve().parents[1] / "suites" / "known-failures.yaml")
    if e.id == "server-spec-context-end-early-stop"
)


class Cells:
    """Stands in for the Executor: each cell's results are given (no logits: nothing to re-score)."""

    def __init__(self, suite, cells):
        self.runs = {cell: CellRun(suite, cell, [Outcome("ctx_end_a", 0, r)]) for cell, r in cells.items()}

    def run(self, _suite, cell):
        return self.runs[cell]

    def rescorer(self):
        return contextlib.nullcontext(SimpleNamespace(score=lambda *args: None))

    def environment(self, cell):
        return {"device": "cpu"}


def lossless(spec: Result, cell: Cell = SERVER):
    suite = load_suite("draft-budget")
    plain = Result(prompt_tokens=[0] * 250, tokens=[1, 2, 3, 4, 5, 6], stop_reason="limit", spec_stats={})
    cells = Cells(suite, {cell: spec, cell.reference(spec="none"): plain})
    return CHECKS["lossless"](CheckContext(cells.run(suite, cell), "ctx_end_a", cells, None, str, ""))


def ended(tokens: list[int], stop: str = "limit") -> Result:
    return Result(
        prompt_tokens=[0] * 250,
        tokens=tokens,
        stop_reason=stop,
        truncated=stop == "limit",
        spec_stats={"draft_n": 4, "draft_n_accepted": 4},
    )


def test_the_context_end_entry_explains_an_output_cut_short_there_and_nothing_else():
    short = lossless(ended([1, 2, 3, 4]))
    assert short.failures == [
        "round 0: unexplained at token 4 (the output ended there, stop: limit; the reference has 6 tokens)"
    ]
    assert tag([ENTRY], "draft-budget", SERVER, [short]) == [] and short.evidence["known_failure"] == ENTRY.id
    for other in (
        ended([1, 2, 9, 4, 5, 6]),  # another token: not this defect
        ended([1, 2, 3, 4], stop="eos"),
    ):  # ended on an EOG: not the context limit
        verdict = lossless(other)
        assert not verdict.passed and tag([ENTRY], "draft-budget", SERVER, [verdict]) == [verdict], other
    inproc = SERVER.reference(backend="inproc")
    short = lossless(ended([1, 2, 3, 4]), inproc)
    assert tag([ENTRY], "draft-budget", inproc, [short]) == [short]  # the engine has no excuse
