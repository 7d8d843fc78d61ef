"""specharness: determinism and regression test harness for speculative decoding in llama.cpp."""

__version__ = "0.1.0"

MODES = ("seq", "par", "no-kv-unified")
"""The three ways a backend serves requests, named the same everywhere in the project."""
