"""specharness: determinism and regression test harness for speculative decoding in llama.cpp."""

__version__ = "0.1.0"

MODES = ("seq", "par", "no-kv-unified")
"""The three ways a backend serves requests, named the same everywhere in the project."""

DEFAULT_MODELS = ("tiny-dense", "tiny-hybrid", "tiny-recurrent")
"""The generated targets a run uses by default, one per kind; a suite's blocks of these (or of some of them) are
its generic matrix, where a model of your own runs."""
