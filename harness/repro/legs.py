"""`case.json`: the legs of a reproducer, built from the cell runs of a trial.

A leg is one served configuration and the exact requests it got: the subject (the failing cell) and, for a
comparison, the reference it is compared with (spec `none` for `lossless`, `seq` for `mode-invariant`). Each
holds the ServeConfig's fields, the llama-server command line (paths as `$LLAMA_SERVER`, `$MODEL`,
`$DRAFT_MODEL`), the request batches in the order they were sent (`seq`: one at a time, `par`: at once), each
request's /completion body with its prompt as token ids, and the tokens each request produced.

A restore round (harness.execute.slot_restore) is replayed step by step: its requests one at a time, with a `save` step
after the turn the round saves and a `restore` step before the next one (`restore`: erase, then restore;
`restore-over`: the other conversation's request, then restore; `restore-fresh`: a fresh server or engine of the
same configuration, where the chat's later requests of the round go, `"server": "fresh"`, and a `close-fresh`
step at the round's end).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from harness.backends.base import ServeConfig
from harness.backends.client import completion_payload
from harness.execute import CellRun, Executor
from harness.execute.slot_restore import DETOUR, detour
from harness.suites import FRESH, RESTORE_ROUNDS, Suite, case_keys

SUBJECT, REFERENCE = "subject", "reference"
JUDGES = {
    "crash": "the server (or the engine's worker) dies or does not answer: the failure reproduces",
    "error": "a request ends with an error: the failure reproduces",
    "differs": "the subject's output differs from the reference's: the failure reproduces",
    "rounds-differ": "the rounds' outputs differ from one another: the failure reproduces",
    "kv": "the KV cache of the request's slot is unhealthy (`specharness scan`): the failure reproduces",
    "restore": "a turn served after its slot's save and restore drafts or accepts other counts than the same turn "
    "of the uninterrupted round, with the same output: the failure reproduces",
}
"""How a reproducer decides, by judge name."""
PLACEHOLDERS = {
    "server_bin": "$LLAMA_SERVER",
    "model": "$MODEL",
    "draft_model": "$DRAFT_MODEL",
    "slot_save_path": "$WORK",
}


def judge_of(check: str, kind: str) -> str | None:
    """The judge of a failure: from its signature's kind (harness.signatures) and its check; None when only the
    harness's own check can judge it (acceptance, spec-ran, ...)."""
    if kind in ("crash", "timeout"):
        return "crash"
    if kind == "error":
        return "error"
    if check in ("lossless", "mode-invariant"):
        return "differs"
    if check == "repeat-identical":
        return "rounds-differ"
    if check == "kv-healthy":
        return "kv"
    if check == "restore-identical":
        return "restore"
    return None


def reference_cell(check: str, cell):
    """The cell a comparison check compares with (None for the others)."""
    if check == "lossless":
        return cell.reference(spec="none")
    if check == "mode-invariant":
        return cell.reference(mode="seq")
    return None


def tokenize(model: Path, text: str) -> list[int]:
    """Token ids of a completion prompt as llama-server's /tokenize gives them (BOS added, specials parsed)."""
    from harness.engine.model import Model

    return Model(model).tokenize(text)


def serve_fields(config: ServeConfig) -> dict:
    """A ServeConfig as JSON (paths left out: they are the reproducer's variables, and so is the process's extra
    environment; a scripted drafter's outputs as [prompt, output] pairs)."""
    data = asdict(config)
    for name in ("model", "draft_model", "env"):
        data.pop(name)
    engine = dict(config.engine)
    script = engine.pop("script", None)
    engine.pop("drafters", None)
    if script:
        engine["script"] = {"kind": script["kind"], "outputs": [[list(k), v] for k, v in script["outputs"].items()]}
    data["engine"] = engine
    return data


def server_command(config: ServeConfig, server_bin: Path, slot_save: bool) -> list[str]:
    """llama-server's argv for the config, as the server backend starts it, without host and port; paths are
    PLACEHOLDERS."""
    from harness.backends.server import LlamaServer

    options = {"slot_save_path": Path(PLACEHOLDERS["slot_save_path"])} if slot_save else {}
    server = LlamaServer.from_config(config, server_bin, port=0, **options)
    argv = server.command()
    names = {str(server_bin): PLACEHOLDERS["server_bin"], str(config.model): PLACEHOLDERS["model"]}
    if config.draft_model:
        names[str(config.draft_model)] = PLACEHOLDERS["draft_model"]
    out, skip = [], 0
    for _i, word in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if word in ("--host", "--port"):
            skip = 1
            continue
        out.append(names.get(word, word))
    return out


