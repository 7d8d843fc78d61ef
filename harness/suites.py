"""Prompt suites: named sets of cases. Built in for now; YAML suite files come with the suite system."""

from dataclasses import dataclass

from harness.errors import HarnessError
from harness.request import Request, Sampling


@dataclass
class Case:
    """One named request of a suite."""

    name: str
    request: Request


@dataclass
class Suite:
    """A named list of cases, each sent `repeats` times."""

    name: str
    cases: list[Case]
    repeats: int = 1
    description: str = ""


QUICKSORT_PROMPT = "Write a quicksort demo in {lang}. Please, write just code. Do not write any extra comments."


def _quicksort() -> Suite:
    return Suite(
        name="quicksort",
        description="the quicksort prompt of the field reports, greedy, 128 tokens, for C, Java and Python",
        cases=[
            Case(lang, Request(prompt=QUICKSORT_PROMPT.format(lang=lang), sampling=Sampling(n_predict=128)))
            for lang in ("C", "Java", "Python")
        ],
    )


BUILTIN_SUITES = {"quicksort": _quicksort}
DEFAULT_SUITE = "quicksort"


def load_suite(name: str) -> Suite:
    """A suite by name; an unknown name is a one-line error listing the known ones."""
    if name not in BUILTIN_SUITES:
        raise HarnessError(f"unknown suite '{name}' (known: {', '.join(sorted(BUILTIN_SUITES))})")
    return BUILTIN_SUITES[name]()
