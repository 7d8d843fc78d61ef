"""The in-process speculative engine on llama-cpp-python's low-level API."""

from harness.engine.context import ContextParams
from harness.engine.engine import Engine

__all__ = ["ContextParams", "Engine"]
