"""llama.cpp's defaults and wording that both the in-process engine and the llama-server backend use: the
weight repacking and thread defaults, and how a refused batch is reported. A neutral module, so the engine
imports no backend code (the import contracts in pyproject.toml; docs/architecture.md)."""

import os
from pathlib import Path

INVALID_BATCH = "llama.cpp rejected the batch as invalid (inconsistent sequence positions)"
"""llama_decode's -1: llama_batch_allocr::init refused the batch (llama-server answers `Invalid input batch.`)."""


def invalid_batch(seq_id: int, last: int, start: int) -> str:
    """Why llama.cpp refused a batch, in one line with llama.cpp's own names, the same from both backends: the
    last position X the memory holds for the sequence and the batch's first position Y, which must be X + 1
    (X < Y for M-RoPE)."""
    return (
        f"{INVALID_BATCH}: the KV cache's last position of sequence {seq_id} is X = {last}, the batch "
        f"starts it at Y = {start} (required: Y = X + 1)"
    )


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`/proc/cpuinfo`; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


AMX_DEFECT = "amx_int8"
"""The CPU flag under which llama.cpp's AMX matrix multiplication (weights repacked into the AMX buffer type)
segfaults on Q4_K models: ggml-org/llama.cpp#20824, the `amx-repack-segfault` entry of known-failures.yaml."""


def default_repack() -> bool:
    """llama-server's `--repack` default (on), except on a CPU with AMX, where the repacked weights crash
    llama.cpp (AMX_DEFECT): there the suites serve with `--no-repack`, the run header says so, and the
    `amx-repack` suite keeps the defect itself under test as a known failure."""
    return AMX_DEFECT not in cpu_flags()


def default_threads() -> int:
    """Half the cores (at least one): spin barriers make all-core decoding slow on a busy 2-core box."""
    return max(1, (os.cpu_count() or 2) // 2)


NO_BACKTRACE = "GGML_NO_BACKTRACE"
"""Set (to 1) in llama-server's and the engine worker's environment: on an abort ggml otherwise forks gdb to attach
and print a backtrace (ggml_print_backtrace), which takes seconds where gdb is installed; under load longer than
the stall window (a known GGML_ASSERT read as a timeout) or the crash grace. The reports use the abort line."""
