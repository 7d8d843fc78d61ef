"""`ISSUE.md`: the failure as an upstream bug report, ready to paste (environment, model and how to make it,
command, requests, expected, actual, first divergence with its margin, KV-scan findings, failure pattern)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from harness.models import generator
from harness.repro.legs import REFERENCE, SUBJECT
from harness.repro.rate import RATE_BOUND, lowest_rate

EXPECTED = {
    "crash": "every request completes",
    "error": "every request completes without an error",
    "kv": "a healthy KV cache: one cell per (seq_id, position), none past the sequence, no holes",
    "rounds-differ": "every round gives the same tokens (greedy decoding)",
    "restore": "a turn served after its slot's save and restore drafts and accepts as many tokens as the same turn "
    "of the uninterrupted round (the restore brings back the draft context with the target's)",
}
"""What a judge expects when there is no reference leg."""


PUBLIC_REMOTE = re.compile(r"^(?:https?|ssh|git)://|^[\w.-]+@[\w.-]+:")
"""A remote an upstream reader can fetch from (not a path on the machine that wrote the bundle)."""


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def harness_source() -> dict:
    """Which specharness wrote the bundle: its version, and where it runs from a git checkout, the checkout's
    commit, whether it had uncommitted changes and a public remote (without any credentials in its URL)."""
    import harness

    root = Path(harness.__file__).resolve().parents[1]
    out: dict = {"version": harness.__version__}
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:  # an installed wheel (or a checkout around it): no commit
        return out
    out["commit"] = _git(root, "rev-parse", "HEAD")
    out["dirty"] = bool(_git(root, "status", "--porcelain", "--untracked-files=no"))
    remote = _git(root, "config", "--get", "remote.origin.url") or ""
    remote = re.sub(r"^(\w+://)[^/@]*@", r"\1", remote)  # no user:token@
    if PUBLIC_REMOTE.match(remote):
        out["remote"] = remote
    return out


def install_line(source: dict | None) -> str:
    """How an upstream reader gets the specharness that wrote the bundle (there is no package index release)."""
    source = source or {}
    commit = source.get("commit")
    if commit and source.get("remote"):
        line = f"`pip install 'git+{source['remote']}@{commit}'`"
    elif commit:
        line = (
            f"specharness at commit `{commit}` (its checkout had no public remote): clone the specharness repository, "
            f"then `git checkout {commit} && pip install .`"
        )
    else:
        line = (
            f"specharness {source.get('version', '?')} (installed, not a git checkout: no commit recorded), from the "
            "specharness repository: `pip install .`"
        )
    if source.get("dirty"):
        line += " (the checkout had uncommitted changes)"
    return line


def _model_lines(info: dict) -> list[str]:
    lines = [f"- `{info['name']}`: `{info['file']}`, {info['kind']} ({info['arch']}), sha256 `{info['sha256']}`"]
    recipe = generator.RECIPES.get(info["name"])
    if recipe is not None:
        lines.append(
            f"  - generated, byte-identical on every machine (specharness model generator v"
            f"{generator.GENERATOR_VERSION}, weight seed {recipe.seed}"
            + (f", draft of {recipe.draft_of} with noise {recipe.noise}" if recipe.draft_of else "")
            + f"): `specharness models make {info['name']}` with specharness as in Reproduce"
        )
    return lines


LOG_TAIL_LINES = 20
"""The last lines of a dead process's log that ISSUE.md quotes under its error."""


def _tokens(output: dict) -> str:
    """An output as ISSUE.md lists it; an error's log tail (harness.backends.process: "; log PATH ends with:" and
    its lines) quoted below it, without the run's log path, which the bundle does not carry."""
    if output.get("error"):
        first, *tail = output["error"].splitlines()
        first, quoted = re.subn(r"; log \S+ ends with:$", "; the log ended with:", first)
        if not (quoted and tail):
            return f"error: {first}"
        lines = ["  " + line for line in tail[-LOG_TAIL_LINES:]]
        return "\n".join([f"error: {first}", "", "  ```", *lines, "  ```"])
    return f"{output['tokens']} {output['text']!r} (stop: {output['stop_reason']})"


