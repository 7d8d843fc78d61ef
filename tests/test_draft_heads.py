"""The draft heads fed with the target's layer inputs in the engine (draft-eagle3, draft-dflash, draft-dspark, ported
from common/speculative.cpp at 0c1e570) against llama-server's, on the generated tiny-hybrid-mtp and its heads. That
both backends draft and accept the same per request in quicksort's cells is held by their baselines
(tests/test_default_types.py) and each backend's `acceptance` against its own; here: the root cause of
llama-server's EAGLE3 par defect (known failure `server-eagle3-acceptance-falls-with-slots-verifying-together`):
its draft sampling on the backend with several slots drafting in one batch."""

import pytest

from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.engine import ContextParams, Engine
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.execute import ExecOptions, serve_config
from harness.llama.defaults import INVALID_BATCH
from harness.matrix import Cell
from harness.models import resolve
from harness.models.registry import head_draft_for
from harness.suites.request import Request, Sampling

MODEL = "tiny-hybrid-mtp"
TEXTS = ("Write a quicksort demo in C.", "Write a merge sort in Java.", "Explain recursion.")
NO_BACKEND_SAMPLING = {"no-spec-draft-backend-sampling": True}
"""llama-server's `--no-spec-draft-backend-sampling`: the heads' draft tokens sampled on the CPU."""


def requests(n_predict: int = 32) -> list[Request]:
    return [Request(prompt=t, sampling=Sampling(n_predict=n_predict, temperature=0, ignore_eos=True)) for t in TEXTS]


def serve(backend, name: str, mode: str, spec: str, overrides: dict | None = None) -> list:
    """The three requests on one session: one at a time in seq, at once otherwise."""
    options = ExecOptions(backends={}, kv_scan="off", logit_top_k=0, parallel=3, spec_overrides=overrides or {})
    session = backend.open(serve_config(Cell(name, mode, spec, MODEL), options))
    try:
        if mode == "seq":
            return [session.run([r])[0] for r in requests()]
        return session.run(requests())
    finally:
        session.close()


def counts(results: list) -> list[tuple[int, int]]:
    return [(r.spec_stats["draft_n"], r.spec_stats["draft_n_accepted"]) for r in results]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    return {
        "inproc": InprocBackend(),
        "server": ServerBackend(ensure_server(None, "cpu", [], jobs=None), run_dir=tmp_path_factory.mktemp("server")),
    }


def test_eagle3_slots_drafting_in_one_batch_accept_what_one_slot_does_only_with_the_draft_sampled_on_the_cpu(backends):
    """The root cause of the EAGLE3 par defect (known failures server-eagle3-acceptance-falls-with-slots-verifying-
    together and engine-eagle3-acceptance-falls-with-slots-drafting-together): with `--no-spec-draft-backend-sampling`
    the three slots, drafting in one batch, draft and accept request for request on both backends what llama-server
    does one request at a time; with the draft sampled on the backend (the default) the engine, scheduling
    deterministically, accepts fewer (a row's candidate ids are another slot's row's)."""
    engine = counts(serve(backends["inproc"], "inproc", "par", "draft-eagle3", NO_BACKEND_SAMPLING))
    server = counts(serve(backends["server"], "server", "par", "draft-eagle3", NO_BACKEND_SAMPLING))
    alone = counts(serve(backends["server"], "server", "seq", "draft-eagle3", NO_BACKEND_SAMPLING))
    assert engine == server == alone
    on_the_backend = counts(serve(backends["inproc"], "inproc", "par", "draft-eagle3"))
    assert sum(c[1] for c in on_the_backend) < sum(c[1] for c in alone), (on_the_backend, alone)


def run_engine(spec: str, fault: str | None) -> list:
    head = resolve(head_draft_for(MODEL, spec)).path
    config = SpecConfig(spec_type=(spec,), spec_draft_model=head, spec_draft_p_min=0.0, fault=fault)
    with Engine(resolve(MODEL).path, ContextParams(n_ctx=1024), config) as e:
        return e.run(requests())


