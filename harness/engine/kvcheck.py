"""The KV scanner on the engine's own memory: a slot's sequence state, parsed and checked in place."""

from harness.engine.context import Context
from harness.kv.scan import layout_from_model, scan_bytes


class KvChecker:
    """Scans one slot's sequence state (flags 0: every part) against the positions the slot believes it holds."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.layout = layout_from_model(ctx.model.path)

    def scan(self, seq_id: int, n_past: int) -> dict:
        """The brief scan verdict of sequence `seq_id`, which should hold exactly positions 0..n_past-1."""
        blob = self.ctx.state_seq(seq_id, 0)
        return scan_bytes(blob, "seq", self.layout, {seq_id: n_past}, name=f"sequence {seq_id}").brief()