def render(
    case: dict,
    environment: dict,
    divergence: dict | None,
    kv: list[str],
    pattern: str | None,
    shrunk: str | None,
) -> str:
    """The text of ISSUE.md for `case` (case.json's content)."""
    subject = next(leg for leg in case["legs"] if leg["role"] == SUBJECT)
    reference = next((leg for leg in case["legs"] if leg["role"] == REFERENCE), None)
    title = f"{case['signature']} with speculative decoding ({case['cell_id']})"
    out = [f"# {title}", "", "## Environment", ""]
    out += [f"- {k}: {v}" for k, v in environment.items()]
    out += ["", "## Model", ""]
    for info in (case["model"], case.get("draft_model")):
        if info:
            out += _model_lines(info)
    out += ["", "## Command", ""]
    for leg in case["legs"]:
        what = "the failing configuration" if leg["role"] == SUBJECT else f"the reference ({case['reference_what']})"
        if leg["command"]:
            out += [f"{what}:", "", "```sh", " ".join(leg["command"]), "```", ""]
        else:
            serve = leg["serve"]
            engine = {k: v for k, v in serve["engine"].items() if k != "script" and v is not None}
            out += [
                f"{what}: the in-process engine (specharness), {leg['cell_id']}: n_ctx {serve['n_ctx']}, n_batch "
                f"{serve['n_batch']}, n_ubatch {serve['n_ubatch']}, {serve['parallel']} slots, speculative "
                f"{serve['spec'] or 'none'}, engine options {engine}",
                "",
            ]
    sent = sum(len(b["requests"]) for b in subject["batches"])
    out += [
        f"Requests ({sent}, `requests/*.json`: one `/completion` body each, the prompt as token ids; "
        f"{'sent at once' if any(b['how'] == 'par' for b in subject['batches']) else 'one after another'}).",
        "",
        *_slot_steps(subject),
        f"The failing request ({case['key']}):",
        "",
        "```json",
        case["request"],
        "```",
        "",
        "Prompt text: " + repr(case["prompt_text"]),
        "",
        "## Expected",
        "",
    ]
    if reference is not None:
        out += [f"{case['reference_what']}: " + _tokens(reference["outputs"][0]) if reference["outputs"] else "-"]
    else:
        out += [EXPECTED.get(case["judge"], f"`{case['check']}` passes")]
    out += ["", "## Actual", ""] + [f"- round {o['round']}: " + _tokens(o) for o in subject["outputs"]]
    if divergence:
        out += [
            "",
            "## First divergence",
            "",
            f"- at generated token {divergence.get('index')}: {divergence.get('kind')} — {divergence.get('reason')}",
            f"- reference token {divergence.get('ref_token')} {divergence.get('ref_text')!r}, got "
            f"{divergence.get('other_token')} {divergence.get('other_text')!r}",
            f"- margin of the reference's top token: {divergence.get('margin')} nats (noise floor "
            f"{divergence.get('noise_floor')}, {divergence.get('floor_source')})",
        ]
    out += ["", "## KV-scan findings", ""] + ([f"- {line}" for line in kv] or ["- none (healthy, or not scanned)"])
    if pattern:
        out += ["", "## Failure pattern", "", pattern]
    out += [
        "",
        "## Reproduce",
        "",
        "`bash repro.sh` (llama-server and curl; `LLAMA_SERVER=... MODEL=... DRAFT_MODEL=...` to change the "
        "binary or models) exits 1 when the failure reproduces (the same signature), 3 on a different failure, 0 "
        "when it does not reproduce, 2 when it cannot tell; `python repro.py` runs the same requests on "
        "specharness's in-process engine.",
        "",
        _rate_line(case.get("reproduction") or {}),
        "",
        "The specharness that wrote this bundle (for `repro.py`, `specharness scan` and the generated models): "
        + install_line(case.get("harness"))
        + ".",
    ]
    if shrunk:
        out += ["", shrunk]
    return "\n".join(out) + "\n"


def _rate_line(reproduction: dict) -> str:
    """How often the failure reproduced, and how many runs repro.sh makes for it (harness.repro.rate)."""
    n = reproduction.get("retries", 1)
    if not reproduction.get("measured"):
        return f"Reproduction rate: not measured; `repro.sh` runs the case {n} time(s) (`REPRO_RUNS=N` for more)."
    shown, runs = reproduction["shown"], reproduction["runs"]
    low = lowest_rate(shown, runs)
    kind = "in every run measured" if shown == runs else "the failure is intermittent"
    return (
        f"Reproduction rate: {shown} of {runs} runs ({shown / runs:.0%}): {kind}. `repro.sh` runs the case up to "
        f"{n} times and stops at the first reproduction, printing `reproduced k of n`; it says `not reproduced` only "
        f"after {n} clean runs: {shown} of {runs} leaves a rate as low as {low:.0%} open (one-sided "
        f"{RATE_BOUND:.0%} bound), and a build failing at that rate shows it in {n} runs with probability >= "
        f"{reproduction.get('confidence', 0.99):.0%}. `REPRO_ALL=1` runs all {n} and counts."
    )


def _slot_steps(leg: dict) -> list[str]:
    """How a leg's slot saves and restores go between its requests (restore rounds), in words."""
    steps = [b for b in leg["batches"] if b["how"] in ("save", "restore")]
    if not steps:
        return []
    words = {
        "restore": "erased (`action=erase`) and restored (`action=restore`)",
        "restore-fresh": "restored into a fresh llama-server of the same command line (`action=restore`)",
        "restore-over": "restored (`action=restore`, no erase) after the slot served another, longer conversation "
        "(`requests/*-detour.json`)",
    }
    kinds = sorted({b["kind"] for b in steps if b["how"] == "restore"})
    return [
        "Between the requests the slot is saved (`POST /slots/{id}?action=save`, llama-server started with "
        "`--slot-save-path`) after a chat's turn and, before its next turn, "
        + "; or ".join(f"{words[k]} ({k} round)" for k in kinds)
        + ".",
        "",
    ]
