"""A llama-server context checkpoint restored past the prompt's shared prefix (known failure
server-stale-context-checkpoint, suites/checkpoints.yaml).

llama-server erases the context checkpoints of a slot that lie past a new prompt's shared prefix with
`cur.pos_max > pos_next` (tools/server/server-context.cpp, 0c1e570 and b11434). A recurrent or hybrid state
(pos_min == pos_max) is restored from pos_max + 1 on, so the checkpoint whose last position is the first one the
new prompt changed holds a token the slot no longer has, survives, and a later request that shares one more token
goes on from it. The `checkpoints` suite shows it (`back` differs from the same prompt read whole) and the failure
line names the checkpoint (harness.backends.server_checkpoints). The patch erases a checkpoint from where a
restore would go on, `std::max(cur.pos_min + 1, cur.pos_max) > pos_next`; the patched vendored build passes the
suite (every check passes, and the run says the known failure did not reproduce). The patched tree is built through
the build cache like tests/seeded.py's."""

from __future__ import annotations

import json

import pytest
from seeded import seeded_tree, server_suite_run

from harness.backends.build import ensure_server
from harness.backends.server_checkpoints import Ledger

ERASE_FROM_RESTART = {
    (
        "                                    const auto & cur = *it;\n"
        "                                    if (cur.pos_max > pos_next) {\n"
    ): (
        "                                    const auto & cur = *it;\n"
        "                                    // a checkpoint is restored from std::max(pos_min + 1, pos_max) on: a\n"
        "                                    // recurrent state (pos_min == pos_max) holds the token at pos_max too\n"
        "                                    if (std::max(cur.pos_min + 1, cur.pos_max) > pos_next) {\n"
    ),
}
"""The proposed fix: the erase loop after a prompt's shared prefix is known (the only text of the file)."""


def _created(n: int) -> str:
    return f"slot create_check: id  0 | task 3 | created context checkpoint 1 of 32 (pos_min = {n - 1}, n_tokens = {n})"


def _restored(n: int) -> str:
    return f"slot   operator(): id  0 | task 9 | restored context checkpoint (pos_max = {n - 1}, n_tokens = {n})"


def test_a_checkpoint_restored_for_a_prompt_it_was_not_made_from_is_named_stale():
    ledger = Ledger()
    warm = list(range(10, 30))
    assert ledger.follow(0, warm, [], [_created(16), _created(17)]) is None
    branch = warm[:16] + [99] + warm[17:]  # token 16 changed: checkpoint 17 no longer matches, checkpoint 16 does
    assert ledger.follow(0, branch, [], [_restored(16)]) is None
    said = ledger.follow(0, branch[:17] + [5, 6], [], [_restored(17)])
    assert said == (
        "prompt went on from a stale context checkpoint (n_tokens 17, made from a prompt whose token 16 is 26, "
        "this prompt's 99)"
    ), said


def test_a_checkpoint_erased_or_loaded_from_elsewhere_is_no_longer_claimed():
    ledger = Ledger()
    warm = list(range(10, 30))
    ledger.follow(0, warm, [], [_created(17)])
    erased = "slot   operator(): id  0 | task 5 | erased invalidated context checkpoint (pos_min = 16, n_tokens = 17)"
    ledger.follow(0, warm, [], [erased])
    assert ledger.follow(0, [1] * 20, [], [_restored(17)]) is None  # not seen made since: no claim
    ledger.follow(0, warm, [], [_created(17)])
    cache = "srv  load: - found better prompt with f_keep = 0.900, f_sim = 0.800"
    assert ledger.follow(0, [1] * 20, [cache], [_restored(17)]) is None  # the prompt cache brought its own


@pytest.mark.long  # a patched build (one file recompiled) and a suite run
def test_the_checkpoints_suite_passes_once_llama_server_erases_from_where_a_restore_goes_on(tmp_path, tiny_models):
    patched = ensure_server(
        source=seeded_tree(ERASE_FROM_RESTART, "patched-erase-from-restart", "tests/test_stale_checkpoint.py")
    )
    out = tmp_path / "run"
    proc, checks = server_suite_run(patched.server_bin, "checkpoints", out)
    failed = [(c["model"], c["spec"], c["case"], c["check"], c["message"]) for c in checks if c["passed"] is False]
    assert not failed, (failed, proc.stdout[-2000:])
    # the patched build is the vendored commit's: the run says the known failure did not reproduce, and exits 1 so
    # that a fixed defect's entry gets removed
    fixed = "FIXED? known failure server-stale-context-checkpoint did not reproduce"
    assert proc.returncode == 1 and fixed in proc.stdout + proc.stderr, proc.stdout[-2000:]
    judged = [c for c in checks if c["passed"] and c["check"] == "repeat-identical" and c["case"] == "back"]
    assert len(judged) == 6, judged  # 3 models: none and draft-simple (draft-mtp on tiny-hybrid-mtp)
    results = json.loads((out / "results.json").read_text())
    assert not [r for r in results if r.get("stale_checkpoint")]
