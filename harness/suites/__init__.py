"""Prompt suites: YAML files in `suites/`, validated on load (errors name file, line and field).

A suite declares its cases (completion prompts, multi-turn chats, grammar or JSON schema, sampling
parameters, repeats), its default matrix (backends × modes × speculative configs × models) and the
checks that apply; `SUITE_SCHEMA` below is the format, docs/guide/own-model-and-suites.md the guide.
"""

import difflib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jsonschema
import yaml

import harness
from harness import DEFAULT_MODELS, MODES
from harness.errors import HarnessError
from harness.matrix import SPEC_PRESETS, block_of
from harness.suites import yamltext
from harness.suites.request import SAMPLING_SCHEMA, Request, Sampling
from harness.suites.rollback_options import CHECKPOINT_KINDS, STRATEGIES

SERVE_FIELDS = {
    "n_ctx": "integer",
    "n_batch": "integer",
    "n_ubatch": "integer",
    "parallel": "integer",
    "repack": "boolean",
    "context_shift": "boolean",
    "stall_s": "number",
}

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
                    **({"minimum": 1} if t == "integer" else {"exclusiveMinimum": 0} if t == "number" else {}),
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
        "run_order": {"type": "array", "items": {"enum": ["seq", "par", *RESTORE_ROUNDS]}, "minItems": 1},
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


@dataclass
class Case:
    """One named case: a completion prompt, or a chat whose turns are sent one after another."""

    name: str
    sampling: Sampling
    prompt: str | None = None
    turns: list[str] = field(default_factory=list)
    expect_accepts: bool = True
    """Whether `spec-ran` expects some drafts of this case accepted (a grammar the drafter does not see
    may reject them all: then speculation must run, but need not pay off)."""

    @property
    def is_chat(self) -> bool:
        return bool(self.turns)

    def request(self, deadline_s: float | None = None) -> Request:
        """The completion request (chats are built turn by turn by the runner)."""
        return Request(prompt=self.prompt, sampling=self.sampling, tag=self.name, deadline_s=deadline_s)


@dataclass
class Suite:
    """A validated suite file."""

    name: str
    path: Path | None
    cases: list[Case]
    matrix: list[dict]
    """The blocks of the run matrix (see harness.matrix.cells)."""
    checks: list[str]
    serve: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    """In-process engine options (`rollback`, `checkpoint_flags`, `checkpoint_attempts`) for its inproc cells;
    llama-server has no such options, so server cells ignore them."""
    rounds: list[str] = field(default_factory=lambda: ["par"])
    """How each round sends the cases to the one session of a cell: `seq` one request at a time,
    `par` all at once (in `seq` mode the one slot still serves them one after another)."""
    allow_errors: list[str] = field(default_factory=list)
    expect: dict[str, Any] = field(default_factory=dict)
    """What a cell must exercise (the `exercised` check): `completed_min` (share of requests with output)
    and `spec_stats_min` (speculative counter → minimum total over the cell)."""
    slow: bool = False
    """Its pytest items carry the `slow` marker (`-m "not slow"` leaves them out)."""
    tolerances: dict[str, float] = field(default_factory=dict)
    """`logits-close` tolerances (harness.result.logits.Tolerances fields) and the triage's `near_tie` margin."""
    deadline_s: float | None = None
    """Seconds each request may take before it ends as `timeout`; None: derived from n_predict and the
    measured speed (harness.backends.base.request_deadline)."""
    restore_after: int | None = None
    """`restore.after_turn`: the chat turn after which RESTORE_ROUNDS save the slot and restore it."""

    def cell_case(self, case: Case, model: str) -> Case:
        """`case` as the cells of `model` run it: with its matrix block's sampling overrides applied."""
        overrides = block_of(self.matrix, model).get("sampling")
        return replace(case, sampling=replace(case.sampling, **overrides)) if overrides else case

    @property
    def first_key(self) -> str:
        """The record name of the first case (where cell-level checks report)."""
        return case_keys(self.cases[0])[0]


def case_keys(case: Case) -> list[str]:
    """The record names of a case: its name, or `<name>.turnN` for each turn of a chat."""
    return [f"{case.name}.turn{i + 1}" for i in range(len(case.turns))] if case.is_chat else [case.name]


def suites_dir() -> Path:
    """`./suites` when run from a checkout; else the suites an installed wheel carries (`harness/bundled/suites`,
    see setup.py), or the `suites/` of the checkout an editable install points at."""
    here = Path.cwd() / "suites"
    if here.is_dir():
        return here
    package = Path(harness.__file__).resolve().parent
    bundled = package / "bundled" / "suites"
    return bundled if bundled.is_dir() else package.parent / "suites"


