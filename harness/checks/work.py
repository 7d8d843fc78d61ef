"""The `work` check: a cell's requests do no more work per generated token than its baseline's.

Some defects change neither a token nor acceptance, each step just does more (a full checkpoint where the partial
one suffices, the whole draft KV serialised, a prompt read again). Tokens/s cannot see that on a shared machine; the
counts (`Result.work`, harness.result.WORK_COUNTERS) are deterministic and machine-independent.
"""

import dataclasses

from harness.checks.acceptance import options_key
from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, harness_fault, not_run
from harness.models import resolve
from harness.models.registry import sliding_window
from harness.result import WORK_COUNTERS
from harness.verdict.baselines import BaselineError, output_digest, shown

MORE_IS_WORSE = tuple(c for c in WORK_COUNTERS if c != "prompt_reused")
"""The counters where more is more work (`prompt_reused` is work saved: a prompt read again shows in
`prompt_read` and `target_decoded`)."""
PROMPT_COUNTERS = ("prompt_read",)
"""Counters of the prompt, compared as they are (not per generated token: the prompt does not grow with it)."""
SAME_OUTPUT_TOLERANCE = {
    (backend, mode): 0.0 for backend in ("inproc", "server") for mode in ("seq", "par", "no-kv-unified")
}
"""Relative slack for a request whose output equals its baseline's, per (backend, mode): measured, 3 clean runs
of quicksort on tiny-hybrid (none and draft-simple, 54 requests each) gave identical counts request for request on
both backends in every mode, and 2 clean runs of quicksort on Gemma 3 270M (126 requests) too, but where
llama-server served a request from a slot's prompt cache in one run and not in the other (see `work`)."""
DEFAULT_TOLERANCE = 0.10
"""Relative slack for a backend and mode not measured."""
CACHE_MOVES = ("par", "no-kv-unified")
"""The modes where a request's prompt cache is chance: llama-server serves it on the slot the pool lends it, whose
cache may hold its prompt or not (tiny-hybrid: 2 of 54 requests read 4 prompt tokens and restored a prompt
checkpoint in one of 3 runs, all 22 in the others; Gemma: 4 of 126, with a second prompt checkpoint created and, for
ngram-mod, other drafts and partial rollbacks), and so may its drafts where the slots share a drafter's state
(ngram-mod's table on llama-server: in 1 of 27 par requests of Gemma 69 tokens drafted against 68, 5 partial rollbacks
against 3, with the same prompt cache). There a request whose `prompt_reused` or `draft_n` differs from its
baseline's is not compared; in `seq` (one slot) both are the same every run and everything is compared."""
ROUND_COUNTERS = ("ckpt_created", "ckpt_created_bytes", "ckpt_restored", "ckpt_restored_bytes", "partial_rollbacks")
"""The counters of a request's speculative rounds: one checkpoint, and a restore or a partial rollback, per round
that rejected. Where the split of the drafts into rounds is chance (CACHE_MOVES on a backend that does not report
its rounds, `spec_cycles`) they are compared only where the backend reports its rounds and they are the baseline's:
llama-server split the same 68 drafts of Gemma quicksort (Python, par, ngram-mod, 54 accepted, same output, same
prompt cache) into rounds with 2, 3 and 4 partial rollbacks in 3 requests and runs; its /completion reports no
rounds and the baseline's rows hold none of its log's (harness.result.Work.steps), so against the baseline they are
not compared there (`rounds_not_compared` in the evidence) and the other counters are: outside `seq` llama-server's
rounds are compared with seq's same requests instead (`against_seq`), whose counts the baseline judges."""
OTHER_DRAFTS = "the drafter proposed other tokens than in the baseline"
"""Why a request's ROUND_COUNTERS are not compared with its baseline row in any mode, `seq` included, where its
drafted or accepted count is not the row's (`other_drafts` in the evidence): its rounds follow other drafts, so its
checkpoints and rollbacks are not like with like. A drafter's near-ties flip with the CPU's kernels like a target's:
Gemma 3 270M's q2_k-pure drafter on an AVX2-only machine (AMD family 23) drafted 91 tokens, 23 accepted, for w1
iterative.turn2 (llama-server, seq, draft-simple) against 87 and 25 recorded on an AVX-512 one (family 25), same
output, 3 runs alike: 22 partial rollbacks against 19 (2026-12-05). The drafts themselves are `acceptance`'s to judge
(calibrated per machine); the other counters, and the rounds of every request whose drafts are the row's, are still
compared."""
SPLITS_UNREPORTED = ("server",)
"""Backends whose split of a request into batches is shared with the other slots and not reported: llama-server
fills its logical batch (n_batch) with the slots' tokens in turn, so outside `seq` where a slot's prompt breaks depends
on what the other slots put in the same batch, and it creates a prompt checkpoint before each batch that starts near
the prompt's end (tools/server/server-context.cpp, `near_prompt_end`). Measured: small-batch (`-b 2 -np 2`), par, no
speculation, tiny-hybrid, C: 2 checkpoints created against 1 in its baseline, same output and prompt cache, in 2 of the
last 4 full pytest runs (2026-11-26). There a request's checkpoint counters (and `target_decoded`, which counts
each round's verification batch) are not compared with the baseline outside `seq` (ROUND_COUNTERS); `against_seq`
compares them with seq's same request where the request's log shows the same rounds and prompt batches."""


