"""`synth-acceptance`: llama-server's synthetic acceptance (`--spec-synth-rates P0,P1,...`, a benchmarking option)
accepts draft position i at the configured rate, and the same seed gives the same decisions.

What llama-server does (tools/server/server-context.cpp, `server_sample_and_accept_synth`, at 0c1e570). P_i is the
unconditional probability that draft position i is accepted (n_max values, non-increasing:
common/speculative.cpp `common_speculative_synth_rates_resolve`); the verifier walks a step's draft and accepts
position i when a uniform draw of the slot's std::mt19937 is below the conditional rate P_i / P_{i-1} (P_{-1} = 1;
0 where P_{i-1} is 0), stopping at the first rejection, whatever the target sampled: the output is not the target's
(`lossless` and `baseline` are not run). The generator is seeded when a request starts, with the request's
sampling seed (the harness leaves it to llama-server's `-s 42`; a random seed, -1, draws one from
std::random_device). A drafted end-of-generation token is never accepted, whatever the draw.

The statistic. A step that drafted position i accepted it with probability P_i, independently of how the step came
to draft it (the draw is made after the draft, from a generator only the verifier uses), so:
- per position (where a request's per-position counts are known, `Result.spec_stats` `drafted_per_pos` /
  `accepted_per_pos`, the in-process engine's counters, which llama-server's log prints at `-lv 5` as one
  `add accepted tokens: ... ids.size=K, n_draft=N` line per step (`steps_from_log`): K - 1 accepted of N
  drafted): the steps that accepted position i out of those that drafted it are Binomial(drafted_i, P_i),
  judged with the two-sided exact `scipy.stats.binomtest`;
- from the totals llama-server's response gives (`timings.draft_n`, `timings.draft_n_accepted`, the generated
  count): draft-simple at `--spec-draft-p-min` 0 (llama-server's default) drafts min(n_max, n_remaining - 1)
  tokens at every step (get_n_draft_max: a step leaves room for the token sampled after its draft; no draft at
  n_remaining 1), so a request's steps are a Markov chain in its generated count g: from g, a draft of
  n = min(n_max, n_predict - g - 1) tokens accepts k of them with probability P_{k-1} - P_k (P_{n-1} for all n)
  and g moves to g + k + 1. `total_law` gives the exact joint law of (accepted, drafted) of the paths that end
  where the request ended (n_predict, or an end-of-generation token at a step's end), and the test is the exact
  two-sided test of the accepted total under it (p: the probability of every total no likelier than the
  observed one). Its expectation is the sum over the steps of P_0 + ... + P_{n_s - 1} (2.4 per full step of the
  `synth-rates` preset, 0.9 + 0.7 + 0.5 + 0.3; 89.2 of quicksort's 128 tokens, about 37 steps). It is not
  conditioned on the drafted total: the tokens are the accepted ones plus one per step, so with n_max tokens a
  full step the drafted total fixes the accepted one (given 134 drafted of 128 tokens, 93 accepted is the only
  likely total whatever the rates); the drafted total must only be one the chain drafts with the accepted one
  (else the drafts were not full ones, and the request is not judged).
The per-position test is used where the counts are there, the totals' otherwise (llama-server's responses).

One request per case is judged: the rounds of a case send it with the same seed, so they draw the same decisions
and are copies, not further samples (they are compared with each other instead: the same seed must give the same
counts, in every mode). The cases of a cell share the seed too (each request's generator starts at the same seed):
their counts agree wherever their drafts do, so they are not independent either; the union bound below holds
whatever the dependence.

False alarms: the test fails at p < ALPHA. A default run judges RUN_JUDGMENTS positions with it: 4 draft positions ×
3 cases (the synth-acceptance suite: C, Java, Python) × 2 cells (seq and par of `synth-rates` on tiny-dense,
llama-server), so ALPHA = 1e-3 / (4 × 3 × 2) = 1e-3 / 24 ≈ 4.2e-5 keeps a clean run red through this check with
probability at most 1e-3 (a union bound; the totals test makes 1 judgment per case and cell, 6 × ALPHA ≈ 2.5e-4).
Power at that alpha is that of one request (the cases and cells share the seed: one sample a run; quicksort's 128
tokens, about 37 steps), simulated over 300 requests: position 0 accepted at 0.5 instead of 0.9 (the later
conditional rates unchanged) fails 89% of them from the totals, 100% per position; position 3 at 0.5 instead of 0.3
fails 0% (totals) and 2% (per position), every rate at 0.8 times its value 5% and 24%. Gross faults only: a finer
test needs more steps (longer requests, or cases with seeds of their own).

Not judged: a drafted end-of-generation token (its rejection is forced; tiny-dense's draft drafted none in the
measured runs) biases the counts low; a request that reached the end of the context (`truncated`: the draft is also
capped by the context) or stopped at a stop string (mid-step) is left out of the totals test, as is a cell whose
drafts end early (`spec-draft-p-min` > 0: the lengths are then not known from the totals).
"""

