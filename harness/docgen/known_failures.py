"""The known llama.cpp defects (`known-failures.md`), from `suites/known-failures.yaml`."""

import json
import re

from harness.docgen.common import ROOT, _code, _header, _table, _text
from harness.suites import yamltext

_KF_ORDER = (
    "suites",
    "suite",
    "backend",
    "modes",
    "specs",
    "models",
    "cpu_flags",
    "without_cpu_flags",
    "check",
    "evidence",
    "limits",
    "versions",
    "fixed_in",
    "found",
    "upstream",
)


def known_failures_page() -> str:
    path = ROOT / "suites" / "known-failures.yaml"
    statistical = ROOT / "suites" / "statistical" / "known-failures.yaml"
    entries = (yamltext.load(path.read_text()) or []) + (yamltext.load(statistical.read_text()) or [])
    out = [
        _header(
            "Known llama.cpp defects",
            "`suites/known-failures.yaml` and, for the statistical suites, `suites/statistical/known-failures.yaml`",
        )
    ]
    comment = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
    if comment:
        out.append(_text(" ".join(comment)).replace("\\|", "|") + "\n")
    out.append(
        _table(
            ["id", "suites", "backend", "cells", "checks"],
            [
                [
                    f"[`{e['id']}`](#{e['id']})",
                    ", ".join(_code(s) for s in _list(e.get("suites", e.get("suite", [])))),
                    _code(e.get("backend", "")),
                    _text(_cells(e)),
                    ", ".join(_code(c) for c in _list(e.get("check", []))),
                ]
                for e in entries
            ],
        )
    )
    for e in entries:
        out.append(f"## `{e['id']}`\n")
        keys = [k for k in _KF_ORDER if k in e] + sorted(
            k for k in e if k not in _KF_ORDER and k not in ("id", "reason")
        )
        facts = [[_code(k), _value(k, e[k])] for k in keys]
        out.append(_table(["field", "value"], facts))
        if e.get("reason"):
            out.append(_text(e["reason"]).replace("\\|", "|") + "\n")
    return "\n".join(out)


def _value(key: str, value: object) -> str:
    if key == "upstream":
        return _link(str(value))
    if key in ("found", "reason"):
        return _text(value)
    if isinstance(value, list):
        return "<br>".join(_code(v) for v in value)
    if isinstance(value, dict):
        return "<br>".join(f"{_code(k)}: {_code(json.dumps(v))}" for k, v in value.items())
    return _code(value)


def _list(value: object) -> list:
    return value if isinstance(value, list) else [value]


def _cells(entry: dict) -> str:
    parts = [
        f"{axis} {', '.join(entry[axis])}" if entry.get(axis) else f"every {axis[:-1]}"
        for axis in ("modes", "specs", "models")
    ]
    return "; ".join(parts)


def _link(text: str) -> str:
    return re.sub(r"(https?://\S+?)([.,;)]?(\s|$))", r"<\1>\2", _text(text).replace("&lt;", "<").replace("&gt;", ">"))