@pytest.mark.parametrize(
    ("spec", "fault"), [("draft-eagle3", "eagle3-stale-boundary"), ("draft-eagle3", "head-wrong-layer")]
)
def test_the_eagle3_faults_move_the_drafts_not_the_output(spec, fault):
    """`eagle3-stale-boundary` (the boundary left at the last verified position after a rejection) and
    `head-wrong-layer` (its layers' inputs concatenated in reverse order): other drafts, fewer accepted, the same
    output. (The generated DFlash head reads its anchor and a tenth of the features: a wrong layer does not move
    its drafts, measured 23 accepted either way.)"""
    clean, wrong = run_engine(spec, None), run_engine(spec, fault)
    assert [r.tokens for r in wrong] == [r.tokens for r in clean]
    accepted = [sum(c[1] for c in counts(rs)) for rs in (clean, wrong)]
    assert accepted[1] < accepted[0], accepted


@pytest.mark.parametrize("spec", ["draft-eagle3", "draft-dflash", "draft-dspark"])
def test_a_draft_left_in_the_heads_cache_fails_the_next_batch_as_invalid(spec):
    """`head-draft-left-in-cache`: the drafted positions stay in the head's KV cache, so the next target batch's
    positions do not continue the head's sequence; llama.cpp refuses the head's batch and the requests fail with
    it (llama-server: "failed to process speculative batch"), which `no-crash` reports."""
    results = run_engine(spec, "head-draft-left-in-cache")
    assert all(r.error and INVALID_BATCH in r.error for r in results), [r.error for r in results]


def test_a_head_without_three_layers_is_not_an_eagle3_head_and_says_so():
    model = resolve(MODEL)
    dflash = resolve(head_draft_for(MODEL, "draft-dflash")).path
    config = SpecConfig(spec_type=("draft-eagle3",), spec_draft_model=dflash)
    with pytest.raises(HarnessError, match="is not an EAGLE3 head \\(architecture dflash"):
        with Engine(model.path, ContextParams(n_ctx=256), config):
            pass


def test_a_head_type_without_a_draft_model_is_a_one_line_error():
    with pytest.raises(HarnessError, match="spec type draft-dflash needs a draft model"):
        SpecConfig(spec_type=("draft-dflash",))


@pytest.mark.parametrize("spec", ["draft-eagle3", "draft-dflash"])
def test_the_engine_saves_and_restores_a_slot_with_its_head_context(spec):
    """Slot save / restore with a head (ggml-org/llama.cpp#28619 concerns the draft context): the saved state carries
    the head context's sequence (EAGLE3 on a hybrid target: and its deferred boundary, as llama-server's
    `get_state` stashes it); restored into a fresh engine, a request continuing the saved tokens reuses them and
    drafts exactly as in the engine that saved it."""
    head = resolve(head_draft_for(MODEL, spec)).path
    first = Request(prompt=TEXTS[0], sampling=Sampling(n_predict=24, temperature=0, ignore_eos=True))

    def engine() -> Engine:
        config = SpecConfig(spec_type=(spec,), spec_draft_model=head)
        return Engine(resolve(MODEL).path, ContextParams(n_ctx=1024), config, keep_slot_states=True)

    with engine() as e:
        turn1 = e.run([first])[0]
        state = e.save_slot(0)["state"]
        follow = Request(prompt=state.tokens + turn1.tokens[-1:], sampling=Sampling(n_predict=24, temperature=0))
        assert e.restore_slot(0, state).get("n_restored") == len(state.tokens)
        same_engine = e.run([follow])[0]
    [(data, extra)] = state.drafts
    assert len(data) > 0 and ((extra is not None) == (spec == "draft-eagle3")), extra
    with engine() as fresh:
        assert fresh.restore_slot(0, state).get("n_restored") == len(state.tokens)
        again = fresh.run([follow])[0]
    assert again.tokens == same_engine.tokens and again.timings.cache_n == len(state.tokens)
    assert counts([again]) == counts([same_engine]) and counts([again])[0][0] > 0