def tolerance(ctx: CheckContext) -> float:
    """The slack of a count compared with the baseline's (a request with the output its row was measured on)."""
    return SAME_OUTPUT_TOLERANCE.get((ctx.cell.backend, ctx.cell.mode), DEFAULT_TOLERANCE)


def cannot_judge(suite, case) -> str | None:
    """Why `work` cannot judge a case of a suite by design (its not-run reason), None where it can: a sampled case
    (temperature > 0), whose steps follow the tokens the sampler draws, and a suite whose requests may end with an
    allowed error (kv-fill's context_full: which requests end so is the slots' race), keep no work baseline."""
    if suite.allow_errors:
        return (
            f"requests of {suite.name} may end with {', '.join(suite.allow_errors)} by design (which ones is chance: "
            "the slots race for the KV cache), so no baseline holds their work"
        )
    if case.sampling.temperature > 0:
        return (
            f"sampled at temperature {case.sampling.temperature:g}: the steps follow the tokens the sampler draws, "
            "and baselines hold greedy runs' work only"
        )
    return None


CHECKPOINT_KINDS = ("prompt", "speculative")
"""The kinds of checkpoint whose sizes are compared with each other (harness.result.Work.ckpt_sizes): llama-server's
prompt checkpoints, and those before a verification. Each is PARTIAL_ONLY (tools/server/server-context.cpp: the
target's and the draft context's `update_tgt` / `update_dft`): it holds the state a `seq_rm` cannot cut back, a
recurrent state of fixed size, and no KV cell. So on a model without a sliding-window cache every checkpoint of a
kind has one size, at any position (measured: tiny-hybrid 0.056 MiB at 18 to 184 tokens; with its hybrid draft
0.112 MiB, prompt and speculative, at 18 to 146). One that grows with the sequence carries a KV cache whole: the
state write of a plain KV cache ignores PARTIAL_ONLY (src/llama-kv-cache.cpp, `GGML_UNUSED(flags)`; PR #28873)."""


