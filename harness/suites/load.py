"""Finding, loading and validating suites: YAML files in `suites/` (or a directory of your own), validated on load
against `SUITE_SCHEMA` (errors name file, line and field)."""

import difflib
from pathlib import Path
from typing import Any

import jsonschema
import yaml

import harness
from harness.errors import HarnessError
from harness.matrix import SPEC_PRESETS
from harness.suites import yamltext
from harness.suites.request import Sampling
from harness.suites.schema import (
    CHECK_NAMES,
    DEFAULT_CHECKS,
    DEFAULT_MATRIX,
    REGENERATE,
    RESTORE_ROUNDS,
    SHARED_SEED_CHECKS,
    SUITE_SCHEMA,
)
from harness.suites.suite import Case, Suite


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
    shared = [c for c in data.get("checks", DEFAULT_CHECKS) if c in SHARED_SEED_CHECKS]
    if data.get("seeds") == "per-cell" and shared:
        raise HarnessError(
            f"{where}:{_line_of(root, ['seeds'])}: seeds: per-cell gives every cell its own draw, and `{shared[0]}` "
            "compares a cell's output with another cell's draw of the same seed (drop the check or the per-cell seeds)"
        )
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
        seeds=data.get("seeds", "shared"),
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
