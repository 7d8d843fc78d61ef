"""draft-mtp in the engine (the target's own MTP head through llama-cpp-python's ctypes bindings) against
llama-server's, on the generated tiny-hybrid-mtp: the same drafted and accepted counts request for request, the
output of no speculation, and the hybrid target rolled back inside its recurrent snapshots as llama-server does."""

import pytest

from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.engine import ContextParams, Engine
from harness.engine.slot_state import SavedSlot
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell
from harness.models import resolve
from harness.suites.request import Request, Sampling

MODEL = "tiny-hybrid-mtp"
TEXTS = ("Write a quicksort demo in C.", "Write a merge sort in Java.", "Explain recursion.")


def requests(n_predict: int = 48) -> list[Request]:
    return [Request(prompt=t, sampling=Sampling(n_predict=n_predict, temperature=0, ignore_eos=True)) for t in TEXTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per (backend, spec), the results of the three requests, par (3 slots, concurrent)."""
    backends = {
        "inproc": InprocBackend(),
        "server": ServerBackend(ensure_server(None, "cpu", [], jobs=None), run_dir=tmp_path_factory.mktemp("server")),
    }
    out = {}
    for name, backend in backends.items():
        for spec in ("none", "draft-mtp"):
            options = ExecOptions(backends={}, kv_scan="off", logit_top_k=0, parallel=3)
            session = backend.open(serve_config(Cell(name, "par", spec, MODEL), options))
            try:
                out[name, spec] = session.run(requests())
            finally:
                session.close()
    return out


def test_the_engine_drafts_and_accepts_what_llama_server_does(runs):
    counts = {
        name: [(r.spec_stats["draft_n"], r.spec_stats["draft_n_accepted"]) for r in runs[name, "draft-mtp"]]
        for name in ("inproc", "server")
    }
    assert counts["inproc"] == counts["server"]
    drafted, accepted = (sum(c[i] for c in counts["inproc"]) for i in (0, 1))
    assert 0.2 < accepted / drafted < 0.95


def test_the_output_is_the_output_without_speculation_on_both_backends(runs):
    for name in ("inproc", "server"):
        assert all(r.ok for r in runs[name, "draft-mtp"])
        assert [r.tokens for r in runs[name, "draft-mtp"]] == [r.tokens for r in runs[name, "none"]]
    assert [r.tokens for r in runs["inproc", "none"]] == [r.tokens for r in runs["server", "none"]]


def test_the_mtp_context_decodes_count_as_draft_decodes_every_target_token_plus_one_per_drafted_token(runs):
    """`draft_decoded` of a draft-mtp request: the MTP context follows every token the target decodes for the
    request (prompt, verifications) and decodes once per drafted token (id_last, then each draft but the last).
    It was 0 before the MTP drafter counted into the work meter."""
    for r in runs["inproc", "draft-mtp"]:
        w = r.work
        assert w.draft_decoded == w.target_decoded + r.spec_stats["draft_n"] > w.target_decoded, (w, r.spec_stats)
    assert all(r.work.draft_decoded == 0 for r in runs["inproc", "none"])


def test_auto_rollback_is_partial_under_draft_mtp_and_checkpoint_drafts_less():
    """llama-server gives the target n_rs_seq = n_max snapshots for draft-mtp: the engine's `auto` does the same;
    checkpoint rollback (no snapshots) replays after each rejection, so fewer steps draft, with the same output."""
    model = resolve(MODEL)
    got = {}
    for rollback in ("auto", "checkpoint"):
        with Engine(
            model.path, ContextParams(n_ctx=1024), SpecConfig(spec_type=("draft-mtp",), rollback=rollback)
        ) as e:
            assert e.scheduler.spec.strategy == ("partial" if rollback == "auto" else "checkpoint")
            got[rollback] = e.run(requests(32)[:1])[0]
    assert got["auto"].tokens == got["checkpoint"].tokens
    assert got["checkpoint"].spec_stats["draft_n"] < got["auto"].spec_stats["draft_n"]


def test_a_model_without_an_mtp_block_is_a_one_line_error():
    with pytest.raises(HarnessError, match="draft-mtp needs a model with one MTP \\(nextn\\) block: tiny-hybrid-"):
        with Engine(resolve("tiny-hybrid").path, ContextParams(n_ctx=256), SpecConfig(spec_type=("draft-mtp",))):
            pass


def test_the_mtp_wrong_row_fault_moves_the_drafts_not_the_output():
    """`mtp-wrong-row`: after a rejection the MTP head gets the hidden row of the last verified position, not the
    last accepted one: other drafts, more target decodes (what `work` catches, exact in seq), the same output."""
    model = resolve(MODEL)
    got = {}
    for fault in (None, "mtp-wrong-row"):
        with Engine(model.path, ContextParams(n_ctx=1024), SpecConfig(spec_type=("draft-mtp",), fault=fault)) as e:
            got[fault] = e.run(requests(32))
    clean, wrong = got[None], got["mtp-wrong-row"]
    assert [r.tokens for r in wrong] == [r.tokens for r in clean]
    assert [r.spec_stats["accepted_per_pos"] for r in wrong] != [r.spec_stats["accepted_per_pos"] for r in clean]
    assert sum(r.work.target_decoded for r in wrong) > sum(r.work.target_decoded for r in clean)


def test_the_engine_saves_and_restores_a_slot_with_its_mtp_context():
    """Slot save / restore with draft-mtp (ggml-org/llama.cpp#28619 concerns the MTP draft context): the saved state
    carries the MTP context's sequence and the target row waiting for the next token; restored into a fresh engine,
    a request whose prompt continues the saved tokens reuses them and drafts exactly as it does restored into the
    engine that saved it (whose MTP context and rows never left). An MTP context left empty (the target's state
    alone: what llama-server's restore leaves) drafts otherwise, its output unchanged."""
    model = resolve(MODEL)
    first = Request(prompt=TEXTS[0], sampling=Sampling(n_predict=24, temperature=0, ignore_eos=True))

    def engine() -> Engine:
        return Engine(
            model.path, ContextParams(n_ctx=1024), SpecConfig(spec_type=("draft-mtp",)), keep_slot_states=True
        )

    with engine() as e:
        turn1 = e.run([first])[0]
        saved = e.save_slot(0)
        state = saved["state"]
        follow = Request(prompt=state.tokens + turn1.tokens[-1:], sampling=Sampling(n_predict=24, temperature=0))
        assert e.restore_slot(0, state).get("n_restored") == len(state.tokens)
        same_engine = e.run([follow])[0]
        empty = e.scheduler.spec.mirrors[0].save_seq(1)  # a sequence this engine never used
    [(mtp, row)] = state.drafts
    assert len(mtp) > len(empty[0]) and row is not None and row.any()
    assert saved["n_written"] == len(state.target) + len(mtp) + row.nbytes
    assert same_engine.timings.cache_n == len(state.tokens)
    for variant in ("whole", "target only"):
        restoring = state if variant == "whole" else SavedSlot(state.tokens, state.target, [empty])
        with engine() as fresh:
            assert fresh.restore_slot(0, restoring).get("n_restored") == len(state.tokens)
            again = fresh.run([follow])[0]
        assert again.tokens == same_engine.tokens and again.timings.cache_n == len(state.tokens)
        counts = (again.spec_stats["draft_n"], again.spec_stats["draft_n_accepted"])
        reference = (same_engine.spec_stats["draft_n"], same_engine.spec_stats["draft_n_accepted"])
        assert (counts == reference) == (variant == "whole"), (variant, counts, reference)
