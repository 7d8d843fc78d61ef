"""Models the harness runs: generated tiny GGUF models, the real Gemma 3 270M, or any .gguf path."""

from harness import DEFAULT_MODELS
from harness.models.registry import (
    ModelInfo,
    ModelUnavailable,
    draft_for,
    kind_of_arch,
    list_models,
    make,
    model_key,
    resolve,
)

__all__ = [
    "DEFAULT_MODELS",
    "ModelInfo",
    "ModelUnavailable",
    "draft_for",
    "kind_of_arch",
    "list_models",
    "make",
    "model_key",
    "resolve",
]
