"""The noise floor: how far logically equivalent runs move the logits, per (model, backend, device).

`specharness calibrate` measures it (harness/calibration/) and writes
`fixtures/calibration/<model>--<backend>--<device>.json` (`device`: the backend's build, cpu / cuda / metal / gpu);
`specharness run` measures a (model, backend, device, build) that has none once and keeps it in the user cache,
`cache_dir()/calibration/<model>--<backend>--<device key>--<build>.json` (`device_key`: the device and the
hardware that runs its kernels). `logits-close` and the first-divergence triage read it here (`load`): from
`--calibration-dir` first when given, then the committed file, then the user cache. A model is known by
harness.models.model_key (a registry name, or a model file's content). A model without a calibration falls back to
`DEFAULT`, and every verdict that used it says `uncalibrated`, with the default tolerances and the command that
measures them.
"""

import functools
import hashlib
import json
import platform
import re
import subprocess
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from harness.errors import HarnessError
from harness.paths import cache_dir
from harness.result.logits import Tolerances

NEAR_TIE = 0.05
"""Uncalibrated near-tie floor, nats: flash attention on vs off flipped a margin of 0.0008 on tiny-dense."""
ACCEPTANCE = 0.05
"""Uncalibrated acceptance tolerance: the drop (absolute, of a request's accepted / drafted and accepted /
generated) that `acceptance` lets pass; the largest calibrated spread on this project's models is far below."""
SAFETY = 2.0
"""A mode's near-tie floor is SAFETY × the largest margin change (or flipped margin) measured in that mode
(harness.calibration uses the same factor for every tolerance)."""
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
    and against seq (see harness.calibration.tolerances.acceptance_spread)."""
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
    seeded: dict = field(default_factory=dict)
    """Mode → (seeded sampled draws that diverged, distinct draws) measured on this device and build in the
    calibration pass (harness.calibration.seeded; empty where the file holds none: the committed rate applies,
    harness.checks.seeded.NOISE)."""

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
        names = {f.name for f in fields(Tolerances)} - {"windows"}
        mine = {k: v for k, v in declared.items() if k in names}
        windows = {k: v for k, v in self.tolerances.windows.items() if k not in mine}  # a declared bound is the bound
        tol = replace(self.tolerances, **mine, windows=windows)
        return replace(self, tolerances=tol, near_tie=near_tie, source=f"suite {suite} tolerances over {self.source}")


DEFAULT = NoiseFloor()


def calibration_root() -> Path:
    """`fixtures/calibration` beside the `suites/` directory in use."""
    from harness.suites import suites_dir  # here: the suites' module reaches the engine, reports must not

    return suites_dir().parent / "fixtures" / "calibration"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def calibration_path(model: str, backend: str, device: str, root: Path | None = None) -> Path:
    """A committed calibration file (or one of a `--calibration-dir`): keyed by the device class of the build."""
    return (root or calibration_root()) / f"{_safe(model)}--{backend}--{device}.json"


def cache_root() -> Path:
    """The user cache of calibrations a run measured (`cache_dir()/calibration`)."""
    return cache_dir() / "calibration"


@functools.cache
def hardware(device: str) -> str:
    """What runs a build's kernels on this machine: the GPU's name for a CUDA build (nvidia-smi), else the CPU's
    (a Metal build runs on the chip that is the CPU), with the machine type; `unknown` where it cannot be read."""
    name = ""
    if device == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired):
            name = ""
    if not name and device != "cuda":
        try:
            info = Path("/proc/cpuinfo").read_text()
            name = next(
                (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), ""
            )
        except OSError:
            name = ""
        name = name or platform.processor()
    return f"{name or 'unknown'} ({platform.machine()})"


def device_key(env: dict) -> str:
    """The device a calibration in the user cache was measured on: the build's device class (cpu, cuda, metal,
    gpu: a CUDA build never reads a CPU calibration) and a digest of the hardware that runs its kernels
    (`hardware`), e.g. `cpu-1a2b3c4d`."""
    device = str(env.get("device", "cpu"))
    return f"{device}-{hashlib.sha256(hardware(device).encode()).hexdigest()[:8]}"


def build_digest(env: dict) -> str:
    """A digest of the build facts of a backend's `environment()` (llama.cpp commit and source, compiler, offload,
    or llama-cpp-python's version), without the model's."""
    facts = {k: v for k, v in env.items() if k != "model_sha256"}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:8]


def cache_path(model: str, backend: str, env: dict) -> Path:
    """The user-cache calibration of (model key, backend) on the device and build of `env`."""
    return cache_root() / f"{_safe(model)}--{backend}--{device_key(env)}--{build_digest(env)}.json"


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
    tokens or logits (`logits: false`, harness.calibration.variants)."""
    return bool(variant.get("logits", True))


def seq_bit_exact(measured: dict) -> bool:
    """Whether every measured `seq` speculative variant, served as the cells serve it, is bit-identical to the
    seq / no-speculation reference: max |Δ| 0 and no token flipped. A flip counts on its own: llama-server logs no
    logits of the tokens a verification step emits, so its max |Δ| covers the steps without drafts only, and a
    variant can measure 0 there yet pick other tokens (the `numerics` suite's Q4_K models). True when none was
    measured."""
    return all(
        float(v.get("max_abs_max", 0.0)) == 0.0 and not v.get("flips")
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
        names = {f.name for f in fields(Tolerances)} - {"windows"}
        windows = {k: tuple(float(x) for x in v) for k, v in raw.get("windows", {}).items()}
        tol = Tolerances(**{k: float(v) for k, v in raw.items() if k in names}, windows=windows)
        acceptance = {spec: acceptance_of(v) for spec, v in data.get("acceptance", {}).items()}
        measured = data.get("measured", {})
        near_tie = float(raw["near_tie"])
        exact = seq_bit_exact(measured)
        floors = mode_floors(measured, near_tie)
        if exact:
            floors.pop("seq", None)  # nothing is excused in seq (CheckContext.excuses_near_ties)
        seeded = {m: (int(k), int(n)) for m, (k, n) in data.get("seeded", {}).get("by_mode", {}).items()}
        return NoiseFloor(tol, near_tie, source, acceptance, exact, floors, seeded)
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


def find(model: str, backend: str, device: str | dict, root: Path | None = None) -> Path | None:
    """The calibration file of (model, backend, device): from `root` when given, else the committed one, else
    (`device` the backend's `environment()`, which names the build) the user cache's; None when none has it."""
    from harness.models import model_key  # here: reports reach this module and need no model registry

    key = model_key(model)
    env = device if isinstance(device, dict) else None
    device_class = str(env.get("device", "cpu")) if env is not None else str(device)
    paths = [calibration_path(key, backend, device_class, r) for r in ([root, None] if root else [None])]
    if env is not None:
        paths.append(cache_path(key, backend, env))
    return next((p for p in paths if p.is_file()), None)


def where(path: Path) -> str:
    """How a calibration file is named to the user: `cached` (the user cache) or `committed`."""
    return "cached" if path.parent == cache_root() else "committed"


def load(model: str, backend: str, device: str | dict, root: Path | None = None) -> NoiseFloor:
    """The calibrated floor of (model, backend, device) — `model` a registry name or a model file, `device` the
    device class or the backend's `environment()` — from `root` when given and calibrated there, else from the
    committed files, else from the user cache (`find`); `uncalibrated` when none has it."""
    path = find(model, backend, device, root)
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
    shown = f"{path.parent.name}/{path.name}" if where(path) == "committed" else f"user cache: {path.name}"
    return from_data(data, f"calibrated ({shown})")