def work(ctx: CheckContext) -> CheckResult:
    """No request does more work than it should. Four rules:

    - against the baseline: no request does more work per generated token than the same request of the baseline
      (rows below);
    - a partial checkpoint does not grow with the sequence: on a model without a sliding-window cache, every
      checkpoint of a kind a request creates has the size of its first (CHECKPOINT_KINDS), baseline or not;
    - one checkpoint per draft (`per_batch`, llama-server's steps): no verification batch has more than one
      speculative checkpoint created before it or restored after it;
    - outside `seq`, like with like (`against_seq`, llama-server's steps): each request does the work of the same
      request in `seq` of this run where that work is the request's own (its drafting rounds, and its prompt's
      cache and batches, the same as there), every count exact; what differs is not compared and the evidence
      says why (`against_seq`).

    Fails naming the counters and the request, or the checkpoint that grew; not run where the backend counted no
    work, with the reason where it cannot judge a case by design (`cannot_judge`: sampled cases, requests that may
    fail by design), or where the baseline holds no work for the cell (`--update-baselines` records it) and no
    checkpoint size could be compared."""
    why = cannot_judge(ctx.run.suite, ctx.case_def)
    if why:
        return not_run("work", why)
    done = ctx.completed()
    if not done:
        return not_run("work", NO_OUTPUT)
    counted = [o for o in done if o.result.work.counted()]
    if not counted:
        return not_run("work", f"the {ctx.cell.backend} backend counted no work")
    lines, evidence = checkpoint_sizes(ctx, counted)
    for rule in (against_seq, per_batch):
        more, seen = rule(ctx, counted)
        lines, evidence = lines + more, {**evidence, **seen}
    return with_sizes(against_baseline(ctx, counted), lines, evidence)


def checkpoint_sizes(ctx: CheckContext, counted: list) -> tuple[list[str], dict]:
    """The rule that a partial checkpoint does not grow with the sequence (CHECKPOINT_KINDS): within each request,
    every checkpoint of a kind is compared with its first. Requests are not compared with each other: a round that
    restored a slot (slot-restore) or met another slot's cache holds other contexts' state by design. Returns a line
    per request with a checkpoint of another size, and the evidence (the distinct [n_tokens, bytes] per kind, or
    why sizes are not compared)."""
    window = sliding_window(resolve(ctx.cell.model))
    if window:
        return [], {
            "checkpoint_sizes_not_compared": f"{ctx.cell.model} has a sliding-window cache ({window} positions): "
            "its partial checkpoints hold the window's cells, which grow with the sequence up to the window"
        }
    lines, evidence = [], {}
    for kind in CHECKPOINT_KINDS:
        for o in counted:
            taken = [(n, size) for k, n, size in (o.result.work.ckpt_sizes or []) if k == kind]
            if not taken:
                continue
            seen = evidence.setdefault("checkpoint_sizes", {}).setdefault(kind, [])
            seen[:] = sorted({*map(tuple, seen), *taken})[:10]
            (n0, size0), rest = taken[0], taken[1:]
            _, n, size = max(((abs(s - size0), n, s) for n, s in rest), default=(0, n0, size0))
            if size != size0:
                how = "grows" if size > size0 and n > n0 else "differs"
                lines.append(
                    f"{ctx.case} round {o.round}: a {kind} checkpoint of {_kib(size)} at {n} tokens against "
                    f"{_kib(size0)} at {n0} tokens in the same request: a partial checkpoint {how} with the sequence"
                )
    return lines, evidence


