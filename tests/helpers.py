"""Small helpers shared by the engine tests."""

import os
import threading
import time

import requests

from harness.suites.request import Request, Sampling

QUICKSORT_PROMPT = "Write a quicksort demo in {lang}. Please, write just code. Do not write any extra comments."
LANGS = ("C", "Java", "Python", "Rust")


def quicksort(lang: str, n_predict: int = 64, **sampling) -> Request:
    """The field reports' quicksort prompt for one language."""
    return Request(prompt=QUICKSORT_PROMPT.format(lang=lang), sampling=Sampling(n_predict=n_predict, **sampling))


def numerics_stand_in(top_k: int):
    """The serve config of suites/numerics.yaml's CPU stand-in for GPU numerics: tiny-dense-wide at Q4_K drafted by
    its f32 copy, four drafts a step, `seq` (a verification row's logits differ from the same position alone)."""
    from harness.backends.base import ServeConfig
    from harness.models import resolve

    return ServeConfig(
        model=resolve("tiny-dense-wide-q4_k").path,
        mode="seq",
        flash_attn="off",
        draft_model=resolve("tiny-dense-wide").path,
        spec={"spec-type": "draft-simple", "spec-draft-n-max": 4},
        logit_top_k=top_k,
    )


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def kill_when_busy(server, sig: int, done: threading.Event, wait_s: float = 60.0) -> None:
    """Send `sig` to a LlamaServer's process as soon as one of its slots is processing (a state, not a sleep);
    gives up after `wait_s` seconds or once `done` is set."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not done.is_set():
        try:
            if any(slot["is_processing"] for slot in requests.get(f"{server.url}/slots", timeout=5).json()):
                os.kill(server.process.pid, sig)
                return
        except requests.RequestException:
            pass
        time.sleep(0.005)
