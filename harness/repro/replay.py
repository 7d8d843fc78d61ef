"""What `repro.py` runs: the legs of a bundle's `case.json` on the in-process engine, judged as repro.sh judges.

`$MODEL` and `$DRAFT_MODEL` replace the run's models; `$SPECHARNESS_FAULT` replaces the run's in-process fault
switch (`none`: the clean engine). Exit status: 1 the failure reproduces (the same signature: the same crash or
error, kind of KV damage, first divergent token), 3 a different failure, 0 it does not reproduce, 2 it could not be
told (as repro.sh).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from harness.backends.base import ServeConfig
from harness.backends.inproc import InprocBackend
from harness.errors import HarnessError
from harness.kv.scan import damaged
from harness.repro.legs import JUDGES, REFERENCE, SUBJECT
from harness.suites.request import Request, Sampling

REPRODUCED, NOT_REPRODUCED, UNDECIDED, DIFFERENT = 1, 0, 2, 3


def _config(case: dict, leg: dict) -> ServeConfig:
    serve = dict(leg["serve"])
    engine = dict(serve.pop("engine"))
    fault = os.environ.get("SPECHARNESS_FAULT")
    if fault is not None:
        engine["fault"] = None if fault in ("", "none") else fault
    script = engine.pop("script", None)
    if script:
        engine["script"] = {"kind": script["kind"], "outputs": {tuple(k): v for k, v in script["outputs"]}}
    draft = os.environ.get("DRAFT_MODEL") or (case.get("draft_model") or {}).get("path")
    return ServeConfig(
        model=Path(os.environ.get("MODEL") or case["model"]["path"]),
        draft_model=Path(draft) if draft and serve["spec"] else None,
        engine=engine,
        **serve,
    )


def _request(payload: dict) -> Request:
    names = {f.name for f in fields(Sampling)}
    sampling = Sampling(**{k: v for k, v in payload.items() if k in names})
    return Request(prompt=list(payload["prompt"]), sampling=sampling, cache_prompt=payload.get("cache_prompt", True))


def run_leg(case: dict, leg: dict) -> dict[str, list]:
    """Serve one leg (a restore round's slot steps as the run took them, harness.repro.legs.batches); request key →
    its Results, in the order sent."""
    config = _config(case, leg)
    backend = InprocBackend()
    sessions = {"main": backend.open(config)}
    saved: dict[str, object] = {}
    results: dict[str, list] = {}
    try:
        for batch in leg["batches"]:
            if batch["how"] in ("save", "restore", "close-fresh"):
                failed = _slot_step(batch, sessions, saved, backend, config)
                if failed is not None:  # the run's later turns of the chat end with this error
                    results.setdefault(case["key"], []).append(failed)
                    break
                continue
            session = sessions.get(batch.get("server", "main"), sessions["main"])
            requests = [_request(r["payload"]) for r in batch["requests"]]
            if batch["how"] == "par":
                done = session.run(requests)
            else:
                done = [session.run([request])[0] for request in requests]
            for request, result in zip(batch["requests"], done, strict=False):
                results.setdefault(request["key"], []).append(result)
    finally:
        for session in sessions.values():
            session.close()
    return results


def _slot_step(step: dict, sessions: dict, saved: dict, backend, config: ServeConfig):
    """Save, restore (erase first; after the other conversation; into a fresh engine) or close the fresh engine;
    None, or a failed Result saying why the engine refused."""
    from harness.result import Result

    if step["how"] == "close-fresh":
        fresh = sessions.pop("fresh", None)
        if fresh is not None:
            fresh.close()
        return None
    if step["how"] == "save":
        answer = sessions["main"].save_slot(step["slot"])
        if "error" in answer:
            return Result(stop_reason="error", error=f"slot save refused: {answer['error']}")
        saved[step["file"]] = answer["state"]
        return None
    kind = step["kind"]
    if kind == "restore-fresh":
        if "fresh" not in sessions:
            sessions["fresh"] = backend.open(config)
        target = sessions["fresh"]
    else:
        target = sessions["main"]
    if kind == "restore-over":
        other = target.run([_request(step["detour"])])[0]
        if not other.ok:
            return other
    answer = target.restore_slot(step["slot"], saved[step["file"]], erase=kind == "restore")
    if "error" in answer:
        return Result(stop_reason="error", error=f"slot restore refused ({kind}): {answer['error']}")
    return None


def _first_damage(scan: dict) -> str | None:
    """The first kind of damage of a KV scan, named as signatures name it (`kv-healthy: <damage>`)."""
    names = (("duplicate_cells", "duplicate cells"), ("orphans", "orphans"), ("missing_positions", "holes"))
    totals = scan.get("totals") or {}
    found = next((name for key, name in names if totals.get(key)), None)
    draft = (scan.get("draft") or {}).get("totals") or {}
    in_draft = next((f"{name} in the draft context" for key, name in names if draft.get(key)), None)
    return found or in_draft


def judge(case: dict, outputs: dict[str, dict[str, list]]) -> tuple[int, str]:
    """(exit status, what was seen) for the judge of `case` over each leg's results of the failing request:
    REPRODUCED only for the run's signature, DIFFERENT for another failure."""
    from harness.repro.script import expectation
    from harness.signatures import of_error

    kind, subject = case["judge"], outputs[SUBJECT][case["key"]]
    failed = [r for r in subject if not r.ok]
    if kind in ("crash", "error"):
        same = [r for r in failed if of_error(r.error).text == case["signature"]]
        if same:
            return REPRODUCED, f"REPRODUCED: {same[0].error.splitlines()[0]}"
        if failed:
            return DIFFERENT, f"DIFFERENT FAILURE: {of_error(failed[0].error).text} ({failed[0].error.splitlines()[0]})"
        return NOT_REPRODUCED, "not reproduced: every request completed"
    if failed:
        return DIFFERENT, f"DIFFERENT FAILURE: the subject did not complete: {failed[0].error.splitlines()[0]}"
    if kind == "kv":
        scan = next((r.kv_scan for r in subject if damaged(r.kv_scan)), None)
        if scan is None:
            return NOT_REPRODUCED, "not reproduced: the KV cache is healthy"
        found = f"kv-healthy: {_first_damage(scan)}"
        if found == case["signature"] or not case["signature"].startswith("kv-healthy: "):
            return REPRODUCED, f"REPRODUCED: {found}, KV scan totals {scan['totals']}"
        return DIFFERENT, f"DIFFERENT FAILURE: {found}, KV scan totals {scan['totals']}"
    if kind == "restore":
        return _restore_judge(case, subject)
    if kind == "rounds-differ":
        lines = [f"round {i + 1}: {r.tokens}" for i, r in enumerate(subject)]
        differ = len({tuple(r.tokens) for r in subject}) > 1
        return (REPRODUCED if differ else NOT_REPRODUCED), "\n".join(lines)
    expected = outputs[REFERENCE][case["key"]][0]
    if not expected.ok:
        return UNDECIDED, f"the reference did not complete: {expected.error.splitlines()[0]}"
    lines = [f"expected ({case['reference_what']}): {expected.tokens}"]
    run_at = set(expectation(case).get("at") or [])
    status = NOT_REPRODUCED
    for r in subject:
        lines.append(f"actual   (subject):   {r.tokens}")
        if r.tokens != expected.tokens:
            index = next(
                (i for i, (a, b) in enumerate(zip(expected.tokens, r.tokens, strict=False)) if a != b),
                min(len(expected.tokens), len(r.tokens)),
            )
            lines.append(f"first divergence at generated token {index}")
            if not run_at or index in run_at:
                status = REPRODUCED
            elif status != REPRODUCED:
                status = DIFFERENT
    verdicts = {
        REPRODUCED: "REPRODUCED",
        DIFFERENT: f"DIFFERENT FAILURE: the output first diverges elsewhere than in the run (at {sorted(run_at)})",
        NOT_REPRODUCED: "not reproduced: the outputs are equal",
    }
    return status, "\n".join([*lines, verdicts[status]])


def main(case_file: Path) -> int:
    case = json.loads(Path(case_file).read_text())
    if case["judge"] not in JUDGES:
        print(
            f"this failure ({case['signature']}) is judged by specharness's own check: specharness run", file=sys.stderr
        )
        return UNDECIDED
    print(f"{case['signature']}: {case['suite']}[{case['key']}] {case['cell_id']} on the in-process engine")
    try:
        outputs = {leg["role"]: run_leg(case, leg) for leg in case["legs"]}
    except HarnessError as err:
        print(f"could not run: {err}", file=sys.stderr)
        return UNDECIDED
    status, seen = judge(case, outputs)
    print(seen)
    return status


def _restore_judge(case: dict, subject: list) -> tuple[int, str]:
    """The failing turn's drafted and accepted counts after each restore against the uninterrupted round's (as
    repro.sh: other counts with the same tokens reproduce it, other tokens are a different failure)."""
    from harness.suites import RESTORE_ROUNDS

    leg = next(leg for leg in case["legs"] if leg["role"] == SUBJECT)
    kinds = [r for b in leg["batches"] for r in b.get("requests", []) if r["key"] == case["key"]]
    served = list(zip(kinds, subject, strict=False))
    reference = next((res for r, res in served if r["kind"] not in RESTORE_ROUNDS), None)
    if reference is None:
        return UNDECIDED, "the bundle has no uninterrupted turn to compare"

    def counts(res) -> tuple[int, int]:
        return res.spec_stats.get("draft_n", 0), res.spec_stats.get("draft_n_accepted", 0)

    lines = [f"uninterrupted: drafted / accepted {counts(reference)}"]
    status = NOT_REPRODUCED
    for r, res in served:
        if r["kind"] not in RESTORE_ROUNDS:
            continue
        lines.append(f"round {r['round']} ({r['kind']}): drafted / accepted {counts(res)}")
        if res.tokens != reference.tokens:
            return DIFFERENT, "\n".join([*lines, "DIFFERENT FAILURE: the restored turn returned other tokens"])
        if counts(res) != counts(reference):
            status = REPRODUCED
    verdict = {
        REPRODUCED: "REPRODUCED: a restored turn drafted / accepted other counts, same output",
        NOT_REPRODUCED: "not reproduced: every restored turn drafted and accepted as the uninterrupted one",
    }
    return status, "\n".join([*lines, verdict[status]])
