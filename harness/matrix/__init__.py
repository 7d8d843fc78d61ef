"""The run matrix: which backend × mode × speculative config × model cells a suite runs in.

- `presets`: the named speculative configs (`spec_preset`) and how their options are served;
- `cell`: a `Cell`, which knows its preset, its served options and its draft model, and a matrix's cells;
- `shard`: `--shard I/N`, one part of a run's cells, balanced by estimated cost.
"""

from harness.matrix.cell import BACKEND_NAMES, Cell, block_of, cells, narrowing
from harness.matrix.presets import SPEC_PRESETS, canonical, keeps_seeded_tokens, served_as, served_options, spec_preset
from harness.matrix.shard import Shard, estimated_cost, shard

__all__ = [
    "BACKEND_NAMES",
    "SPEC_PRESETS",
    "Cell",
    "Shard",
    "block_of",
    "canonical",
    "cells",
    "estimated_cost",
    "keeps_seeded_tokens",
    "narrowing",
    "served_as",
    "served_options",
    "shard",
    "spec_preset",
]
