"""The `work` check: a cell's requests do no more work per generated token than its baseline's.

Some defects change neither a token nor acceptance, each step just does more (a full checkpoint where the partial
one suffices, the whole draft KV serialised, a prompt read again). Tokens/s cannot see that on a shared machine; the
counts (`Result.work`, harness.result.WORK_COUNTERS) are deterministic and machine-independent.
"""

import dataclasses

from harness.baselines import BaselineError, output_digest, shown
from harness.checks.acceptance import options_key
from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, harness_fault, not_run
from harness.models import resolve
from harness.models.registry import sliding_window
from harness.result import WORK_COUNTERS

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
rounds, so there they are not compared (`rounds_not_compared` in the evidence) and the other counters are."""
SPLITS_UNREPORTED = ("server",)
"""Backends whose split of a request into batches is shared with the other slots and not reported: llama-server
fills its logical batch (n_batch) with the slots' tokens in turn, so outside `seq` where a slot's prompt breaks depends
on what the other slots put in the same batch, and it creates a prompt checkpoint before each batch that starts near
the prompt's end (tools/server/server-context.cpp, `near_prompt_end`). Measured: small-batch (`-b 2 -np 2`), par, no
speculation, tiny-hybrid, C: 2 checkpoints created against 1 in its baseline, same output and prompt cache, in 2 of the
last 4 full pytest runs (2026-11-26). There a request's checkpoint counters are never compared outside `seq`
(ROUND_COUNTERS)."""
OTHER_OUTPUT_TOLERANCE = 0.25
"""Relative slack per generated token for a request whose output differs from its baseline's (its drafts, and
so its steps, differ: `baseline` / `lossless` judge the tokens)."""


def tolerance(ctx: CheckContext, same_output: bool) -> float:
    if not same_output:
        return OTHER_OUTPUT_TOLERANCE
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
    """No request does more work than it should. Two rules:

    - against the baseline: no request does more work per generated token than the same request of the baseline
      (rows below);
    - a partial checkpoint does not grow with the sequence: on a model without a sliding-window cache, every
      checkpoint of a kind a request creates has the size of its first (CHECKPOINT_KINDS), baseline or not.

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
    return with_sizes(against_baseline(ctx, counted), *checkpoint_sizes(ctx, counted))


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


def with_sizes(verdict: CheckResult, lines: list[str], evidence: dict) -> CheckResult:
    """The baseline rule's verdict with the checkpoint-size rule's lines and evidence: failed where either failed
    (every failing request's line kept, so a known defect must explain each)."""
    evidence = {**verdict.evidence, **evidence}
    if not lines:
        return dataclasses.replace(verdict, evidence=evidence)
    more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
    if verdict.not_run is None and not verdict.passed:
        failures = (verdict.failures or [verdict.message]) + lines
        return CheckResult("work", False, verdict.message, evidence, failures=failures)
    return CheckResult("work", False, f"{lines[0]}{more}", evidence, failures=lines)


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
    neither its rounds nor its prompt's batches: SPLITS_UNREPORTED). A counter the backend cannot count (None) is not
    compared.
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
    failures, compared, worst, grown, skipped, rounds_skipped = [], 0, None, set(), 0, 0
    for o in counted:
        row = by_round.get(o.round)
        if row is None:
            continue
        if ctx.cell.mode in CACHE_MOVES and (
            o.result.work.prompt_reused != row.get("prompt_reused")
            or ("draft_n" in row and o.result.spec_stats.get("draft_n", 0) != row["draft_n"])
        ):
            skipped += 1
            continue
        compared += 1
        rounds_known = ctx.cell.mode not in CACHE_MOVES or (
            ctx.cell.backend not in SPLITS_UNREPORTED and _same_rounds(o.result.spec_stats, row)
        )
        rounds_skipped += not rounds_known
        generated, before_generated = max(len(o.result.tokens), 1), max(int(row.get("generated", 1)), 1)
        same = row.get("output") == output_digest(o.result.tokens)
        slack = tolerance(ctx, same)
        for counter in MORE_IS_WORSE:
            now, before = getattr(o.result.work, counter), row.get(counter)
            if now is None or before is None or (counter in ROUND_COUNTERS and not rounds_known):
                continue
            if same or counter in PROMPT_COUNTERS:
                a, b, unit = now, before, ""
            else:
                a, b, unit = now / generated, before / before_generated, " per generated token"
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
    if not compared:
        why = (
            f"every request met another prompt cache or drafted otherwise than in the baseline ({skipped})"
            if skipped
            else f"the baseline {shown(path)} holds no work row for this case's rounds under {key}"
        )
        return not_run("work", why)
    if failures:
        # the counters in a fixed order (the failure's signature), then the request that grew most
        counters = [c for c in MORE_IS_WORSE if c in grown]
        evidence["counters"] = counters
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        message = f"more work than the baseline in {', '.join(counters)}; {worst[2]}{more}"
        return CheckResult("work", False, message, evidence, failures=failures)
    return CheckResult("work", True, evidence=evidence)


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
