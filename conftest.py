"""Repository-wide pytest setup: the suite plugin (`pytest suites/`) and the tiny-model fixtures."""

import llama_cpp
import pytest

from harness.engine.logging import set_llama_verbose
from harness.models import DEFAULT_MODELS, resolve

pytest_plugins = ["harness.pytest_plugin", "pytester"]


@pytest.fixture(scope="session", autouse=True)
def quiet_llama_cpp():
    """llama.cpp's own log stays silent in tests (`specharness --verbose` shows it)."""
    set_llama_verbose(False)
    llama_cpp.llama_backend_init()


@pytest.fixture(scope="session")
def tiny_models():
    """name → ModelInfo for tiny-dense, tiny-hybrid and tiny-recurrent (generated on first use)."""
    return {name: resolve(name) for name in DEFAULT_MODELS}
