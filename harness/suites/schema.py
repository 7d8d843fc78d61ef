"""The suite format: `SUITE_SCHEMA` (docs/guide/own-model-and-suites.md is the guide), the round kinds, the
default matrix and the default checks."""

from harness import DEFAULT_MODELS, MODES
from harness.suites.request import SAMPLING_SCHEMA
from harness.suites.rollback_options import CHECKPOINT_KINDS, STRATEGIES

SERVE_FIELDS = {
    "n_ctx": "integer",
    "n_batch": "integer",
    "n_ubatch": "integer",
    "parallel": "integer",
    "repack": "boolean",
    "context_shift": "boolean",
    "stall_s": "number",
    "ctx_checkpoints": "integer",
    "checkpoint_min_step": "integer",
    "cache_ram": "integer",
}
"""A suite's `serve` settings (ServeConfig's fields of the same names) and their JSON types."""
SERVE_MINIMUM = {"ctx_checkpoints": 0, "checkpoint_min_step": 0, "cache_ram": -1}
"""Where a `serve` integer may go below 1: llama-server's `--ctx-checkpoints 0` and `--cache-ram 0` switch the
context checkpoints and the host-RAM prompt cache off, `--cache-ram -1` has no limit, and `--checkpoint-min-step 0`
checkpoints at every step."""

FRESH = "fresh"
"""A round kind: the cases one request at a time, as `seq` does, each with llama-server's prompt cache off
(`cache_prompt: false`): every prompt read whole in a cleared slot, so nothing an earlier request left in the
slot (its cells, its context checkpoints) can shape the output. `repeat-identical` then compares the cached
rounds' outputs with these. The in-process engine reads every prompt whole anyway."""

RESTORE_ROUNDS = ("restore", "restore-fresh", "restore-over")
"""Round kinds that interrupt each chat after turn `restore.after_turn`: its slot is saved (llama-server's
`POST /slots/{id}?action=save`), then erased and restored into the same session (`restore`), restored into a
fresh session of the same cell (`restore-fresh`), or restored, without an erase, into the same slot after it
served another, longer conversation (`restore-over`), and the chat goes on there; requests go one at a time."""


class Regenerate(str):
    """A chat turn that asks the last reply again (`{regenerate: true}` in a suite's `chat:`): the conversation up
    to the last user message sent once more, its new reply in place of the old one, as a user's "regenerate"
    button does. Its prompt is a prefix of what the slot holds (the last prompt and its reply), so the slot must
    go back inside its own tokens: a recurrent or hybrid model needs a context checkpoint there."""


REGENERATE = Regenerate("(regenerate the last reply)")
"""The one regenerate turn (a string elsewhere: it reads as its own words in a report or a bench workload)."""

_NAMES = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_TURN = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["regenerate"],
            "properties": {"regenerate": {"const": True}},
        },
    ],
    "description": "a user message or {regenerate: true}",
}
_CASE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9_.+]+$"},
        "prompt": {"type": "string"},
        "vars": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
        "prompt_repeat": {"type": "integer", "minimum": 1},
        "chat": {"type": "array", "items": _TURN, "minItems": 1},
        "json_schema": {"type": "object"},
        "grammar": {"type": "string"},
        "sampling": SAMPLING_SCHEMA,
        "expect_accepts": {"type": "boolean"},
    },
    "oneOf": [{"required": ["prompt"]}, {"required": ["chat"]}],
    "dependentRequired": {"prompt_repeat": ["prompt"]},
}
_BLOCK = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "backends": _NAMES,
        "modes": {"type": "array", "items": {"enum": list(MODES)}, "minItems": 1},
        "specs": _NAMES,
        "models": _NAMES,
        "sampling": SAMPLING_SCHEMA,
    },
}
"""One block of the matrix: its axes (missing ones take DEFAULT_MATRIX's) and sampling fields that override
the suite's for the block's models (e.g. a shorter n_predict for a slower real model)."""
SEEDS = ("shared", "per-cell")
"""A suite's `seeds`: `shared` (the default) sends each case's seed as written to every cell, so cells can be
compared draw for draw (lossless, mode-invariant); `per-cell` sends each cell its own seed derived from the case's
and the cell's id (harness.suites.suite.cell_seed), so every speculative cell's output is an independent draw of the
case's law: what the pooled `distribution` test adds up (harness.checks.distribution, "Pooled tests")."""
NONE_REFERENCE_CHECKS = ("lossless", "probs-complete", "prompt-reuse", "kv-healthy", "baseline")
"""Checks that read the cell without speculation of the same backend, model and mode (`Cell.reference(spec="none")`):
a suite with one of them has that cell run beside each speculative one (harness.execute.Executor.expect); a
suite without serves only its own cells (a check that asks for another cell anyway gets it served on demand)."""
SHARED_SEED_CHECKS = ("lossless", "mode-invariant", "logits-close")
"""Checks that compare one cell's output with another cell's draw of the same seed: a suite of `per-cell` seeds
cannot have them."""


