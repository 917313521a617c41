"""Depth allocation (DESIGN 1.5-1.7): the heap greedy and the batched threshold rule agree on every
problem (ties, zeros, minimum depth, packets, budgets past capacity, batches, padding), both reach the
brute-force optimum, and a budget within capacity is spent exactly."""

from __future__ import annotations

import itertools
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from planekv.kvstore import BudgetError, GaussianTree, greedy_allocate, ladder, threshold_allocate
from planekv.kvstore.allocate import step_gains

W = 8
D = GaussianTree(W).distortion
LINEAR_D = [float(W - t) for t in range(W + 1)]  # every step gains 1: ties everywhere


def _importances(gen: torch.Generator, rows: int, n: int) -> torch.Tensor:
    """A mix of continuous values, exact zeros, ties and all-equal rows (float64)."""
    kind = torch.randint(0, 5, (rows, 1), generator=gen)
    cont = torch.rand(rows, n, generator=gen, dtype=torch.float64) ** 3 * 10
    ints = torch.randint(0, 3, (rows, n), generator=gen).double()
    zeros = torch.where(torch.rand(rows, n, generator=gen) < 0.5, 0.0, cont)
    same = cont[:, :1].expand(rows, n)
    allz = torch.zeros(rows, n, dtype=torch.float64)
    return torch.where(kind == 0, cont, torch.where(kind == 1, ints, torch.where(kind == 2, zeros,
                       torch.where(kind == 3, same, allz))))


def _objective(a: torch.Tensor, depth: torch.Tensor, dist: list[float]) -> torch.Tensor:
    dd = torch.tensor(dist, dtype=torch.float64)
    return (a * (dd[0] - dd[depth])).sum(-1)