from collections import defaultdict

from harness.checks.base import NO_OUTPUT, CheckContext, CheckResult, not_run

NAME = "synth-acceptance"
RUN_FALSE_ALARM = 1e-3
"""The per-run false-alarm budget of this check: a clean default run is red through it at most this often."""
RUN_JUDGMENTS = 4 * 3 * 2
"""Positions judged in a default run: 4 draft positions × 3 quicksort cases × 2 cells (seq, par)."""
ALPHA = RUN_FALSE_ALARM / RUN_JUDGMENTS
"""The p-value below which a position (or a request's total) fails: 1e-3 / 24 ≈ 4.2e-5."""
NOT_VALID = "synthetic acceptance keeps drafted tokens the target did not choose (llama-server: output not valid)"
"""Why `lossless` and `baseline` do not judge a cell with synthetic acceptance."""
_STEP = "add accepted tokens:"
_RESTORE = "restoring speculative checkpoint"


def rates_of(options: dict) -> list[float] | None:
    """The configured unconditional rates (`spec-synth-rates`: a comma-separated string or a list), or None."""
    value = options.get("spec-synth-rates")
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [float(x) for x in items]


def accepts_synthetically(options: dict) -> bool:
    """Whether the speculative options make llama-server accept drafts at random (`--spec-synth-rates` with a
    rate above 0, or `--spec-synth-len` above 1): its output then holds draft tokens the target did not choose.
    `--spec-synth-len 1` (rates 0: every draft rejected, `synth-reject`) keeps the target's output."""
    rates = rates_of(options)
    if rates is not None:
        return any(r > 0 for r in rates)
    length = options.get("spec-synth-len")
    return length is not None and float(length) > 1


def step_law(rates: list[float], n: int) -> list[float]:
    """P(k of a draft of n tokens accepted), k = 0..n, under unconditional rates: P_{k-1} - P_k, and P_{n-1}."""
    out, before = [], 1.0
    for k in range(n):
        out.append(max(before - rates[k], 0.0))
        before = rates[k]
    out.append(before)
    return out


def total_law(rates: list[float], n_predict: int, end: int) -> dict[tuple[int, int], float]:
    """{(accepted, drafted): probability} of the paths of draft-simple's steps (p_min 0) that reach `end`
    generated tokens at a step's end: the first token is sampled after the prompt (g = 1); a step at g drafts
    n = min(n_max, n_predict - g - 1) tokens (n_predict <= 0: no limit) and moves g by its accepted count + 1; at
    n <= 0 a plain step moves it by 1. With end = n_predict every path gets there (the masses sum to 1)."""
    n_max = len(rates)
    laws = {n: step_law(rates, n) for n in range(1, n_max + 1)}
    mass: dict[int, dict[tuple[int, int], float]] = {1: {(0, 0): 1.0}}
    for g in range(1, end):
        states = mass.pop(g, None)
        if not states:
            continue
        n = n_max if n_predict <= 0 else min(n_max, n_predict - g - 1)
        if n <= 0:
            nxt = mass.setdefault(g + 1, {})
            for key, p in states.items():
                nxt[key] = nxt.get(key, 0.0) + p
            continue
        for (t, d), p in states.items():
            for k, q in enumerate(laws[n]):
                if q > 0 and g + k + 1 <= end:
                    nxt = mass.setdefault(g + k + 1, {})
                    nxt[(t + k, d + n)] = nxt.get((t + k, d + n), 0.0) + p * q
    return mass.get(end, {})


