"""The noise floor: how far logically equivalent runs move the logits, per (model, backend, device).

`specharness calibrate` measures it (harness/calibrate.py) and writes
`fixtures/calibration/<model>--<backend>--<device>.json`; `logits-close` and the first-divergence triage
read it here. A model without a calibration file falls back to `DEFAULT` and every verdict that used it
says `uncalibrated`.
"""

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from harness.errors import HarnessError
from harness.logits import Tolerances
from harness.suites import suites_dir

NEAR_TIE = 0.05
"""Uncalibrated near-tie floor, nats: flash attention on vs off flipped a margin of 0.0008 on tiny-dense."""


@dataclass(frozen=True)
class NoiseFloor:
    """Tolerances for comparing logits and the near-tie floor for triage, with where they came from."""

    tolerances: Tolerances = field(default_factory=Tolerances)
    near_tie: float = NEAR_TIE
    """The largest top1−top2 margin (nats) that numerical noise is measured to flip: a divergence at a
    smaller margin can be a near-tie, at a larger one it cannot."""
    source: str = "default (uncalibrated)"

    @property
    def calibrated(self) -> bool:
        return not self.source.startswith("default")

    def describe(self) -> str:
        return f"near-tie floor {self.near_tie:.3g} nats, {self.source}"


DEFAULT = NoiseFloor()


def calibration_root() -> Path:
    """`fixtures/calibration` beside the `suites/` directory in use."""
    return suites_dir().parent / "fixtures" / "calibration"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def calibration_path(model: str, backend: str, device: str, root: Optional[Path] = None) -> Path:
    return (root or calibration_root()) / f"{_safe(model)}--{backend}--{device}.json"


def from_data(data: dict, source: str) -> NoiseFloor:
    """A NoiseFloor from a calibration file's content (HarnessError naming `source` when malformed)."""
    try:
        raw = data["tolerances"]
        names = {f.name for f in fields(Tolerances)}
        tol = Tolerances(**{k: float(v) for k, v in raw.items() if k in names})
        return NoiseFloor(tol, float(raw["near_tie"]), source)
    except (KeyError, TypeError, ValueError) as err:
        raise HarnessError(f"corrupt calibration file {source}: {err!r}; re-run `specharness calibrate`") from None


def load(model: str, backend: str, device: str, root: Optional[Path] = None) -> NoiseFloor:
    """The calibrated floor of (model, backend, device), or DEFAULT when none was calibrated."""
    path = calibration_path(model, backend, device, root)
    if not path.is_file():
        return DEFAULT
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HarnessError(f"corrupt calibration file {path}: {err}; re-run `specharness calibrate`") from None
    return from_data(data, f"calibrated ({path.parent.name}/{path.name})")