def _spent(budget: int, n: int, m: int, p: int) -> int:
    k = (W - m) // p
    return m * n + p * min((budget - m * n) // p, k * n)


@pytest.mark.parametrize("m", [0, 1, 2])
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dist", [D, LINEAR_D], ids=["tree", "linear"])
def test_greedy_threshold_and_brute_force_agree(gen, m, p, n, dist):
    rows = 24
    a = _importances(gen, rows, n)
    lad = ladder(W, m, p)
    cap = lad[-1] * n
    budgets = torch.randint(m * n, cap + 6, (rows,), generator=gen)
    budgets[0], budgets[1] = m * n, cap  # the edges: only the minimum, exactly full
    thr = threshold_allocate(a, budgets, dist, W, m, p)
    assert thr.shape == (rows, n) and thr.dtype == torch.int64
    # every depth vector on the ladder, for the brute force
    allv = torch.tensor(list(itertools.product(lad, repeat=n)), dtype=torch.int64)  # [V, n]
    cost = allv.sum(1)
    for r in range(rows):
        b = int(budgets[r])
        g = greedy_allocate(a[r].tolist(), b, dist, W, m, p)
        assert g == thr[r].tolist(), (a[r].tolist(), b, g, thr[r].tolist())
        assert all(x in lad for x in g)
        assert sum(g) == _spent(b, n, m, p)
        ok = cost == sum(g)
        best = _objective(a[r], allv[ok], dist).max()
        got = _objective(a[r], torch.tensor(g), dist)
        assert float(got) >= float(best) - 1e-12 * max(1.0, float(best)), (a[r].tolist(), b, g)


@pytest.mark.parametrize("m,p", [(0, 1), (1, 1), (1, 2), (0, 3), (3, 2)])
def test_batched_with_valid_mask_equals_greedy_per_problem(gen, m, p):
    lead = (3, 4)
    n = 37
    a = _importances(gen, 12, n).reshape(*lead, n)
    valid = torch.rand(*lead, n, generator=gen) < 0.7
    valid[0, 0] = True  # a full row
    valid[0, 1] = False  # an empty row
    n_valid = valid.sum(-1)
    cap = ladder(W, m, p)[-1]
    budgets = (torch.rand(lead, generator=gen) * (cap + 1) * n_valid + m * n_valid).long()
    depth = threshold_allocate(a, budgets, D, W, m, p, valid=valid)
    assert depth.shape == (*lead, n)
    for i, j in itertools.product(range(lead[0]), range(lead[1])):
        idx = valid[i, j].nonzero().flatten()
        g = greedy_allocate(a[i, j, idx].tolist(), int(budgets[i, j]), D, W, m, p)
        assert depth[i, j, idx].tolist() == g
        assert bool((depth[i, j][~valid[i, j]] == 0).all())


@pytest.mark.parametrize("m", [0, 1])
def test_budget_spent_exactly_within_capacity(gen, m):
    n = 150
    a = torch.rand(20, n, generator=gen, dtype=torch.float64) * torch.rand(20, 1, generator=gen, dtype=torch.float64)
    a[:5, ::3] = 0.0
    budgets = torch.randint(m * n, W * n + 1, (20,), generator=gen)
    depth = threshold_allocate(a, budgets, D, W, m, 1)
    assert torch.equal(depth.sum(-1), budgets)
    assert int(depth.min()) >= m and int(depth.max()) <= W
    for r in (0, 7, 19):
        assert greedy_allocate(a[r].tolist(), int(budgets[r]), D, W, m) == depth[r].tolist()


def test_beyond_capacity_reads_everything(gen):
    a = torch.rand(4, 10, generator=gen)
    assert bool((threshold_allocate(a, 10_000, D) == W).all())
    assert greedy_allocate(a[0].tolist(), 81, D) == [W] * 10
    # packet 2 from 1: the top of the ladder is 7
    assert bool((threshold_allocate(a, 10_000, D, W, 1, 2) == 7).all())


def test_hand_examples():
    # gains: 4 r0 = 2.55 > 4 r1 = 0.98 > 1 r0 = 0.64 > 4 r2 = 0.33 > 1 r1 = 0.25
    assert greedy_allocate([4.0, 1.0], 1, D) == [1, 0]
    assert greedy_allocate([4.0, 1.0], 2, D) == [2, 0]
    assert greedy_allocate([4.0, 1.0], 3, D) == [2, 1]
    assert greedy_allocate([4.0, 1.0], 4, D) == [3, 1]
    assert greedy_allocate([4.0, 1.0], 5, D) == [3, 2]
    # ties: larger gain, then shallower step, then lower index
    assert greedy_allocate([1.0, 1.0, 1.0], 4, D) == [2, 1, 1]
    assert greedy_allocate([0.0, 0.0, 0.0], 4, D) == [2, 1, 1]
    assert greedy_allocate([1.0, 1.0, 1.0], 4, LINEAR_D) == [2, 1, 1]
    assert greedy_allocate([1.0, 1.0], 3, LINEAR_D) == [2, 1]  # step 0 of item 1 before step 1 of item 0
    assert greedy_allocate([1.0, 2.0, 1.0], 4, LINEAR_D) == [0, 4, 0]  # gain 2 beats gain 1 at any step
    assert greedy_allocate([1.0, 2.0, 1.0], 10, LINEAR_D) == [1, 8, 1]
    for a, b, dist in (([1.0, 1.0, 1.0], 4, D), ([0.0] * 3, 4, D), ([1.0, 1.0], 3, LINEAR_D),
                       ([1.0, 2.0, 1.0], 10, LINEAR_D), ([4.0, 1.0], 5, D)):
        assert threshold_allocate(torch.tensor(a), b, dist).tolist() == greedy_allocate(a, b, dist)
    # minimum depth 1, packets of 2: depths 1, 3, 5, 7
    assert greedy_allocate([1.0, 0.5], 2, D, W, 1, 2) == [1, 1]
    assert greedy_allocate([1.0, 0.5], 3, D, W, 1, 2) == [1, 1]  # one plane cannot make a packet
    assert greedy_allocate([1.0, 0.5], 4, D, W, 1, 2) == [3, 1]


def test_more_budget_never_lowers_a_depth(gen):
    a = torch.rand(30, generator=gen, dtype=torch.float64)
    budgets = torch.arange(0, W * 30 + 1)
    depth = threshold_allocate(a.expand(budgets.numel(), 30), budgets, D)
    assert bool((depth[1:] >= depth[:-1]).all())
    assert torch.equal(depth.sum(1), budgets)
    # more important items are never shallower
    order = a.argsort()
    assert bool((depth[:, order][:, 1:] >= depth[:, order][:, :-1]).all())


def test_budget_below_minimum_raises():
    with pytest.raises(BudgetError):
        greedy_allocate([1.0, 1.0, 1.0], 2, D, W, min_depth=1)
    with pytest.raises(BudgetError):
        threshold_allocate(torch.ones(3), 2, D, W, min_depth=1)
    with pytest.raises(BudgetError):
        threshold_allocate(torch.ones(2, 3), torch.tensor([3, 2]), D, W, min_depth=1)
    with pytest.raises(BudgetError):
        greedy_allocate([1.0], -1, D)
    # padding does not need a minimum
    valid = torch.tensor([True, True, False])
    assert threshold_allocate(torch.ones(3), 2, D, W, 1, valid=valid).tolist() == [1, 1, 0]


def test_bad_importances_raise():
    for bad in ([-1.0, 1.0], [float("nan"), 1.0]):
        with pytest.raises(BudgetError):
            greedy_allocate(bad, 3, D)
        with pytest.raises(BudgetError):
            threshold_allocate(torch.tensor(bad), 3, D)
    with pytest.raises(BudgetError):
        threshold_allocate(torch.tensor([float("inf"), 1.0]), 3, D)


def test_ladder_and_step_gains():
    assert ladder(8) == list(range(9))
    assert ladder(8, 1, 2) == [1, 3, 5, 7]
    assert ladder(8, 2, 3) == [2, 5, 8]
    assert ladder(8, 8) == [8]
    for bad in ((8, -1, 1), (8, 9, 1), (8, 0, 0)):
        with pytest.raises(BudgetError):
            ladder(*bad)
    r = step_gains(D, 8, 1, 2)
    assert r == pytest.approx([D[1] - D[3], D[3] - D[5], D[5] - D[7]], abs=0)
    assert all(x >= y for x, y in pairwise(r))
    # min depth = W: nothing to allocate, everyone at W
    assert greedy_allocate([1.0, 2.0], 100, D, W, 8) == [8, 8]
    assert threshold_allocate(torch.tensor([1.0, 2.0]), 100, D, W, 8).tolist() == [8, 8]


def test_empty_problem():
    """No items: nothing to allocate (threshold_allocate has an explicit n == 0 branch for this)."""
    assert greedy_allocate([], 5, D) == []
    assert threshold_allocate(torch.zeros(0), 5, D).shape == (0,)
    assert threshold_allocate(torch.zeros(3, 0), torch.tensor([0, 1, 2]), D).shape == (3, 0)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(
    a=st.lists(st.one_of(st.just(0.0), st.sampled_from([0.5, 1.0, 2.0]),
                         st.floats(0.0, 1e6, allow_nan=False, allow_subnormal=True)), min_size=1, max_size=12),
    frac=st.floats(0.0, 1.2),
    m=st.integers(0, 3),
    p=st.integers(1, 3),
)
def test_property_greedy_equals_threshold(a, frac, m, p):
    cap = ladder(W, m, p)[-1] * len(a)
    budget = m * len(a) + int(frac * (cap - m * len(a)))
    g = greedy_allocate(a, budget, D, W, m, p)
    t = threshold_allocate(torch.tensor(a, dtype=torch.float64), budget, D, W, m, p)
    assert t.tolist() == g
    assert sum(g) == _spent(budget, len(a), m, p)


def test_sort_and_bisection_paths_agree(monkeypatch) -> None:
    """Small problems sort the gains, large ones bisect on float64 bit patterns: same depths."""
    from planekv.kvstore import allocate as A
    from planekv.kvstore.codebook import GaussianTree

    dist = GaussianTree(8).distortion
    g = torch.Generator().manual_seed(7)
    for _ in range(60):
        rows, n = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))
        a = torch.rand(rows, n, generator=g) * torch.randint(0, 3, (rows, n), generator=g)
        a = torch.round(a * 3) / 3  # many exact ties
        bud = torch.randint(0, 8 * n + 5, (rows,), generator=g)
        monkeypatch.setattr(A, "SORT_BELOW", 1 << 30)
        by_sort = A.threshold_allocate(a, bud, dist)
        monkeypatch.setattr(A, "SORT_BELOW", 0)
        by_bisection = A.threshold_allocate(a, bud, dist)
        assert torch.equal(by_sort, by_bisection)


