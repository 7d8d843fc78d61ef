"""Token ids → text for messages and reports, from a model's vocabulary alone (no weights loaded)."""

import functools
from collections.abc import Callable
from pathlib import Path

from harness.engine.model import Vocab
from harness.errors import HarnessError
from harness.models import resolve


@functools.cache
def detokenizer(model_path: Path) -> Callable[[list[int]], str]:
    """A function turning token ids into text with the vocabulary of `model_path`: the engine's own
    detokenizer (`Vocab`), so messages show the text the engine produced; `<id>`s when the file cannot
    be read. The vocabulary stays loaded for the life of the process."""
    vocab = Vocab.load(model_path)
    if vocab is None:
        return lambda tokens: " ".join(f"<{t}>" for t in tokens)
    return vocab.detokenize


def for_model(name: str) -> Callable[[list[int]], str] | None:
    """The detokenizer of a registry name or .gguf path, None when the model is not at hand (never built)."""
    try:
        return detokenizer(resolve(name, make=False).path)
    except HarnessError:
        return None