STEP_PARTS = {
    "speculative": (
        "ckpt_created",
        "ckpt_created_bytes",
        "ckpt_restored",
        "ckpt_restored_bytes",
        "partial_rollbacks",
        "target_decoded",
    ),
    "prompt": ("prompt_read", "ckpt_created", "ckpt_created_bytes", "ckpt_restored", "ckpt_restored_bytes"),
}
"""What `steps_of` counts of a llama-server request, in two parts compared apart (`against_seq`): the speculative
part (checkpoints created before a verification and restored after one, partial rollbacks, and `target_decoded` of
the generation: one-token decodes and verification batches, replays included), which follows from the request's
drafting rounds; and the prompt part (prompt tokens read, prompt checkpoints created and restored), which follows
from the prompt cache the slot held and the batches its prompt was read in."""
SEQ_TOLERANCE = 0.0
"""Relative slack of `against_seq`: measured, every compared part equal to seq's, bytes included (a checkpoint of
one sequence has one size in every mode). `specharness run --suite categories --backend server` (its 22 cells; 140
par and no-kv-unified requests of tiny-dense, tiny-hybrid and tiny-recurrent with draft-simple and tiny-hybrid-mtp
with draft-mtp), 3 clean runs on 2026-12-01: the speculative part compared in 140 of 140 requests each run, the
prompt part in 121, 119 and 119 (the others had another prompt cache than in seq), no count above seq's; `--suite
quicksort --backend server`, 3 clean runs: the speculative part in 231, 230 and 230 of 234 (the rest: EAGLE3's
drafts in par and no-kv-unified, which differ from seq's, a known defect), the prompt part in 194, 198 and 197, none
above."""


def steps_of(work) -> dict | None:
    """A llama-server request's steps (harness.result.Work.steps) as what `against_seq` compares: its drafting
    `rounds` (each fresh draft's size and how many of it the target accepted: a restored verification's accepted
    count is its replay's draft less the target's token), and the counts of STEP_PARTS (`speculative`, `prompt`);
    None where the backend logged no steps."""
    steps = work.steps
    if steps is None:
        return None
    verifications = steps.get("verifications") or []
    rounds, spec = [], dict.fromkeys(STEP_PARTS["speculative"], 0)
    spec["target_decoded"] = steps.get("decodes", 0)
    replay = False
    for i, (n_draft, accepted, made, made_bytes, restored, restored_bytes) in enumerate(verifications):
        spec["ckpt_created"] += made
        spec["ckpt_created_bytes"] += made_bytes
        spec["ckpt_restored"] += restored
        spec["ckpt_restored_bytes"] += restored_bytes
        spec["target_decoded"] += (1 + n_draft) if n_draft else 0
        if accepted is not None and 0 <= accepted < n_draft:
            spec["partial_rollbacks"] += 1
        if not replay and n_draft:
            kept = accepted
            if accepted == -1:  # restored: its replay verifies what was accepted and the target's token
                kept = verifications[i + 1][0] - 1 if i + 1 < len(verifications) else None
            rounds.append((n_draft, kept))
        replay = accepted == -1  # the next batch replays this one
    sizes = [c for c in work.ckpt_sizes or [] if c[0] == "prompt"]
    restored = steps.get("prompt_restored") or [0, 0]
    prompt = {
        "prompt_read": work.prompt_read,
        "ckpt_created": len(sizes),
        "ckpt_created_bytes": sum(c[2] for c in sizes),
        "ckpt_restored": restored[0],
        "ckpt_restored_bytes": restored[1],
    }
    return {
        "rounds": rounds,
        "speculative": spec,
        "prompt": prompt,
        "prompt_batches": list(steps.get("prompt_batches") or []),
        "verifications": verifications,
    }


def per_batch(ctx: CheckContext, counted: list) -> tuple[list[str], dict]:
    """One checkpoint per draft: llama-server checkpoints a slot's state once before verifying a fresh draft (a
    replay reuses it) and restores it at most once after, so a verification batch with more than one speculative
    checkpoint created before it or restored after it is work done twice, in any mode and without a reference.
    Returns a line per such request, and the evidence (the batches checked)."""
    lines, batches = [], 0
    for o in counted:
        steps = steps_of(o.result.work)
        if steps is None:
            continue
        batches += len(steps["verifications"])
        over = [(i, v) for i, v in enumerate(steps["verifications"]) if v[2] > 1 or v[4] > 1]
        if over:
            i, v = over[0]
            what = f"{v[2]} speculative checkpoints created" if v[2] > 1 else f"{v[4]} checkpoints restored"
            lines.append(
                f"{ctx.case} round {o.round}: {what} for one verification batch where one suffices, in {len(over)} "
                f"of its {len(steps['verifications'])} batches (the first: batch {i + 1}, {v[0]} drafts)"
            )
    return lines, ({"batches_checked": batches} if batches else {})


