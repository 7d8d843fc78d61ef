"""Calibration: how far logically equivalent runs move the logits, per (model, backend, device), measured,
stored and made sure of before a run judges (the noise floor itself and its lookup: harness.verdict.noise).

- `variants`: what is measured (the prompts, the runs equivalent to the `seq`, non-speculative reference);
- `measure`: the measurements and `calibrate`, the content of a calibration file (`serving`: side by side);
- `tolerances`: from measurements to tolerances, and the comparison and merge with a committed file;
- `store`: writing the committed files and the user cache of per-device calibrations;
- `auto`: a run's calibrations, measured once where its device and build have none.
"""

from harness.calibration.auto import ensure
from harness.calibration.measure import calibrate
from harness.calibration.store import write, write_cache
from harness.calibration.tolerances import merged, within_spread
from harness.calibration.variants import specs_of, variants

__all__ = [
    "calibrate",
    "ensure",
    "merged",
    "specs_of",
    "variants",
    "within_spread",
    "write",
    "write_cache",
]
