"""Calibration per device without committing files: the lookup (a `--calibration-dir`, the committed files, then
the user cache, keyed by device and build: a CUDA build never reads a CPU calibration), and a `run` on a model with
no calibration that measures it once, caches it and says so in its header; the next run uses the cache."""

import json
import shutil

import pytest

from harness.calibration import write_cache
from harness.cli import main
from harness.models import model_key, resolve
from harness.verdict import noise

CPU = {"device": "cpu", "llama_cpp_commit": "0c1e570", "source_identity": "0c1e570", "compiler": "GNU 12"}


def test_lookup_takes_the_committed_file_then_the_user_cache_of_this_device_and_build(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    committed = noise.find("tiny-dense", "server", CPU)
    assert committed == noise.calibration_path("tiny-dense", "server", "cpu") and noise.where(committed) == "committed"
    cuda = {**CPU, "device": "cuda", "gpu_layers": "all"}
    assert noise.find("tiny-dense", "server", cuda) is None  # never the CPU file
    assert noise.device_key(cuda).startswith("cuda-") and noise.device_key(CPU).startswith("cpu-")

    data = json.loads(committed.read_text())
    data["model"] = "my-model"  # a model no committed file covers
    written = write_cache(data, cuda)
    assert written.parent == noise.cache_root() == tmp_path / "cache" / "calibration"
    assert written.name == f"my-model--server--{noise.device_key(cuda)}--{noise.build_digest(cuda)}.json"
    assert noise.find("my-model", "server", cuda) == written and noise.where(written) == "cached"
    assert noise.find("my-model", "server", {**cuda, "llama_cpp_commit": "b11434"}) is None  # another build
    assert noise.find("my-model", "server", CPU) is None  # another device
    assert noise.find("my-model", "server", "cuda") is None  # a device class alone reads committed files only
    floor = noise.load("my-model", "server", cuda)
    assert floor.calibrated and "user cache" in floor.source
    assert committed.read_text() == json.dumps(json.loads(committed.read_text()), indent=1) + "\n"  # untouched


@pytest.mark.workflows  # a new model's first calibration, end to end (79 s of the default pytest's 2 cores)
def test_run_calibrates_an_uncalibrated_model_once_then_uses_the_cache(tmp_path, monkeypatch, capsys, tiny_models):
    model = tmp_path / "my-dense.gguf"  # a model file no committed calibration covers (known by its content)
    shutil.copyfile(resolve("tiny-dense").path, model)
    monkeypatch.setenv("SPECHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECHARNESS_AUTO_CALIBRATE", "1")  # the test session turns it off (conftest.py)
    argv = ["run", "--suite", "quicksort", "--backend", "inproc", "--mode", "seq", "--spec", "none,ngram-mod"]
    argv += ["--model", str(model)]

    assert main([*argv, "--out", str(tmp_path / "r1")]) == 0
    err = capsys.readouterr().err
    cached = list((tmp_path / "cache" / "calibration").glob(f"{model_key(str(model))}--inproc--cpu-*.json"))
    assert len(cached) == 1, cached
    assert f"calibrated {model} on inproc/cpu-" in err and "now (" in err and f"cached in {cached[0]}" in err
    assert "uncalibrated: " not in err
    meta = json.loads((tmp_path / "r1" / "run.json").read_text())
    device, calibrated = meta["calibration"]  # the header: the backend's device, then the calibration measured
    assert device.startswith("device: in-process engine (llama-cpp-python ") and "on cpu (no GPU offload)" in device
    assert calibrated.startswith("calibrated ")
    seeded = json.loads(cached[0].read_text())["seeded"]  # the seeded noise, measured in the same pass
    assert set(seeded["by_mode"]) == {"seq", "par", "no-kv-unified"}, seeded
    assert all(n == 2 * 10 and 0 <= k <= n for k, n in seeded["by_mode"].values()), seeded
    floors = [c["evidence"].get("noise_floor", "") for c in json.loads((tmp_path / "r1" / "checks.json").read_text())]
    assert any("user cache" in f for f in floors), floors

    written = cached[0].stat().st_mtime_ns
    assert main([*argv, "--out", str(tmp_path / "r2")]) == 0
    err = capsys.readouterr().err
    assert f"calibration: cached: {model} on inproc/cpu-" in err and "calibrated " not in err
    assert cached[0].stat().st_mtime_ns == written  # measured once

    other = tmp_path / "other.gguf"  # with the measuring turned off: the default floor, said as before
    shutil.copyfile(resolve("tiny-hybrid").path, other)
    args = [*argv[:-1], str(other), "--spec", "none", "--no-auto-calibrate", "--out", str(tmp_path / "r3")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "calibrating " not in err and "calibrated " not in err and "uncalibrated: " in err
