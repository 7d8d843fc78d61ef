"""The `Request` record: one completion or chat request, the same for every backend.

`Sampling` holds every per-request sampling field of llama-server's `/completion`, under llama-server's
own names and with its defaults (tools/server/server-schema.cpp, common/common.h), except two project
choices: `temperature` defaults to 0 (greedy: the determinism checks are defined for it) and
`n_predict` to 128. Each field carries the JSON schema a suite file's value must satisfy
(`SAMPLING_SCHEMA`); the server backend sends the fields as they are, the in-process engine builds
llama.cpp's `common_sampler` chain from them (harness.engine.sampler).
"""

from dataclasses import dataclass, field, fields

SAMPLER_NAMES = (
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typ_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
    "infill",
    "adaptive_p",
)
"""Sampler names llama-server accepts in `samplers` (common_sampler_types_from_names, canonical spellings)."""
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
"""llama-server's default order (common_params_sampling::samplers)."""
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")
UINT32 = 0xFFFFFFFF

_NUMBER = {"type": "number"}
_COUNT = {"type": "integer", "minimum": 0}
_BIAS = {"description": "a number or false", "anyOf": [{"type": "number"}, {"const": False}]}
_LOGIT_BIAS = {
    "description": "a list of [token id or text, bias] pairs or a mapping token id or text: bias",
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "array",
                "prefixItems": [{"type": ["integer", "string"]}, _BIAS],
                "minItems": 2,
                "maxItems": 2,
            },
        },
        {"type": "object", "additionalProperties": _BIAS},
    ],
}


def _f(default, schema: dict):
    """A Sampling field with the JSON schema its value must satisfy in a suite file."""
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: list(default), metadata={"schema": schema})
    return field(default=default, metadata={"schema": schema})


