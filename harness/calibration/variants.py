"""What calibration measures: the prompts, and the runs equivalent to the `seq`, non-speculative reference.

Logically equivalent runs must produce the same tokens, but not the same bits: a verification batch of k+1
tokens, another micro-batch split, or slots sharing one batch (par) run other kernels than a one-token decode.
The reference is the `seq`, non-speculative run of each prompt (every case of every suite that runs the model,
a chat's first turn, greedy, as long as the suite runs it); every other mode × speculative config of the
backend, plus a 7-token micro-batch split, is an equivalent run (a `Variant`).
"""

from dataclasses import dataclass, replace

from harness import MODES
from harness.errors import Unservable
from harness.execute import ExecOptions, serve_config
from harness.execute.run_options import DEFAULT_SUITE
from harness.matrix import Cell, cells, spec_preset
from harness.suites import Case, load_suite, suite_files

SPECS = {
    "inproc": ["none", "scripted-accept", "draft-simple", "ngram-mod", "ngram-map-k", "draft-mtp"],
    "server": [
        "none",
        "draft-simple",
        "ngram-mod",
        "ngram-map-k",
        "draft-mtp",
        "draft-eagle3",
        "draft-dflash",
        "draft-dspark",
    ],
}
"""The speculative configs of each backend's equivalent runs (`scripted-accept` drafts the reference's own
output, so every draft is accepted: only the batch shape changes), each where the model can serve it
(draft-simple with a draft model, draft-mtp with an MTP block, the draft heads -eagle3 / -dflash / -dspark with
the model's generated head). A cell where a known defect moves tokens or logits, or acceptance, is measured only
for what that defect leaves alone (`variants`): EAGLE3's acceptance collapses when slots verify together
(docs/upstream-defects.md row 14), and measuring that defect as noise would set a tolerance that excuses it."""
UBATCH = 7


def prompts(model: str) -> list[Case]:
    """The calibration prompts: every case of every suite whose matrix names `model` (a chat's first turn),
    greedy, as long as that suite runs it for the model (a case generating to the context end, `n_predict`
    -1, is left out); each distinct prompt once. A model no suite names (a
    model file of your own) takes the cases of the default suite, `quicksort`."""
    cases, seen = [], set()
    suites = [load_suite(str(path)) for path in suite_files()]
    named = [s for s in suites if any(model in block["models"] for block in s.matrix)]
    for suite in named or [s for s in suites if s.name == DEFAULT_SUITE]:
        for c in suite.cases:
            case = suite.cell_case(c, model)
            if case.sampling.n_predict < 0:  # runs to the context end by design (draft-budget's ctx_end_*)
                continue
            case = replace(
                case,
                name=f"{suite.name}.{case.name}",
                turns=case.turns[:1],
                sampling=replace(case.sampling, temperature=0.0, seed=None),
            )
            key = (
                case.prompt,
                tuple(case.turns),
                case.sampling.n_predict,
                repr(case.sampling.json_schema),
                case.sampling.grammar,
            )
            if key not in seen:
                seen.add(key)
                cases.append(case)
    return cases


IN_ORDER = "in-order"
"""The variant that sends the requests one at a time (every other sends them all at once)."""


NUMERIC_CHECKS = {"lossless", "mode-invariant", "baseline", "repeat-identical", "logits-close"}
"""The checks whose failures a defect shows as moved tokens or logits: a cell where a known defect does so is no
measure of numerical noise."""


def defect_of(
    cell: Cell, checks: set[str] | frozenset[str] = frozenset(NUMERIC_CHECKS), entries: list | None = None
) -> str | None:
    """The known llama.cpp defect (suites/known-failures.yaml, or `entries` already read from it) that moves what
    `checks` judge in `cell` (by default its tokens or logits), whichever suite and llama.cpp version: such a cell
    is no measure of that noise (an intermittent flip of the defect measured as noise would raise the near-tie
    floor and excuse it)."""
    if entries is None:
        from harness.suites import suites_dir
        from harness.verdict.known_failures import FILE_NAME
        from harness.verdict.known_failures import load as load_known

        entries = load_known(suites_dir() / FILE_NAME)
    return next((e.id for e in entries if set(checks) & set(e.check) and e.shows_in(cell)), None)


