"""How a sequence's memory goes back to an earlier position after rejected drafts.

- `seq-rm`: remove the rejected positions (`llama_memory_seq_rm`): attention KV caches.
- `checkpoint`: save the sequence state before verifying (`llama_state_seq_get_data_ext`, PARTIAL_ONLY
  by default), restore it on a partial acceptance, trim the attention cells past it, replay.
- `partial`: hybrid models created with `n_rs_seq` recurrent snapshots roll back with `seq_rm` inside
  the snapshot window (no replay).
"""

import struct

import llama_cpp

from harness.engine.context import Context
from harness.errors import HarnessError
from harness.suites.rollback_options import CHECKPOINT_KINDS, STRATEGIES


class LlamaRefused(Exception):
    """llama.cpp refused a memory or state operation the engine asked for: the request fails with it
    (an error Result, like a failed decode), which is a finding about llama.cpp, not a harness bug."""


CHECKPOINT_FLAGS = dict(zip(CHECKPOINT_KINDS, (llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, 0), strict=True))


def choose_strategy(requested: str, kind: str, arch: str) -> str:
    """The strategy for a target of this model kind; refuses combinations that would give wrong output."""
    if requested not in STRATEGIES:
        raise HarnessError(f"unknown rollback '{requested}' (use one of: {', '.join(STRATEGIES)})")
    if requested == "auto":
        return "seq-rm" if kind == "dense" else "checkpoint"
    if requested == "seq-rm" and kind != "dense":
        raise HarnessError(
            f"rollback seq-rm cannot roll back the recurrent state of a {kind} model ({arch}); "
            "use --rollback checkpoint (what llama-server does) or auto"
        )
    if requested == "partial" and kind != "hybrid":
        raise HarnessError(
            f"rollback partial needs a hybrid model with recurrent snapshots, not a {kind} model ({arch})"
        )
    return requested


def check_partial(ctx: Context) -> None:
    """`partial` needs llama.cpp to have given the context recurrent snapshots (it silently clamps to 0)."""
    if ctx.n_rs_seq <= 0:
        raise HarnessError(
            f"rollback partial: llama.cpp gives {ctx.model.arch} no recurrent-state snapshots "
            "(llama_n_rs_seq = 0); use --rollback checkpoint"
        )


def can_seq_rm(ctx: Context) -> bool:
    """True when removing a suffix of a sequence is exact (attention KV only)."""
    return ctx.model.kind == "dense"


def restore(ctx: Context, seq_id: int, state: bytes, flags: int, n_keep: int, trim: bool = True) -> None:
    """Restore a checkpoint, then (restore first: the hybrid order) drop attention cells from `n_keep` on."""
    if not ctx.set_state_seq(seq_id, state, flags):
        raise LlamaRefused(f"llama.cpp refused to restore the checkpoint of sequence {seq_id}")
    if trim and not ctx.seq_rm(seq_id, n_keep, -1):
        raise LlamaRefused(f"llama.cpp refused to trim sequence {seq_id} at {n_keep} after a restore")


SEQ_STATE_MAGIC = 0xAF143CD8
"""The first u32 of a `llama_state_seq_get_data_ext` blob; then the i32 sequence id, then (PARTIAL_ONLY on a hybrid)
the recurrent section: u32 cell count (1: the sequence's tail) and that cell's i32 position."""


def stale_partial(ctx: Context, seq_id: int, keep: int) -> bool:
    """Fault `stale-partial-rollback`: roll back to `keep` with the recurrent state of one token before (the state
    before the last kept token, at `keep - 1`), as llama.cpp serves a snapshot plane that a single-token step left
    stale (ggml-org/llama.cpp PR #29117); positions and attention cells stay right.

    llama.cpp hands the stale state out itself: a rollback one token further reads the snapshot plane of
    `keep - 2`; the sequence then goes back to its state before (no decode: other slots' rows of the step may
    not be sampled yet), rolls back to `keep`, and takes the stale recurrent state labelled `keep - 1`. Returns
    False (nothing done) where that plane is outside the snapshot window; the caller then rolls back right."""
    partial = CHECKPOINT_FLAGS["partial"]
    whole = ctx.state_seq(seq_id, 0)
    if not ctx.seq_rm(seq_id, keep - 1, -1):
        return False
    stale = bytearray(ctx.state_seq(seq_id, partial))
    magic, _, n_cells, pos = struct.unpack_from("<IiIi", stale)
    if magic != SEQ_STATE_MAGIC or n_cells != 1 or pos != keep - 2:
        raise LlamaRefused(f"stale-partial-rollback: unexpected recurrent state of sequence {seq_id} (pos {pos})")
    struct.pack_into("<i", stale, 12, keep - 1)
    if not ctx.set_state_seq(seq_id, whole, 0) or not ctx.seq_rm(seq_id, keep, -1):
        raise LlamaRefused(f"llama.cpp refused to restore and roll back sequence {seq_id} to {keep}")
    if not ctx.set_state_seq(seq_id, bytes(stale), partial):
        raise LlamaRefused(f"llama.cpp refused the recurrent state of sequence {seq_id}")
    return True
