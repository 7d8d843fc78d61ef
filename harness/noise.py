"""The noise floor: how far logically equivalent runs move the logits, per (model, backend, device).

`specharness calibrate` measures it (harness/calibrate.py) and writes
`fixtures/calibration/<model>--<backend>--<device>.json`; `logits-close` and the first-divergence triage
read it here (from `--calibration-dir` first when given). A model is known by harness.models.model_key (a
registry name, or a model file's content). A model without a calibration file falls back to `DEFAULT`, and
every verdict that used it says `uncalibrated`, with the default tolerances and the command that measures them.
"""

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from harness.errors import HarnessError
from harness.logits import Tolerances

NEAR_TIE = 0.05
"""Uncalibrated near-tie floor, nats: flash attention on vs off flipped a margin of 0.0008 on tiny-dense."""
ACCEPTANCE = 0.05
"""Uncalibrated acceptance tolerance: the drop (absolute, of a request's accepted / drafted and accepted /
generated) that `acceptance` lets pass; the largest calibrated spread on this project's models is far below."""


@dataclass(frozen=True)
class NoiseFloor:
    """Tolerances for comparing logits and the near-tie floor for triage, with where they came from."""

    tolerances: Tolerances = field(default_factory=Tolerances)
    near_tie: float = NEAR_TIE
    """The largest top1−top2 margin (nats) that numerical noise is measured to flip: a divergence at a
    smaller margin can be a near-tie, at a larger one it cannot."""
    source: str = "default (uncalibrated)"
    acceptance: dict = field(default_factory=dict)
    """Spec config → {"fixed": …, "concurrent": …, "modes": …}: the calibrated drop of a request's acceptance
    that passes against a run of the same cell in a fixed request order, with the requests sent all at once,
    and against seq (see harness.calibrate.acceptance_spread)."""
    seq_bit_exact: bool = True
    """Whether calibration measured every `seq` speculative run bit-identical to no speculation (max |Δ| 0 at
    every position: the tiny models). Where it measured differences (the verification batch takes other kernels
    than a one-token decode: Gemma's repacked Q4_K weights on x86), a proven near-tie in `seq` is numerics too.
    Uncalibrated: assumed exact, so every `seq` divergence fails."""

    @property
    def calibrated(self) -> bool:
        return not self.source.startswith("default")

    def acceptance_tolerance(self, spec: str, against: str = "fixed") -> tuple[float, str]:
        """The acceptance tolerance of a spec config against a run of the same cell (`fixed` request order,
        or `concurrent`: requests sent all at once) or against seq (`modes`), and where it came from."""
        if spec in self.acceptance:
            return self.acceptance[spec][against], self.source
        return ACCEPTANCE, f"default (uncalibrated for {spec})"

    def describe(self) -> str:
        return f"near-tie floor {self.near_tie:.3g} nats, {self.source}"


DEFAULT = NoiseFloor()


def calibration_root() -> Path:
    """`fixtures/calibration` beside the `suites/` directory in use."""
    from harness.suites import suites_dir  # here: the suites' module reaches the engine, reports must not

    return suites_dir().parent / "fixtures" / "calibration"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def calibration_path(model: str, backend: str, device: str, root: Path | None = None) -> Path:
    return (root or calibration_root()) / f"{_safe(model)}--{backend}--{device}.json"


def from_data(data: dict, source: str) -> NoiseFloor:
    """A NoiseFloor from a calibration file's content (HarnessError naming `source` when malformed)."""
    try:
        raw = data["tolerances"]
        names = {f.name for f in fields(Tolerances)}
        tol = Tolerances(**{k: float(v) for k, v in raw.items() if k in names})
        acceptance = {
            spec: {
                "fixed": float(v["tolerance"]),
                "concurrent": float(v.get("tolerance_concurrent", v["tolerance"])),
                "modes": float(v.get("tolerance_modes", v["tolerance"])),
            }
            for spec, v in data.get("acceptance", {}).items()
        }
        exact = all(
            float(v.get("max_abs_max", 0.0)) == 0.0 for k, v in data.get("measured", {}).items() if k.startswith("seq/")
        )
        return NoiseFloor(tol, float(raw["near_tie"]), source, acceptance, exact)
    except (KeyError, TypeError, ValueError) as err:
        raise HarnessError(f"corrupt calibration file {source}: {err!r}; re-run `specharness calibrate`") from None


def uncalibrated(model: str, backend: str, root: Path | None = None) -> NoiseFloor:
    """DEFAULT, its source naming the default tolerances and the command that would measure the real ones."""
    t = DEFAULT.tolerances
    where = f" --calibration-dir {root}" if root and Path(root).resolve() != calibration_root().resolve() else ""
    return replace(
        DEFAULT,
        source=(
            f"default (uncalibrated: nmse {t.nmse:g}, kl {t.kl:g}, max_abs {t.max_abs:g}, near-tie "
            f"{DEFAULT.near_tie:g} "
            f"nats; measure them with: specharness calibrate --model {model} --backend {backend} --write{where})"
        ),
    )


def load(model: str, backend: str, device: str, root: Path | None = None) -> NoiseFloor:
    """The calibrated floor of (model, backend, device) — `model` a registry name or a model file — from `root`
    when given and calibrated there, else from the default root; `uncalibrated` when neither has it."""
    from harness.models import model_key  # here: reports reach this module and need no model registry

    key = model_key(model)
    path = next(
        (
            p
            for p in (calibration_path(key, backend, device, r) for r in ([root, None] if root else [None]))
            if p.is_file()
        ),
        None,
    )
    if path is None:
        return uncalibrated(model, backend, root)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HarnessError(f"corrupt calibration file {path}: {err}; re-run `specharness calibrate`") from None
    return from_data(data, f"calibrated ({path.parent.name}/{path.name})")
