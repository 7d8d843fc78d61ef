"""Writing a reproducer bundle from a trial that showed the failure: case.json, repro.sh (llama-server cells),
repro.py and ISSUE.md."""

from __future__ import annotations

import json
from pathlib import Path

from harness.checks import kv_problems
from harness.engine import detok as detokenizers
from harness.matrix import Cell
from harness.models import draft_for, resolve
from harness.repro import issue, script
from harness.repro.legs import JUDGES, REFERENCE, SUBJECT, judge_of, leg, reference_cell, tokenize
from harness.repro.rate import CONFIDENCE, retries
from harness.signatures import classify

REPRO_PY = '''#!/usr/bin/env python3
"""Reproducer written by specharness, on its in-process engine: {signature}.

Exit status 1: the failure reproduces (the same signature), 3: a different failure, 0: it does not, 2: it could not be
told. MODEL and DRAFT_MODEL replace the
run's models; SPECHARNESS_FAULT replaces the run's in-process fault switch (none: the clean engine)."""
import sys
from pathlib import Path

from harness.repro.replay import main

sys.exit(main(Path(__file__).resolve().with_name("case.json")))
'''


def _model(name: str) -> dict:
    info = resolve(name)
    return {
        "name": info.name,
        "file": info.path.name,
        "path": str(info.path),
        "sha256": info.sha256,
        "kind": info.kind,
        "arch": info.arch,
    }


def _prompts(suite, cell, executor) -> dict[str, list[int]]:
    """Token ids of every request key of the suite: as a backend evaluated them in any run of the executor,
    else a completion prompt tokenized here (a request that crashed reports none)."""
    found: dict[str, list[int]] = {}
    for run in executor.runs():
        for o in run.outcomes:
            if o.result.prompt_tokens and o.case not in found:
                found[o.case] = list(o.result.prompt_tokens)
    for case in suite.cases:
        if not case.is_chat and case.name not in found:
            found[case.name] = (
                list(case.prompt) if isinstance(case.prompt, list) else tokenize(resolve(cell.model).path, case.prompt)
            )
    return found


def environment(executor, backend: str) -> dict:
    """The environment lines of ISSUE.md: llama.cpp and how it was built, the machine, specharness."""
    from harness import __version__
    from harness.backends.facts import backend_facts
    from harness.report.files import host

    facts = backend_facts(backend, executor.backends()[backend])
    out = {}
    build = facts.get("build")
    if build:
        out["llama.cpp"] = f"commit {build.get('commit')}" + (" (modified tree)" if build.get("dirty") else "")
        out["build"] = f"{build.get('backend')}, {build.get('compiler')}, CMake {' '.join(build.get('cmake_args', []))}"
        if build.get("linked_libraries"):
            out["build"] += f"; linked against {build['linked_libraries']}"
    else:
        out["llama.cpp"] = (
            f"in-process, the llama.cpp vendored in llama-cpp-python {facts.get('llama_cpp_python', '?')}"
        )
        out["system info"] = facts.get("system_info", "")
    machine = host()
    out["CPU"] = f"{machine['cpu']}, {machine['cores']} cores, {machine['platform']}"
    out["weight repacking"] = machine["weight repacking"]
    out["device"] = facts.get("device", "?")
    source = issue.harness_source()
    out["specharness"] = __version__ + (f", commit {source['commit']}" if source.get("commit") else "")
    return out


def reproduction(rate: tuple[int, int] | None) -> dict:
    """case.json's `reproduction`: the measured rate and the runs repro.sh makes for it (harness.repro.rate)."""
    shown, runs = rate or (1, 1)
    return {
        "shown": shown,
        "runs": runs,
        "measured": rate is not None,
        "retries": retries(shown, runs) if rate is not None else 1,
        "confidence": CONFIDENCE,
    }


def write_bundle(
    out: Path,
    candidate,
    attempt,
    build=None,
    draft_model: str | None = None,
    pattern: str | None = None,
    shrunk: str | None = None,
    rate: tuple[int, int] | None = None,
) -> dict:
    """Write the bundle of `attempt` (a trial run of `candidate` that showed its signature) into `out`; returns
    {file role: path}. `build`: the llama-server build the trial served (llama-server cells); `rate`: (runs that
    showed the signature, runs) measured of the case (harness.repro.rate: repro.sh's retries, ISSUE.md's rate)."""
    out.mkdir(parents=True, exist_ok=True)
    executor, cell, key = attempt.executor, candidate.cell, candidate.key
    suite = attempt.run.suite
    records = [{"error": o.result.error, "stop_reason": o.result.stop_reason} for o in attempt.run.of_case(key)]
    signature = classify(attempt.verdict, records)
    judge = judge_of(candidate.check, signature.kind)
    prompts = _prompts(suite, cell, executor)
    server_bin = build.server_bin if cell.backend == "server" and build is not None else None
    legs = [leg(SUBJECT, executor, suite, cell, key, prompts, server_bin, judge == "kv")]
    ref = reference_cell(candidate.check, cell) if judge == "differs" else None
    if ref is not None:
        legs.insert(0, leg(REFERENCE, executor, suite, ref, key, prompts, server_bin, False))
    for one in legs:
        one["cell_id"] = Cell(**one["cell"]).id
    draft = (draft_model or draft_for(cell.model, cell.preset.draft)) if "draft-simple" in cell.spec else None
    target = next(r["payload"] for b in legs[-1]["batches"] for r in b["requests"] if r["key"] == key)
    detok = detokenizers.for_model(cell.model) or str
    case = {
        "signature": signature.text,
        "check": candidate.check,
        "judge": judge,
        "key": key,
        "suite": suite.name,
        "cell_id": cell.id,
        "reference_what": f"{ref.id}" if ref else "",
        "model": _model(cell.model),
        "draft_model": _model(draft) if draft else None,
        "legs": legs,
        "request": json.dumps(target),
        "prompt_text": detok(target["prompt"]),
        "harness": issue.harness_source(),
        "reproduction": reproduction(rate),
    }
    (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
    files = {"case": out / "case.json"}
    if server_bin is not None and judge in JUDGES:
        defaults = {"LLAMA_SERVER": str(server_bin), "MODEL": case["model"]["path"]}
        if draft:
            defaults["DRAFT_MODEL"] = case["draft_model"]["path"]
        files["repro.sh"] = script.write(out, case, defaults)
    (out / "repro.py").write_text(REPRO_PY.format(signature=signature.text))
    (out / "repro.py").chmod(0o755)
    files["repro.py"] = out / "repro.py"
    verdict = attempt.verdict.evidence if attempt.verdict is not None else {}
    divergence = {
        k: v
        for k, v in (verdict.get("first_divergence") or {}).items()
        if k not in ("reference_tokens", "tokens", "reference_margins")
    } or None
    kv = [f"round {o.round}: {p}" for o in attempt.run.of_case(key) for p in kv_problems(o.result)]
    (out / "ISSUE.md").write_text(
        issue.render(case, environment(executor, cell.backend), divergence, kv, pattern, shrunk)
    )
    files["ISSUE.md"] = out / "ISSUE.md"
    return files
