"""The speculative types whose drafts come from the target's hidden states (draft-mtp, draft-eagle3, draft-dflash,
draft-dspark) on a real llama-server, with the generated tiny-hybrid-mtp and its generated heads: each drafts, the
output equals the output without speculation, and some drafts are accepted, some rejected."""

import pytest

from harness.backends.build import ensure_server
from harness.backends.server_backend import ServerBackend
from harness.execute import ExecOptions, serve_config
from harness.matrix import Cell, spec_preset
from harness.models import resolve
from harness.suites.request import Request, Sampling

MODEL = "tiny-hybrid-mtp"
TYPES = ("draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark")


def test_a_head_preset_serves_its_generated_head_as_the_draft_model():
    for spec in TYPES:
        config = serve_config(Cell("server", "seq", spec, MODEL), ExecOptions(backends={}))
        expected = None if spec == "draft-mtp" else resolve(f"{MODEL}-{spec.removeprefix('draft-')}").path
        assert config.draft_model == expected
        assert config.spec == spec_preset(spec).options


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per spec config (none first), the results of two 48-token greedy requests on llama-server, seq."""
    backend = ServerBackend(ensure_server(None, "cpu", [], jobs=None), run_dir=tmp_path_factory.mktemp("server"))
    requests = [
        Request(prompt=text, sampling=Sampling(n_predict=48, temperature=0, ignore_eos=True))
        for text in ("Write a quicksort demo in C.", "Write a merge sort in Java.")
    ]
    out = {}
    for spec in ("none", *TYPES):
        session = backend.open(
            serve_config(Cell("server", "seq", spec, MODEL), ExecOptions(backends={}, kv_scan="off", logit_top_k=0))
        )
        try:
            out[spec] = session.run(requests)
        finally:
            session.close()
    return out


@pytest.mark.parametrize("spec", TYPES)
def test_the_type_drafts_on_llama_server_and_keeps_the_output(results, spec):
    assert all(r.ok for r in results[spec]), [r.error for r in results[spec]]
    assert [r.tokens for r in results[spec]] == [r.tokens for r in results["none"]]
    drafted = sum(r.spec_stats["draft_n"] for r in results[spec])
    accepted = sum(r.spec_stats["draft_n_accepted"] for r in results[spec])
    assert drafted > 0
    if spec_preset(spec).expect_accepts:
        assert 0 < accepted < drafted
    else:
        assert accepted == 0
