"""The llama-server-only `serve` settings (issue 63, item 3): `ctx_checkpoints`, `checkpoint_min_step` and
`cache_ram` become `--ctx-checkpoints`, `--checkpoint-min-step` and `--cache-ram` on llama-server's command line,
a suite may set 0 (off) and -1 (`cache_ram`: no limit), and a cell of the in-process engine that sets one is not
served (`not run`, naming the flags), not served without them."""

from __future__ import annotations

import pytest

from harness.backends.base import ServeConfig
from harness.backends.build import ensure_server
from harness.backends.inproc import InprocBackend
from harness.backends.server import LlamaServer
from harness.errors import HarnessError, Unservable
from harness.models import resolve
from harness.suites import parse_suite

SERVE = {"ctx_checkpoints": 1, "checkpoint_min_step": 0, "cache_ram": 16}


def _suite(serve: str) -> str:
    return (
        "suite: s\nmatrix: {backends: [server], models: [tiny-hybrid]}\n"
        f"serve: {serve}\ncases:\n  - {{name: a, prompt: hi}}\n"
    )


def test_the_server_only_settings_are_llama_server_flags(tiny_models):
    config = ServeConfig(model=resolve("tiny-hybrid").path, **SERVE)
    argv = LlamaServer.from_config(config, ensure_server().server_bin, port=1).command()
    pairs = {argv[i]: argv[i + 1] for i in range(len(argv) - 1)}
    assert pairs["--ctx-checkpoints"] == "1" and pairs["--checkpoint-min-step"] == "0" and pairs["--cache-ram"] == "16"
    plain = LlamaServer.from_config(ServeConfig(model=config.model), ensure_server().server_bin, port=1).command()
    assert not {"--ctx-checkpoints", "--checkpoint-min-step", "--cache-ram"} & set(plain)  # llama-server's defaults


def test_a_suite_may_switch_them_off_or_unlimit_the_cache_but_not_below(tmp_path):
    ok = parse_suite(_suite("{ctx_checkpoints: 0, checkpoint_min_step: 0, cache_ram: -1}"), tmp_path / "s.yaml")
    assert ok.serve == {"ctx_checkpoints": 0, "checkpoint_min_step": 0, "cache_ram": -1}
    with pytest.raises(HarnessError, match="cache_ram"):
        parse_suite(_suite("{cache_ram: -2}"), tmp_path / "s.yaml")


def test_the_in_process_engine_does_not_serve_a_cell_that_sets_one():
    config = ServeConfig(model=resolve("tiny-hybrid").path, mode="par", parallel=2, **SERVE)
    with pytest.raises(Unservable, match="--ctx-checkpoints 1, --checkpoint-min-step 0, --cache-ram 16"):
        InprocBackend().open(config)
