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

import json
import shutil
import time
from pathlib import Path

import pytest
from filelock import FileLock

from harness.backends.base import ServeConfig
from harness.backends.build import SOURCE_MARKER, BuildInfo, ensure_server, read_marker, vendored_source
from harness.backends.server_backend import ServerBackend
from harness.matrix import spec_preset
from harness.models import draft_for, resolve
from harness.paths import cache_dir
from harness.request import Request, Sampling

SPIN = {
    "                        slot.spec_draft = std::move(accepted);\n": (
        "                        // seeded bug: the whole rejected draft is replayed, not the accepted part\n"
    ),
}
"""The edit: in the checkpoint-restore branch of the speculative verification (the only line of this text)."""
NAME = "seeded-replay-loop"


def spinning_tree() -> Path:
    """The vendored tree with the replay loop, kept in the cache (same bytes, same build key, built once)."""
    source = vendored_source()
    tree = cache_dir() / "src" / f"{source.name}-{NAME}"
    target = tree / "tools" / "server" / "server-context.cpp"
    with FileLock(str(tree) + ".lock"):
        if not target.is_file():
            staging = tree.with_name(tree.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source, staging, symlinks=True)
            path = staging / "tools" / "server" / "server-context.cpp"
            text = path.read_text()
            for line, replacement in SPIN.items():
                assert text.count(line) == 1, f"the vendored server-context.cpp changed: cannot seed {line.strip()!r}"
                text = text.replace(line, replacement)
            path.write_text(text)
            commit = read_marker(source / SOURCE_MARKER)
            (staging / SOURCE_MARKER).write_text(
                json.dumps({"commit": f"{commit[:12]}-{NAME}", "origin": "tests/test_stall_spin.py"}) + "\n"
            )
            staging.rename(tree)
    return tree


@pytest.fixture(scope="module")
def spinning_server() -> BuildInfo:
    return ensure_server(source=spinning_tree())


@pytest.mark.parametrize("model", ["tiny-hybrid", "tiny-recurrent"])
def test_a_request_on_a_spinning_server_ends_within_the_stall_window(spinning_server, tmp_path, model):
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
    assert took <= 10.0, f"the spinning request took {took:.1f} s"