def against_seq(ctx: CheckContext, counted: list) -> tuple[list[str], dict]:
    """Outside `seq`, each llama-server request against the same request in `seq` of this run, like with like:
    the speculative part of its work (STEP_PARTS) where its output, prompt and drafting rounds (`steps_of`: each
    fresh draft's size and its accepted count, which for a greedy request are the drafter's and the target's, not the
    scheduler's) are seq's; the prompt part where its prompt, the prompt tokens it reused from the slot's cache and
    the batches its prompt was read in are seq's (which slot the pool lends, and what the other slots put in a batch,
    are chance). Every count is compared exact (SEQ_TOLERANCE). Returns a line per request that did more, and the
    evidence: `against_seq` with how many requests' parts were compared and why the others were not (never a pass:
    a cell none of whose requests could be compared has `compared` 0 and its reasons)."""
    if ctx.cell.mode == "seq" or not any(o.result.work.steps is not None for o in counted):
        return [], {}
    seq_cell = ctx.cell.reference(mode="seq")
    theirs = {o.round: o for o in ctx.other(seq_cell) if o.result.ok}
    lines, compared, skipped = [], {"speculative": 0, "prompt": 0}, {}

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    for o in counted:
        mine, ref = steps_of(o.result.work), theirs.get(o.round)
        if mine is None:
            skip("llama-server logged no steps for it (its task's lines did not all come)")
            continue
        seq = steps_of(ref.result.work) if ref is not None else None
        if seq is None:
            skip("seq has no such request with logged steps")
            continue
        if ctx.prompt_differs(o, ctx.earlier_replies(seq_cell, o.round)) or (
            o.result.prompt_tokens and ref.result.prompt_tokens and o.result.prompt_tokens != ref.result.prompt_tokens
        ):
            skip("its prompt differs from seq's (earlier replies differ)")
            continue
        parts = []
        if o.result.work.prompt_reused != ref.result.work.prompt_reused:
            skip("prompt part: it reused another part of its prompt from the slot's cache than in seq")
        elif mine["prompt_batches"] != seq["prompt_batches"]:
            skip("prompt part: its prompt was read in other batches than in seq (the other slots shared them)")
        else:
            parts.append(("prompt", "same prompt, prompt cache and prompt batches"))
        if o.result.tokens != ref.result.tokens:
            skip("speculative part: its output differs from seq's (the token checks judge it)")
        elif mine["rounds"] != seq["rounds"]:
            skip("speculative part: its drafts or their acceptance differ from seq's (the drafter's state)")
        else:
            parts.append(("speculative", f"same output and {len(mine['rounds'])} drafting rounds"))
        for part, same in parts:
            compared[part] += 1
            grown = []
            for counter in STEP_PARTS[part]:
                a, b = mine[part][counter], seq[part][counter]
                if a is not None and b is not None and a > b * (1 + SEQ_TOLERANCE) and a > b:
                    grown.append(f"{counter} {a} against {b}")
            if grown:
                lines.append(
                    f"{ctx.case} round {o.round}: more {part} work than the same request in seq ({same}): "
                    f"{', '.join(grown)} (tolerance {SEQ_TOLERANCE:.0%})"
                )
    evidence = {"compared": compared, "seq": seq_cell.id}
    if skipped:
        evidence["not_compared"] = skipped
    return lines, {"against_seq": evidence}