@dataclass(frozen=True)
class Variant:
    """One run equivalent to the seq / none reference, and what it measures."""

    name: str
    cell: Cell
    serve: dict
    logits: bool = True
    """Whether its logits and flips count toward the floor: False where a known defect moves tokens or logits."""
    acceptance: bool = True
    """Whether its requests' acceptance counts toward the spread: False where a known defect moves acceptance itself.
    Under a known defect of tokens or logits it counts (on the requests whose output equals the other run's, as the
    `acceptance` check compares): measured 2026-12-02, llama-server draft-dspark's acceptance moves under concurrency
    with the output unchanged on requests that took no step of that defect (quicksort's Python request in
    no-kv-unified: 14/50 -> 12/56 in 2 of 10 rounds sent at once, no partial rollback from a micro-batch ahead of
    another in 20 more), so requests without the step are no sample of the noise the check meets."""


def specs_of(backend: str, model: str) -> list[str]:
    """The speculative configs calibration measures for `model` on `backend`: SPECS, then every other one a suite
    judges the `acceptance` of on this model and backend (so no such cell is judged by the uncalibrated default),
    each where the model can serve it."""
    suites = [load_suite(str(path)) for path in suite_files()]
    judged = [
        cell.spec
        for suite in suites
        if "acceptance" in suite.checks  # the check's name, as suites and known-failures.yaml write it
        for cell in cells(suite.matrix, {"models": [model]})
        if cell.backend == backend and cell.preset.speculative
    ]
    return [s for s in dict.fromkeys([*SPECS[backend], *judged]) if _servable(Cell(backend, "seq", s, model))]


def variants(backend: str, model: str, only: list[str] | None = None, specs: list[str] | None = None) -> list[Variant]:
    """Every run equivalent to the seq / none reference (of the `only` specs where given): every mode × spec
    (`specs_of`), each spec with a 7-token micro-batch
    split, and each drafter that learns across requests once more with the requests sent one at a time (served in
    a fixed order, which its acceptance depends on). Where a known defect moves tokens or logits (`defect_of`) the
    run's logits are left out (its acceptance counts, on the requests of the same output); where
    one moves acceptance, its acceptance is left out; a run left with nothing to measure is not served. `specs`:
    `specs_of(backend, model)` where the caller has it already (it reads every suite)."""
    from harness.suites import suites_dir
    from harness.verdict.known_failures import FILE_NAME
    from harness.verdict.known_failures import load as load_known

    entries = load_known(suites_dir() / FILE_NAME)  # once for every variant, before any cell is made
    specs = [s for s in (specs or specs_of(backend, model)) if only is None or s in only]
    out = [
        (f"{mode}/{spec}", Cell(backend, mode, spec, model), {})
        for mode in MODES
        for spec in specs
        if (mode, spec) != ("seq", "none")
    ]
    out += [
        (f"seq/{spec}/n_ubatch={UBATCH}", Cell(backend, "seq", spec, model), {"n_ubatch": UBATCH}) for spec in specs
    ]
    out += [
        (f"seq/{spec}/{IN_ORDER}", Cell(backend, "seq", spec, model), {})
        for spec in specs
        if spec_preset(spec).learns_across_requests
    ]
    kept = []
    for name, cell, serve in out:
        numeric = defect_of(cell, entries=entries) is not None
        acceptance = defect_of(cell, {"acceptance"}, entries) is None
        if not numeric or (cell.preset.speculative and acceptance):
            kept.append(Variant(name, cell, serve, logits=not numeric, acceptance=acceptance))
    return kept


def _servable(cell: Cell) -> bool:
    """Whether the cell's model has what its speculative type needs (the executor's own test)."""
    try:
        serve_config(cell, ExecOptions(backends={}))
    except Unservable:
        return False
    return True
