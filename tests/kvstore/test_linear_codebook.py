"""The named codebook option whose reconstruction is linear in the planes (UniformLinearTree): nested
uniform cells, values a_t + sum_j w_tj b_j fitted by least squares, D(t) checked against sampling,
the allocator's assumption (non-increasing gains), and its use through FormatSpec, Codec and the
reference reader."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from planekv.kvstore import (
    CODEBOOKS,
    Codec,
    FormatSpec,
    GaussianTree,
    PlaneKVCache,
    ReadPolicy,
    UniformLinearTree,
    make_codebook,
)
from planekv.kvstore.codebook import _centroid, _mass
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic

LINEAR = [n for n in CODEBOOKS if n.startswith("uniform-linear")]


def _bits(node: int, t: int) -> list[int]:
    return [(node >> (t - 1 - j)) & 1 for j in range(t)]


@pytest.mark.parametrize("name", LINEAR)
def test_levels_are_linear_in_the_planes_and_sorted(name: str) -> None:
    tree = make_codebook(name)
    assert isinstance(tree, UniformLinearTree) and tree.name == name
    for t in range(tree.depth + 1):
        a, w = tree.linear_weights(t)
        assert len(w) == t
        lv = tree.levels(t)
        for node, v in enumerate(lv):
            assert v == pytest.approx(a + sum(wj * bj for wj, bj in zip(w, _bits(node, t), strict=True)),
                                      abs=1e-12)
        assert lv == sorted(lv)
        # the table holds the same values for every full-depth code below the node
        tab = tree.table()[t]
        for code in (0, 37, 128, 255):
            assert tab[code].item() == pytest.approx(lv[code >> (tree.depth - t)], abs=1e-6)


def test_cells_are_nested_uniform_halvings() -> None:
    tree = UniformLinearTree(8, clip=3.0)
    assert tree.split_thresholds(0) == [0.0]
    assert tree.split_thresholds(1) == pytest.approx([-1.5, 1.5])
    assert tree.split_thresholds(2) == pytest.approx([-2.25, -0.75, 0.75, 2.25])
    for t in range(1, 8):
        assert tree.thresholds(t + 1) == sorted(tree.thresholds(t) + tree.split_thresholds(t))
    b = tree.boundaries()
    assert b.numel() == 255
    assert b[0].item() == pytest.approx(-3 + 6 / 256) and b[-1].item() == pytest.approx(3 - 6 / 256)


def test_least_squares_fit_residual_is_orthogonal_to_the_bits() -> None:
    """The fitted values minimize E[(Z - Zhat)^2] among reconstructions additive in the t bits: the
    mass-weighted residual (centroid - level) is orthogonal to every bit and to the constant."""
    tree = UniformLinearTree(8, clip=3.0)
    for t in (1, 3, 5):
        edges = [-math.inf, *tree.thresholds(t), math.inf]
        cells = list(zip(edges[:-1], edges[1:], strict=True))
        res = [_mass(a, b) * (_centroid(a, b) - lv) for (a, b), lv in zip(cells, tree.levels(t), strict=True)]
        assert abs(sum(res)) < 1e-12
        for j in range(t):
            assert abs(sum(r for node, r in enumerate(res) if _bits(node, t)[j])) < 1e-12


def test_distortion_matches_sampling_and_the_measured_ratios() -> None:
    tree, gauss = UniformLinearTree(8, clip=3.0), GaussianTree(8)
    z = torch.randn(2_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    leaf = torch.bucketize(z.float(), tree.boundaries())
    tab = tree.table().double()
    for t in (1, 2, 4, 6, 8):
        mse = float(((z - tab[t][leaf]) ** 2).mean())
        # deep cells: the error is mostly the tails past the clip (0.27% of samples), so sampling is noisier
        assert mse == pytest.approx(tree.distortion[t], rel=0.02 if t <= 4 else 0.06)
    ratio = [u / g for u, g in zip(tree.distortion[2:6], gauss.distortion[2:6], strict=True)]
    assert ratio == pytest.approx([1.38, 1.33, 1.27, 1.31], abs=0.01)  # linear_codebook.py's table


@pytest.mark.parametrize("name", LINEAR)
def test_gains_do_not_increase(name: str) -> None:
    """The allocators take a channel's or token's steps in order, which needs non-increasing gains."""
    g = make_codebook(name).marginal_gains()
    assert all(a >= b for a, b in zip(g, g[1:], strict=False)), g


def test_bad_names_and_clips_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown codebook"):
        make_codebook("uniform-linear-c9")
    with pytest.raises(ValueError, match="unknown codebook"):
        FormatSpec(model_id="m", n_layers=1, n_q_heads=2, n_kv_heads=1, head_dim=64, calibration_id="x",
                   codebook="uniform")
    with pytest.raises(ValueError, match="clip"):
        UniformLinearTree(8, clip=0.1)
    with pytest.raises(ValueError, match="depth"):
        UniformLinearTree(9)


def test_format_codec_and_reference_reader_use_the_named_codebook() -> None:
    """The codebook is part of the format's identity; the codec encodes with its cells and decodes
    with its values; the reference reader at full depth reconstructs x~ = mu + sigma * table[W, code]."""
    syn = make_synthetic(n_tokens=96, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=3)
    spec = dataclasses.replace(syn.spec, codebook="uniform-linear-c3")
    assert spec.format_id != syn.spec.format_id
    codec, gauss = Codec(spec, syn.calibration), Codec(syn.spec, syn.calibration)
    assert codec.tree.name == "uniform-linear-c3" and gauss.tree.name == "gaussian-lloyd-tree"
    kc = codec.encode_k(syn.k[0], 0)
    assert not torch.equal(kc, gauss.encode_k(syn.k[0], 0))
    # codes name the uniform cells: inside the clip, the code is the index of z's cell of width 6/256
    mu, sig = codec.stats(0, "k")
    xt = codec.rot_k.forward(syn.k[0].float())
    z = (xt - mu[:, None, :]) / sig[:, None, :]
    inner = z.abs() < 2.99
    assert inner.float().mean() > 0.95
    cell = torch.floor((z + 3.0) / (6.0 / 256)).long()
    assert (kc.long()[inner] == cell[inner]).float().mean() > 0.999  # float32 rounding at cell edges
    # and decode to the fitted values
    zhat = codec.table("cpu")[8][kc.long()]
    assert float((z - zhat)[inner].abs().max()) < 6.0 / 256
    # a decode step through the reference reader with this codec
    cache = PlaneKVCache(spec, 1)
    cache.append(0, kc, codec.encode_v(syn.v[0], 0), seq=0)
    q = syn.q[0].transpose(0, 1).contiguous()[:1]
    out, st = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(4.0))
    full, _ = readkv_decode(q, cache, 0, codec, ReadPolicy.flexible(8.0))
    assert torch.isfinite(out).all() and float(st.k_bits.sum()) > 0
    assert ((out - full).norm() / full.norm()).item() < 0.2
