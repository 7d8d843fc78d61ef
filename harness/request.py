"""The `Request` record: one completion or chat request, the same for every backend."""

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class Sampling:
    """Sampling parameters under llama-server's request field names. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    """None: the backend's `seed` option (llama-server's `-s`)."""
    n_predict: int = 128
    stop: list[str] = field(default_factory=list)
    grammar: Optional[str] = None
    """A GBNF grammar constraining the output (llama.cpp's grammar sampler)."""
    json_schema: Optional[dict] = None
    """A JSON schema constraining the output (turned into a grammar; ignored when `grammar` is set)."""

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Request:
    """A raw completion (`prompt` as text or token ids) or a chat (`messages`, rendered by the backend)."""

    prompt: Union[str, list[int], None] = None
    messages: Optional[list[dict]] = None
    sampling: Sampling = field(default_factory=Sampling)
    tag: str = ""
    """Free-form label (suite/case/repeat) carried through to the result; backends ignore it."""

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a Request needs exactly one of `prompt` or `messages`")
