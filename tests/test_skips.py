"""Tests skip only because a model is unavailable (ModelUnavailable), never on any other harness error, and never
drop a model's cells with a print: a model that fails to build or a bad file fails the test."""

import ast
from pathlib import Path

import pytest
import skips

from harness.errors import HarnessError
from harness.models import ModelUnavailable

TESTS = Path(__file__).resolve().parent


def test_require_model_skips_on_an_unavailable_model_only(monkeypatch):
    def unavailable(name):
        raise ModelUnavailable(f"model '{name}' needs the PyPI package x: pip install 'specharness[real]'")

    monkeypatch.setattr(skips, "resolve", unavailable)
    with pytest.raises(pytest.skip.Exception, match="gemma3-270m unavailable: model 'gemma3-270m' needs"):
        skips.require_model("gemma3-270m")

    def broken(name):
        raise HarnessError(f"llama-quantize failed making {name}: out of memory")

    monkeypatch.setattr(skips, "resolve", broken)
    with pytest.raises(HarnessError, match="llama-quantize failed"):
        skips.require_model("gemma3-270m-draft")


def _names(node) -> set[str]:
    if node is None:
        return set()
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node) if isinstance(n, ast.Name | ast.Attribute)
    }


def _calls(body: list, name: str) -> bool:
    return any(isinstance(n, ast.Call) and name in _names(n.func) for stmt in body for n in ast.walk(stmt))


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_skips_on_any_harness_error_of_a_model_or_drops_a_model_with_a_print(path):
    tree = ast.parse(path.read_text())
    for block in (n for n in ast.walk(tree) if isinstance(n, ast.Try)):
        resolves = _calls(block.body, "resolve")  # a model looked up in the registry
        for handler in block.handlers:
            caught = _names(handler.type)
            where = f"{path.name}:{handler.lineno}"
            assert not (resolves and "HarnessError" in caught and _calls(handler.body, "skip")), (
                f"{where} skips on any HarnessError: catch ModelUnavailable (tests/skips.py require_model)"
            )
            assert not ("ModelUnavailable" in caught and _calls(handler.body, "print")), (
                f"{where} drops a model with a print: skip with the reason (tests/skips.py require_model)"
            )
