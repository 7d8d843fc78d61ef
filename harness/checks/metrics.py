"""`metrics-agree`: llama-server's own counters (`/metrics`) say what its answers say.

Around every batch it serves (one request in `seq`, a round's requests sent together elsewhere) the session
reads llama-server's /metrics with every slot idle (harness.backends.server_backend `_measured`): the counters
a slot adds when it is released (server-context.cpp `metrics_on_prediction`) must have moved by exactly what
the batch's answers report in their `timings`:

- `tokens_predicted_total` by the sum of `predicted_n`;
- `spec_decode_num_draft_tokens_total` by the sum of `draft_n`;
- `spec_decode_num_accepted_tokens_total` by the sum of `draft_n_accepted`, and the per-position series
  `spec_decode_num_accepted_tokens_per_pos_total` (summed over its positions) by the same.

Exact: both are the same slot counters, added up in two places. Nobody else compares them (upstream's server
tests read /metrics without the timings), so a slot whose counters are dropped, doubled or reset before they
reach /metrics (the acceptance rate every dashboard shows) is seen here. Prompt counters are not compared:
llama-server counts prompt tokens of a batch even for a slot released before the count (its own note in
`metrics_post_decode`). A batch with a request that did not complete (its counters are llama-server's, its
answer is not) or that the session could not measure (a restart, no answer from /metrics) is not compared, and
the evidence says so. In-process cells: not run (the engine has no /metrics).
"""

import dataclasses

from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, not_run
from harness.result import Result

NAME = "metrics-agree"
COUNTERS = (
    ("tokens_predicted_total", "predicted_n"),
    ("spec_decode_num_draft_tokens_total", "draft_n"),
    ("spec_decode_num_accepted_tokens_total", "draft_n_accepted"),
    ("spec_decode_num_accepted_tokens_per_pos_total", "draft_n_accepted"),
)
"""(/metrics counter, the answers' field whose sum over the batch it must have moved by)."""


def answered(result: Result, field: str) -> int:
    """What one answer reports for `field` (its timings' predicted_n, its draft counters)."""
    if field == "predicted_n":
        return result.timings.predicted_n
    return int(result.spec_stats.get(field, 0))


def metrics_agree(ctx: CheckContext) -> CheckResult:
    """llama-server's /metrics counters moved over each batch of the case's requests by exactly what the batch's
    answers report (predicted tokens, drafted, accepted, accepted per position; see the module docstring). Fails
    naming the counter, the batch's requests and both numbers; not run in-process, or where no batch of the case
    could be compared (the reason in the evidence)."""
    if ctx.cell.backend != "server":
        return not_run(NAME, "the in-process engine has no /metrics (llama-server's counters)")
    if not ctx.completed():
        return not_run(NAME, NO_OUTPUT)
    members: dict[int, list] = {}
    for o in ctx.run.outcomes:
        if o.result.metrics:
            members.setdefault(o.result.metrics["batch"], []).append(o)
    batches = {o.result.metrics["batch"]: o.result.metrics for o in ctx.outcomes if o.result.metrics}
    if not batches:
        return not_run(NAME, "no request of the case was measured by /metrics")
    failures, compared, left_out = [], 0, []
    for batch, measured in sorted(batches.items()):
        mates = members[batch]
        names = ", ".join(sorted({f"{o.case} round {o.round}" for o in mates}))
        if "unmeasured" in measured:
            left_out.append(f"batch {names}: {measured['unmeasured']}")
            continue
        if len(mates) != measured["requests"] or not all(o.result.ok for o in mates):
            left_out.append(f"batch {names}: a request did not complete (its counters are not in an answer)")
            continue
        compared += 1
        delta = measured["delta"]
        for counter, field in COUNTERS:
            moved = round(delta.get(counter, 0.0))
            says = sum(answered(o.result, field) for o in mates)
            if moved != says:
                failures.append(f"{names}: /metrics {counter} moved by {moved}, the answers' {field} add up to {says}")
    evidence = {"batches_compared": compared}
    if left_out:
        evidence["not_compared"] = left_out
    if not compared:
        return dataclasses.replace(not_run(NAME, f"no batch could be compared: {left_out[0]}"), evidence=evidence)
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        return CheckResult(
            NAME,
            False,
            f"llama-server's /metrics disagree with its answers: {failures[0]}{more}",
            evidence,
            failures=failures,
        )
    return CheckResult(NAME, True, evidence=evidence)
