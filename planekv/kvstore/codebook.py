"""The Gaussian Lloyd binary tree (DESIGN section 1, step 3).

Every node of the tree is an interval of the standard normal line. The root is the whole line and
reconstructs to 0 (the calibrated mean). Each node splits in two at the threshold that satisfies the
*conditional* Lloyd condition: the threshold is the midpoint of the two children's centroids, where
a centroid is E[Z | Z in interval]. A depth-t prefix of a code therefore names a depth-t node, and
reading more planes only ever refines the value. Past depth 2 this is not the t-bit Lloyd-Max
quantizer (whose cells need not nest); that is intended, and it is what makes the code progressive.

All numbers are computed in float64 from closed forms (normal pdf and tail function), solved by
bisection, once per process and cached.
"""

from __future__ import annotations

import math
from functools import cache

import torch

MAX_DEPTH = 8
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _mass(a: float, b: float) -> float:
    """P(a < Z < b), accurate in both tails (uses the upper tail for a >= 0)."""
    if a >= 0.0:
        return 0.5 * (math.erfc(a / _SQRT2) - math.erfc(b / _SQRT2))
    if b <= 0.0:
        return 0.5 * (math.erfc(-b / _SQRT2) - math.erfc(-a / _SQRT2))
    return 1.0 - 0.5 * math.erfc(-a / _SQRT2) - 0.5 * math.erfc(b / _SQRT2)


def _xpdf(x: float) -> float:
    return 0.0 if math.isinf(x) else x * _pdf(x)


def _centroid(a: float, b: float) -> float:
    """E[Z | a < Z < b]."""
    return (_pdf(a) - _pdf(b)) / _mass(a, b)


def _second_moment(a: float, b: float) -> float:
    """E[Z^2 | a < Z < b]."""
    return 1.0 + (_xpdf(a) - _xpdf(b)) / _mass(a, b)


def _split(a: float, b: float) -> float:
    """The threshold tau in (a, b) with tau = (E[Z|a<Z<tau] + E[Z|tau<Z<b]) / 2."""
    if math.isinf(a) and math.isinf(b):
        return 0.0  # symmetry
    lo = a if not math.isinf(a) else b - 40.0
    hi = b if not math.isinf(b) else a + 40.0
    # f(tau) = tau - midpoint is negative near lo and positive near hi (log-concave density):
    # bisection to the last bit of a float64.
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        f = mid - 0.5 * (_centroid(a, mid) + _centroid(mid, b))
        if f < 0.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _variance(a: float, b: float) -> float:
    """Var(Z | a < Z < b) = E[(Z - centroid)^2 | node], computed stably for narrow cells."""
    mass = _mass(a, b)
    c = _centroid(a, b)
    # E[Z^2] - c^2 cancels badly for narrow tail cells; 1 + (a phi(a) - b phi(b)) / m - c^2 is the
    # closed form, and it is clamped at 0 for cells narrower than float64 can resolve.
    return max(0.0, 1.0 + (_xpdf(a) - _xpdf(b)) / mass - c * c)


@cache
def _build(depth: int) -> tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...], tuple[float, ...],
                                tuple[tuple[float, ...], ...]]:
    """Levels per depth, split thresholds per depth, D(0..depth), and node variances per depth."""
    intervals: list[tuple[float, float]] = [(-math.inf, math.inf)]
    levels: list[tuple[float, ...]] = []
    thresholds: list[tuple[float, ...]] = []
    distortion: list[float] = []
    variances: list[tuple[float, ...]] = []
    for t in range(depth + 1):
        cents = [_centroid(a, b) for a, b in intervals]
        levels.append(tuple(cents))
        variances.append(tuple(_variance(a, b) for a, b in intervals))
        # D(t) = sum over nodes of P(node) * Var(Z | node).
        distortion.append(
            sum(_mass(a, b) * (_second_moment(a, b) - c * c) for (a, b), c in zip(intervals, cents, strict=False))
        )
        if t == depth:
            break
        taus = [_split(a, b) for a, b in intervals]
        thresholds.append(tuple(taus))
        intervals = [iv for (a, b), tau in zip(intervals, taus, strict=False) for iv in ((a, tau), (tau, b))]
    return tuple(levels), tuple(thresholds), tuple(distortion), tuple(variances)


