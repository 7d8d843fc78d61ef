"""`work` fails a llama-server that does more checkpoint work in par only (issue 48 item 2): a one-edit patch of the
vendored server-context.cpp (0c1e570) that, for slots with an id above 0 only, checkpoints the slot's state a second
time before every verification of a fresh draft (and logs it, as the first) roughly doubles par's and no-kv-unified's
speculative checkpoints and leaves seq, the tokens and the drafts as they are. `categories` on tiny-hybrid with
draft-simple on that build exits 1 with `work` failing its par and no-kv-unified cells only: against the same
requests in seq (`against_seq`) and for the batch checkpointed twice (`per_batch`); the unpatched build passes the
same run.

The patched tree is built through the build cache like tests/seeded.py's (`seeded_tree`): the compiler cache serves
every object but server-context.cpp's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from seeded import seeded_tree

from harness.backends.build import BuildInfo, ensure_server

ROOT = Path(__file__).resolve().parents[1]
CELLS = ["--suite", "categories", "--backend", "server", "--model", "tiny-hybrid", "--spec", "draft-simple"]
"""The run: categories' tiny-hybrid draft-simple server cells in seq, par and no-kv-unified (a hybrid target
checkpoints before every draft longer than its `n_rs_seq` snapshots)."""

DOUBLE_CHECKPOINT = {
    "                            (float) ckpt.data_dft.size() / 1024 / 1024);\n": (
        "                            (float) ckpt.data_dft.size() / 1024 / 1024);\n"
        "                    if (slot.id > 0) { // seeded bug: the state checkpointed again, slots above 0 only\n"
        "                        ckpt.update_tgt(ctx_tgt, slot.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);\n"
        '                        SLT_DBG(slot, "created speculative checkpoint (pos_min = %d, pos_max = %d, "\n'
        '                                "n_tokens = %d, size = %.3f MiB, draft = %.3f MiB)\\n",\n'
        "                                ckpt.pos_min, ckpt.pos_max, slot.prompt.n_tokens(),\n"
        "                                (float) ckpt.size() / 1024 / 1024,\n"
        "                                (float) ckpt.data_dft.size() / 1024 / 1024);\n"
        "                    }\n"
    ),
}
"""The edit: the speculative checkpoint of server-context.cpp's drafting step (`update_tgt` before a verification)
taken twice for a slot whose id is above 0. The second holds the same state, so nothing but the work changes."""
DOUBLE_CHECKPOINT_NAME = "seeded-par-double-checkpoint"

pytestmark = pytest.mark.long  # two builds' categories runs of 3 cells (30 requests each) on llama-server


def double_checkpoint_server() -> BuildInfo:
    """The vendored llama-server with DOUBLE_CHECKPOINT (built once through the build cache)."""
    return ensure_server(
        source=seeded_tree(DOUBLE_CHECKPOINT, DOUBLE_CHECKPOINT_NAME, "tests/test_work_patched_server.py")
    )


def categories_run(build: BuildInfo, out: Path) -> tuple[int, list[dict], str]:
    """`specharness run` of CELLS in seq, par and no-kv-unified on `build` (its default checks): (exit code,
    checks.json, console)."""
    argv = ["run", *CELLS, "--server-bin", str(build.server_bin), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    checks = json.loads((out / "checks.json").read_text()) if (out / "checks.json").is_file() else []
    return proc.returncode, checks, proc.stdout + proc.stderr


def test_a_build_that_checkpoints_twice_in_par_only_fails_work_there(tmp_path, tiny_models):
    code, checks, console = categories_run(double_checkpoint_server(), tmp_path / "run")
    assert code == 1, console[-3000:]
    failed = [c for c in checks if not c["passed"] and c.get("not_run") is None]
    assert failed and {c["check"] for c in failed} == {"work"}, [(c["check"], c["message"]) for c in failed]
    assert {c["mode"] for c in failed} == {"par", "no-kv-unified"}  # seq serves slot 0 only: untouched
    lines = [line for c in failed for line in c.get("failures") or [c["message"]]]
    # against seq's same requests: the speculative checkpoints and their bytes, the same rounds
    seq_lines = [line for line in lines if "more speculative work than the same request in seq" in line]
    assert seq_lines and all("ckpt_created" in line and "ckpt_created_bytes" in line for line in seq_lines), lines
    # and the batch checkpointed twice, without a reference
    assert any(
        "2 speculative checkpoints created for one verification batch where one suffices" in line for line in lines
    )
    # the verdict leads with the comparison with seq (its signature) where the request's rounds were seq's
    assert sum("more speculative work than the same request in seq" in c["message"] for c in failed) >= 8
    # every par request on a slot above 0 drafts: most cases fail in both modes
    assert len({(c["mode"], c["case"]) for c in failed}) >= 8, [(c["mode"], c["case"]) for c in failed]
    print("\n".join(lines[:6]))


def test_the_unpatched_build_passes_the_same_run_comparing_par_with_seq(tmp_path, tiny_models):
    code, checks, console = categories_run(ensure_server(), tmp_path / "run")
    assert code == 0, console[-3000:]
    work = [c for c in checks if c["check"] == "work" and c["mode"] != "seq"]
    assert work and all(c["passed"] for c in work), [c["message"] for c in work]
    compared = [c["evidence"]["against_seq"]["compared"]["speculative"] for c in work]
    assert sum(compared) >= len(work) // 2, compared  # par and no-kv-unified compared with seq, not skipped
