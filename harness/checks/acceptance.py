"""Draft acceptance of one request, how far it may fall, and the `acceptance` check that judges it.

A request's acceptance is judged by two fractions, both deterministic for greedy decoding on one build:
accepted / drafted (the acceptance rate: the drafts got worse) and accepted / generated (the share of the
output that came from drafts: drafting got rarer, even where each draft is as good). A drop of either fails
when it is beyond the tolerance AND one token does not undo it (one more accepted and, for the rate, one fewer
drafted where this run drafted more): a single draft token accepted or rejected the other way is no finding,
and no calibration can tell it from a legitimate change of one draft. The two allowances do not add up: a
drop of several tokens is judged by the tolerance alone, so a collapse of a short request (2 of 2 accepted,
then 0 of 2) or of a long one (Gemma: 23 of 92 drafted, then 15) fails.

The check compares like with like only (`check`): each request with the stored row of the same cell, case,
options (`options_key`: the `--spec-*` overrides, slots, draft model) and round (modulo the rounds stored:
`--repeat`), recorded on the same output; and in `par` / `no-kv-unified`, with drafters that keep no state
between requests, with the same request in `seq`, where both produced the same output. What cannot be
compared is `not run`, with the reason: no row yet, baselines updated in this very run, an output that
differs (a near-tie flip or a divergence the token checks report), a tolerance calibration refused.
"""

from dataclasses import dataclass, field

from harness.checks.base import CheckContext, CheckResult, harness_fault, not_run
from harness.errors import HarnessError
from harness.verdict.baselines import output_digest

NAME = "acceptance"


@dataclass
class Acceptance:
    """The speculative counters of one request (or of several, summed)."""

    drafted: int
    accepted: int
    generated: int
    drafted_per_pos: list[int] | None = None
    accepted_per_pos: list[int] | None = None
    """Per draft position (in-process only: llama-server's /completion does not report them)."""

    @classmethod
    def of(cls, stats: dict, generated: int) -> "Acceptance":
        return cls(
            int(stats.get("draft_n", 0)),
            int(stats.get("draft_n_accepted", 0)),
            generated,
            stats.get("drafted_per_pos"),
            stats.get("accepted_per_pos"),
        )

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_generated(self) -> float:
        return self.accepted / self.generated if self.generated else 0.0

    @property
    def steps(self) -> int | None:
        """Verification steps that had a draft (where per-position counts are known)."""
        return self.drafted_per_pos[0] if self.drafted_per_pos else None

    @property
    def per_draft(self) -> float | None:
        """Accepted tokens per draft (mean acceptance length − 1)."""
        return self.accepted / self.steps if self.steps else None

    def position_rates(self) -> list[float] | None:
        """Per draft position k: the share of drafts with a token at k whose token at k was accepted."""
        if self.drafted_per_pos is None or self.accepted_per_pos is None:
            return None
        return [a / d if d else 0.0 for d, a in zip(self.drafted_per_pos, self.accepted_per_pos, strict=False)]

    def describe(self) -> str:
        per_draft = "" if self.per_draft is None else f", {self.per_draft:.2f} accepted per draft"
        return f"{100 * self.rate:.1f} % ({self.accepted}/{self.drafted} drafted{per_draft})"

    def to_evidence(self) -> dict:
        out = {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated": self.generated,
            "acceptance": round(self.rate, 4),
        }
        if self.per_draft is not None:
            out["accepted_per_draft"] = round(self.per_draft, 3)
        if self.position_rates() is not None:
            out["drafted_per_pos"], out["accepted_per_pos"] = self.drafted_per_pos, self.accepted_per_pos
        return out


def summed(items: list[Acceptance]) -> Acceptance:
    """Several requests' counters added up (per position where every one has them)."""

    def add(lists):
        if any(x is None for x in lists):
            return None
        out = [0] * max((len(x) for x in lists), default=0)
        for x in lists:
            for i, v in enumerate(x):
                out[i] += v
        return out

    return Acceptance(
        sum(a.drafted for a in items),
        sum(a.accepted for a in items),
        sum(a.generated for a in items),
        add([a.drafted_per_pos for a in items]),
        add([a.accepted_per_pos for a in items]),
    )


def undone_by_one(before: Acceptance, after: Acceptance) -> Acceptance:
    """`after` with one token given back: one more accepted and, where `after` drafted more than `before` (a
    rejected draft token makes the next step draft once more), one fewer drafted."""
    extra = 1 if after.drafted > before.drafted else 0
    return Acceptance(after.drafted - extra, after.accepted + 1, after.generated)