@pytest.mark.parametrize("m,p", [(0, 1), (1, 2), (2, 1)])
@pytest.mark.parametrize("dist", [D, LINEAR_D], ids=["tree", "linear"])
def test_a_readable_depth_limit_moves_the_budget_to_readable_steps(gen, m, p, dist):
    """``max_depth`` (a tiered cache's residency): no item passes its limit, the heap greedy and the threshold
    rule still agree (ties included), the budget goes to readable steps (spent exactly while they last), and
    the result is the brute-force optimum over the depths within the limits."""
    rows, n = 24, 4
    a = _importances(gen, rows, n)
    lad = ladder(W, m, p)
    lim = torch.tensor(lad)[torch.randint(0, len(lad), (rows, n), generator=gen)]  # on the ladder, >= m
    budgets = torch.randint(m * n, lad[-1] * n + 6, (rows,), generator=gen)
    thr = threshold_allocate(a, budgets, dist, W, m, p, max_depth=lim)
    assert bool((thr <= lim).all()) and bool((thr >= m).all())
    allv = torch.tensor(list(itertools.product(lad, repeat=n)), dtype=torch.int64)
    for i in range(rows):
        want = greedy_allocate(a[i].tolist(), int(budgets[i]), dist, W, m, p, max_depth=lim[i].tolist())
        assert thr[i].tolist() == want
        readable = int(lim[i].sum())
        assert int(thr[i].sum()) == min(_spent(int(budgets[i]), n, m, p), readable)
        ok = (allv <= lim[i]).all(1) & (allv.sum(1) <= int(budgets[i]))
        best = _objective(a[i], allv[ok], dist).max()
        assert float(_objective(a[i], thr[i], dist)) == pytest.approx(float(best), rel=1e-12, abs=1e-12)


def test_a_limit_of_w_everywhere_is_no_limit(gen):
    a = _importances(gen, 64, 12)
    budgets = torch.randint(0, 80, (64,), generator=gen)
    free = threshold_allocate(a, budgets, D, W)
    assert torch.equal(threshold_allocate(a, budgets, D, W, max_depth=torch.full((64, 12), W)), free)
    with pytest.raises(BudgetError, match="below the minimum depth"):
        threshold_allocate(a, budgets + 12, D, W, min_depth=1, max_depth=torch.zeros(64, 12, dtype=torch.int64))