def find_suite(name_or_path: str, extra: Path | None = None) -> Suite:
    """A suite by path, or by name from `extra` (a user's suites directory, `--suites-dir`: its suites add to
    and replace those in use) and then from `suites_dir()`; an unknown name lists the suites of both."""
    if extra is not None and Path(name_or_path).suffix not in (".yaml", ".yml"):
        if (extra / f"{name_or_path}.yaml").is_file():
            return load_suite(name_or_path, extra)
        if not (suites_dir() / f"{name_or_path}.yaml").is_file():
            known = ", ".join(sorted({p.stem for d in (extra, suites_dir()) for p in suite_files(d)})) or "none"
            raise HarnessError(f"unknown suite '{name_or_path}' (known: {known})")
    return load_suite(name_or_path)


def user_suites_dir(path: Path | None) -> Path | None:
    """`--suites-dir`, checked: a directory of suite files (one-line HarnessError otherwise)."""
    if path is None:
        return None
    if not path.is_dir():
        raise HarnessError(f"--suites-dir {path}: not a directory (`specharness init DIR` writes a starter one)")
    if not suite_files(path):
        raise HarnessError(f"--suites-dir {path}: no suite files (*.yaml) in it")
    return path.resolve()


NOT_SUITES = ("known-failures.yaml",)
"""YAML files beside the suites that are not suites."""


def suite_files(directory: Path | None = None) -> list[Path]:
    """Every suite file, sorted by name."""
    return sorted(p for p in (directory or suites_dir()).glob("*.yaml") if p.name not in NOT_SUITES)