EPSILON = 1e-12
"""Float slack for comparing equal fractions computed from different counts (35/41 against 35/41)."""


def fall(before: Acceptance, after: Acceptance, tolerance: float) -> str | None:
    """Why `after` fell too far below `before` (None when it holds): the rate or the share of accepted tokens
    dropped by more than `tolerance`, and one token given back (`undone_by_one`) does not undo the drop."""
    if before.drafted == 0:
        return None
    why = []
    back = undone_by_one(before, after)
    if after.rate < before.rate - tolerance - EPSILON and min(1.0, back.rate) < before.rate - EPSILON:
        why.append(f"acceptance {before.describe()} -> {after.describe()}")
    if (
        after.per_generated < before.per_generated - tolerance - EPSILON
        and back.per_generated < before.per_generated - EPSILON
    ):
        of = "" if before.generated == after.generated else f" of {before.generated} generated"
        why.append(f"accepted tokens {before.accepted}{of} -> {after.accepted} of {after.generated} generated")
    if not why:
        return None
    where = steepest_fall(before, after)
    if where is not None:
        k, a, b = where
        why.append(f"steepest fall at draft position {k + 1} ({100 * a:.0f} % -> {100 * b:.0f} % accepted)")
    return "; ".join(why)


def steepest_fall(before: Acceptance, after: Acceptance) -> tuple[int, float, float] | None:
    """(position, rate before, rate after) of the draft position whose acceptance fell most (None when the
    per-position counts are missing or nothing fell)."""
    a, b = before.position_rates(), after.position_rates()
    if a is None or b is None:
        return None
    drops = [(x - (b[k] if k < len(b) else 0.0), k) for k, x in enumerate(a)]
    drop, k = max(drops, default=(0.0, 0))
    return (k, a[k], b[k] if k < len(b) else 0.0) if drop > 0 else None


# --- the `acceptance` check ------------------------------------------------------------------------------


def options_key(ctx: CheckContext) -> str:
    """The baseline key of this cell's acceptance rows: `<mode>/<spec>`, then the run options that shape a
    request's drafts where they differ from the defaults, e.g. `par/draft-simple [spec-draft-n-max=4]`: the
    `--spec-*` overrides, the slots (`--parallel`, unless the suite sets them) and `--draft-model`. In-process
    engine options (rollback strategy, checkpoint flags, a seeded `--fault`) are the software under test: a
    run with them is compared with the clean rows."""
    key = f"{ctx.cell.mode}/{ctx.cell.spec}"
    options = getattr(ctx.executor, "options", None)
    if options is None:
        return key
    shaping = {str(k): v for k, v in sorted(options.spec_overrides.items())}
    defaults = {f.name: f.default for f in type(options).__dataclass_fields__.values()}
    if "parallel" not in ctx.run.suite.serve and options.parallel != defaults.get("parallel", options.parallel):
        shaping["parallel"] = options.parallel
    if options.draft_model and "draft" in ctx.cell.spec:
        from harness.models import model_key  # here: a check without a draft model reads no model registry

        shaping["draft-model"] = model_key(options.draft_model)
    if not shaping:
        return key
    return f"{key} [{', '.join(f'{k}={v}' for k, v in shaping.items())}]"


@dataclass
class Pair:
    """One request compared with one reference (or why it is not)."""

    label: str
    """`baseline` or `seq`."""
    round: int
    before: Acceptance | None = None
    limit: float | None = None
    skipped: str | None = None
    """Why this request is not compared with this reference (None: it is)."""