def with_sizes(verdict: CheckResult, lines: list[str], evidence: dict) -> CheckResult:
    """The baseline rule's verdict with the checkpoint-size rule's lines and evidence: failed where either failed
    (every failing request's line kept, so a known defect must explain each)."""
    evidence = {**verdict.evidence, **evidence}
    if not lines:
        if verdict.not_run is not None and verdict.evidence.get("nothing_compared") and _seq_compared(evidence):
            # the baseline's rows were there but no request was comparable; seq's same requests were
            evidence = {k: v for k, v in evidence.items() if k != "nothing_compared"}
            return CheckResult("work", True, evidence={**evidence, "baseline_not_compared": verdict.not_run})
        return dataclasses.replace(verdict, evidence=evidence)
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    if verdict.not_run is None and not verdict.passed:
        failures = (verdict.failures or [verdict.message]) + lines
        return CheckResult("work", False, verdict.message, evidence, failures=failures)
    return CheckResult("work", False, f"{lines[0]}{more}", evidence, failures=lines)


def _seq_compared(evidence: dict) -> bool:
    """Whether `against_seq` compared a part of any request."""
    return any((evidence.get("against_seq") or {}).get("compared", {}).values())


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def against_baseline(ctx: CheckContext, counted: list) -> CheckResult:
    """No request does more work per generated token than the same request of the baseline (the `work` rows
    `--update-baselines` stores per cell and round): target tokens decoded, prompt tokens read, checkpoints and
    their bytes, partial rollbacks, draft-model decodes (harness.result.WORK_COUNTERS). A request with the
    baseline's output is compared count for count (exact: measured so on both backends), another per generated
    token with a slack; outside `seq` a request that met another prompt cache or drafted another number of tokens
    than in the baseline (llama-server lends it any slot, and slots share ngram-mod's table) is not compared, and
    its checkpoint and rollback counters only where its rounds are known to be the baseline's (llama-server reports
    neither its rounds nor its prompt's batches: SPLITS_UNREPORTED) and, in every mode, its drafts are
    (OTHER_DRAFTS). A counter the backend cannot count (None) is not compared.
    Fails naming the counters and the request; not run where the baseline holds none for the cell
    (`--update-baselines` records it) or none of the requests could be compared (`work` has already set aside
    the cases it cannot judge and requests without counted work)."""
    store, key = ctx.baselines, options_key(ctx)
    try:
        rows, path = store.work(ctx, key)
    except BaselineError as err:
        return harness_fault("work", f"{err} (fix or delete it; it is never replaced silently)")
    if store.update:
        return not_run("work", "baselines updated in this run (not compared with what it wrote)")
    if rows is None:
        return not_run(
            "work",
            f"no work in the baseline {shown(path)} for {key}, re-record with: {ctx.repro} "
            f"--update-baselines{store.option}",
        )
    by_round = {r["round"]: r for r in rows}
    # where the rounds are not reported, the target's decodes (a verification batch per round, replays included)
    # follow the rounds too
    round_counters = ROUND_COUNTERS + (("target_decoded",) if ctx.cell.backend in SPLITS_UNREPORTED else ())
    failures, compared, worst, grown, skipped, rounds_skipped, other = [], 0, None, set(), 0, 0, 0
    other_drafts = []  # requests whose drafter proposed otherwise than in the baseline: their rounds not compared
    earlier = store.earlier_replies(ctx)  # a chat turn after a reply other than the baseline's has another prompt
    for o in counted:
        row = by_round.get(o.round)
        if row is None:
            continue
        n_prompt = (row.get("prompt_read") or 0) + (row.get("prompt_reused") or 0)
        if ctx.prompt_differs(o, earlier) or (n_prompt and n_prompt != len(o.result.prompt_tokens)):
            skipped += 1  # another prompt than the row's (an earlier reply differed, here or where it was recorded)
            continue
        if ctx.cell.mode in CACHE_MOVES and (
            o.result.work.prompt_reused != row.get("prompt_reused")
            or ("draft_n" in row and o.result.spec_stats.get("draft_n", 0) != row["draft_n"])
        ):
            skipped += 1
            continue
        compared += 1
        drafts = _other_drafts(o.result.spec_stats, row)
        rounds_known = drafts is None and (
            ctx.cell.mode not in CACHE_MOVES
            or (ctx.cell.backend not in SPLITS_UNREPORTED and _same_rounds(o.result.spec_stats, row))
        )
        rounds_skipped += not rounds_known
        if drafts is not None:
            other_drafts.append(f"{ctx.case} round {o.round}: {drafts}")
        # another output than the row's (numerics of another machine, a flip): other drafts, other steps, so only
        # the prompt's work is like with like; `lossless` / `baseline` judge the tokens
        same = row.get("output") == output_digest(o.result.tokens)
        other += not same
        slack = tolerance(ctx)
        for counter in MORE_IS_WORSE:
            now, before = getattr(o.result.work, counter), row.get(counter)
            if now is None or before is None or (counter in round_counters and not rounds_known):
                continue
            if not same and counter not in PROMPT_COUNTERS:
                continue
            a, b, unit = now, before, ""
            if a > b * (1 + slack) and a > b:
                growth = (a / b - 1) if b else float("inf")
                line = (
                    f"{ctx.case} round {o.round}: {counter} {_num(a)} against {_num(b)}{unit} in the baseline "
                    f"({'+' + format(growth, '.0%') if b else 'from 0'}, tolerance {slack:.0%})"
                )
                failures.append(line)
                grown.add(counter)
                if worst is None or growth > worst[0]:
                    worst = (growth, counter, line)
    evidence = {"baseline": shown(path), "key": key, "compared": compared}
    if skipped:
        evidence["not_compared"] = skipped  # requests whose cache or drafts moved (CACHE_MOVES)
    if rounds_skipped:
        evidence["rounds_not_compared"] = rounds_skipped  # requests whose rounds are not known to be the baseline's
    if other_drafts:
        evidence["other_drafts"] = other_drafts[:10]  # why: the drafter's proposals differ (OTHER_DRAFTS)
    if other:
        evidence["other_output"] = other  # requests whose output is not the row's: their prompt's work only
    if not compared:
        why = (
            f"every request met another prompt cache or drafted otherwise than in the baseline ({skipped})"
            if skipped
            else f"the baseline {shown(path)} holds no work row for this case's rounds under {key}"
        )
        return dataclasses.replace(not_run("work", why), evidence={**evidence, "nothing_compared": True})
    if failures:
        # the counters in a fixed order (the failure's signature), then the request that grew most
        counters = [c for c in MORE_IS_WORSE if c in grown]
        evidence["counters"] = counters
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        message = f"more work than the baseline in {', '.join(counters)}; {worst[2]}{more}"
        return CheckResult("work", False, message, evidence, failures=failures)
    return CheckResult("work", True, evidence=evidence)


def _other_drafts(stats: dict, row: dict) -> str | None:
    """How a request's drafts differ from its baseline row's (OTHER_DRAFTS): its drafted and accepted counts
    against the row's where the row stores them, None where they are the same (or the row stores neither)."""
    fields = [(f, stats.get(f, 0), row[f]) for f in ("draft_n", "draft_n_accepted") if row.get(f) is not None]
    if all(now == before for _, now, before in fields):
        return None
    return "drafted " + ", ".join(f"{f} {now} against {before}" for f, now, before in fields) + " in the baseline"


def _same_rounds(stats: dict, row: dict) -> bool:
    """Whether a request's drafts were split into the same rounds as its baseline's: neither drafted, or the backend
    reports its rounds (`spec_cycles`; llama-server does not) and its drafted, accepted and rounds are the row's
    where the row stores them."""
    if not stats.get("draft_n", 0) and not row.get("draft_n", 0):
        return True  # nothing drafted: no rounds
    if "spec_cycles" not in stats:
        return False
    return all(
        row.get(field) is None or stats.get(stat, 0) == row[field]
        for field, stat in (("draft_n", "draft_n"), ("draft_n_accepted", "draft_n_accepted"), ("rounds", "spec_cycles"))
    )


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:.3f}"