def load_suite(name_or_path: str, directory: Path | None = None) -> Suite:
    """A suite by name (`suites/<name>.yaml`) or by path; an unknown name lists the known ones."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = (directory or suites_dir()) / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(p.stem for p in suite_files(directory)) or "none"
        raise HarnessError(f"unknown suite '{name_or_path}' (known: {known})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise HarnessError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    return parse_suite(text, path)


def _line_of(node: yaml.Node, path: list) -> int:
    """The 1-based line of the YAML node at a JSON path (the deepest node that exists)."""
    for key in path:
        if isinstance(node, yaml.MappingNode):
            found = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            found = node.value[key]
        else:
            found = None
        if found is None:
            break
        node = found
    return node.start_mark.line + 1


def parse_suite(text: str, path: Path | None = None) -> Suite:
    """Parse and validate suite YAML; any problem is a one-line HarnessError naming file, line and field."""
    where = str(path) if path else "<suite>"
    try:
        root = yamltext.compose(text)
        data = yamltext.load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise HarnessError(f"{where}{line}: not valid YAML ({getattr(err, 'problem', err)})") from None
    if root is None or not isinstance(data, dict):
        raise HarnessError(f"{where}:1: a suite file must be a mapping with `suite` and `cases`")
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(SUITE_SCHEMA).iter_errors(data))
    if error is not None:
        path_, message = list(error.absolute_path), error.message
        known = list(error.schema.get("properties", {})) if isinstance(error.schema, dict) else []
        unknown = [k for k in error.instance if k not in known] if isinstance(error.instance, dict) else []
        if error.validator == "additionalProperties" and unknown:
            close = difflib.get_close_matches(str(unknown[0]), known, n=1)
            path_.append(unknown[0])
            message = f"unknown field '{unknown[0]}'" + (f" (did you mean '{close[0]}'?)" if close else "")
        elif error.validator == "anyOf" and "description" in error.schema:
            message = f"{error.instance!r} is not {error.schema['description']}"
        field_path = ".".join(str(p) for p in path_) or "(top level)"
        raise HarnessError(f"{where}:{_line_of(root, path_)}: {field_path}: {message}")
    if path is not None and data["suite"] != path.stem:
        raise HarnessError(
            f"{where}:{_line_of(root, ['suite'])}: suite: '{data['suite']}' must match the file name '{path.stem}'"
        )
    named = [(["checks", i], v, CHECK_NAMES) for i, v in enumerate(data.get("checks", []))]
    raw_blocks = data.get("matrix", {})
    blocks = raw_blocks if isinstance(raw_blocks, list) else [raw_blocks]
    where_block = (lambda b: ["matrix", b]) if isinstance(raw_blocks, list) else (lambda b: ["matrix"])
    named += [
        ([*where_block(b), "specs", i], v, SPEC_PRESETS)
        for b, block in enumerate(blocks)
        for i, v in enumerate(block.get("specs", []))
    ]
    for field_path, value, known in named:
        if any(part not in known for part in value.split("+")):
            raise HarnessError(
                f"{where}:{_line_of(root, field_path)}: {'.'.join(map(str, field_path))}: "
                f"unknown name '{value}' (known: {', '.join(known)})"
            )
    _check_restore(data, root, where, blocks, where_block)
    names = [c["name"] for c in data["cases"]]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise HarnessError(f"{where}:{_line_of(root, ['cases'])}: cases: duplicate case name '{dupes[0]}'")
    for i, raw in enumerate(data["cases"]):
        if isinstance((raw.get("chat") or [""])[0], dict):
            raise HarnessError(
                f"{where}:{_line_of(root, ['cases', i, 'chat', 0])}: cases.{i}.chat.0: a chat's first turn has no "
                "reply to regenerate"
            )
    base = data.get("sampling", {})
    cases = []
    for i, raw in enumerate(data["cases"]):
        try:
            cases.append(_case(raw, base, path, data.get("expect_accepts", True)))
        except (KeyError, IndexError, ValueError) as err:
            raise HarnessError(
                f"{where}:{_line_of(root, ['cases', i, 'prompt'])}: cases.{i}.prompt: cannot fill "
                f"in vars ({type(err).__name__}: {err}; write literal braces as {{{{ and }}}})"
            ) from None
    return Suite(
        name=data["suite"],
        path=path,
        cases=cases,
        matrix=[{**DEFAULT_MATRIX, **block} for block in blocks],
        checks=data.get("checks", DEFAULT_CHECKS),
        serve=data.get("serve", {}),
        engine=data.get("engine", {}),
        rounds=data.get("run_order", ["par"]) * data.get("repeats", 1),
        allow_errors=data.get("allow_errors", []),
        expect=data.get("expect", {}),
        tolerances=data.get("tolerances", {}),
        slow=data.get("slow", False),
        deadline_s=data.get("deadline_s"),
        restore_after=data.get("restore", {}).get("after_turn"),
    )


def _check_restore(data: dict, root: yaml.Node, where: str, blocks: list[dict], where_block) -> None:
    """Restore rounds need `restore.after_turn`, chats that go on after it, and `seq` cells (one slot, whose
    state is the chat's own when it is saved); `restore` without restore rounds is a mistake too."""
    kinds = [k for k in data.get("run_order", []) if k in RESTORE_ROUNDS]
    if not kinds:
        if "restore" in data:
            raise HarnessError(
                f"{where}:{_line_of(root, ['restore'])}: restore: no run_order round restores a slot "
                f"(add {' or '.join(RESTORE_ROUNDS)})"
            )
        return
    if "restore" not in data:
        raise HarnessError(
            f"{where}:{_line_of(root, ['run_order'])}: run_order: '{kinds[0]}' needs `restore: {{after_turn: N}}`"
        )
    after = data["restore"]["after_turn"]
    for i, case in enumerate(data["cases"]):
        if len(case.get("chat", [])) <= after:
            raise HarnessError(
                f"{where}:{_line_of(root, ['cases', i])}: cases.{i}: restore rounds need a chat of more than "
                f"{after} turns (restore.after_turn)"
            )
    for b, block in enumerate(blocks):
        modes = block.get("modes", DEFAULT_MATRIX["modes"])
        if list(modes) != ["seq"]:
            raise HarnessError(
                f"{where}:{_line_of(root, [*where_block(b), 'modes'])}: {'.'.join(map(str, where_block(b)))}.modes: "
                "restore rounds need `modes: [seq]` (one slot, holding the chat's own state when it is saved)"
            )


def _case(raw: dict[str, Any], base: dict, path: Path | None, expect_accepts: bool) -> Case:
    sampling = Sampling(**{**base, **raw.get("sampling", {})})
    sampling.json_schema = raw.get("json_schema")
    if "grammar" in raw:
        grammar_path = (path.parent if path else Path.cwd()) / raw["grammar"]
        if not grammar_path.is_file():
            raise HarnessError(f"{path}: case {raw['name']}: grammar file not found: {grammar_path}")
        sampling.grammar = grammar_path.read_text()
    prompt = raw.get("prompt")
    if prompt is not None and raw.get("vars"):
        prompt = prompt.format(**raw["vars"])
    if prompt is not None:
        prompt *= raw.get("prompt_repeat", 1)  # a long context from a short line
    turns = [REGENERATE if isinstance(turn, dict) else turn for turn in raw.get("chat", [])]
    return Case(
        name=raw["name"],
        sampling=sampling,
        prompt=prompt,
        turns=turns,
        expect_accepts=raw.get("expect_accepts", expect_accepts),
    )