@dataclass
class Plan:
    """What one case's acceptance is compared with, and the tolerances that apply."""

    tolerance: float | None
    source: str
    concurrent: float | None
    concurrent_source: str
    modes: float | None
    modes_source: str
    key: str
    pairs: list[Pair] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Why a whole reference is not compared (no baseline yet, baselines updated in this run)."""
    pending: str | None = None
    """The `no baseline yet` line: no acceptance row for this cell and options (a model without any baseline for
    this suite, backend and device, a cell outside the recorded matrix, other options)."""


def check(ctx: CheckContext) -> CheckResult:
    """The `acceptance` check of one case: the steps below, in order (the module docstring says what they judge)."""
    preset = ctx.cell.preset
    if not preset.speculative:
        return not_run(NAME, "the cell does not speculate")
    if not ctx.completed():
        return not_run(NAME, "no request of the case completed (no-crash says why)")
    mine = measured(ctx)
    plan = tolerances(ctx)
    try:
        against_baseline(ctx, plan, mine)
    except HarnessError as err:
        return harness_fault(NAME, f"{err} (fix or delete it; it is never replaced silently)")
    against_seq(ctx, plan, mine)
    problems = judge(plan, mine, ctx.run.suite.rounds)
    return result(ctx, plan, mine, problems)


def measured(ctx: CheckContext) -> dict[int, tuple[Acceptance, list[int]]]:
    """Step 1: this run's counters and output, per round of the case's completed requests."""
    return {
        o.round: (Acceptance.of(o.result.spec_stats, len(o.result.tokens)), o.result.tokens) for o in ctx.completed()
    }


def tolerances(ctx: CheckContext) -> Plan:
    """Step 2: the calibrated tolerances of (model, backend, device, spec): against the same cell with the
    requests in a fixed order, sent at once (a drafter that learns across requests then depends on the order
    they are served in), and against seq; None where calibration refused one (noise exceeds the range)."""
    floor = ctx.noise_floor
    fixed, source = floor.acceptance_tolerance(ctx.cell.spec)
    concurrent, concurrent_source = floor.acceptance_tolerance(ctx.cell.spec, "concurrent")
    modes, modes_source = floor.acceptance_tolerance(ctx.cell.spec, "modes")
    return Plan(fixed, source, concurrent, concurrent_source, modes, modes_source, options_key(ctx))


def _limit(plan: Plan, ctx: CheckContext, round_: int, label: str) -> tuple[float | None, str]:
    if label == "seq":
        return plan.modes, plan.modes_source
    if ctx.run.suite.rounds[round_] == "par" and ctx.cell.preset.learns_across_requests:
        return plan.concurrent, plan.concurrent_source
    return plan.tolerance, plan.source


def against_baseline(ctx: CheckContext, plan: Plan, mine: dict) -> None:
    """Step 3: each request against the stored row of the same options and round (round r against stored
    round r modulo the rounds stored, where the suite sends them the same way and, for a drafter that learns
    across requests, only rounds the baseline recorded: a later round follows a longer history), measured on
    the same output. With `--update-baselines` the rows are written here and nothing is compared with them."""
    store = ctx.baselines
    if store is None:
        return
    stored, path = store.acceptance(ctx, plan.key)
    if store.update:
        plan.notes.append("baselines updated in this run (not compared with what it wrote)")
        return
    if stored is None:
        what = plan.key if plan.key == f"{ctx.cell.mode}/{ctx.cell.spec}" else f"these options ({plan.key})"
        other = store.rows_mismatch(ctx, store.load(path))
        plan.pending = store.not_recorded(ctx) or (
            f"no baseline yet: no acceptance baseline for {what} in {path.name}"
            + (f" ({other})" if other else "")
            + f"; record it with: {ctx.repro} --update-baselines{store.option}"
        )
        plan.notes.append(plan.pending)
        return
    recorded = store.earlier_replies(ctx)
    rows = {row["round"]: row for row in stored}
    n = len(rows)
    rounds = ctx.run.suite.rounds
    learns = ctx.cell.preset.learns_across_requests
    done = {o.round: o for o in ctx.completed()}
    for r, (_, tokens) in sorted(mine.items()):
        pair = Pair("baseline", r)
        plan.pairs.append(pair)
        src = r % n if n and sorted(rows) == list(range(n)) else r
        if ctx.prompt_differs(done[r], recorded):
            pair.skipped = "its prompt carries earlier replies that differ from the baseline's"
        elif src not in rows:
            pair.skipped = f"no stored row for round {src}"
        elif src != r and learns:
            pair.skipped = (
                f"the drafter learns across requests: round {r} follows {r} earlier rounds, a history the "
                f"baseline (rounds 0-{n - 1}) did not record"
            )
        elif src != r and (r >= len(rounds) or src >= len(rounds) or rounds[r] != rounds[src]):
            pair.skipped = f"round {r} is sent otherwise than stored round {src}"
        elif rows[src]["output"] != output_digest(tokens):
            pair.skipped = (
                "its output differs from the one the baseline's counts were measured on (a divergence the "
                "token checks report, or a near-tie flip they excuse): its acceptance is not comparable"
            )
        else:
            pair.before = Acceptance.of(rows[src], rows[src]["generated"])
            pair.limit, why = _limit(plan, ctx, r, "baseline")
            if pair.limit is None:
                pair.skipped = why


def against_seq(ctx: CheckContext, plan: Plan, mine: dict) -> None:
    """Step 4: in `par` / `no-kv-unified`, with a drafter that keeps no state between requests, each request
    against the same request in `seq` of this run (a drafter state leaking between slots shows as a skew on
    some slots), where both produced the same output from the same prompt."""
    if ctx.cell.mode == "seq" or ctx.cell.preset.learns_across_requests:
        return
    seq_cell = ctx.cell.reference(mode="seq")
    theirs = {o.round: o for o in ctx.other(seq_cell) if o.result.ok}
    done = {o.round: o for o in ctx.completed()}
    for r, (_, tokens) in sorted(mine.items()):
        if r not in theirs:
            continue
        pair = Pair("seq", r)
        plan.pairs.append(pair)
        o = theirs[r]
        if ctx.prompt_differs(done[r], ctx.earlier_replies(seq_cell, r)):
            pair.skipped = "its prompt carries earlier replies that differ from seq's"
        elif o.result.tokens != tokens:
            at = next((i for i, (a, b) in enumerate(zip(o.result.tokens, tokens, strict=False)) if a != b), None)
            where = f" at token {at}" if at is not None else " in length"
            pair.skipped = (
                f"its output differs from seq's{where} (a near-tie flip mode-invariant excuses, or a divergence "
                "it reports): its acceptance is not comparable"
            )
        else:
            pair.before = Acceptance.of(o.result.spec_stats, len(o.result.tokens))
            pair.limit, why = _limit(plan, ctx, r, "seq")
            if pair.limit is None:
                pair.skipped = why


def judge(plan: Plan, mine: dict, rounds: list[str]) -> list[str]:
    """Step 5: one line per compared request whose acceptance fell beyond its tolerance, naming how its round sent
    it (`round 5 (par)`: with `--repeat`, which rounds sent their requests at once follows from the run order)."""
    problems = []
    for pair in plan.pairs:
        if pair.skipped is None and pair.before is not None:
            why = fall(pair.before, mine[pair.round][0], pair.limit)
            if why:
                how = f" ({rounds[pair.round]})" if pair.round < len(rounds) else ""
                problems.append(f"round {pair.round}{how} against {pair.label} (tolerance {pair.limit:.3g}): {why}")
    return problems


def result(ctx: CheckContext, plan: Plan, mine: dict, problems: list[str]) -> CheckResult:
    """Step 6: the verdict with its evidence; when no request was compared, `no baseline yet` (counted apart, as
    a missing token baseline) where that is the only reason, else `not run` with the reasons."""
    compared = [p for p in plan.pairs if p.skipped is None]
    skipped = [p for p in plan.pairs if p.skipped is not None]
    evidence: dict = {
        "tolerance": plan.tolerance,
        "tolerance_source": plan.source,
        "baseline_key": plan.key,
        "requests": len(mine),
        "compared": len(compared),
        "after": summed([a for a, _ in mine.values()]).to_evidence(),
    }
    if any(p.label == "baseline" and p.limit is not None for p in compared) and plan.concurrent != plan.tolerance:
        evidence["tolerance_sent_at_once"] = plan.concurrent
    if any(p.label == "seq" for p in compared):
        evidence["tolerance_against_seq"] = plan.modes
    for label in ("baseline", "seq"):
        befores = [p.before for p in compared if p.label == label and p.before is not None]
        if befores:
            evidence[label] = summed(befores).to_evidence()
    if plan.pending and not compared:
        evidence["no_baseline"] = True
    if skipped:
        evidence["not_compared"] = [f"round {p.round} against {p.label}: {p.skipped}" for p in skipped]
        moot = [p for p in skipped if p.label == "baseline" and "earlier replies" in p.skipped]
        if moot:
            evidence["not_compared_with_baseline"] = len(moot)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(
            NAME,
            False,
            f"{ctx.cell.id}, {problems[0]}{more}; tolerances: {plan.source}",
            evidence,
            failures=problems,
        )
    if not compared and plan.pending and not skipped:  # the same kind as a missing token baseline
        return CheckResult(NAME, True, plan.pending, evidence)
    if not compared:
        reasons = list(dict.fromkeys(plan.notes + [f"round {p.round} against {p.label}: {p.skipped}" for p in skipped]))
        outcome = not_run(NAME, "; ".join(reasons) if reasons else "nothing to compare with")
        outcome.evidence = evidence
        return outcome
    notes = "; ".join(plan.notes + evidence.get("not_compared", []))
    return CheckResult(NAME, True, f"{len(compared)} compared; not compared: {notes}" if notes else "", evidence)
