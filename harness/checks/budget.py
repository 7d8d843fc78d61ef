"""`within-n-predict`: speculation never returns more tokens than a request asked for."""

from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, not_run


def within_n_predict(ctx: CheckContext) -> CheckResult | None:
    """No completed request returned more tokens than the case's `n_predict`, and one that returned exactly
    `n_predict` ended with stop reason `limit` (or `word`: llama-server checks stop strings first, and a stop
    string the last token completes ends the request as `word`). A speculative step emits several tokens at
    once, so the draft must leave room: llama-server caps it at `n_remaining - 1` (get_n_draft_max;
    ggml-org/llama.cpp#10641), the in-process engine likewise. Does not apply to `n_predict: -1` (the context
    end bounds those)."""
    n_predict = ctx.case_def.sampling.n_predict
    done = ctx.completed()
    if n_predict < 0:
        return not_run("within-n-predict", "n_predict -1: the context end bounds the request")
    if not done:
        return not_run("within-n-predict", NO_OUTPUT)
    failures = [
        f"round {o.round}: {len(o.result.tokens)} tokens returned for n_predict {n_predict}"
        for o in done
        if len(o.result.tokens) > n_predict
    ]
    failures += [
        f"round {o.round}: all {n_predict} tokens returned, but the stop reason is {o.result.stop_reason}, not limit"
        for o in done
        if len(o.result.tokens) == n_predict and o.result.stop_reason not in ("limit", "word")
    ]
    evidence = {"n_predict": n_predict, "requests": len(done), "most_returned": max(len(o.result.tokens) for o in done)}
    if failures:
        return CheckResult(
            "within-n-predict",
            False,
            f"{len(failures)} of {len(done)} requests broke n_predict; {failures[0]}",
            evidence,
            failures=failures,
        )
    return CheckResult("within-n-predict", True, evidence=evidence)
