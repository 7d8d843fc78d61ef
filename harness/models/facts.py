"""run.json's `models`: the facts of the models a run used or planned, asked by the command that ran it (the
report writer reads stored runs only and never resolves a model: the import contracts in pyproject.toml)."""

from harness.errors import HarnessError
from harness.models.registry import draft_for, resolve


def run_models(executor, planned: list) -> dict:
    """run.json's `models`: file, sha256, size, arch and kind of every model the run used or planned, draft models
    included (`{"error": ...}` for one that cannot be resolved)."""
    used = {c.model for _, c in planned} | {r.cell.model for r in executor.runs()}
    chosen = executor.options.draft_model
    drafts = {chosen or draft_for(c.model, c.preset.draft) for _, c in planned if "draft-simple" in c.spec}
    models = {}
    for name in sorted(used | (drafts - {None})):
        try:
            info = resolve(name, make=False)
        except HarnessError as err:
            models[name] = {"error": str(err)}
            continue
        models[name] = {
            "file": info.path.name,
            "sha256": info.sha256,
            "size": info.size,
            "arch": info.arch,
            "kind": info.kind,
        }
    return models
