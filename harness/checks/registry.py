"""The check registry (`CHECKS`) and the one evaluation of a cell's checks (`evaluate_cell`).

A check that does not apply to a case (e.g. `lossless` without speculation), or lacks what it judges, returns
`not_run(name, reason)`: recorded and reported, never a pass (`evaluate` gives each check exactly one of passed,
failed, not run, harness error)."""

import traceback
from collections.abc import Callable

from harness import interrupt
from harness.checks.base import CellSource, CheckContext, CheckResult, harness_fault, not_run
from harness.checks.budget import within_n_predict
from harness.checks.distribution import output_distribution
from harness.checks.draft_size import draft_size
from harness.checks.health import grammar_valid, kv_healthy, logits_close
from harness.checks.lossless import baseline, lossless, mode_invariant, no_crash, repeat_identical
from harness.checks.metrics import metrics_agree
from harness.checks.probs import probs_complete
from harness.checks.restore import restore_identical
from harness.checks.reuse import prompt_reuse
from harness.checks.speculation import acceptance, exercised, spec_ran
from harness.checks.synth import synth_acceptance
from harness.checks.work import work
from harness.engine import detok as detokenizers
from harness.errors import HarnessBug, HarnessError
from harness.result.cellrun import CellRun
from harness.suites import case_keys

Check = Callable[[CheckContext], CheckResult | None]


CHECKS: dict[str, Check] = {
    "no-crash": no_crash,
    "repeat-identical": repeat_identical,
    "lossless": lossless,
    "mode-invariant": mode_invariant,
    "baseline": baseline,
    "spec-ran": spec_ran,
    "acceptance": acceptance,
    "grammar-valid": grammar_valid,
    "kv-healthy": kv_healthy,
    "logits-close": logits_close,
    "exercised": exercised,
    "probs-complete": probs_complete,
    "prompt-reuse": prompt_reuse,
    "within-n-predict": within_n_predict,
    "work": work,
    "metrics-agree": metrics_agree,
    "restore-identical": restore_identical,
    "distribution": output_distribution,
    "synth-acceptance": synth_acceptance,
    "draft-size": draft_size,
}


def evaluate(ctx: CheckContext, names: list[str]) -> list[CheckResult]:
    """Every named check's outcome on one case of one cell, one result each, in order:

    - passed / failed: a verdict the software under test earned (a failing one's message ends with how to
      reproduce it); a llama.cpp crash, at start-up included, is a failed `no-crash`;
    - not run (`CheckResult.not_run`, with the reason): the check does not apply to the case, or what it needs
      did not happen (no request completed: `no-crash` says why);
    - harness error (`CheckResult.harness_error`): the harness could not serve this cell or a cell the check
      compares with, or a check raised. Never a verdict and never excused by a known failure: `specharness run`
      exits 3, the pytest item is an ERROR.
    """
    interrupt.phase("checking")
    if ctx.run.unservable is not None:  # the model has nothing the cell's speculative type needs: no verdict
        return [not_run(name, ctx.run.unservable) for name in names]
    if ctx.run.fault is not None:  # the cell was never (fully) served: nothing in it was earned
        trace = ctx.run.harness_error or ctx.run.fault
        return [harness_fault(name, f"the cell could not be served: {trace}") for name in names]
    results = []
    for name in names:
        try:
            result = CHECKS[name](ctx)
        except HarnessError as err:  # e.g. a reference cell the harness could not serve
            result = harness_fault(name, str(err))
        except HarnessBug as err:
            result = harness_fault(name, err.args[0] if err.args else repr(err))
        except Exception:  # noqa: BLE001 - a bug of ours in a check: a harness error, with its traceback
            result = harness_fault(name, traceback.format_exc())
        if result is None:
            result = not_run(name, "does not apply to this case")
        if result.is_verdict and not result.passed:
            result.message += f"\n  reproduce: {ctx.repro}"
        results.append(result)
    return results


def plain_detokenizer(tokens: list[int]) -> str:
    """Token ids as text where the model's vocabulary is not at hand."""
    return " ".join(f"<{t}>" for t in tokens)


def evaluate_cell(
    run: CellRun,
    cells: CellSource,
    baselines,
    names: list[str],
    repro: Callable[[str], str] | str,
    keys: list[str] | None = None,
) -> list[tuple[str, CheckResult]]:
    """The one loop over a cell's cases (every record name, or those in `keys`): each case's `evaluate` of the
    checks `names`, as (record name, result). `cells` serves the cells the checks compare with; `repro` is the
    command that reproduces the cell (or, given a record name, the case). Every caller (run, the pytest plugin,
    bisect, shrink) judges through here: one policy for harness errors, the detokenizer and what is not run."""
    detok = detokenizers.for_model(run.cell.model) if run.fault is None else None
    out = []
    for case in run.suite.cases:
        for key in case_keys(case):
            if keys is not None and key not in keys:
                continue
            command = repro(key) if callable(repro) else repro
            ctx = CheckContext(run, key, cells, baselines, detok or plain_detokenizer, command)
            out += [(key, r) for r in evaluate(ctx, names)]
    return out


def harness_errors(results) -> list[CheckResult]:
    """The results (CheckResults, or tuples ending with one) that are harness errors."""
    return [r for r in (x[-1] if isinstance(x, tuple) else x for x in results) if r.harness_error is not None]
