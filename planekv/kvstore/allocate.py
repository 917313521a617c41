"""Query-aware depth allocation (DESIGN section 1, steps 5-7).

Each item (a Key channel, or a Value token) has an importance ``a >= 0`` and a depth on the ladder
``m, m + p, m + 2p, ...`` (minimum depth m, packet p, never past W). Every item starts at m; each
further step of p planes removes ``a * (D(s) - D(s + p))`` of expected squared error. Given a budget
of B planes, both allocators spend ``m * n`` on the minimum and then take ``(B - m n) // p`` steps
in one fixed order: larger gain first; among equal gains the shallower step, then the lower item
index. Because the tree's marginal gains fall with depth, that order is greedy-optimal and is the
same as a threshold rule: ``steps(x) = #{k : a_x r_k > lambda}`` (plus ties at lambda in order).

- :func:`greedy_allocate`: the exact heap greedy (reference, small problems).
- :func:`threshold_allocate`: batched torch; finds lambda per problem by bisection on the bit
  pattern of a float64 (exact), using sorted importances, then settles ties. No heap, no sort of
  the n * K gains; this is the formulation the kernels use.

Both take an optional per-item ``max_depth``: the deepest depth that can be read (a tiered cache's resident
depth). Steps past it are left out of the order, so the budget goes to the next readable gains; with
``max_depth`` >= W everywhere the result is the unlimited one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch

from .errors import BudgetError


def ladder(width: int, min_depth: int = 0, packet: int = 1) -> list[int]:
    """Allowed depths: min_depth, min_depth + packet, ... (<= width)."""
    if not 0 <= min_depth <= width or packet < 1:
        raise BudgetError(f"bad ladder: min_depth={min_depth}, packet={packet}, W={width}")
    return list(range(min_depth, width + 1, packet))


def step_gains(distortion: Sequence[float], width: int, min_depth: int = 0, packet: int = 1) -> list[float]:
    """r_k = D(s_{k-1}) - D(s_k) for the ladder's steps k = 1..K (non-increasing)."""
    lad = ladder(width, min_depth, packet)
    return [distortion[a] - distortion[b] for a, b in zip(lad[:-1], lad[1:], strict=False)]


