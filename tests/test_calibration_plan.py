"""What `calibrate` serves (harness.calibration.measure.servings): every variant once, a repeat only those whose
serving depends on timing, and never `seq/<spec>/in-order` (one slot serves in order whatever the round: it is
`seq/<spec>`'s serving, measured identical in every committed calibration file)."""

from collections import Counter

import pytest

from harness.calibration.measure import same_serving, servings, timing_dependent
from harness.calibration.variants import IN_ORDER, prompts, variants
from harness.errors import HarnessError


def test_a_repeat_serves_only_timing_dependent_variants_and_seq_in_order_is_never_served_twice():
    plan = servings(variants("server", "tiny-dense"), prompts("tiny-dense"), 2, False)
    every = variants("server", "tiny-dense", None)
    served = Counter(s.variant.name for s in plan)
    in_order = [v for v in every if v.name.endswith(f"/{IN_ORDER}") and v.cell.mode == "seq"]
    assert in_order, "the plan has seq in-order variants to fold"
    for v in every:
        if same_serving(v):
            assert served[v.name] == 0 and same_serving(v) in served
        else:
            assert served[v.name] == (2 if timing_dependent(v) else 1), v.name
    # longest first: every drafting-model variant before the others, so the last servings side by side are short
    kinds = [s.cell.spec.startswith("draft-") for s in plan]
    assert kinds == sorted(kinds, reverse=True)


def test_repeat_all_serves_every_variant_but_in_order_again():
    plan = servings(variants("server", "tiny-dense"), prompts("tiny-dense"), 2, True)
    served = Counter(s.variant.name for s in plan)
    for v in variants("server", "tiny-dense", None):
        assert served[v.name] == (0 if same_serving(v) else 2), v.name


def _pool_and_servings():
    from harness.backends.choose import backend_factories
    from harness.calibration.measure import _suite
    from harness.calibration.serving import Servings
    from harness.matrix import Cell

    pool = Servings("server", backend_factories()["server"](), jobs=2)
    suite = _suite("calibrate", prompts("tiny-dense")[:2], {})
    first = (suite, Cell("server", "seq", "none", "tiny-dense"))
    rest = [(suite, Cell("server", "par", spec, "tiny-dense")) for spec in ("none", "ngram-mod", "draft-simple")]
    return pool, first, rest


def test_servings_side_by_side_return_every_run_in_order_and_leave_no_session_open(tiny_models):
    pool, first, rest = _pool_and_servings()
    reference, runs = pool.serve(first, rest, lambda run: None)
    assert reference.cell == first[1] and [r.cell for r in runs] == [cell for _, cell in rest]
    assert all(not (r.error or r.fault or r.crash) and len(r.outcomes) == 2 for r in [reference, *runs])
    assert not pool._shared._open  # every executor closed its sessions


def test_a_failed_reference_stops_every_serving_and_closes_every_open_session(tiny_models):
    pool, first, rest = _pool_and_servings()

    def refuse(run):
        raise HarnessError("the reference was refused")

    with pytest.raises(HarnessError, match="the reference was refused"):
        pool.serve(first, rest, refuse)
    assert pool._shared.closing and not pool._shared._open