@dataclass
class Sampling:
    """Sampling parameters under llama-server's request field names. temperature 0 means greedy."""

    temperature: float = _f(0.0, {"type": "number", "minimum": 0})
    top_k: int = _f(40, _COUNT)  # 0 = the whole vocabulary
    top_p: float = _f(0.95, {"type": "number", "minimum": 0, "maximum": 1})
    min_p: float = _f(0.05, {"type": "number", "minimum": 0, "maximum": 1})
    typical_p: float = _f(1.0, _NUMBER)  # 1 = off
    top_n_sigma: float = _f(-1.0, _NUMBER)  # < 0 = off
    xtc_probability: float = _f(0.0, {"type": "number", "minimum": 0, "maximum": 1})
    xtc_threshold: float = _f(0.1, {"type": "number", "minimum": 0, "maximum": 1})  # > 0.5 = off
    dynatemp_range: float = _f(0.0, _NUMBER)
    dynatemp_exponent: float = _f(1.0, _NUMBER)
    repeat_last_n: int = _f(64, _COUNT)  # 0 = penalties off
    repeat_penalty: float = _f(1.0, {"type": "number", "exclusiveMinimum": 0})  # 1 = off
    frequency_penalty: float = _f(0.0, _NUMBER)
    presence_penalty: float = _f(0.0, _NUMBER)
    dry_multiplier: float = _f(0.0, _NUMBER)  # 0 = DRY off
    dry_base: float = _f(1.75, {"type": "number", "minimum": 1})
    dry_allowed_length: int = _f(2, _COUNT)
    dry_penalty_last_n: int = _f(64, _COUNT)
    dry_sequence_breakers: list[str] = _f(
        DEFAULT_DRY_BREAKERS, {"type": "array", "items": {"type": "string"}, "minItems": 1}
    )
    mirostat: int = _f(0, {"enum": [0, 1, 2]})
    mirostat_tau: float = _f(5.0, _NUMBER)
    mirostat_eta: float = _f(0.1, _NUMBER)
    adaptive_target: float = _f(
        -1.0, {"type": "number", "maximum": 1}
    )  # < 0 = off; used when `samplers` has adaptive_p
    adaptive_decay: float = _f(0.9, {"type": "number", "minimum": 0, "maximum": 0.99})
    min_keep: int = _f(0, _COUNT)
    logit_bias: list | dict = _f([], _LOGIT_BIAS)
    """Token id or text (every token of its tokenization) → bias added to the logit; `false` bans it."""
    ignore_eos: bool = _f(False, {"type": "boolean"})
    """End-of-generation tokens get a -inf logit bias (llama-server's vocabulary EOG biases)."""
    samplers: list[str] = _f(DEFAULT_SAMPLERS, {"type": "array", "items": {"enum": list(SAMPLER_NAMES)}})
    seed: int | None = _f(None, {"type": "integer", "minimum": -1, "maximum": UINT32})
    """None: the backend's `seed` option (llama-server's `-s`); -1: random."""
    n_probs: int | None = _f(None, _COUNT)
    """Top candidates logged per generated token; None: the run's `--logit-top-k`."""
    post_sampling_probs: bool = _f(False, {"type": "boolean"})
    """The top `n_probs` are the sampler chain's candidates after sampling (`prob` / `top_probs`, zero
    probabilities dropped) instead of the softmax of the raw logits over the vocabulary (`logprob`)."""
    n_predict: int = _f(
        128,
        {
            "type": "integer",
            "description": "-1 (until the context is full) or a count >= 1",
            "anyOf": [{"const": -1}, {"minimum": 1}],
        },
    )
    n_keep: int = _f(0, {"type": "integer", "minimum": -1})
    """Context shift (`context_shift` on): prompt tokens kept at the start of the context (-1: the whole prompt;
    llama-server adds one for a model that adds BOS)."""
    n_discard: int = _f(0, {"type": "integer", "minimum": 0})
    """Context shift: tokens after the kept ones discarded per shift (0: half of the rest)."""
    stop: list[str] = _f([], {"type": "array", "items": {"type": "string"}})
    grammar: str | None = None
    """A GBNF grammar constraining the output (llama.cpp's grammar sampler)."""
    json_schema: dict | None = None
    """A JSON schema constraining the output (turned into a grammar; ignored when `grammar` is set)."""

    @property
    def greedy(self) -> bool:
        """True when the output does not depend on the random number generator: temperature 0 (and no
        dynamic temperature, mirostat, XTC or sampler order without `temperature`, which still draw)."""
        return (
            self.temperature <= 0.0
            and self.dynatemp_range <= 0.0
            and self.mirostat == 0
            and "temperature" in self.samplers
            and "adaptive_p" not in self.samplers
            and not (self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5)
        )

    @property
    def picks_argmax(self) -> bool:
        """Greedy, with no grammar, no logit bias of the request and no sampler in the order that may drop
        the top token (penalties, DRY, typical, infill): the token is the argmax of the model's logits (up
        to the model's own suppressed tokens), so a logit margin speaks about it."""
        active = set(self.samplers)
        penalties = (
            "penalties" in active
            and self.repeat_last_n != 0
            and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)
        )
        dry = "dry" in active and self.dry_multiplier != 0.0 and self.dry_penalty_last_n != 0
        typical = "typ_p" in active and self.typical_p < 1.0
        return (
            self.greedy
            and not (penalties or dry or typical or "infill" in active)
            and self.grammar is None
            and self.json_schema is None
            and not self.logit_bias
        )

    @property
    def state_follows_tokens(self) -> bool:
        """Whether the sampler state before a token depends on the earlier tokens alone: penalties and DRY
        count tokens and `dist` draws once per token; a grammar (a rejected sample is drawn again), XTC
        (draws only over two or more candidates), mirostat and adaptive-p (they learn from probabilities)
        depend on the earlier logits too."""
        xtc = "xtc" in self.samplers and self.xtc_probability > 0 and self.xtc_threshold <= 0.5
        return (
            self.grammar is None
            and self.json_schema is None
            and self.mirostat == 0
            and "adaptive_p" not in self.samplers
            and not xtc
        )

    @property
    def random_seed(self) -> bool:
        """A seed of -1 (or 0xFFFFFFFF) asks for a random one: outputs are not reproducible."""
        return self.seed is not None and self.seed & UINT32 == UINT32

    def server_fields(self) -> dict:
        """The /completion fields, as they are (unset seed, grammar and schema are left to the server;
        `n_probs` is the caller's)."""
        optional = ("seed", "grammar", "json_schema")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in optional and f.name != "n_probs"}
        out.update({k: getattr(self, k) for k in optional if getattr(self, k) is not None})
        return out


SAMPLING_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "properties": {f.name: f.metadata["schema"] for f in fields(Sampling) if "schema" in f.metadata},
}
"""The JSON schema of a suite file's `sampling:` mapping (every field above but grammar and json_schema,
which a case gives as its own keys)."""


@dataclass
class Request:
    """A raw completion (`prompt` as text or token ids) or a chat (`messages`, rendered by the backend)."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    sampling: Sampling = field(default_factory=Sampling)
    tag: str = ""
    """Free-form label (suite/case/repeat) carried through to the result; backends ignore it but name it
    in errors (a request past its deadline)."""
    deadline_s: float | None = None
    """Seconds the request may take; None: derived from n_predict and the measured speed
    (harness.backends.base.request_deadline)."""
    cache_prompt: bool = True
    """llama-server's `cache_prompt`: False reads the whole prompt in a cleared slot (a `fresh` round); the
    in-process engine reads every prompt whole anyway."""

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a Request needs exactly one of `prompt` or `messages`")