def judge_total(rates: list[float], n_predict: int, end: int, drafted: int, accepted: int) -> dict | None:
    """The exact two-sided test of a request's accepted total under `total_law`: the p-value (the probability of
    every accepted total no likelier than `accepted`) and the expected accepted total. Not conditioned on the
    drafted total: a request's tokens are its steps' accepted tokens plus one per step, so the drafted total (4 per
    full step) fixes the accepted one and proves nothing; it must only be one the chain drafts along with
    `accepted`. None where it is not (the drafts were not draft-simple's full ones: not judged)."""
    every = [0.5 ** (i + 1) for i in range(len(rates))]  # every accepted count of every draft possible
    if total_law(every, n_predict, end).get((accepted, drafted), 0.0) <= 0:
        return None
    marginal: dict[int, float] = {}
    for (t, _), p in total_law(rates, n_predict, end).items():
        marginal[t] = marginal.get(t, 0.0) + p
    norm = sum(marginal.values())
    if norm <= 0:
        return {"p_value": 0.0, "expected_accepted": None}
    observed = marginal.get(accepted, 0.0) / norm
    p_value = sum(p for p in marginal.values() if p / norm <= observed * (1 + 1e-7)) / norm if observed else 0.0
    expected = sum(t * p for t, p in marginal.items()) / norm
    return {"p_value": min(1.0, p_value), "expected_accepted": round(expected, 3)}


def per_position(steps: list[tuple[int, int]], n_max: int) -> tuple[list[int], list[int]]:
    """(drafted_per_pos, accepted_per_pos) of steps given as (drafted, accepted): a step drafted positions
    0..drafted-1 and accepted positions 0..accepted-1."""
    drafted, accepted = [0] * n_max, [0] * n_max
    for n, a in steps:
        for i in range(min(n, n_max)):
            drafted[i] += 1
            accepted[i] += i < a
    return drafted, accepted


def steps_from_log(messages: list[str]) -> list[tuple[int, int]] | None:
    """(drafted, accepted) of each verification step of one task's llama-server log messages (`-lv 5`: its
    `add accepted tokens: sampled=.., ids.size=K, n_draft=N` line, K - 1 of N accepted); None where a step
    restored a checkpoint (the line after a restore is the replay's, which does not say how many were drafted)."""
    steps = []
    for message in messages:
        if message.startswith(_RESTORE):
            return None
        if message.startswith(_STEP):
            fields = dict(part.strip().split("=", 1) for part in message[len(_STEP) :].split(",") if "=" in part)
            steps.append((int(fields["n_draft"]), int(fields["ids.size"]) - 1))
    return steps


def judge_positions(drafted: list[int], accepted: list[int], rates: list[float], alpha: float = ALPHA) -> dict:
    """Each draft position's accepted count against its configured unconditional rate (two-sided exact binomial
    test): {"passed", "positions": [{position, drafted, accepted, rate, observed, p_value}], "min_p"}; a position
    no step drafted is listed without a p-value."""
    from scipy import stats

    rows = []
    for i, rate in enumerate(rates):
        n = drafted[i] if i < len(drafted) else 0
        k = accepted[i] if i < len(accepted) else 0
        row = {"position": i, "drafted": n, "accepted": k, "rate": rate}
        if n > 0:
            row["observed"] = round(k / n, 4)
            row["p_value"] = float(stats.binomtest(k, n, rate).pvalue) if k <= n else 0.0
        rows.append(row)
    ps = [r["p_value"] for r in rows if "p_value" in r]
    return {"passed": all(p >= alpha for p in ps), "positions": rows, "min_p": min(ps, default=None)}


def _counts(stats_: dict) -> tuple:
    """What the same seed must reproduce: the totals and, where known, the per-position counts."""
    return (
        stats_.get("draft_n", 0),
        stats_.get("draft_n_accepted", 0),
        tuple(stats_.get("drafted_per_pos") or ()),
        tuple(stats_.get("accepted_per_pos") or ()),
    )


