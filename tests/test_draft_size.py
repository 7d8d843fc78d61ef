"""`draft-size` (harness/checks/draft_size.py): every verified draft within --spec-draft-n-min .. -n-max.

It closes a gap `specharness mutate` found: mutant 9905836fa1b6 (a `break` after the first short draft is cleared in
draft-simple's loop over the slots, common/speculative.cpp) kept every later slot's short draft. The output stays
lossless, so it survived every suite (fixtures/mutation/survivors.yaml); forced-rejection's n-min cells catch it."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from seeded import seeded_tree

from harness.checks.draft_size import draft_lengths
from harness.result.work import Work

ROOT = Path(__file__).resolve().parent.parent

KEY = (
    "                dp.result->clear();\n            }\n        }\n    }\n\n"
    "    void accept(llama_seq_id /*seq_id*/, uint16_t /*n_accepted*/, bool /*is_other*/) override {"
)
N_MIN_BREAK = {KEY: KEY.replace("dp.result->clear();\n", "dp.result->clear();\n                break;\n", 1)}
"""The edit: mutant 9905836fa1b6, draft-simple's `draft` stops its n_min loop over the slots at the first short draft
it clears (common/speculative.cpp; the text around it makes it the one such loop)."""
N_MIN_TREE = ("seeded-n-min-break", "tests/test_draft_size.py", "common/speculative.cpp")
"""seeded_tree's name, origin and file for N_MIN_BREAK."""


def test_draft_lengths_read_llama_servers_verifications_and_the_engines_per_position_counts():
    server = SimpleNamespace(work=Work(steps={"verifications": [[3, 2], [0, None], [1, 1]]}), spec_stats={})
    assert draft_lengths(server) == [3, 0, 1]
    # the engine: drafted_per_pos[k] steps had a token at position k: 4 steps, of 1, 2, 2 and 3 tokens
    engine = SimpleNamespace(work=Work(), spec_stats={"drafted_per_pos": [4, 3, 1]})
    assert sorted(draft_lengths(engine)) == [1, 2, 2, 3]
    assert draft_lengths(SimpleNamespace(work=Work(), spec_stats={})) is None


def run(server_bin: Path, out: Path, mode: str) -> subprocess.CompletedProcess:
    args = ["--suite", "forced-rejection", "--backend", "server", "--model", "tiny-dense", "--mode", mode]
    args += ["--spec", "none,draft-p-min-0.2-n-min-2", "--server-bin", str(server_bin), "--out", str(out)]
    args += ["--repeat", "3"]  # in par the kill needs two short drafts in one step, slot 0's first: 9 of 10 runs
    cmd = [sys.executable, "-m", "harness.cli", "run", *args, "--no-auto-calibrate"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.long  # one llama-server variant (speculative.cpp recompiled) and forced-rejection's n-min cells on it
def test_a_server_that_keeps_short_drafts_of_later_slots_fails_draft_size_in_par_only(tmp_path, tiny_models):
    """The mutant, served: in par the two requests draft in one batch and the slot after the first short draft keeps
    its own. That needs slot 0's draft and a later slot's to be short in the same step: 12 of 13 runs of the par cell
    failed (2026-12-07), 3 to 5 one-token drafts verified in one request; three rounds here (a miss about 1e-3). In
    seq each request drafts alone and nothing changes."""
    from harness.backends.build import ensure_server

    build = ensure_server(source=seeded_tree(N_MIN_BREAK, *N_MIN_TREE))
    par = run(build.server_bin, tmp_path / "par", "par")
    said = par.stdout + par.stderr
    assert par.returncode == 1, said[-3000:]
    assert "[draft-size]" in said and "tokens verified, below n_min 2" in said, said[-3000:]
    assert "1 distinct failure: draft-size" in said
    seq = run(build.server_bin, tmp_path / "seq", "seq")
    assert seq.returncode == 0, seq.stdout[-2000:] + seq.stderr[-2000:]