def _n_steps(budget: int, n_items: int, width: int, min_depth: int, packet: int) -> int:
    rest = budget - min_depth * n_items
    if rest < 0:
        raise BudgetError(f"budget {budget} planes is below the minimum depth {min_depth} x {n_items} items")
    k = (width - min_depth) // packet
    return min(rest // packet, k * n_items)


def greedy_allocate(importance: Sequence[float], budget: int, distortion: Sequence[float],
                    width: int = 8, min_depth: int = 0, packet: int = 1,
                    max_depth: Sequence[int] | None = None) -> list[int]:
    """Exact greedy with a heap: depths (planes) per item, spending ``budget`` planes (``max_depth``: per item,
    the deepest readable depth)."""
    a = [float(x) for x in importance]
    if any(not x >= 0.0 for x in a):
        raise BudgetError("importances must be finite and >= 0")
    r = step_gains(distortion, width, min_depth, packet)
    limit = [len(r)] * len(a) if max_depth is None else [_steps_to(m, len(r), min_depth, packet) for m in max_depth]
    steps = min(_n_steps(budget, len(a), width, min_depth, packet), sum(limit))
    depth = [min_depth] * len(a)
    # Heap key: (-gain, step index, item): the module's total order.
    heap = [(-x * r[0], 0, i) for i, x in enumerate(a) if limit[i] > 0] if r else []
    heapq.heapify(heap)
    for _ in range(steps):
        _, k, i = heapq.heappop(heap)
        depth[i] += packet
        if k + 1 < limit[i]:
            heapq.heappush(heap, (-a[i] * r[k + 1], k + 1, i))
    return depth


def _steps_to(max_depth: int, n_steps: int, min_depth: int, packet: int) -> int:
    """Steps of the ladder an item may take when it can be read to ``max_depth`` planes."""
    if max_depth < min_depth:
        raise BudgetError(f"a readable depth {max_depth} is below the minimum depth {min_depth}")
    return min(n_steps, (max_depth - min_depth) // packet)


SORT_BELOW = 1 << 20  # CPU problems with fewer gains than this sort instead of bisecting


def _kth_largest(prio_sorted: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per row, the count-th largest value of a [rows, K, n] tensor whose rows are sorted ascending
    along the last axis, clamped at 0 (invalid entries are -1). Exact.

    On CUDA, and for small problems on the CPU (a decode step), one sort of the K*n values per row
    and a gather; for large CPU problems (teacher-forced passes) a bisection on the int64 pattern
    of float64, cheaper than sorting there. Both return the same float64 value: the smallest
    lambda >= 0 with fewer than ``count`` entries above it."""
    if prio_sorted.is_cuda or prio_sorted.numel() <= SORT_BELOW:
        flat = prio_sorted.reshape(prio_sorted.shape[0], -1).sort(-1).values  # ascending
        idx = (flat.shape[1] - count.to(flat.device)).clamp(0, flat.shape[1] - 1)
        return flat.gather(1, idx[:, None])[:, 0].clamp_min(0.0)
    rows = prio_sorted.shape[0]
    hi_val = prio_sorted[:, :, -1].amax(1).clamp_min(0.0)
    lo = torch.zeros(rows, dtype=torch.int64, device=prio_sorted.device)  # pattern of 0.0
    hi = hi_val.view(torch.int64).clone()

    def strict_count(lam: torch.Tensor) -> torch.Tensor:
        q = lam[:, None, None].expand(rows, prio_sorted.shape[1], 1).contiguous()
        # number of entries > lam in each sorted row = n - searchsorted(right=True)
        le = torch.searchsorted(prio_sorted, q, right=True)
        return (prio_sorted.shape[2] - le).sum((1, 2))

    # Invariant: strict_count(hi) < count; answer = smallest pattern with that property.
    zero_ok = strict_count(lo.view(torch.float64)) < count
    for _ in range(64):
        if bool((hi - lo <= 1).all()):
            break
        mid = lo + (hi - lo) // 2
        ok = strict_count(mid.view(torch.float64)) < count
        hi = torch.where(ok, mid, hi)
        lo = torch.where(ok, lo, mid)
    return torch.where(zero_ok, torch.zeros_like(hi_val), hi.view(torch.float64))


def threshold_allocate(importance: torch.Tensor, budget: torch.Tensor | int, distortion: Sequence[float],
                       width: int = 8, min_depth: int = 0, packet: int = 1,
                       valid: torch.Tensor | None = None, chunk: int = 256,
                       max_depth: torch.Tensor | None = None) -> torch.Tensor:
    """Depths [..., n] (int64) for importances [..., n] and budgets [...] (planes per problem).

    ``valid`` [..., n] marks real items (padding gets depth 0 and no budget). ``max_depth`` [..., n]: the
    deepest readable depth per item (steps past it are not taken). Equals :func:`greedy_allocate` on every
    problem.
    """
    a = importance.detach().to(torch.float64)
    lead = a.shape[:-1]
    n = a.shape[-1]
    rows = math.prod(lead)
    a = a.reshape(rows, n)
    if not torch.isfinite(a).all() or (a < 0).any():
        raise BudgetError("importances must be finite and >= 0")
    v = torch.ones_like(a, dtype=torch.bool) if valid is None else valid.reshape(rows, n).to(a.device)
    bud = torch.as_tensor(budget, dtype=torch.int64, device=a.device).expand(lead).reshape(-1)
    n_valid = v.sum(1)
    rest = bud - min_depth * n_valid
    if (rest < 0).any():
        bad = int(torch.nonzero(rest < 0)[0, 0])
        raise BudgetError(f"budget {int(bud[bad])} planes is below the minimum depth {min_depth} x "
                          f"{int(n_valid[bad])} items")
    r = torch.tensor(step_gains(distortion, width, min_depth, packet), dtype=torch.float64, device=a.device)
    n_k = r.numel()
    depth = torch.where(v, min_depth, 0).to(torch.int64)
    if n_k == 0 or n == 0:
        return depth.reshape(*lead, n)
    if max_depth is None:
        limit = None
        count = torch.minimum(rest // packet, n_k * n_valid)
    else:
        md = max_depth.to(device=a.device, dtype=torch.int64).reshape(rows, n)
        if bool(((md < min_depth) & v).any()):
            raise BudgetError(f"a readable depth is below the minimum depth {min_depth}")
        limit = torch.where(v, ((md - min_depth) // packet).clamp(0, n_k), 0)  # [rows, n] steps each may take
        count = torch.minimum(rest // packet, limit.sum(1))
    kk = torch.arange(n_k, device=a.device)
    for s in range(0, rows, chunk):
        e = min(rows, s + chunk)
        ac = torch.where(v[s:e], a[s:e], torch.tensor(-1.0, dtype=torch.float64, device=a.device))
        prio = ac[:, None, :] * r[None, :, None]  # [c, K, n]; invalid items < 0
        neg = torch.tensor(-1.0, dtype=torch.float64, device=a.device)
        prio = torch.where(prio < 0, neg, prio)
        if limit is None:
            # Every step row k is a * r_k with r_k > 0: sorting a once sorts all K rows.
            prio_sorted = ac.sort(-1).values[:, None, :] * r[None, :, None]
            prio_sorted = torch.where(prio_sorted < 0, neg, prio_sorted)
        else:  # steps past an item's readable depth are out; each step row sorted on its own
            prio = torch.where(kk[None, :, None] < limit[s:e, None, :], prio, neg)
            prio_sorted = prio.sort(-1).values
        cnt = count[s:e]
        lam = _kth_largest(prio_sorted, cnt.clamp_min(1))
        lam = torch.where(cnt > 0, lam, torch.full_like(lam, float("inf")))
        strict = prio > lam[:, None, None]
        need = cnt - strict.sum((1, 2))
        tie = (prio == lam[:, None, None]) & (prio >= 0)
        # Ties in order (step k, then item): flatten K-major and take the first `need`.
        order = tie.reshape(e - s, -1).cumsum(1).reshape_as(tie)
        take = strict | (tie & (order <= need[:, None, None]))
        depth[s:e] += packet * take.sum(1)
    return depth.reshape(*lead, n)
