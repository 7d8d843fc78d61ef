"""Repository-wide pytest fixtures: the tiny models, built once per cache and shared by all tests."""

import pytest

from harness.models import DEFAULT_MODELS, resolve


@pytest.fixture(scope="session")
def tiny_models():
    """name → ModelInfo for tiny-dense, tiny-hybrid and tiny-recurrent (generated on first use)."""
    return {name: resolve(name) for name in DEFAULT_MODELS}
