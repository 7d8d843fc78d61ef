"""A speculative configuration of the in-process engine (`SpecConfig`, from llama-server's `--spec-*` options) and
the drafters it builds, in llama-server's order."""

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from harness.engine import rollback
from harness.engine.context import CACHE_TYPES, Context
from harness.engine.drafters.base import Drafter
from harness.engine.faults import check_fault
from harness.errors import HarnessError

SPEC_TYPES = (
    "none",
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "draft-simple",
    "draft-eagle3",
    "draft-mtp",
    "draft-dflash",
    "draft-dspark",
)
"""`--spec-type` values, in llama.cpp's priority order after `none` (common/speculative.cpp: the n-gram
types before the draft model and the heads; the first drafter with a draft wins the step)."""
HEADS = ("draft-eagle3", "draft-dflash", "draft-dspark")
"""The types that draft with a head fed the target's layer inputs (`--spec-draft-model` names the head)."""
DRAFT_SAMPLING = ("greedy", "probabilistic")
"""`--spec-draft-sampling` values (common/arg.cpp at b11434; default greedy)."""


@dataclass
class SpecConfig:
    """Speculative options. Fields starting with `spec_` are llama-server's `--spec-*` flags with `_`
    for `-`; `rollback`, `checkpoint_flags`, `checkpoint_attempts` and `fault` exist only in-process."""

    spec_type: tuple[str, ...] = ()
    spec_draft_model: Path | None = None
    spec_draft_n_max: int = 3
    spec_draft_n_min: int = 0
    spec_draft_p_min: float = 0.0
    spec_draft_type_k: str = "f16"
    spec_draft_type_v: str = "f16"
    """The draft context's KV cache types (llama-server's `-ctkd` / `-ctvd`; a quantized V needs flash attention)."""
    spec_ngram_simple_size_n: int = 12
    spec_ngram_simple_size_m: int = 48
    spec_ngram_map_k_size_n: int = 12
    spec_ngram_map_k_size_m: int = 48
    spec_ngram_map_k_min_hits: int = 1
    spec_ngram_map_k4v_size_n: int = 12
    spec_ngram_map_k4v_size_m: int = 48
    spec_ngram_map_k4v_min_hits: int = 1
    spec_ngram_mod_n_match: int = 24
    spec_ngram_mod_n_min: int = 48
    spec_ngram_mod_n_max: int = 64
    spec_draft_backend_sampling: bool = True
    """`--spec-draft-backend-sampling` (on by default; `--no-spec-draft-backend-sampling`): the draft heads sample
    their drafts with a top-k chain attached to the head's context (llama_set_sampler), else on the CPU."""
    spec_draft_sampling: str = "greedy"
    """`--spec-draft-sampling`: `greedy` (argmax drafts, verified by match) or `probabilistic` (sampled drafts
    verified by rejection sampling at temperature > 0; b11434 and newer)."""
    rollback: str = "auto"
    checkpoint_flags: str = "partial"
    checkpoint_attempts: int = 3
    fault: str | None = None
    drafters: list[Drafter] = field(default_factory=list)
    """Extra drafters tried before the `spec_type` ones (tests use the scripted drafter here)."""

    def __post_init__(self) -> None:
        types = tuple(t for t in self.spec_type if t != "none")
        unknown = [t for t in types if t not in SPEC_TYPES]
        if unknown:
            raise HarnessError(f"unknown spec type '{unknown[0]}' (use: {', '.join(SPEC_TYPES)})")
        if "none" in self.spec_type:
            types = ()
        for needs in ("draft-simple", *HEADS):
            if needs in types and self.spec_draft_model is None:
                raise HarnessError(f"spec type {needs} needs a draft model (--spec-draft-model NAME|PATH)")
        for flag, value in (
            ("spec-draft-type-k", self.spec_draft_type_k),
            ("spec-draft-type-v", self.spec_draft_type_v),
        ):
            if value not in CACHE_TYPES:
                raise HarnessError(f"{flag} must be one of {', '.join(CACHE_TYPES)}, not '{value}'")
        if self.spec_draft_sampling not in DRAFT_SAMPLING:
            raise HarnessError(
                f"spec-draft-sampling must be one of {', '.join(DRAFT_SAMPLING)}, not '{self.spec_draft_sampling}'"
            )
        if self.checkpoint_flags not in rollback.CHECKPOINT_FLAGS:
            raise HarnessError(f"checkpoint_flags must be partial or full, not '{self.checkpoint_flags}'")
        self.spec_type = types
        check_fault(self.fault)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "SpecConfig":
        """Build from llama-server style names (`spec-type`, `spec-draft-n-max`, ...)."""
        known = {f.name for f in fields(cls)}
        kwargs = {}
        for key, value in options.items():
            name = key.lstrip("-").replace("-", "_")
            if name.startswith("no_spec_") and value is True:  # llama-server's negative bool flags
                name, value = name[len("no_") :], False
            if name not in known or name == "drafters":
                raise HarnessError(f"unknown speculative option '{key}'")
            kwargs[name] = value
        if isinstance(kwargs.get("spec_type"), str):
            kwargs["spec_type"] = tuple(kwargs["spec_type"].split(","))
        return cls(**kwargs)

    @property
    def enabled(self) -> bool:
        return bool(self.spec_type or self.drafters)

    @property
    def rs_rollback(self) -> bool:
        """llama-server's `need_n_rs_seq()` (draft-mtp and the heads): the target gets `spec_draft_n_max` recurrent
        snapshots and a hybrid rolls back inside them (`auto` means `partial`)."""
        return any(t in self.spec_type for t in ("draft-mtp", *HEADS))

    def max_draft(self) -> int:
        """The longest draft any configured drafter may propose (sizes `n_rs_seq` for `partial`)."""
        sizes = {
            "draft-simple": self.spec_draft_n_max,
            "ngram-simple": self.spec_ngram_simple_size_m,
            "ngram-map-k": self.spec_ngram_map_k_size_m,
            "ngram-map-k4v": self.spec_ngram_map_k4v_size_m,
            "ngram-mod": self.spec_ngram_mod_n_max,
            "ngram-cache": 8,
            "draft-mtp": self.spec_draft_n_max,
            **{head: self.spec_draft_n_max for head in HEADS},
        }
        return max([sizes[t] for t in self.spec_type] + [d.n_max for d in self.drafters])


