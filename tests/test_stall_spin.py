"""A request on a llama-server that spins without returning tokens ends within the stall window, not at its
deadline (issue 28, item 9), on a real spinning build.

The seeded build replays the whole rejected draft after a checkpoint restore instead of the accepted part
(tools/server/server-context.cpp keeps `slot.spec_draft` where it should take `accepted`): the replay verifies
the same draft in the same batch, rejects it at the same token, restores the same checkpoint, and the slot
spins forever, the replay loop of ggml-org/llama.cpp#28060. Every verification appends the draft to the
slot's tokens and every restore cuts them again, so /slots' `n_prompt_tokens` moves at every look while
`n_decoded` stands still. A hybrid or recurrent target takes the checkpoint path on any partial acceptance.

The build goes through the build cache like tests/seeded.py's (the compiler cache serves every file but the
edited one); without it the test builds it first."""

from __future__ import annotations

import time

import pytest
from seeded import seeded_tree

from harness.backends.base import ServeConfig
from harness.backends.build import BuildInfo, ensure_server
from harness.backends.server_backend import ServerBackend
from harness.matrix import spec_preset
from harness.models import draft_for, resolve
from harness.suites.request import Request, Sampling

SPIN = {
    "                        slot.spec_draft = std::move(accepted);\n": (
        "                        // seeded bug: the whole rejected draft is replayed, not the accepted part\n"
    ),
}
"""The edit: in the checkpoint-restore branch of the speculative verification (the only line of this text)."""
NAME = "seeded-replay-loop"


@pytest.fixture(scope="module")
def spinning_server() -> BuildInfo:
    return ensure_server(source=seeded_tree(SPIN, NAME, "tests/test_stall_spin.py"))


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-recurrent"])
def test_a_request_on_a_spinning_server_ends_within_the_stall_window_named_a_livelock(spinning_server, tmp_path, model):
    config = ServeConfig(
        model=resolve(model).path,
        mode="seq",
        draft_model=resolve(draft_for(model)).path,
        spec=dict(spec_preset("draft-simple").options),
    )
    request = Request(
        prompt="Write a quicksort demo in C. Please, write just code.",
        sampling=Sampling(n_predict=256, temperature=0.0),
        deadline_s=60.0,
        tag="spinning",
    )
    with ServerBackend(spinning_server, run_dir=tmp_path).open(config) as session:
        started = time.monotonic()
        [result] = session.run([request])
        took = time.monotonic() - started
    assert result.stop_reason == "timeout", (result.stop_reason, len(result.tokens), result.error)
    assert "got no token for" in result.error and "stall window" in result.error and "case spinning" in result.error
    assert "spinning: llama-server logged `" in result.error and "a livelock" in result.error, result.error
    assert took <= 10.0, f"the spinning request took {took:.1f} s"
