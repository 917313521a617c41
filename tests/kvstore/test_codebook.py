"""The Gaussian Lloyd binary tree (DESIGN 1.3): reference levels, thresholds and D(t), nesting,
conditional-mean levels (checked by Monte Carlo), the reconstruction table, and bad depths."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch

from planekv.kvstore.codebook import MAX_DEPTH, GaussianTree, lloyd_max_levels

# DESIGN 1.3, as printed. Each value is checked to every printed digit (half a unit of the last one).
D_REFERENCE = ["1", "0.3634", "0.1175", "0.0348", "0.0098", "0.00266", "0.00071", "0.000185", "0.000048"]


def _tol(printed: str) -> float:
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return 0.5 * 10.0 ** (-decimals) + 1e-15


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


@pytest.fixture(scope="module")
def tree() -> GaussianTree:
    return GaussianTree(8)


def test_depth_one_levels(tree):
    lv = tree.levels(1)
    s = math.sqrt(2 / math.pi)
    assert lv[0] == pytest.approx(-s, abs=1e-12) and lv[1] == pytest.approx(s, abs=1e-12)
    assert lv[1] == pytest.approx(0.7979, abs=5e-5)
    assert tree.thresholds(1) == [0.0]
    assert tree.levels(0) == [0.0]


def test_depth_two_levels_and_thresholds(tree):
    assert tree.levels(2) == pytest.approx([-1.5104, -0.4528, 0.4528, 1.5104], abs=5e-5)
    assert tree.thresholds(2) == pytest.approx([-0.9816, 0.0, 0.9816], abs=5e-5)


def test_distortion_reference_values(tree):
    d = tree.distortion
    assert len(d) == MAX_DEPTH + 1
    for t, printed in enumerate(D_REFERENCE):
        assert abs(d[t] - float(printed)) <= _tol(printed), (t, d[t], printed)
    # closed forms where they exist
    assert d[0] == 1.0
    assert d[1] == pytest.approx(1 - 2 / math.pi, abs=1e-14)


def test_distortion_equals_one_minus_energy_of_levels(tree):
    """For conditional-mean levels, D(t) = 1 - sum_nodes P(node) level^2; masses from the thresholds."""
    for t in range(1, MAX_DEPTH + 1):
        edges = [-math.inf, *tree.thresholds(t), math.inf]
        mass = [_phi(b) - _phi(a) for a, b in pairwise(edges)]
        energy = sum(p * c * c for p, c in zip(mass, tree.levels(t), strict=True))
        assert tree.distortion[t] == pytest.approx(1 - energy, rel=1e-9, abs=1e-13)


def test_levels_are_closed_form_centroids(tree):
    for t in range(1, MAX_DEPTH + 1):
        edges = [-math.inf, *tree.thresholds(t), math.inf]
        for (a, b), c in zip(pairwise(edges), tree.levels(t), strict=True):
            mass = _phi(b) - _phi(a)
            if mass > 1e-9:
                assert c == pytest.approx((_pdf(a) - _pdf(b)) / mass, rel=1e-7, abs=1e-9)
            assert a < c < b


def test_marginal_gains_non_increasing(tree):
    g = tree.marginal_gains()
    assert len(g) == MAX_DEPTH
    d = tree.distortion
    assert g == pytest.approx([d[t - 1] - d[t] for t in range(1, MAX_DEPTH + 1)], rel=0, abs=0)
    assert all(x > 0 for x in g)
    assert all(a >= b for a, b in pairwise(g))
    assert all(a > b for a, b in pairwise(d))


def test_children_straddle_parent(tree):
    for t in range(MAX_DEPTH):
        parent = tree.levels(t)
        child = tree.levels(t + 1)
        split = tree.split_thresholds(t)
        assert len(parent) == 2**t and len(child) == 2 ** (t + 1) and len(split) == 2**t
        edges = [-math.inf, *tree.thresholds(t), math.inf] if t else [-math.inf, math.inf]
        for i in range(2**t):
            lo, hi = child[2 * i], child[2 * i + 1]
            assert lo < split[i] < hi
            assert lo < parent[i] < hi
            # the split lies in the parent's interval, and obeys the conditional Lloyd condition
            assert edges[i] < split[i] < edges[i + 1]
            assert split[i] == pytest.approx(0.5 * (lo + hi), abs=1e-9)
        # depth-(t+1) thresholds are the depth-t ones plus the new splits
        assert tree.thresholds(t + 1) == sorted((tree.thresholds(t) if t else []) + split)


def test_levels_sorted_and_symmetric(tree):
    for t in range(MAX_DEPTH + 1):
        lv = tree.levels(t)
        assert lv == sorted(lv)
        assert lv == pytest.approx([-x for x in reversed(lv)], abs=1e-9)
    th = tree.thresholds(MAX_DEPTH)
    assert len(th) == 2**MAX_DEPTH - 1
    assert all(a < b for a, b in pairwise(th))


def test_levels_are_conditional_means_monte_carlo(tree):
    g = torch.Generator().manual_seed(20261130)
    z = torch.randn(2_000_000, generator=g, dtype=torch.float64)
    leaf = torch.bucketize(z, tree.boundaries().double())
    n = torch.bincount(leaf, minlength=256).double()
    s = torch.bincount(leaf, weights=z, minlength=256)
    s2 = torch.bincount(leaf, weights=z * z, minlength=256)
    lv = torch.tensor(tree.levels(8), dtype=torch.float64)
    ok = n >= 2000
    assert int(ok.sum()) > 150
    mean = s[ok] / n[ok]
    var = (s2[ok] / n[ok] - mean**2).clamp_min(0)
    se = (var / n[ok]).sqrt()
    err = (mean - lv[ok]).abs()
    assert bool((err <= 5 * se + 1e-9).all()), float((err / se).max())
    # and the leaf masses are the normal masses of the leaf intervals
    edges = [-math.inf, *tree.thresholds(8), math.inf]
    p = torch.tensor([_phi(b) - _phi(a) for a, b in pairwise(edges)], dtype=torch.float64)
    se_p = (p * (1 - p) / z.numel()).sqrt()
    assert bool(((n / z.numel() - p).abs() <= 5 * se_p + 1e-7).all())


def test_table_matches_levels(tree):
    tab = tree.table()
    assert tab.shape == (MAX_DEPTH + 1, 256) and tab.dtype == torch.float32
    codes = torch.arange(256)
    for t in range(MAX_DEPTH + 1):
        want = torch.tensor(tree.levels(t), dtype=torch.float64)[codes >> (8 - t)].float()
        assert torch.equal(tab[t], want)
    assert torch.equal(tab[0], torch.zeros(256))


def test_boundaries(tree):
    b = tree.boundaries()
    assert b.dtype == torch.float32 and b.shape == (255,)
    assert torch.equal(b, torch.tensor(tree.thresholds(8), dtype=torch.float64).float())
    # bucketize on the boundaries puts z in the leaf whose depth-t prefix is the depth-t node
    z = torch.linspace(-4, 4, 10001)
    leaf = torch.bucketize(z, b)
    for t in range(1, MAX_DEPTH + 1):
        node = torch.bucketize(z, torch.tensor(tree.thresholds(t)).float())
        assert torch.equal(leaf >> (8 - t), node)


def test_shallower_tree_is_a_prefix():
    deep, shallow = GaussianTree(8), GaussianTree(4)
    for t in range(5):
        assert shallow.levels(t) == deep.levels(t)
    assert shallow.distortion == deep.distortion[:5]
    assert shallow.thresholds(4) == deep.thresholds(4)


@pytest.mark.parametrize("depth", [0, -1, 9, 16])
def test_bad_tree_depth(depth):
    with pytest.raises(ValueError):
        GaussianTree(depth)


def test_bad_query_depth(tree):
    with pytest.raises(ValueError):
        tree.levels(9)
    with pytest.raises(ValueError):
        tree.levels(-1)
    with pytest.raises(ValueError):
        tree.thresholds(0)
    with pytest.raises(ValueError):
        tree.split_thresholds(8)
    with pytest.raises(ValueError):
        GaussianTree(3).levels(4)


def _flat_distortion(levels: list[float], taus: list[float]) -> float:
    edges = [-math.inf, *taus, math.inf]
    energy = sum((_phi(b) - _phi(a)) * c * c for (a, b), c in zip(pairwise(edges), levels, strict=True))
    return 1 - energy


def test_lloyd_max():
    lv1, th1 = lloyd_max_levels(1)
    assert lv1 == pytest.approx([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], abs=1e-12)
    assert th1 == pytest.approx([0.0], abs=1e-12)
    lv2, _ = lloyd_max_levels(2)
    assert lv2 == pytest.approx([-1.5104, -0.4528, 0.4528, 1.5104], abs=5e-5)
    lv3, th3 = lloyd_max_levels(3)
    # the classical 3-bit Lloyd-Max quantizer of N(0, 1) (Max, 1960)
    assert lv3 == pytest.approx([-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520], abs=5e-4)
    assert th3 == pytest.approx([0.5 * (a + b) for a, b in pairwise(lv3)], abs=1e-12)
    # past depth 2 the tree is not Lloyd-Max: the flat quantizer has strictly lower error
    tree = GaussianTree(8)
    for b in (3, 4):
        lv, th = lloyd_max_levels(b)
        assert _flat_distortion(lv, th) < tree.distortion[b] - 1e-5
    with pytest.raises(ValueError):
        lloyd_max_levels(0)


def test_node_variances_monte_carlo_and_distortion(tree):
    """variances(t) are Var(Z | node) of N(0, 1): checked by Monte Carlo at depths 1-3 and on the
    depth-8 leaves, their mass-weighted mean is D(t), tail nodes are the widest, and the table is laid
    out like table()."""
    g = torch.Generator().manual_seed(20261201)
    z = torch.randn(2_000_000, generator=g, dtype=torch.float64)
    leaf = torch.bucketize(z, tree.boundaries().double())
    for t in (1, 2, 3, 8):
        node = leaf >> (8 - t)
        n = torch.bincount(node, minlength=2**t).double()
        s = torch.bincount(node, weights=z, minlength=2**t)
        s2 = torch.bincount(node, weights=z * z, minlength=2**t)
        ok = n >= 5000
        var = s2[ok] / n[ok] - (s[ok] / n[ok]) ** 2
        want = torch.tensor(tree.variances(t), dtype=torch.float64)[ok]
        assert torch.allclose(var, want, rtol=0.05, atol=1e-6), (t, var[:4], want[:4])
        vs = tree.variances(t)
        assert min(vs[0], vs[-1]) == pytest.approx(max(vs), rel=1e-12)  # the tails are the widest nodes
        edges = [-math.inf, *tree.thresholds(t), math.inf]
        mass = [_phi(b) - _phi(a) for a, b in pairwise(edges)]
        assert sum(m * v for m, v in zip(mass, vs, strict=True)) == pytest.approx(tree.distortion[t], rel=1e-6)
    assert tree.variances(0) == [pytest.approx(1.0)]
    tab = tree.variance_table()
    codes = torch.arange(256)
    for t in range(MAX_DEPTH + 1):
        want = torch.tensor(tree.variances(t), dtype=torch.float64)[codes >> (8 - t)].float()
        assert torch.equal(tab[t], want)
