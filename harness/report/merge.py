"""`specharness report --merge DIR... --out DIR`: shard run directories (`--shard I/N`) merged into one.

Shards of different harness versions, of different llama.cpp (per backend) or of different model
files are refused. A cell can be in several shards: its owner (the shard that was to check it) runs
it, and a shard whose cells compare with it runs it again on demand as a reference. Records and
verdicts are kept once, the owner's first; a reference run whose tokens differ from the owner's is
listed as a merge conflict (that is nondeterminism across machines, worth a look).
"""

from pathlib import Path

from harness.errors import HarnessError
from harness.report.files import RunDir, cell_id, item_name, llama_cpp_identity, logits_key, now, write_files


def _owner(runs: list[RunDir]) -> dict[tuple[str, str], int]:
    """(suite, cell id) → index of the shard that checked it."""
    owner = {}
    for i, run in enumerate(runs):
        for c in run.meta.get("cells") or []:
            if c.get("status") != "not run":
                owner.setdefault((c["suite"], c["id"]), i)
    return owner


def check_compatible(runs: list[RunDir]) -> None:
    """Refuse shards that are not parts of one run (one-line HarnessError naming the two directories)."""
    first = runs[0]
    for run in runs:
        if not run.meta:
            raise HarnessError(
                f"{run.path}: no run.json (made by an older specharness): cannot check it is a shard of the same run"
            )
    for run in runs[1:]:
        if run.meta.get("harness_version") != first.meta.get("harness_version"):
            raise HarnessError(
                f"cannot merge {run.path} (specharness {run.meta.get('harness_version')}) with "
                f"{first.path} (specharness {first.meta.get('harness_version')})"
            )
        ia, ib = llama_cpp_identity(first.meta), llama_cpp_identity(run.meta)
        for backend in ia.keys() & ib.keys():
            if ia[backend] != ib[backend]:
                raise HarnessError(
                    f"cannot merge {run.path} ({backend} llama.cpp {ib[backend]}) with "
                    f"{first.path} ({backend} llama.cpp {ia[backend]})"
                )
        ma, mb = first.meta.get("models") or {}, run.meta.get("models") or {}
        for model in ma.keys() & mb.keys():
            if ma[model].get("sha256") != mb[model].get("sha256"):
                raise HarnessError(
                    f"cannot merge {run.path} with {first.path}: model {model} differs "
                    f"({mb[model].get('sha256')} vs {ma[model].get('sha256')})"
                )
    shards = [r.meta.get("shard") for r in runs if r.meta.get("shard")]
    if len({s.split("/")[1] for s in shards}) > 1:
        raise HarnessError(f"cannot merge shards of different splits: {', '.join(sorted(set(shards)))}")
    if len(set(shards)) != len(shards):
        raise HarnessError(f"shard {next(s for s in shards if shards.count(s) > 1)} given twice")


def merge(dirs: list[Path], out: Path) -> Path:
    """Merge the run directories into `out` (which must not hold a run yet); returns results.json."""
    if (out / "results.json").exists():
        raise HarnessError(
            f"{out / 'results.json'} already exists (choose another --out; results are never overwritten)"
        )
    runs = [RunDir.load(d) for d in dirs]
    check_compatible(runs)
    owner = _owner(runs)
    order = lambda row, i: (owner.get((row["suite"], cell_id(row)), i) != i, i)  # noqa: E731  the owner's first

    rows, conflicts, logits = {}, [], {}
    for i, row in sorted(((i, r) for i, run in enumerate(runs) for r in run.records), key=lambda p: order(p[1], p[0])):
        key = (item_name(row), row["repeat"])
        if key not in rows:
            rows[key] = row
            frames = runs[i].logit_frames()
            if logits_key(row) in frames:
                logits[logits_key(row)] = frames[logits_key(row)]
        elif rows[key]["tokens"] != row["tokens"] and rows[key].get("error") is None and row.get("error") is None:
            conflicts.append(f"{key[0]} round {key[1]}: {runs[i].run_id} differs")
    verdicts = {}
    for _i, v in sorted(((i, v) for i, run in enumerate(runs) for v in run.checks), key=lambda p: order(p[1], p[0])):
        verdicts.setdefault((item_name(v), v["check"]), v)
    vocab: dict = {}
    for run in runs:
        for model, pieces in run.vocab.items():
            vocab.setdefault(model, {}).update(pieces)

    cells: dict[tuple, dict] = {}
    rank = {"done": 0, "error": 1, "not run": 2}
    for run in runs:
        for c in run.meta.get("cells") or []:
            key = (c["suite"], c["id"])
            if key not in cells or rank[c["status"]] < rank[cells[key]["status"]]:
                cells[key] = c
    first = runs[0].meta
    shards = [r.meta.get("shard") for r in runs if r.meta.get("shard")]
    count = int(shards[0].split("/")[1]) if shards else None
    meta = {
        **{k: first.get(k) for k in ("format", "harness_version", "host", "options")},
        "tool": "specharness report --merge",
        "command": " ; ".join(r.meta.get("command") or "" for r in runs),
        "started": min(r.meta.get("started") or "" for r in runs),
        "finished": max(r.meta.get("finished") or "" for r in runs),
        "merged_at": now(),
        "shard": None,
        "interrupted": any(r.meta.get("interrupted") for r in runs),
        "backends": {k: v for r in runs for k, v in (r.meta.get("backends") or {}).items()},
        "models": {k: v for r in runs for k, v in (r.meta.get("models") or {}).items()},
        "suites": {k: v for r in runs for k, v in (r.meta.get("suites") or {}).items()},
        "uncalibrated": list(dict.fromkeys(line for r in runs for line in r.meta.get("uncalibrated") or [])),
        "known_failures_scope": list(
            dict.fromkeys(line for r in runs for line in r.meta.get("known_failures_scope") or [])
        ),
        "known_failures": list({e["id"]: e for r in runs for e in r.meta.get("known_failures") or []}.values()),
        "cells": list(cells.values()),
        "shards": [
            {
                "run_id": r.run_id,
                "shard": r.meta.get("shard"),
                "command": r.meta.get("command"),
                "started": r.meta.get("started"),
                "host": r.meta.get("host"),
            }
            for r in runs
        ],
        "shard_count": count,
        "missing_shards": sorted(set(range(1, count + 1)) - {int(s.split("/")[0]) for s in shards}) if count else [],
        "merge_conflicts": conflicts,
    }
    return write_files(out, list(rows.values()), list(verdicts.values()), logits, vocab, meta)