def build_drafters(config: SpecConfig, target: Context) -> list[Drafter]:
    """The drafter chain in llama.cpp's priority order."""
    from harness.engine.drafters.draft_dflash import DraftDFlash
    from harness.engine.drafters.draft_eagle3 import DraftEagle3
    from harness.engine.drafters.draft_model import DraftSimple
    from harness.engine.drafters.draft_mtp import DraftMTP
    from harness.engine.drafters.ngram_cache import NgramCache
    from harness.engine.drafters.ngram_map import NgramMapK, NgramMapK4V
    from harness.engine.drafters.ngram_mod import NgramMod
    from harness.engine.drafters.ngram_simple import NgramSimple

    c = config

    def head(cls, **own):
        """A draft head fed with the target's layer inputs (`--spec-draft-model` is the head)."""
        return lambda: cls(
            c.spec_draft_model,
            target,
            c.spec_draft_n_max,
            c.spec_draft_n_min,
            c.spec_draft_p_min,
            wrong_layer=c.fault == "head-wrong-layer",
            backend_sampling=c.spec_draft_backend_sampling,
            leave_draft=c.fault == "head-draft-left-in-cache",
            **own,
        )

    make = {
        "ngram-simple": lambda: NgramSimple(c.spec_ngram_simple_size_n, c.spec_ngram_simple_size_m),
        "ngram-map-k": lambda: NgramMapK(
            c.spec_ngram_map_k_size_n, c.spec_ngram_map_k_size_m, c.spec_ngram_map_k_min_hits
        ),
        "ngram-map-k4v": lambda: NgramMapK4V(
            c.spec_ngram_map_k4v_size_n, c.spec_ngram_map_k4v_size_m, c.spec_ngram_map_k4v_min_hits
        ),
        "ngram-mod": lambda: NgramMod(c.spec_ngram_mod_n_match, c.spec_ngram_mod_n_min, c.spec_ngram_mod_n_max),
        "draft-mtp": lambda: DraftMTP(
            target,
            c.spec_draft_n_max,
            c.spec_draft_n_min,
            c.spec_draft_p_min,
            wrong_row=c.fault == "mtp-wrong-row",
            wrong_q=c.fault == "q-wrong-temperature",
        ),
        "draft-eagle3": head(DraftEagle3, stale_boundary=c.fault == "eagle3-stale-boundary"),
        "draft-dflash": head(DraftDFlash),
        "draft-dspark": head(DraftDFlash, dspark=True),
        "ngram-cache": lambda: NgramCache(keep_across_requests=c.fault == "ngram-cache-kept-across-requests"),
        "draft-simple": lambda: DraftSimple(
            c.spec_draft_model,
            target,
            c.spec_draft_n_max,
            c.spec_draft_n_min,
            c.spec_draft_p_min,
            stale=c.fault == "stale-draft-context",
            cache_types=(c.spec_draft_type_k, c.spec_draft_type_v),
            wrong_q=c.fault == "q-wrong-temperature",
        ),
    }
    return list(c.drafters) + [make[t]() for t in SPEC_TYPES if t in c.spec_type]
