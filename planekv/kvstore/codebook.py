"""The progressive codebooks: the Gaussian Lloyd binary tree (DESIGN section 1, step 3), and a named
option whose reconstruction is linear in the planes (:class:`UniformLinearTree`).

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
from typing import Any

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


class NestedCodebook:
    """A progressive codebook of depth ``depth`` (1..8): binary nested cells of the standard normal
    line, a reconstruction value per cell at every depth.

    Codes are W-bit integers whose most significant bit is plane 0 (the first branch); the depth-t
    node of a code is ``code >> (W - t)``, and nodes are numbered left to right, so ``levels(t)`` is
    sorted and indexed by node. Subclasses fill in the levels, the split thresholds, D(t) and the
    node variances.
    """

    name = ""

    def __init__(self, depth: int, levels: tuple[tuple[float, ...], ...], thresholds: tuple[tuple[float, ...], ...],
                 distortion: tuple[float, ...], variances: tuple[tuple[float, ...], ...]) -> None:
        self.depth = depth
        self._levels, self._thresholds, self._distortion, self._variances = levels, thresholds, distortion, variances

    @staticmethod
    def _check_width(depth: int) -> None:
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"tree depth must be in 1..{MAX_DEPTH}, got {depth}")

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
        conditional variance around the node's centroid. Tail nodes are wider, so their variance is
        larger; for centroid levels (the Gaussian tree) ``sum_node P(node) Var(Z | node) = D(t)``."""
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
        return self._per_node(self._levels, device)

    def variance_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Conditional-variance table [depth + 1, 2**depth] (float32), laid out like :meth:`table`:
        ``variance_table()[t, code]`` is Var(Z | the depth-t node of the full-depth ``code``)."""
        return self._per_node(self._variances, device)

    def _per_node(self, vals: tuple[tuple[float, ...], ...], device: torch.device | str | None) -> torch.Tensor:
        codes = torch.arange(1 << self.depth)
        rows = [torch.tensor(vals[t], dtype=torch.float64)[codes >> (self.depth - t)] for t in range(self.depth + 1)]
        return torch.stack(rows).float().to(device)

    def _check_depth(self, t: int, lo: int, hi: int | None = None) -> None:
        hi = self.depth if hi is None else hi
        if not lo <= t <= hi:
            raise ValueError(f"depth {t} outside {lo}..{hi}")


class GaussianTree(NestedCodebook):
    """Gaussian Lloyd binary tree of depth ``depth`` (1..8): every split at the conditional Lloyd
    threshold, every node reconstructs to its centroid (codebook ``gaussian-lloyd-tree``, the
    default)."""

    name = "gaussian-lloyd-tree"

    def __init__(self, depth: int = MAX_DEPTH) -> None:
        self._check_width(depth)
        super().__init__(depth, *_build(depth))

    def __repr__(self) -> str:
        return f"GaussianTree(depth={self.depth})"


@cache
def _build_uniform_linear(depth: int, clip: float) -> tuple[Any, ...]:
    """Nested uniform cells on [-clip, clip] (the two outer leaves extend to infinity) and, at each
    depth t, the least-squares reconstruction additive in the t code bits: levels, split
    thresholds, D(0..depth), node variances, and per depth (a_t, w_t) with level = a_t + w_t . bits."""
    n = 1 << depth
    inner = [-clip + 2.0 * clip * i / n for i in range(1, n)]
    edges = [-math.inf, *inner, math.inf]
    levels, thresholds, distortion, variances, weights = [], [], [], [], []
    for t in range(depth + 1):
        step = 1 << (depth - t)
        nodes = [(edges[i * step], edges[(i + 1) * step]) for i in range(1 << t)]
        mass = [_mass(a, b) for a, b in nodes]
        cent = [_centroid(a, b) for a, b in nodes]
        m2 = [_second_moment(a, b) for a, b in nodes]
        # weighted least squares over the nodes: minimize sum_i m_i (c_i - a - sum_j w_j b_ij)^2, which
        # minimizes E[(Z - Zhat_t)^2] among reconstructions additive in the bits (normal equations,
        # float64, at most 9 unknowns)
        x = torch.tensor([[float((i >> (t - 1 - j)) & 1) for j in range(t)] + [1.0] for i in range(1 << t)],
                         dtype=torch.float64)
        wm = torch.tensor(mass, dtype=torch.float64)
        c = torch.tensor(cent, dtype=torch.float64)
        beta = torch.linalg.solve(x.T @ (wm[:, None] * x), x.T @ (wm * c))
        f = (x @ beta).tolist()
        levels.append(tuple(f))
        weights.append((float(beta[-1]), tuple(float(v) for v in beta[:-1])))
        distortion.append(sum(mi * (si - 2.0 * fi * ci + fi * fi) for mi, si, fi, ci in zip(mass, m2, f, cent,
                                                                                           strict=True)))
        variances.append(tuple(_variance(a, b) for a, b in nodes))
        if t < depth:
            thresholds.append(tuple(edges[(2 * i + 1) * (step // 2)] for i in range(1 << t)))
    return tuple(levels), tuple(thresholds), tuple(distortion), tuple(variances), tuple(weights)


class UniformLinearTree(NestedCodebook):
    """Nested uniform cells on [-clip, clip] with a reconstruction linear in the stored planes
    (codebook ``uniform-linear-c<clip>``, a named option; issue 3's "planes as matrix operands").

    Every split halves its cell (the outer cells reach to infinity), and the depth-t value of a code
    is ``a_t + sum_{j<t} w_{t,j} b_j`` with ``b_j`` the code's bit in plane j and (a_t, w_t) the least
    squares fit of the cells' values: so a logit sum_c q_c sigma_c zhat_c is a constant plus a
    weighted sum of plane bits, and the planes of a tile can be an MMA operand. The price is
    distortion: D(t) / D_tree(t) = 1.38, 1.33, 1.27, 1.31 at t = 2..5 for clip 3
    (``benchmarks/tools/linear_codebook.py``); EVALUATION.md measures what it costs a real model."""

    def __init__(self, depth: int = MAX_DEPTH, clip: float = 3.0) -> None:
        self._check_width(depth)
        if not 0.5 <= clip <= 8.0:
            raise ValueError(f"clip must be in 0.5..8 (standard deviations), got {clip}")
        self.clip = float(clip)
        *parts, self._weights = _build_uniform_linear(depth, self.clip)
        super().__init__(depth, *parts)
        self.name = f"uniform-linear-c{self.clip:g}"

    def linear_weights(self, t: int) -> tuple[float, list[float]]:
        """(a_t, [w_{t,0}, ..., w_{t,t-1}]): ``levels(t)[node] = a_t + sum_j w_{t,j} bit_j(node)``,
        with bit_j the node's j-th most significant of its t bits (plane j)."""
        self._check_depth(t, 0)
        a, w = self._weights[t]
        return a, list(w)

    def __repr__(self) -> str:
        return f"UniformLinearTree(depth={self.depth}, clip={self.clip:g})"


# Named codebooks of FormatSpec.codebook: the default Gaussian tree and the linear option at the
# clips evaluated (EVALUATION.md)
CODEBOOKS = ("gaussian-lloyd-tree", "uniform-linear-c3", "uniform-linear-c3.5")


def make_codebook(name: str, depth: int = MAX_DEPTH) -> NestedCodebook:
    """The codebook called ``name`` (one of CODEBOOKS) at ``depth``."""
    if name == "gaussian-lloyd-tree":
        return GaussianTree(depth)
    if name in CODEBOOKS and name.startswith("uniform-linear-c"):
        return UniformLinearTree(depth, float(name[len("uniform-linear-c"):]))
    raise ValueError(f"unknown codebook {name!r}; known: {CODEBOOKS}")


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
