"""Running `llama-replay` (harness/data/llama-replay.cpp, built beside llama-server by
harness.backends.build.replay_build): one row of logits recomputed through the libraries a llama-server build links,
in the batches a request was computed in (harness.backends.server_rescore.Replay), with the cell's context options.

It is the engine's `replay_row` (harness/engine/score.py) for builds whose libraries the engine does not run: a tag
(b11434), a bisect step, a mutant, a CUDA build. Against the libraries the engine runs it is bit-identical to the
engine's replay (tests/test_replay_tool.py). One process per row: a row is asked for only where triage needs the
logits of a flip the server withheld.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.engine.context import CACHE_TYPES, FLASH_ATTN, ContextParams
from harness.errors import HarnessError

REPLAY_TIMEOUT_S = 300.0
"""One row: the model load (seconds for a large model on a slow disk) and the request's batches, under load."""


@dataclass(frozen=True)
class ReplayTool:
    """`binary` replaying rows of requests served with `model` and the context options `params` (n_rs_seq as the
    target's: harness.engine.engine.target_params)."""

    binary: Path
    model: Path
    params: ContextParams

    def row(self, decodes: list[dict], row: int) -> np.ndarray:
        """The float32 logits of row `row` of the last of `decodes`; HarnessError naming the tool's own error when
        it fails or does not answer in REPLAY_TIMEOUT_S."""
        try:
            proc = subprocess.run(
                [str(self.binary)], input=self.stdin(decodes, row), capture_output=True, timeout=REPLAY_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise HarnessError(f"{self.binary} did not answer in {REPLAY_TIMEOUT_S:.0f} s (REPLAY_TIMEOUT_S)") from None
        except OSError as err:
            raise HarnessError(f"cannot run {self.binary}: {err}") from None
        error = proc.stderr.decode(errors="replace").strip().splitlines()
        if proc.returncode != 0:
            raise HarnessError(f"{self.binary.name} failed (exit {proc.returncode}): {error[-1] if error else ''}")
        head, _, body = proc.stdout.partition(b"\n")
        values = np.frombuffer(body, dtype=np.float32)
        if not head.isdigit() or values.shape[0] != int(head):
            raise HarnessError(f"{self.binary.name} wrote {len(body)} bytes of logits, not {head!r} float32 values")
        return values

    def stdin(self, decodes: list[dict], row: int) -> bytes:
        """The tool's input (its source's header comment): the model, the context line, then the decodes."""
        p = self.params
        context = [p.n_ctx, p.n_batch, p.n_ubatch, p.parallel, p.n_rs_seq, p.kv_unified, p.swa_full]
        context += [FLASH_ATTN[p.flash_attn], CACHE_TYPES[p.cache_type_k], CACHE_TYPES[p.cache_type_v], p.threads]
        context += [p.repack, row, len(decodes)]
        lines = [str(self.model), _words(context)]
        for d in decodes:
            header = [d["seq"], d["start"], d["every_row"], d["keep"], len(d["tokens"]), *d["tokens"]]
            lines.append(_words([*header, *_stand_ins(d["before"]), *_stand_ins(d["after"])]))
        return ("\n".join(lines) + "\n").encode()


def _stand_ins(entries: list) -> list:
    return [len(entries), *(x for seq, n, every in entries for x in (seq, n, every))]


def _words(values: list) -> str:
    return " ".join(str(int(v)) for v in values)