def batches(suite: Suite, run: CellRun, config: ServeConfig, prompts: dict[str, list[int]]) -> list[dict]:
    """The requests of a cell run in the order the executor sent them: per round, per chat step, one batch
    (`par`: sent at once); a restore round's requests one at a time with its slot steps (see the module). A
    request's prompt is the one the backend evaluated, else `prompts[key]`."""
    out = []
    cases = [suite.sent_case(c, run.cell) for c in suite.cases]
    for r, how in enumerate(suite.rounds):
        restoring = how in RESTORE_ROUNDS and suite.restore_after is not None
        saved: dict[str, tuple[int, int]] = {}  # case → (slot, tokens of the saved turn)
        fresh: set[str] = set()  # cases whose chat went on in the fresh server
        for step in range(max(len(c.turns) or 1 for c in cases)):
            requests = []
            for case in cases:
                if step >= (len(case.turns) or 1):
                    continue
                key = case_keys(case)[step]
                done = next((o for o in run.outcomes if o.case == key and o.round == r), None)
                tokens = (
                    done.result.prompt_tokens if done is not None and done.result.prompt_tokens else prompts.get(key)
                )
                if tokens is None:  # a chat turn never sent (an earlier turn failed)
                    continue
                request = {
                    "key": key,
                    "round": r,
                    "kind": how,
                    "payload": completion_payload(
                        tokens, case.sampling, config.logit_top_k, {"cache_prompt": False} if how == FRESH else None
                    ),
                }
                if not (restoring and case.is_chat):
                    requests.append(request)
                    continue
                if step == suite.restore_after and case.name in saved:
                    out.append(_restore_step(how, r, case.name, *saved.pop(case.name), config))
                    if how == "restore-fresh":
                        fresh.add(case.name)
                out.append({"how": "seq", "requests": [request], "server": "fresh" if case.name in fresh else "main"})
                if step == suite.restore_after - 1 and done is not None and done.result.ok:
                    slot = done.result.slot_id if done.result.slot_id >= 0 else 0
                    saved[case.name] = (slot, len(done.result.prompt_tokens) + len(done.result.tokens))
                    out.append(
                        {"how": "save", "round": r, "slot": slot, "file": _slot_file(r, case.name), "requests": []}
                    )
            if requests:
                out.append({"how": "par" if how == "par" and config.n_slots > 1 else "seq", "requests": requests})
        if fresh:
            out.append({"how": "close-fresh", "round": r, "requests": []})
    return out


def _slot_file(r: int, case: str) -> str:
    return f"saved-r{r}-{case}.bin"


def _restore_step(how: str, r: int, case: str, slot: int, saved_len: int, config: ServeConfig) -> dict:
    """The restore before the chat's turn after `restore.after_turn` (with the other conversation of
    `restore-over`, as harness.execute.slot_restore.detour sends it)."""
    step = {"how": "restore", "kind": how, "round": r, "slot": slot, "file": _slot_file(r, case), "requests": []}
    if how == "restore-over":
        other = detour(saved_len)
        step["detour"] = completion_payload(tokenize(config.model, DETOUR), other.sampling, config.logit_top_k)
    return step


def outputs(run: CellRun, key: str) -> list[dict]:
    """What each round's request of `key` produced: tokens and text, or its error."""
    return [
        {
            "round": o.round,
            "tokens": o.result.tokens,
            "text": o.result.text,
            "stop_reason": o.result.stop_reason,
            "error": o.result.error,
            "kv_scan": o.result.kv_scan,
        }
        for o in run.of_case(key)
    ]


def leg(
    role: str,
    executor: Executor,
    suite: Suite,
    cell,
    key: str,
    prompts: dict[str, list[int]],
    server_bin: Path | None,
    slot_save: bool,
) -> dict:
    """One leg of `case.json` from the executor's (memoized) run of `cell`."""
    run = executor.run(suite, cell)
    config = executor._config(suite, cell)
    return {
        "role": role,
        "cell": asdict(cell),
        "serve": serve_fields(config),
        "command": server_command(config, server_bin, slot_save or any(h in RESTORE_ROUNDS for h in suite.rounds))
        if server_bin
        else None,
        "batches": batches(suite, run, config, prompts),
        "outputs": outputs(run, key),
    }
