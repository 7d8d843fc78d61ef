"""A cell, one point of the matrix (backend × mode × speculative config × model), and the cells of a suite's
matrix."""

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from harness import DEFAULT_MODELS, MODES
from harness.errors import HarnessError, Unservable
from harness.matrix.presets import SpecPreset, served_options, spec_preset

BACKEND_NAMES = ("inproc", "server")


@dataclass(frozen=True, order=True)
class Cell:
    """One point of the matrix; its id reads `<mode>-<spec>-<model>-<backend>`."""

    backend: str
    mode: str
    spec: str
    model: str

    @property
    def id(self) -> str:
        return f"{self.mode}-{self.spec}-{self.model}-{self.backend}"

    def reference(self, **changes) -> "Cell":
        """The same cell with some coordinates changed (e.g. spec='none' for the lossless reference)."""
        return replace(self, **changes)

    @cached_property
    def preset(self) -> SpecPreset:
        """The cell's speculative preset, looked up by its name once: every stage below the matrix reads it here."""
        return spec_preset(self.spec)

    def served_options(self, overrides: dict) -> dict:
        """The llama-server options the cell is served with under a run's `--spec-*` overrides."""
        return served_options(self.preset, overrides)

    def draft_model(self, options: dict, chosen: str | None) -> Path | None:
        """The draft model served beside the cell's model under its served `options` (None when its drafters need
        none): `chosen` (`--draft-model`), else the model's registered draft (`draft-simple`) or generated head
        (`draft-eagle3` / `-dflash` / `-dspark`). Unservable where the model lacks what the spec needs."""
        # the model registry is loaded where a cell is served, not with the matrix (as in estimated_cost)
        from harness.models import draft_for, resolve
        from harness.models.registry import HEAD_TYPES, has_mtp_block, head_draft_for

        draft = None
        types = str(options.get("spec-type", "")).split(",")
        if "draft-simple" in types:
            kind = self.preset.draft
            name = chosen or draft_for(self.model, kind)
            if name is None:
                raise Unservable(
                    f"{self.spec} needs a draft model: {self.model} has no registered {kind} (--draft-model)"
                )
            draft = resolve(name).path
        elif heads := [t for t in types if t in HEAD_TYPES]:  # draft-eagle3 / -dflash / -dspark: a generated head
            if chosen is None:
                try:
                    draft = resolve(head_draft_for(self.model, heads[0])).path
                except HarnessError as err:
                    raise Unservable(f"{err} or --draft-model") from None
            else:
                draft = resolve(chosen).path
        if "draft-mtp" in types and not has_mtp_block(resolve(self.model)):
            raise Unservable(f"draft-mtp needs a model with an MTP (nextn) block: {self.model} has none")
        return draft


AXES = ("backends", "modes", "specs", "models")


def cells(matrix: dict | list[dict], only: dict[str, list[str] | None] | None = None) -> list[Cell]:
    """Every cell of a suite's matrix — one block of axes, or a list of blocks whose cells are united (in
    order, each once) — with explicit choices (`only[axis]`) replacing a block's axis.

    Chosen models pick the blocks that name them (`--model gemma3-270m` runs Gemma's block, not the tiny
    models' configs on Gemma); a model no block names (one of your own) runs in the generic blocks, those of the
    default tiny models: a block made for one model's gifts (Gemma's prompt-repeating replies for ngram-cache,
    tiny-hybrid-mtp's MTP block and heads, the -loop model's repetition) would ask of it what it may not have. A
    spec config is left out of the cells of a backend that does not have it (`SpecPreset.runs_on`). `only["cells"]`,
    when given, keeps only the cells with those ids (`--cell`)."""
    blocks = matrix if isinstance(matrix, list) else [matrix]
    chosen = (only or {}).get("models")
    out: list[Cell] = []
    for block in blocks:
        axes = {axis: (only or {}).get(axis) or block[axis] for axis in AXES}
        if chosen:
            generic = set(block["models"]) <= set(DEFAULT_MODELS)
            axes["models"] = [
                m for m in chosen if m in block["models"] or (generic and not any(m in b["models"] for b in blocks))
            ]
        for spec in axes["specs"]:
            spec_preset(spec)
        for cell in (
            Cell(backend, mode, spec, model)
            for backend in axes["backends"]
            for mode in axes["modes"]
            for spec in axes["specs"]
            for model in axes["models"]
        ):
            if cell not in out and cell.preset.runs_on(cell.backend):
                out.append(cell)
    ids = (only or {}).get("cells")
    return [cell for cell in out if cell.id in ids] if ids else out


def block_of(matrix: dict | list[dict], model: str) -> dict:
    """The first block of a matrix that names `model` ({} when none does): its `sampling` overrides apply to
    every cell of that model, whichever cell a check compares with."""
    blocks = matrix if isinstance(matrix, list) else [matrix]
    return next((b for b in blocks if model in b.get("models", ())), {})


def narrowing(
    backends: list[str] | None = None,
    modes: list[str] | None = None,
    specs: list[str] | None = None,
    models: list[str] | None = None,
    ids: list[str] | None = None,
) -> dict:
    """Validated explicit choices for `cells(..., only=)` (None keeps a suite's own axis; `ids` keeps only the
    cells of those ids, `--cell`)."""
    for values, allowed, what in ((backends, BACKEND_NAMES, "backend"), (modes, MODES, "mode")):
        bad = [v for v in values or () if v not in allowed]
        if bad:
            raise HarnessError(f"unknown {what} '{bad[0]}' (use: {', '.join(allowed)})")
    for spec in specs or ():
        spec_preset(spec)
    return {"backends": backends, "modes": modes, "specs": specs, "models": models, "cells": ids}