class GaussianTree:
    """Gaussian Lloyd binary tree of depth ``depth`` (1..8).

    Codes are W-bit integers whose most significant bit is plane 0 (the first branch); the depth-t
    node of a code is ``code >> (W - t)``, and nodes are numbered left to right, so ``levels(t)`` is
    sorted and indexed by node.
    """

    def __init__(self, depth: int = MAX_DEPTH) -> None:
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"tree depth must be in 1..{MAX_DEPTH}, got {depth}")
        self.depth = depth
        self._levels, self._thresholds, self._distortion, self._variances = _build(depth)

    def levels(self, t: int) -> list[float]:
        """Sorted reconstruction values of the 2**t depth-t nodes (standard-normal units)."""
        self._check_depth(t, 0)
        return list(self._levels[t])

    def thresholds(self, t: int) -> list[float]:
        """Sorted thresholds that separate the depth-t nodes: the 2**(t-1) splits made at depth t-1
        merged with all thresholds of shallower depths (2**t - 1 values, t >= 1)."""
        self._check_depth(t, 1)
        out: list[float] = []
        for s in range(t):
            out.extend(self._thresholds[s])
        return sorted(out)

    def split_thresholds(self, t: int) -> list[float]:
        """The thresholds that split depth-t nodes into their children, in node order (t < depth)."""
        self._check_depth(t, 0, self.depth - 1)
        return list(self._thresholds[t])

    def variances(self, t: int) -> list[float]:
        """Var(Z | node) of the 2**t depth-t nodes, left to right (standard-normal units): the
        conditional variance left around each reconstruction value. Tail nodes are wider, so their
        variance is larger; ``sum_node P(node) Var(Z | node) = D(t)``."""
        self._check_depth(t, 0)
        return list(self._variances[t])

    @property
    def distortion(self) -> list[float]:
        """D(t) = E[(Z - Zhat_t)^2] for Z ~ N(0, 1), t = 0..depth."""
        return list(self._distortion)

    def marginal_gains(self) -> list[float]:
        """D(t-1) - D(t) for t = 1..depth: the error removed by reading plane t-1."""
        d = self._distortion
        return [d[t - 1] - d[t] for t in range(1, self.depth + 1)]

    # ---- tensors used by the codec and readers ----

    def boundaries(self, device: torch.device | str | None = None) -> torch.Tensor:
        """All 2**depth - 1 thresholds, sorted (float32): the leaf of z is bucketize(z, this)."""
        return torch.tensor(self.thresholds(self.depth), dtype=torch.float64, device=device).float()

    def table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Reconstruction table [depth + 1, 2**depth] (float32): ``table[t, code]`` is the value of
        the depth-t prefix of a full-depth ``code``."""
        n = 1 << self.depth
        codes = torch.arange(n)
        rows = [
            torch.tensor(self._levels[t], dtype=torch.float64)[codes >> (self.depth - t)]
            for t in range(self.depth + 1)
        ]
        return torch.stack(rows).float().to(device)

    def variance_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Conditional-variance table [depth + 1, 2**depth] (float32), laid out like :meth:`table`:
        ``variance_table()[t, code]`` is Var(Z | the depth-t node of the full-depth ``code``)."""
        n = 1 << self.depth
        codes = torch.arange(n)
        rows = [
            torch.tensor(self._variances[t], dtype=torch.float64)[codes >> (self.depth - t)]
            for t in range(self.depth + 1)
        ]
        return torch.stack(rows).float().to(device)

    def _check_depth(self, t: int, lo: int, hi: int | None = None) -> None:
        hi = self.depth if hi is None else hi
        if not lo <= t <= hi:
            raise ValueError(f"depth {t} outside {lo}..{hi}")

    def __repr__(self) -> str:
        return f"GaussianTree(depth={self.depth})"


def lloyd_max_levels(bits: int, iters: int = 2000) -> tuple[list[float], list[float]]:
    """The b-bit Lloyd-Max quantizer of N(0, 1): (levels, thresholds), both sorted.

    Used by the TurboQuant-style baseline, which stores a flat b-bit code (not a tree).
    """
    if not 1 <= bits <= MAX_DEPTH:
        raise ValueError(f"bits must be in 1..{MAX_DEPTH}, got {bits}")
    n = 1 << bits
    # Start from the tree's leaves (already close) and iterate the Lloyd conditions.
    levels = list(GaussianTree(bits).levels(bits))
    for _ in range(iters):
        taus = [0.5 * (levels[i] + levels[i + 1]) for i in range(n - 1)]
        edges = [-math.inf, *taus, math.inf]
        new = [_centroid(edges[i], edges[i + 1]) for i in range(n)]
        if max(abs(x - y) for x, y in zip(new, levels, strict=False)) < 1e-13:
            levels = new
            break
        levels = new
    taus = [0.5 * (levels[i] + levels[i + 1]) for i in range(n - 1)]
    return levels, taus
