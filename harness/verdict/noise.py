"""The noise floor: how far logically equivalent runs move the logits, per (model, backend, device).

`specharness calibrate` measures it (harness/commands/calibrate.py) and writes
`fixtures/calibration/<model>--<backend>--<device>.json`; `logits-close` and the first-divergence triage
read it here (from `--calibration-dir` first when given). A model is known by harness.models.model_key (a
registry name, or a model file's content). A model without a calibration file falls back to `DEFAULT`, and
every verdict that used it says `uncalibrated`, with the default tolerances and the command that measures them.
"""

import functools
import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from harness.errors import HarnessError
from harness.result.logits import Tolerances

NEAR_TIE = 0.05
"""Uncalibrated near-tie floor, nats: flash attention on vs off flipped a margin of 0.0008 on tiny-dense."""
ACCEPTANCE = 0.05
"""Uncalibrated acceptance tolerance: the drop (absolute, of a request's accepted / drafted and accepted /
generated) that `acceptance` lets pass; the largest calibrated spread on this project's models is far below."""
SAFETY = 2.0
"""A mode's near-tie floor is SAFETY × the largest margin change (or flipped margin) measured in that mode
(harness.commands.calibrate uses the same factor for every tolerance)."""
MINIMUM_NEAR_TIE = 1e-4
"""The smallest floor calibration writes (float32 rounding of a log-probability is ~1e-7 nats)."""
RANGE = 1.0
"""An acceptance fraction lies in [0, 1]: a tolerance this large lets every drop pass, so it cannot fail."""


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
    and against seq (see harness.commands.calibrate.acceptance_spread)."""
    seq_bit_exact: bool = True
    """Whether calibration measured every `seq` speculative run, served as the cells serve it, bit-identical to no
    speculation (max |Δ| 0 at every position). The `n_ubatch=7` variants do not count (no cell splits its batches
    that way; they stand in for another CPU's kernels in the floor). Where it measured differences (a
    verification batch of k+1 tokens takes other kernels than a one-token decode, on every committed model),
    a proven near-tie in `seq` is numerics too. Uncalibrated: assumed exact, so every `seq` divergence fails.
    docs/near-tie-policy.md has the committed numbers."""
    mode_near_tie: dict = field(default_factory=dict)
    """Mode → the near-tie floor measured in that mode: SAFETY × the largest margin change or flipped margin of
    its variants (at least MINIMUM_NEAR_TIE, at most `near_tie`); `for_mode` applies it."""

    @property
    def calibrated(self) -> bool:
        return not self.source.startswith("default")

    def acceptance_tolerance(self, spec: str, against: str = "fixed") -> tuple[float | None, str]:
        """The acceptance tolerance of a spec config against a run of the same cell (`fixed` request order,
        or `concurrent`: requests sent all at once) or against seq (`modes`), and where it came from. None
        when calibration refused it: the noise it measured spans the whole range of a fraction (a tolerance
        ≥ RANGE lets every drop pass), so that comparison is not judged; the source then says why."""
        if spec in self.acceptance:
            value = self.acceptance[spec][against]
            if value is None:
                return None, f"not judged: noise exceeds the range ({self.acceptance[spec]['refused'][against]})"
            return value, self.source
        return ACCEPTANCE, f"default (uncalibrated for {spec})"

    def for_mode(self, mode: str) -> "NoiseFloor":
        """This floor with the near-tie floor measured in `mode` (unchanged where calibration measured none)."""
        if mode not in self.mode_near_tie:
            return self
        return replace(self, near_tie=self.mode_near_tie[mode], source=f"{self.source}, {mode} mode")

    def describe(self) -> str:
        return f"near-tie floor {self.near_tie:.3g} nats, {self.source}"

    def excuses_near_ties(self, mode: str) -> bool:
        """The one near-tie policy: a proven near-tie (both runs' own logits, both signs: harness.verdict.triage) is
        reported, not failed, where numerics can move a token: outside `seq` (the batch a slot shares with others
        changes kernels), and in `seq` where calibration measured this model's speculative runs not bit-identical
        to no speculation (`seq_bit_exact`: the verification batch takes other kernels than a one-token decode).
        Elsewhere every divergence fails. `run`, pytest, bisect and shrink apply it through the checks; the diff
        report through its triage."""
        return mode != "seq" or not self.seq_bit_exact

    def declared(self, tolerances: dict, suite: str) -> "NoiseFloor":
        """This floor with a suite's own `tolerances:` on top (the verdicts then say so); unchanged without any."""
        declared = dict(tolerances)
        if not declared:
            return self
        near_tie = declared.pop("near_tie", self.near_tie)
        names = {f.name for f in fields(Tolerances)}
        tol = replace(self.tolerances, **{k: v for k, v in declared.items() if k in names})
        return replace(self, tolerances=tol, near_tie=near_tie, source=f"suite {suite} tolerances over {self.source}")


DEFAULT = NoiseFloor()


def calibration_root() -> Path:
    """`fixtures/calibration` beside the `suites/` directory in use."""
    from harness.suites import suites_dir  # here: the suites' module reaches the engine, reports must not

    return suites_dir().parent / "fixtures" / "calibration"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def calibration_path(model: str, backend: str, device: str, root: Path | None = None) -> Path:
    return (root or calibration_root()) / f"{_safe(model)}--{backend}--{device}.json"


ACCEPTANCE_KEYS = {"fixed": "tolerance", "concurrent": "tolerance_concurrent", "modes": "tolerance_modes"}
"""NoiseFloor.acceptance's names → the calibration file's keys."""


def acceptance_of(v: dict) -> dict:
    """One spec's acceptance tolerances from a calibration file: a value ≥ RANGE (written before calibration
    refused such tolerances) or null (refused) is None, with the reason under `refused`."""
    out: dict = {"refused": {}}
    for name, key in ACCEPTANCE_KEYS.items():
        raw = v.get(key, v["tolerance"])
        refused = v.get("refused", {}).get(key)
        if raw is not None and float(raw) >= RANGE:
            refused = f"{key} {float(raw):.3g} ≥ {RANGE:g}, the range of a fraction: no drop could fail it"
            raw = None
        out[name] = None if raw is None else float(raw)
        if out[name] is None:
            out["refused"][name] = refused or f"{key} refused at calibration"
    return out


def is_default_batch(variant: str) -> bool:
    """Whether a calibration variant (`<mode>/<spec>[/<how>]`) serves its requests as the suites' cells do (the
    `n_ubatch=` split does not: it stands in for another CPU's kernels)."""
    return "n_ubatch=" not in variant


def logits_count(variant: dict) -> bool:
    """Whether a calibration variant's logits and flips count toward the floors: not where a known defect moves
    tokens or logits (`logits: false`, harness.commands.calibrate.variants)."""
    return bool(variant.get("logits", True))


def seq_bit_exact(measured: dict) -> bool:
    """Whether every measured `seq` speculative variant, served as the cells serve it, is bit-identical to the
    seq / no-speculation reference (max |Δ| 0). True when none was measured."""
    return all(
        float(v.get("max_abs_max", 0.0)) == 0.0
        for k, v in measured.items()
        if k.startswith("seq/") and k.split("/")[1] != "none" and is_default_batch(k) and logits_count(v)
    )


def mode_floors(measured: dict, near_tie: float) -> dict[str, float]:
    """Mode → SAFETY × the largest margin change or flipped margin measured over that mode's variants (the
    n_ubatch split included: another CPU's kernels), at least MINIMUM_NEAR_TIE and at most `near_tie` (the
    file's floor, merged over every machine it was measured on)."""
    largest: dict[str, float] = {}
    for k, v in measured.items():
        if not logits_count(v):
            continue
        flips = [f["reference_gap"] for f in v.get("flips", []) if f.get("reference_gap") is not None]
        value = max([float(v.get("margin_delta_max", 0.0)), *map(float, flips)])
        mode = k.split("/")[0]
        largest[mode] = max(largest.get(mode, 0.0), value)
    return {m: min(near_tie, max(MINIMUM_NEAR_TIE, SAFETY * x)) for m, x in largest.items()}


def from_data(data: dict, source: str) -> NoiseFloor:
    """A NoiseFloor from a calibration file's content (HarnessError naming `source` when malformed)."""
    try:
        raw = data["tolerances"]
        names = {f.name for f in fields(Tolerances)}
        tol = Tolerances(**{k: float(v) for k, v in raw.items() if k in names})
        acceptance = {spec: acceptance_of(v) for spec, v in data.get("acceptance", {}).items()}
        measured = data.get("measured", {})
        near_tie = float(raw["near_tie"])
        exact = seq_bit_exact(measured)
        floors = mode_floors(measured, near_tie)
        if exact:
            floors.pop("seq", None)  # nothing is excused in seq (CheckContext.excuses_near_ties)
        return NoiseFloor(tol, near_tie, source, acceptance, exact, floors)
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
    stat = path.stat()
    return _load_file(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _load_file(path: Path, mtime_ns: int, size: int) -> NoiseFloor:
    """The floor a calibration file holds, parsed once per version of the file (`mtime_ns`, `size`): the checks
    ask for it per case and per check (profiled: 792 parses in a 165-case quicksort)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HarnessError(f"corrupt calibration file {path}: {err}; re-run `specharness calibrate`") from None
    return from_data(data, f"calibrated ({path.parent.name}/{path.name})")
