"""`planekv demo` on synthetic data: every system reports, bits and errors are what a user expects."""

from planekv.demo import run_demo
from planekv.evaluation.decode_data import synthetic_data
from planekv.kvstore.reference import SYSTEM_NAMES


def test_demo_rows() -> None:
    data = synthetic_data(n_tokens=256, n_steps=2, n_layers=1)
    rows, facts = run_demo(data, rates=(4.0, 2.0))
    # every system at both rates, dense and fp8 once
    assert len(rows) == 2 * len(SYSTEM_NAMES) - 2
    by = {(r.system, r.target_rate): r for r in rows}
    dense = by[("Dense fp16", 16.0)]
    assert dense.bits_read == 16.0 and dense.rel_error < 1e-2
    for rate in (4.0, 2.0):
        flex = by[(f"ReadKV(8,{rate:g}) flexible", rate)]
        assert abs(flex.bits_read - rate) < 1e-6  # the budget, exactly
        assert flex.capacity_bits == 8.0
        assert flex.rel_error < 1.0
    assert by[("ReadKV(8,4) flexible", 4.0)].rel_error < by[("ReadKV(8,2) flexible", 2.0)].rel_error
    for rate in (4.0, 2.0):  # PlaneKV's flexible reader (+ Key refinement) spends at most the same budget
        kr = by[(f"ReadKV(8,{rate:g}) flexible + Key refinement 0.3", rate)]
        assert rate - 0.1 < kr.bits_read <= rate + 1e-9 and kr.rel_error < 1.0
    assert facts["pages_in_use"] > 0
