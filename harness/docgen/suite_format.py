"""The suite format (`suite-format.md`), from the JSON schema the suite loader validates with
(`harness.suites.SUITE_SCHEMA`, `harness.suites.request.Sampling`)."""

import ast
import inspect
import json
import textwrap
from dataclasses import MISSING, fields

from harness.docgen.common import _code, _doc, _header, _paragraphs, _table, _text


def _type(schema: dict) -> str:
    if "enum" in schema:
        return " \\| ".join(_code(json.dumps(v)) for v in schema["enum"])
    if "const" in schema:
        return _code(json.dumps(schema["const"]))
    for key in ("oneOf", "anyOf"):
        if key in schema and "type" not in schema:
            return " or ".join(_type(s) for s in schema[key])
    kind = schema.get("type", "")
    kind = " or ".join(kind) if isinstance(kind, list) else kind
    if kind == "array" and isinstance(schema.get("items"), dict) and "prefixItems" not in schema["items"]:
        inner = _type(schema["items"])
        if inner and "properties" not in schema["items"]:
            return f"list of {inner}"
    if kind == "array" and isinstance(schema.get("items"), dict) and "prefixItems" in schema["items"]:
        return "list of pairs"
    return kind or "see below"


def _limits(schema: dict) -> str:
    notes = []
    for key, word in (
        ("minimum", "≥"),
        ("exclusiveMinimum", ">"),
        ("maximum", "≤"),
        ("exclusiveMaximum", "<"),
        ("minItems", "items ≥"),
        ("maxItems", "items ≤"),
        ("minLength", "length ≥"),
    ):
        if key in schema:
            notes.append(f"{word} {schema[key]}")
    if "pattern" in schema:
        notes.append("matches " + _code(schema["pattern"]))
    if "description" in schema:
        notes.append(_text(schema["description"]))
    if isinstance(schema.get("items"), dict):
        inner = _limits(schema["items"])
        if inner and "properties" not in schema["items"]:
            notes.append(f"each: {inner}")
    return "; ".join(notes)


def _schema_rows(schema: dict, prefix: str, required: set[str], rows: list, nested: list) -> None:
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        if "oneOf" in sub and any("properties" in s for s in sub["oneOf"]):
            rows.append(
                [_code(key), "a block or a list of blocks (below)", "yes" if name in required else "", _limits(sub)]
            )
            nested.append((key, next(s for s in sub["oneOf"] if "properties" in s)))
            continue
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            rows.append([_code(key), "list of mappings (below)", "yes" if name in required else "", _limits(sub)])
            nested.append((f"{key}[]", sub["items"]))
            continue
        if sub.get("type") == "object" and "properties" in sub and name != "sampling":
            rows.append([_code(key), "mapping (below)", "yes" if name in required else "", _limits(sub)])
            nested.append((key, sub))
            continue
        kind = "mapping of the sampling fields (below)" if name == "sampling" else _type(sub)
        if (
            sub.get("type") == "object"
            and "additionalProperties" in sub
            and isinstance(sub["additionalProperties"], dict)
        ):
            kind = f"mapping of name → {_type(sub['additionalProperties'])}"
        rows.append([_code(key), kind, "yes" if name in required else "", _limits(sub)])


def _schema_section(title: str, schema: dict, out: list[str]) -> None:
    rows: list = []
    nested: list = []
    _schema_rows(schema, "", set(schema.get("required", [])), rows, nested)
    out.append(f"## `{title}`\n" if title else "## Top level\n")
    extra = []
    if schema.get("additionalProperties") is False:
        extra.append("No other keys are allowed (a misspelt key is an error naming the closest one).")
    for combo in ("oneOf", "anyOf"):
        if combo in schema and all("required" in s for s in schema[combo]):
            names = [" and ".join(_code(k) for k in s["required"]) for s in schema[combo]]
            extra.append("Exactly one of " + ", ".join(names) + ".")
    for key, needs in schema.get("dependentRequired", {}).items():
        extra.append(f"{_code(key)} needs " + ", ".join(_code(n) for n in needs) + ".")
    if extra:
        out.append(" ".join(extra) + "\n")
    out.append(_table(["key", "type", "required", "constraints"], rows))
    for key, sub in nested:
        _schema_section(f"{title}.{key}" if title else key, sub, out)


def _field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings and trailing `#` comments of a dataclass's fields, read from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    tree = ast.parse(source).body[0]
    docs: dict[str, str] = {}
    body = tree.body if isinstance(tree, ast.ClassDef) else []
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        after = body[i + 1] if i + 1 < len(body) else None
        if isinstance(after, ast.Expr) and isinstance(getattr(after, "value", None), ast.Constant):
            if isinstance(after.value.value, str):
                docs[name] = " ".join(after.value.value.split())
                continue
        end = lines[node.end_lineno - 1]
        if "#" in end:
            docs[name] = end.split("#", 1)[1].strip()
    return docs


def suite_format_page() -> str:
    from harness.suites import CHECK_NAMES, DEFAULT_CHECKS, DEFAULT_MATRIX, SUITE_SCHEMA
    from harness.suites.request import SAMPLING_SCHEMA, Sampling

    out = [_header("Suite format", "the JSON schema suite files are validated with (`harness.suites.SUITE_SCHEMA`)")]
    out.append(
        "A suite is a YAML file in `suites/` (or in the directory `--suites-dir` names). It is validated on load "
        "against this schema; a mistake is one line naming the file, the line and the field. The guide to what the "
        "keys mean is [Your own model and suites](../guide/own-model-and-suites.md).\n"
    )
    _schema_section("", SUITE_SCHEMA, out)
    out.append("## Defaults\n")
    out.append(
        _table(
            ["axis", "default when a matrix block leaves it out"],
            [[_code(axis), ", ".join(_code(v) for v in values)] for axis, values in DEFAULT_MATRIX.items()],
        )
    )
    out.append("Checks a suite may name: " + ", ".join(_code(c) for c in CHECK_NAMES) + ".\n")
    out.append("Checks of a suite that names none: " + ", ".join(_code(c) for c in DEFAULT_CHECKS) + ".\n")
    out.append("## `sampling`\n")
    out.append(
        _paragraphs(_doc(Sampling))
        + " Suite-wide under `sampling:`, per matrix block, and per case (a case's own fields merged over the "
        "suite's). Every field takes llama-server's name and, but for `temperature` and `n_predict`, its default.\n"
    )
    docs = _field_docs(Sampling)
    rows = []
    for f in fields(Sampling):
        if f.name not in SAMPLING_SCHEMA["properties"]:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        schema = SAMPLING_SCHEMA["properties"][f.name]
        rows.append(
            [_code(f.name), _type(schema), _code(json.dumps(default)), _text(docs.get(f.name, "")), _limits(schema)]
        )
    out.append(_table(["field", "type", "default", "what", "constraints"], rows))
    out.append(
        "A case's `grammar` (a GBNF file beside the suite) and `json_schema` are keys of the case itself, not of "
        "`sampling`.\n"
    )
    return "\n".join(out)
