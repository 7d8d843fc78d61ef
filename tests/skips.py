"""Skip a test only because a model is unavailable (harness.models.ModelUnavailable: its optional package is not
installed), never on another harness error: a model that fails to build, a llama-quantize that fails, a bad
file are failures of the test."""

from __future__ import annotations

import pytest

from harness.models import ModelUnavailable, resolve


def require_model(name: str):
    """The resolved model, or a skip naming why it is unavailable."""
    try:
        return resolve(name)
    except ModelUnavailable as err:
        pytest.skip(f"{name} unavailable: {err}")
