"""Prompt suites: YAML files in `suites/`, validated on load (errors name file, line and field).

A suite declares its cases (completion prompts, multi-turn chats, grammar or JSON schema, sampling parameters,
repeats), its default matrix (backends × modes × speculative configs × models) and the checks that apply.

- `schema`: the format (`SUITE_SCHEMA`; docs/guide/own-model-and-suites.md is the guide), round kinds, defaults;
- `suite`: a loaded `Suite` and its `Case`s; `load`: finding, reading and validating suite files;
- `request`: a request and its sampling; `yamltext`, `jsonschemas`, `rollback_options`: what the format reads.
"""

from harness.suites.load import find_suite, load_suite, parse_suite, suite_files, suites_dir, user_suites_dir
from harness.suites.schema import (
    CHECK_NAMES,
    DEFAULT_CHECKS,
    DEFAULT_MATRIX,
    FRESH,
    REGENERATE,
    RESTORE_ROUNDS,
    SUITE_SCHEMA,
)
from harness.suites.suite import Case, Suite, case_keys

__all__ = [
    "CHECK_NAMES",
    "DEFAULT_CHECKS",
    "DEFAULT_MATRIX",
    "FRESH",
    "REGENERATE",
    "RESTORE_ROUNDS",
    "SUITE_SCHEMA",
    "Case",
    "Suite",
    "case_keys",
    "find_suite",
    "load_suite",
    "parse_suite",
    "suite_files",
    "suites_dir",
    "user_suites_dir",
]
