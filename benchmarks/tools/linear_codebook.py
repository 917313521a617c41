"""How far a codebook linear in the stored planes is from the Gaussian tree (issue 3's "planes as
matrix operands" route), computed exactly from the tree's cells (no sampling).

    PYTHONPATH=. python benchmarks/tools/linear_codebook.py

Two candidates, each against the tree's distortion D(t) at every depth t:
1. *additive fit of the tree*: the same stored bits (the tree's cells), reconstruction
   ``a_t + sum_{j<t} w_{t,j} b_j`` with the least-squares a_t, w_{t,j} per depth (weights may depend on
   the depth, so a channel's query folds them in): the best reconstruction linear in the planes for
   the tree's encoding;
2. *nested uniform cells* on [-c, c] (clip c) with the same least-squares additive reconstruction: a
   different encoding, linear by construction, for several clips (``UniformLinearTree``, the named
   codebooks ``uniform-linear-c<clip>``).
Prints D_linear(t) / D_tree(t) for t = 1..8.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from planekv.kvstore.codebook import GaussianTree, UniformLinearTree, _centroid, _mass, _second_moment

W = 8


def _cells(edges: list[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mass, centroid and second moment of N(0, 1) on each cell between consecutive edges."""
    m = np.array([_mass(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    c = np.array([_centroid(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    s = np.array([_second_moment(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    return m, c, s


def additive_distortion(edges: list[float]) -> list[float]:
    """E[(Z - a_t - sum_j w_tj b_j)^2] at t = 1..W for the 2^W leaf cells given by ``edges``, the
    least-squares reconstruction linear in the first t code bits (plane 0 = most significant)."""
    mass, cent, m2 = _cells(edges)
    codes = np.arange(1 << W)
    out = []
    for t in range(1, W + 1):
        x = np.stack([((codes >> (W - 1 - j)) & 1).astype(float) for j in range(t)] + [np.ones(1 << W)], 1)
        sw = np.sqrt(mass)
        beta, *_ = np.linalg.lstsq(x * sw[:, None], cent * sw, rcond=None)
        f = x @ beta
        out.append(float(np.sum(mass * (m2 - 2 * f * cent + f * f))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", type=float, nargs="+", default=[2.5, 3.0, 3.5, 4.0])
    args = ap.parse_args()
    tree = GaussianTree(W)
    d_tree = tree.distortion[1:]
    edges = [-math.inf, *tree.thresholds(W), math.inf]
    rows = [("tree's cells, additive fit", additive_distortion(edges))]
    for c in args.clips:
        rows.append((f"nested uniform cells, clip {c:g}", UniformLinearTree(W, c).distortion[1:]))
    print("| codebook | " + " | ".join(f"t={t}" for t in range(1, W + 1)) + " |")
    print("|---|" + "---|" * W)
    print("| Gaussian tree D(t) | " + " | ".join(f"{d:.5f}" for d in d_tree) + " |")
    for name, d in rows:
        print(f"| {name}: D / D_tree | " + " | ".join(f"{x / y:.2f}" for x, y in zip(d, d_tree, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
