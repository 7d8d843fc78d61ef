"""Where calibration files go: the committed ones (`fixtures/calibration/<model>--<backend>--<device>.json`, or a
`--calibration-dir`), and the user cache of per-device calibrations (`cache_dir()/calibration/`, keyed by
`harness.verdict.noise.device_key` and the build), always written atomically. Reading them is
`harness.verdict.noise.load` (the checks read them there)."""

import json
from pathlib import Path

from harness.models import model_key
from harness.paths import write_atomic
from harness.verdict.noise import cache_path, calibration_path


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1) + "\n"))
    return path


def write(data: dict, root: Path | None = None) -> Path:
    """Write a calibration file atomically under `root` (default: fixtures/calibration); returns its path."""
    return _write(calibration_path(model_key(data["model"]), data["backend"], data["device"], root), data)


def write_cache(data: dict, env: dict | None = None) -> Path:
    """Write a calibration measured by a run into the user cache (atomically; never a committed file): keyed by
    the model, the backend, and the device and build of `env` (the run's backend `environment()`; default the one
    it was measured on, `data["environment"]`)."""
    return _write(cache_path(model_key(data["model"]), data["backend"], env or data["environment"]), data)
