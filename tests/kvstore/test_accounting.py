"""Accounting (DESIGN 2), ReadPolicy budgets and validation (DESIGN 1.8, 5), and ReadStats."""

from __future__ import annotations

import itertools

import pytest
import torch

from planekv.kvstore import (
    BudgetError,
    FormatSpec,
    GaussianTree,
    ReadPolicy,
    ReadStats,
    capacity,
    capacity_for,
    dense_bytes,
    history_reads,
    logical_read_bits,
    rate,
    two_stage_workspace_bytes,
    write_amortization,
)
from planekv.kvstore.accounting import codebook_bytes
from planekv.kvstore.calibration import Calibration


def test_write_amortization_reference():
    assert write_amortization(8192, 128, 8, 4) == pytest.approx(0.00787, abs=1e-5)
    s = history_reads(8192, 128)
    assert s == 128 * 8192 + 128 * 127 // 2
    assert write_amortization(8192, 128, 8, 4) == pytest.approx(4 * (8192 + 128) / (4 * s), rel=1e-12)
    assert write_amortization(100, 10, 8, 8) == 0.0
    # more decode steps amortize better
    assert write_amortization(8192, 1024, 8, 4) < write_amortization(8192, 128, 8, 4)
    assert history_reads(0, 1) == 0 and history_reads(5, 1) == 5 and history_reads(0, 3) == 3


@pytest.mark.parametrize("args", [(-1, 10, 8, 4), (10, 0, 8, 4), (10, 10, 8, 0), (10, 10, 8, -1)])
def test_write_amortization_rejects(args):
    with pytest.raises(ValueError):
        write_amortization(*args)


@pytest.mark.parametrize("layers,batch,tokens,heads,d,w", [(30, 4, 8192, 3, 64, 8), (2, 1, 1, 1, 8, 8),
                                                           (26, 2, 1000, 1, 256, 6), (32, 32, 32768, 8, 128, 8)])
def test_capacity_formula_and_split(layers, batch, tokens, heads, d, w):
    total = 2 * layers * batch * tokens * heads * d * w // 8
    c = capacity(layers, batch, tokens, heads, d, w)
    assert c.hot_bytes == total and c.cold_bytes == 0
    assert c.metadata_bytes == codebook_bytes(w)
    assert c.total_bytes == total + codebook_bytes(w)
    for h in range(w + 1):
        s = capacity(layers, batch, tokens, heads, d, w, hot_planes=h, calibration_bytes=123)
        assert s.hot_bytes == 2 * layers * batch * tokens * heads * d * h // 8
        assert s.hot_bytes + s.cold_bytes == total
        assert s.metadata_bytes == 123 + codebook_bytes(w)
    # W/16 of a dense fp16 cache
    assert total * 16 == dense_bytes(layers, batch, tokens, heads, d) * w


def test_capacity_rejects_bad_hot_planes():
    with pytest.raises(ValueError):
        capacity(1, 1, 1, 1, 8, 8, hot_planes=9)
    with pytest.raises(ValueError):
        capacity(1, 1, 1, 1, 8, 8, hot_planes=-1)


def test_codebook_bytes_counts_levels_and_thresholds():
    for w in (1, 4, 8):
        tree = GaussianTree(w)
        n = sum(len(tree.levels(t)) for t in range(w + 1)) + len(tree.thresholds(w))
        assert codebook_bytes(w) == 4 * n
    assert codebook_bytes(8) == 4 * (511 + 255)


def test_capacity_for_spec_counts_each_kv_head_once():
    spec = FormatSpec(model_id="m", n_layers=30, n_q_heads=9, n_kv_heads=3, head_dim=64, calibration_id="c")
    c = capacity_for(spec, batch=2, tokens=4096, hot_planes=3)
    scalars = 2 * 30 * 2 * 4096 * 3 * 64
    assert c.hot_bytes == scalars * 3 // 8 and c.cold_bytes == scalars * 5 // 8
    z = torch.zeros(30, 3, 64)
    calib = Calibration(z, z + 1, z, z + 1, spec.seed_k, spec.seed_v)
    assert c.metadata_bytes == calib.nbytes() + codebook_bytes(8)
    # GQA: the query heads do not enter
    spec_mha = FormatSpec(**{**spec.to_dict(), "n_q_heads": 3})
    assert capacity_for(spec_mha, 2, 4096) == capacity_for(spec, 2, 4096)


def test_logical_read_and_rate():
    assert logical_read_bits(1000, 128, 300, 2000) == 1000 * 300 + 128 * 2000
    assert rate(1000, 128, 300, 2000) == (1000 * 300 + 128 * 2000) / (2 * 1000 * 128)
    assert rate(100, 64, 64 * 8, 100 * 8) == 8.0
    assert rate(100, 64, 0, 0) == 0.0


def test_two_stage_workspace_bytes():
    hq, hk, t, d = 8, 2, 1000, 128
    one = 4 * 2 * hq * t + 5 * hk * t + 5 * hk * d + 4 * hq * d
    assert two_stage_workspace_bytes(hq, hk, t, d) == one
    assert two_stage_workspace_bytes(hq, hk, t, d, batch=3) == 3 * one


GRID = list(itertools.product([1, 7, 64, 1000, 4096], [64, 128], [0.0, 0.5, 1.0, 2.0, 3.3, 4.0, 6.0, 7.9],
                              [0.25, 0.5, 0.75]))