SUITE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["suite", "cases"],
    "properties": {
        "suite": {"type": "string", "pattern": r"^[a-z0-9-]+$"},
        "description": {"type": "string"},
        "slow": {"type": "boolean"},
        "matrix": {"oneOf": [_BLOCK, {"type": "array", "items": _BLOCK, "minItems": 1}]},
        "sampling": SAMPLING_SCHEMA,
        "serve": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                k: {
                    "type": t,
                    **(
                        {"minimum": SERVE_MINIMUM.get(k, 1)}
                        if t == "integer"
                        else {"exclusiveMinimum": 0}
                        if t == "number"
                        else {}
                    ),
                }
                for k, t in SERVE_FIELDS.items()
            },
        },
        "engine": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "rollback": {"enum": list(STRATEGIES)},
                "checkpoint_flags": {"enum": list(CHECKPOINT_KINDS)},
                "checkpoint_attempts": {"type": "integer", "minimum": 0},
            },
        },
        "repeats": {"type": "integer", "minimum": 1},
        "seeds": {"enum": list(SEEDS)},
        "run_order": {"type": "array", "items": {"enum": ["seq", "par", FRESH, *RESTORE_ROUNDS]}, "minItems": 1},
        "restore": {
            "type": "object",
            "additionalProperties": False,
            "required": ["after_turn"],
            "properties": {"after_turn": {"type": "integer", "minimum": 1}},
        },
        "checks": _NAMES,
        "allow_errors": {"type": "array", "items": {"enum": ["context_full"]}},
        "expect": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "completed_min": {"type": "number", "minimum": 0, "maximum": 1},
                "spec_stats_min": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 1}},
            },
        },
        "expect_accepts": {"type": "boolean"},
        "deadline_s": {"type": "number", "exclusiveMinimum": 0},
        "tolerances": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "top1_agreement": {"type": "number", "minimum": 0, "maximum": 1},
                "max_abs": {"type": "number", "minimum": 0},
                "nmse": {"type": "number", "minimum": 0},
                "kl": {"type": "number", "minimum": 0},
                "near_tie": {"type": "number", "minimum": 0},
            },
        },
        "cases": {"type": "array", "items": _CASE, "minItems": 1},
    },
}

DEFAULT_MATRIX = {
    "backends": ["inproc"],
    "modes": list(MODES),
    "specs": ["none"],
    "models": list(DEFAULT_MODELS),
}
CHECK_NAMES = (
    "no-crash",
    "repeat-identical",
    "lossless",
    "mode-invariant",
    "baseline",
    "spec-ran",
    "acceptance",
    "grammar-valid",
    "kv-healthy",
    "logits-close",
    "exercised",
    "probs-complete",
    "prompt-reuse",
    "within-n-predict",
    "work",
    "metrics-agree",
    "restore-identical",
    "distribution",
    "synth-acceptance",
    "draft-size",
)
"""The checks a suite may name (their functions live in harness.checks, which must define exactly these)."""
DEFAULT_CHECKS = [
    "no-crash",
    "repeat-identical",
    "lossless",
    "mode-invariant",
    "baseline",
    "spec-ran",
    "kv-healthy",
    "logits-close",
    "acceptance",
    "work",
    "metrics-agree",
    "distribution",
]
