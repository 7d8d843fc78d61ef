"""The draft context's own KV cache types (llama-server's `--spec-draft-type-k/-v`, `-ctkd/-ctvd`) on both
backends: the in-process engine creates its draft context with them, a type llama.cpp refuses there (a
quantized V without flash attention) refuses to serve with a one-line error on both, and a bad name is a
one-line error naming the option."""

import pytest

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server_backend import ServerBackend
from harness.engine.context import Context, ContextParams
from harness.engine.drafters.draft_model import DraftSimple
from harness.engine.model import Model
from harness.engine.spec_config import SpecConfig
from harness.errors import HarnessError
from harness.matrix import SPEC_PRESETS
from harness.models import draft_for, resolve


def test_the_draft_context_takes_its_own_kv_cache_types(tiny_models):
    model = Model(tiny_models["tiny-dense"].path)
    target = Context(model, ContextParams(n_ctx=512))
    sizes = {}
    try:
        for types in (("f16", "f16"), ("q8_0", "f16")):
            draft = DraftSimple(resolve(draft_for("tiny-dense")).path, target, cache_types=types)
            try:
                assert (draft.ctx.params.cache_type_k, draft.ctx.params.cache_type_v) == types
                draft.process([(t, i, 0, i == 7) for i, t in enumerate(range(100, 108))])
                sizes[types[0]] = len(draft.ctx.state_seq(0))
            finally:
                draft.close()
    finally:
        target.close()
        model.close()
    assert sizes["q8_0"] < sizes["f16"]  # 8 cells × 2 layers of K rows: 68 bytes in q8_0 instead of 128


def test_a_bad_draft_cache_type_is_a_one_line_error_naming_the_option():
    with pytest.raises(HarnessError, match=r"^spec-draft-type-k must be one of .*, not 'q9'$"):
        SpecConfig.from_options({"spec-type": "ngram-mod", "spec-draft-type-k": "q9"})


@pytest.mark.parametrize("backend", ["inproc", "server"])
def test_a_quantized_draft_v_cache_without_flash_attention_is_refused(tiny_models, tmp_path, backend):
    spec = {**SPEC_PRESETS["draft-simple"].options, "spec-draft-type-v": "q8_0"}
    config = ServeConfig(
        model=tiny_models["tiny-dense"].path,
        draft_model=resolve(draft_for("tiny-dense")).path,
        spec=spec,
        flash_attn="off",
    )
    opener = InprocBackend(tmp_path) if backend == "inproc" else ServerBackend(ensure_server(), run_dir=tmp_path)
    with pytest.raises(HarnessError) as err:
        opener.open(config).close()
    message = str(err.value)
    assert "\n" not in message
    if backend == "inproc":
        assert message.startswith("llama.cpp could not create a context for tiny-dense-draft")
        assert "cache_type_v='q8_0'" in message
    else:  # its log says "quantized V cache requires flash_attn to be enabled ... failed to create MTP context"
        assert message.startswith("llama-server exited with code 1 during start-up")
        assert "model loading error" in message