def synth_acceptance(ctx: CheckContext, rates: list[float] | None = None) -> CheckResult:
    """Where the cell's preset sets `spec-synth-rates`: each draft position was accepted at its configured
    unconditional rate (per-position binomial tests where the counts are known, else the exact test of the
    accepted total given the drafted total; p < ALPHA fails, ALPHA from a 1e-3 per-run budget), and the rounds
    of a case (the same seed) drew the same counts. `rates` replaces the configured ones (tests)."""
    preset = ctx.cell.preset
    options = {**preset.options, **getattr(getattr(ctx.executor, "options", None), "spec_overrides", {})}
    configured = rates_of(options)
    if configured is None:
        return not_run(NAME, "the cell's speculative config sets no spec-synth-rates")
    rates = configured if rates is None else rates
    done = ctx.completed()
    if not done:
        return not_run(NAME, NO_OUTPUT)
    sampling = ctx.case_def.sampling
    evidence: dict = {"rates": rates, "alpha": ALPHA}
    failures: list[str] = []

    # the same seed, the same decisions: rounds that generated as many tokens the same way drew the same counts
    if not sampling.random_seed:
        groups = defaultdict(list)
        for o in done:
            groups[(len(o.result.tokens), o.result.stop_reason)].append(o)
        for group in groups.values():
            first = _counts(group[0].result.spec_stats)
            for o in group[1:]:
                if _counts(o.result.spec_stats) != first:
                    failures.append(
                        f"round {o.round} drew {_counts(o.result.spec_stats)[:2]} (drafted, accepted) with the same "
                        f"seed as round {group[0].round}, which drew {first[:2]}"
                    )
        evidence["rounds_compared"] = sum(len(g) for g in groups.values() if len(g) > 1)

    # the rates: one request (the first completed round; the others are copies)
    judged = done[0]
    s, result = judged.result.spec_stats, judged.result
    evidence.update(round=judged.round, drafted=s.get("draft_n", 0), accepted=s.get("draft_n_accepted", 0))
    if s.get("drafted_per_pos") and s.get("accepted_per_pos"):
        verdict = judge_positions(s["drafted_per_pos"], s["accepted_per_pos"], rates)
        evidence.update(statistic="per-position binomial", positions=verdict["positions"], p_value=verdict["min_p"])
        failures += [
            f"round {judged.round}: position {r['position']} accepted {r['accepted']} of {r['drafted']} "
            f"({r['observed']:.3f}) against the rate {r['rate']}: p = {r['p_value']:.3g} < alpha {ALPHA:.2g}"
            for r in verdict["positions"]
            if r.get("p_value", 1.0) < ALPHA
        ]
    else:
        p_min = float(options.get("spec-draft-p-min", 0) or 0)
        if options.get("spec-type") != "draft-simple" or p_min > 0:
            why = f"{options.get('spec-type')} at spec-draft-p-min {p_min}: draft lengths vary, the totals cannot say"
            return _partial(failures, evidence, why)
        if result.truncated or result.stop_reason not in ("limit", "eos"):
            return _partial(failures, evidence, f"round {judged.round} ended by {result.stop_reason} mid-step")
        if not s.get("draft_n"):
            return _partial(failures, evidence, f"round {judged.round} drafted nothing")
        test = judge_total(rates, sampling.n_predict, len(result.tokens), s["draft_n"], s.get("draft_n_accepted", 0))
        if test is None:
            why = f"no path of full draft-simple drafts drafts {s['draft_n']} tokens in {len(result.tokens)}"
            return _partial(failures, evidence, why)
        evidence.update(statistic="exact test of the accepted total given the drafted total", **test)
        if test["p_value"] < ALPHA:
            failures.append(
                f"round {judged.round}: {s.get('draft_n_accepted', 0)} of {s['draft_n']} drafted tokens accepted, "
                f"{test['expected_accepted']} expected at rates {rates}: p = {test['p_value']:.3g} < alpha {ALPHA:.2g}"
            )
    if failures:
        return CheckResult(NAME, False, failures[0], evidence, failures=failures)
    return CheckResult(NAME, True, evidence=evidence)


def _partial(failures: list[str], evidence: dict, why: str) -> CheckResult:
    """The rates could not be judged: a failure of the rounds' comparison still fails, else not run."""
    if failures:
        return CheckResult(NAME, False, failures[0], evidence, failures=failures)
    return not_run(NAME, f"the rates cannot be judged: {why}")