def test_budgets_give_the_rate_back_within_one_increment():
    checked = 0
    for t, d, r, phi in GRID:
        if 2 * r * phi > 8 or 2 * r * (1 - phi) > 8:
            continue  # the split itself asks for more than is stored on one side (clamped; see below)
        pol = ReadPolicy(rate=r, k_share=phi)
        bk, bv = pol.budgets(t, d)
        assert bk == round(2 * d * r * phi) == pol.key_budget(d)  # independent of T
        assert 0 <= bk <= 8 * d and 0 <= bv <= 8 * t
        got = rate(t, d, bk, bv)
        # B_V is floored: never above R, and below by less than one V increment (d bits = 1/(2T) of R)
        assert got <= r + 1e-12
        assert r - got < 1 / (2 * t) + 1e-12, (t, d, r, phi, bk, bv, got)
        checked += 1
    assert checked > 150


def test_budgets_are_clamped_to_what_is_stored():
    assert ReadPolicy(rate=8.0).budgets(100, 64) == (512, 800)
    assert ReadPolicy(rate=8.0, k_share=0.9).budgets(100, 64) == (512, 800)
    assert ReadPolicy(rate=6.0, k_share=0.9).budgets(100, 64) == (512, 400)
    assert ReadPolicy(rate=None, budget_k=10_000, budget_v=10_000).budgets(100, 64) == (512, 800)
    assert ReadPolicy(rate=None, budget_k=3, budget_v=5).budgets(100, 64) == (3, 5)
    assert ReadPolicy(rate=4.0, width=4).budgets(10, 64) == (256, 40)


def test_budgets_below_minimum_depth():
    with pytest.raises(BudgetError):
        ReadPolicy.constrained(0.25).budgets(100, 64)  # B_K = 16 < 64 channels at depth 1
    with pytest.raises(BudgetError):
        ReadPolicy(rate=None, budget_k=64, budget_v=99, min_depth_v=1).budgets(100, 64)
    assert ReadPolicy(rate=None, budget_k=64, budget_v=100, min_depth_k=1, min_depth_v=1).budgets(100, 64) == (64, 100)


@pytest.mark.parametrize("kw", [
    {"rate": -0.5}, {"rate": 8.5}, {"rate": 4.0, "budget_k": 10}, {"rate": 4.0, "budget_k": 1, "budget_v": 1},
    {"rate": None}, {"rate": None, "budget_k": 10}, {"rate": None, "budget_v": 10},
    {"rate": None, "budget_k": -1, "budget_v": 10}, {"rate": None, "budget_k": 1, "budget_v": -10},
    {"k_share": -0.1}, {"k_share": 1.5}, {"min_depth_k": -1}, {"min_depth_v": 9}, {"v_packet": 0},
    {"rate": 5.0, "width": 4},
])
def test_policy_validation(kw):
    with pytest.raises(BudgetError):
        ReadPolicy(**kw)


def test_policy_unknown_reader():
    with pytest.raises(ValueError):
        ReadPolicy(reader="fast")  # type: ignore[arg-type]


def test_policy_presets_and_record():
    f = ReadPolicy.flexible(3.0, 0.4)
    assert (f.reader, f.pool_heads, f.min_depth_k, f.min_depth_v, f.v_packet, f.k_share) == \
        ("flexible", True, 0, 0, 1, 0.4)
    c = ReadPolicy.constrained(2.0)
    assert (c.reader, c.pool_heads, c.min_depth_k, c.min_depth_v, c.v_packet, c.k_share) == \
        ("constrained", False, 1, 1, 2, 0.5)
    assert f.label == "ReadKV(8,3) flexible"
    assert ReadPolicy(rate=None, budget_k=5, budget_v=7).label == "ReadKV(8,BK=5,BV=7) flexible"
    d = c.to_dict()
    assert ReadPolicy(**d) == c and d["rate"] == 2.0


def test_read_stats():
    st = ReadStats(k_bits=torch.tensor([100.0, 300.0]), v_bits=torch.tensor([200.0, 0.0]),
                   tokens=torch.tensor([10.0, 20.0]), n_kv_heads=2, head_dim=8)
    assert st.total_bits.tolist() == [300.0, 300.0]
    assert st.dense_bits.tolist() == [16.0 * 2 * 10 * 8 * 2, 16.0 * 2 * 20 * 8 * 2]
    assert st.bits_per_scalar == pytest.approx(600 / (2 * 8 * 2 * 30))
    assert st.read_fraction == pytest.approx(600 / (16 * 2 * 8 * 2 * 30))
    st.physical_bytes = 5
    st.workspace_bytes = 7
    other = ReadStats(k_bits=torch.tensor([1.0]), v_bits=torch.tensor([2.0]), tokens=torch.tensor([3.0]),
                      n_kv_heads=2, head_dim=8, workspace_bytes=1, physical_bytes=4)
    joined = ReadStats.concat([st, other])
    assert joined.k_bits.tolist() == [100.0, 300.0, 1.0] and joined.tokens.tolist() == [10.0, 20.0, 3.0]
    assert joined.physical_bytes == 9 and joined.workspace_bytes == 8
    other.physical_bytes = None
    assert ReadStats.concat([st, other]).physical_bytes is None
