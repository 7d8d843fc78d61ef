"""The CPU stand-in for GPU numerics (docs/near-tie-policy.md#cpu-stand-in): the `numerics` suite's quantized targets
really compute a verification batch otherwise than single-token decodes (so the suites cover the class of
ggml-org/llama.cpp#25618 on a CPU), and their float sources barely do."""

import gguf
import pytest

from harness.llama.defaults import AMX_DEFECT, default_repack
from harness.models import draft_for, resolve
from harness.models.numerics import PROMPTS, batch_vs_single, summary
from harness.models.registry import QUANTIZED
from harness.suites import load_suite, suites_dir

STAND_INS = ("tiny-dense-wide-q4_k", "tiny-hybrid-mtp-wide-q4_k")
WITHOUT_REPACKING = (
    f"not run: the weights are not repacked on a CPU with {AMX_DEFECT} (its AMX path crashes llama.cpp: known failure "
    "amx-repack-segfault), and unrepacked Q4_K has no 4-row kernel: on the Intel AMX VM (2026-12-07) these prompts' "
    "batches were bit-identical to single decodes, and over every prompt a 4-row batch moved the same few rows as a "
    "2-row one (58 of 1,536 and 28 of 768 rows, max |Δ| 0.085 both: python -m harness.models.numerics)"
)


@pytest.mark.parametrize("name", STAND_INS)
def test_every_matrix_of_the_stand_in_is_q4_k(name):
    """llama-quantize falls back to Q5_0 for a matrix of 128 columns (Q4_K's super-blocks hold 256 values), and
    Q5_0 is not repacked: the `-wide` models are 256 wide so that every matrix of a multiple of 256 columns (all
    but the hybrid's GatedDeltaNet output, 128, and its f32 convolutions) is Q4_K."""
    reader = gguf.GGUFReader(resolve(name).path)
    matrices = {t.name: (int(t.shape[0]), t.tensor_type.name) for t in reader.tensors if len(t.shape) == 2}
    wide = {n: kind for n, (cols, kind) in matrices.items() if cols % 256 == 0}
    assert len(wide) > len(matrices) / 2 and set(wide.values()) == {"Q4_K"}, matrices


def test_a_four_row_batch_moves_the_quantized_model_more_than_its_float_source():
    """The rows of an n-token batch with logits on every row (a verification batch) against n single-token decodes
    of the same tokens. The Q4_K target's matrix products are bit-exact below 4 rows (one-row products; the f16
    attention moves a few rows by ~1e-6) and move every row of a 4-row batch (the repacked weights multiplied 4
    rows at a time): the class of a GPU's batch kernels, which CI then covers. Its f32 source moves every row,
    but by less than 1e-3 nats, and flips no argmax. The Rust quicksort prompt (the numerics suite's `Rust` case)
    holds a flip at 0.0177 nats on the 2-core AVX-512 machine of 2026-12-04: printed, not asserted (another CPU's
    kernels round otherwise)."""
    if not default_repack():
        pytest.skip(WITHOUT_REPACKING)
    prompts, n_gen = (PROMPTS[4],), 16
    quantized = batch_vs_single(resolve("tiny-dense-wide-q4_k").path, (2, 4), prompts=prompts, n_gen=n_gen)
    source = batch_vs_single(resolve("tiny-dense-wide").path, (2, 4), prompts=prompts, n_gen=n_gen)
    print("q4_k", summary(quantized[4]), "f32", summary(source[4]))
    assert quantized[2].max_abs < 1e-5
    assert quantized[4].moved == quantized[4].rows > 0
    assert quantized[4].max_abs > 10 * quantized[2].max_abs
    assert 0 < max(s.max_abs for s in source.values()) < 1e-3
    assert all(s.flips == 0 for s in source.values())


ROUNDING = 1e-5
"""A logit difference of a few float32 ulps (logits of magnitude ~10: an ulp is ~1e-6)."""


def test_the_mtp_stand_in_moves_from_four_rows_on():
    """Below four rows the batch takes the single decode's kernels (at most a rounding difference: 0 on the machine of
    2026-12-04, 1.9e-06 in 3 of 72 rows on the AMD EPYC of 2026-12-05); from four rows on another kernel moves every
    row (1.3e-04 there), the verification batch of a draft of 3."""
    if not default_repack():
        pytest.skip(WITHOUT_REPACKING)
    shifts = batch_vs_single(resolve("tiny-hybrid-mtp-wide-q4_k").path, (3, 4), prompts=PROMPTS[:2], n_gen=12)
    assert shifts[3].max_abs <= ROUNDING and shifts[3].flips == 0
    assert shifts[4].moved == shifts[4].rows > 0 and shifts[4].max_abs > 10 * ROUNDING


def test_a_quantized_model_is_drafted_by_its_float_source():
    for name, q in QUANTIZED.items():
        assert draft_for(name) == q.source


def test_the_numerics_suite_runs_the_25618_case_on_quantized_targets_with_a_drafter():
    suite = load_suite(str(suites_dir() / "numerics.yaml"))
    assert "llama.cpp.25618" in {c.name for c in suite.cases}
    served = {(m, s) for block in suite.matrix for m in block["models"] for s in block["specs"]}
    assert {m for m, _ in served} <= set(QUANTIZED)
    assert {("tiny-dense-wide-q4_k", "draft-simple"), ("tiny-hybrid-mtp-wide-q4_k", "draft-mtp")} <= served
    assert {b for block in suite.matrix for b in block["backends"]} == {"inproc", "server"}
