"""Small helpers shared by the engine tests."""

from harness.request import Request, Sampling

QUICKSORT_PROMPT = "Write a quicksort demo in {lang}. Please, write just code. Do not write any extra comments."
LANGS = ("C", "Java", "Python", "Rust")


def quicksort(lang: str, n_predict: int = 64, **sampling) -> Request:
    """The field reports' quicksort prompt for one language."""
    return Request(prompt=QUICKSORT_PROMPT.format(lang=lang), sampling=Sampling(n_predict=n_predict, **sampling))


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
