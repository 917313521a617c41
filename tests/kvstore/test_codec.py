"""Codec (DESIGN 1.1-1.4): empirical error per depth against D(t), reconstruction at any per-channel or
per-token depth, depth 0 = mu, progressive codes, and the format/calibration identity checks."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from planekv.kvstore import CalibrationError, Codec, FormatMismatch, FormatSpec, GaussianTree


def _gaussian_model_domain(codec: Codec, gen: torch.Generator, t: int, layer: int = 0, kind: str = "k"):
    """x whose transformed, calibrated value z is standard normal: returns (x, z)."""
    spec = codec.spec
    z = torch.randn(spec.n_kv_heads, t, spec.head_dim, generator=gen, dtype=torch.float64)
    mu, sigma = codec.stats(layer, kind)
    xt = mu[:, None, :].double() + sigma[:, None, :].double() * z
    rot = codec.rot_k if kind == "k" else codec.rot_v
    return rot.inverse(xt).float(), z


@pytest.fixture(scope="module")
def error_sd() -> list[float]:
    """Standard deviation of the per-scalar squared error (Z - Zhat_t)^2 for Z ~ N(0, 1), t = 0..8, by
    quadrature over the codec's own (float32) thresholds and table. The standard error of an empirical
    mean of N errors is error_sd[t] / sqrt(N). (The sample standard deviation is not used: at depth 8 a
    tenth of D(8) comes from leaves holding a few dozen of a million samples, so it underestimates.)"""
    tree = GaussianTree(8)
    z = torch.linspace(-12, 12, 2_000_001, dtype=torch.float64)
    w = torch.exp(-0.5 * z * z) / (2 * torch.pi) ** 0.5 * (z[1] - z[0])
    leaf = torch.bucketize(z, tree.boundaries().double())
    out = []
    for t in range(9):
        e2 = (tree.table().double()[t][leaf] - z) ** 2
        m2, m4 = float((w * e2).sum()), float((w * e2 * e2).sum())
        assert m2 == pytest.approx(tree.distortion[t], rel=1e-5)  # the quadrature agrees with D(t)
        out.append((m4 - m2 * m2) ** 0.5)
    return out


@pytest.mark.parametrize("kind", ["k", "v"])
def test_empirical_error_matches_distortion(unit_codec, gen, kind, error_sd):
    codec = unit_codec(n_kv_heads=2, head_dim=64)
    x, z = _gaussian_model_domain(codec, gen, 8192, kind=kind)
    codes = codec.encode_k(x, 0) if kind == "k" else codec.encode_v(x, 0)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    dist = codec.tree.distortion
    mses = []
    for t in range(9):
        zhat = codec.reconstruct(codes, t, 0, kind).double()  # mu = 0, sigma = 1: z units
        e2 = ((zhat - z) ** 2).flatten()
        mse = e2.mean().item()
        se = error_sd[t] / e2.numel() ** 0.5
        assert abs(mse - dist[t]) <= 5 * se, (t, mse, dist[t], se)
        mses.append(mse)
    assert all(a > b for a, b in pairwise(mses))


def test_empirical_error_with_nontrivial_calibration(unit_codec, gen, error_sd):
    shape = (2, 2, 64)
    mu = torch.randn(shape, generator=gen) * 3
    sigma = torch.rand(shape, generator=gen) * 4 + 0.1
    codec = unit_codec(n_layers=2, mu=mu, sigma=sigma)
    dist = codec.tree.distortion
    for layer in (0, 1):
        x, z = _gaussian_model_domain(codec, gen, 4096, layer=layer)
        codes = codec.encode_k(x, layer)
        for t in (0, 1, 3, 8):
            xt = codec.reconstruct(codes, t, layer, "k").double()
            zhat = (xt - mu[layer][:, None, :].double()) / sigma[layer][:, None, :].double()
            e2 = ((zhat - z) ** 2).flatten()
            se = error_sd[t] / e2.numel() ** 0.5
            assert abs(e2.mean().item() - dist[t]) <= 5 * se


def test_decode_full_depth_error(unit_codec, gen, error_sd):
    shape = (1, 2, 64)
    mu = torch.randn(shape, generator=gen)
    sigma = torch.rand(shape, generator=gen) + 0.5
    codec = unit_codec(mu=mu, sigma=sigma)
    x, z = _gaussian_model_domain(codec, gen, 4096)
    xh = codec.decode(codec.encode_k(x, 0), 8, 0, "k")
    assert xh.dtype == torch.float32 and xh.shape == x.shape
    # orthonormal transform: squared error in the model domain = sum of sigma^2 (z - zhat)^2
    sq = ((xh.double() - x.double()) ** 2).sum(-1)  # [Hkv, T]
    zhat = (codec.reconstruct(codec.encode_k(x, 0), 8, 0, "k").double() - mu[0][:, None].double()) \
        / sigma[0][:, None].double()
    want = (sigma[0][:, None].double() ** 2 * (zhat - z) ** 2).sum(-1)
    torch.testing.assert_close(sq.mean(), want.mean(), rtol=1e-3, atol=1e-9)
    # per token and KV head, the expected squared error is D(8) * sum_c sigma_c^2 (5 standard errors)
    s2 = sigma[0].double() ** 2  # [Hkv, d]
    expected = codec.tree.distortion[8] * s2.sum(-1)
    se = error_sd[8] * (s2 * s2).sum(-1).sqrt() / sq.shape[-1] ** 0.5
    assert bool(((sq.mean(-1) - expected).abs() <= 5 * se).all()), (sq.mean(-1), expected, se)
    # and the depth-8 reconstruction is much better than depth 4
    x4 = codec.decode(codec.encode_k(x, 0), 4, 0, "k")
    assert ((x4 - x) ** 2).mean() > 50 * ((xh - x) ** 2).mean()


def test_depth_zero_is_mu(synthetic):
    syn, codec = synthetic(n_tokens=100, n_layers=2, n_kv_heads=2, head_dim=64)
    for layer in range(2):
        for kind, data in (("k", syn.k[layer]), ("v", syn.v[layer])):
            codes = codec.encode_k(data, layer) if kind == "k" else codec.encode_v(data, layer)
            mu, _ = codec.stats(layer, kind)
            rec = codec.reconstruct(codes, 0, layer, kind)
            assert torch.equal(rec, mu[:, None, :].expand_as(rec))
            rot = codec.rot_k if kind == "k" else codec.rot_v
            torch.testing.assert_close(codec.decode(codes, 0, layer, kind), rot.inverse(mu)[:, None, :].expand_as(rec))


def test_per_channel_and_per_token_depths_broadcast(synthetic, gen):
    syn, codec = synthetic(n_tokens=50, n_layers=1, n_kv_heads=2, head_dim=64)
    codes = codec.encode_k(syn.k[0], 0)
    hk, t, d = codes.shape
    full = {tau: codec.reconstruct(codes, tau, 0, "k") for tau in range(9)}
    # per channel [Hkv, 1, d]
    dc = torch.randint(0, 9, (hk, 1, d), generator=gen)
    got = codec.reconstruct(codes, dc, 0, "k")
    for h in range(hk):
        for c in range(d):
            assert torch.equal(got[h, :, c], full[int(dc[h, 0, c])][h, :, c])
    # per token [Hkv, T, 1]
    dt = torch.randint(0, 9, (hk, t, 1), generator=gen)
    got = codec.reconstruct(codes, dt, 0, "v")
    fullv = {tau: codec.reconstruct(codes, tau, 0, "v") for tau in range(9)}
    for h in range(hk):
        for i in range(t):
            assert torch.equal(got[h, i], fullv[int(dt[h, i, 0])][h, i])
    # elementwise [Hkv, T, d]
    de = torch.randint(0, 9, (hk, t, d), generator=gen)
    got = codec.reconstruct(codes, de, 0, "k")
    stack = torch.stack([full[tau] for tau in range(9)])
    assert torch.equal(got, stack.gather(0, de[None]).squeeze(0))
    # decode accepts the same depths
    want = codec.rot_k.inverse(codec.reconstruct(codes, dc, 0, "k"))
    torch.testing.assert_close(codec.decode(codes, dc, 0, "k"), want)


def test_unread_planes_do_not_matter(synthetic, gen):
    syn, codec = synthetic(n_tokens=64, n_layers=1, n_kv_heads=2, head_dim=64)
    codes = codec.encode_v(syn.v[0], 0)
    noise = torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.int64)
    for t in range(9):
        keep = (0xFF << (8 - t)) & 0xFF
        mixed = ((codes.long() & keep) | (noise & ~keep & 0xFF)).to(torch.uint8)
        assert torch.equal(codec.reconstruct(mixed, t, 0, "v"), codec.reconstruct(codes, t, 0, "v"))


def test_leading_batch_dims(synthetic):
    syn, codec = synthetic(n_tokens=40, n_layers=1, n_kv_heads=2, head_dim=64)
    k = torch.stack([syn.k[0], syn.k[0] * 0.5])  # [2, Hkv, T, d]
    codes = codec.encode_k(k, 0)
    assert codes.shape == k.shape
    for b in range(2):
        assert torch.equal(codes[b], codec.encode_k(k[b], 0))
    rec = codec.reconstruct(codes, 5, 0, "k")
    assert torch.equal(rec[1], codec.reconstruct(codes[1], 5, 0, "k"))


def test_first_plane_is_sign_of_z(unit_codec):
    codec = unit_codec(n_kv_heads=1, head_dim=64)
    z = torch.zeros(1, 2, 64, dtype=torch.float64)
    z[0, 0] = 0.1
    z[0, 1] = -0.1
    x = codec.rot_k.inverse(z).float()
    codes = codec.encode_k(x, 0)
    assert bool((codes[0, 0] >= 128).all()) and bool((codes[0, 1] < 128).all())
    rec = codec.reconstruct(codes, 1, 0, "k")
    torch.testing.assert_close(rec[0, 0], torch.full((64,), 0.7978845608), rtol=0, atol=1e-6)


def test_codes_respect_width_and_are_progressive(unit_codec, gen):
    c8 = unit_codec(width=8)
    c4 = unit_codec(width=4)
    assert c8.calibration.calibration_id == c4.calibration.calibration_id
    assert c8.format_id != c4.format_id
    x, _ = _gaussian_model_domain(c8, gen, 2000)
    k8, k4 = c8.encode_k(x, 0), c4.encode_k(x, 0)
    assert int(k4.max()) < 16
    # the 4-plane code is the 4-plane prefix of the 8-plane code
    assert torch.equal(k4, k8 >> 4)
    assert c4.table("cpu").shape == (5, 16)
    for t in range(5):
        torch.testing.assert_close(c4.reconstruct(k4, t, 0, "k"), c8.reconstruct(k8, t, 0, "k"), rtol=0, atol=0)


def test_calibration_id_mismatch_raises(synthetic, unit_codec):
    syn, _ = synthetic(n_tokens=8, n_layers=1, n_kv_heads=2, head_dim=64)
    other = unit_codec(n_kv_heads=2, head_dim=64).calibration
    with pytest.raises(FormatMismatch):
        Codec(syn.spec, other)


def test_seed_and_geometry_mismatch_raise(synthetic):
    syn, _ = synthetic(n_tokens=8, n_layers=1, n_kv_heads=2, head_dim=64)
    calib = syn.calibration
    spec = syn.spec
    bad_seed = FormatSpec(**{**spec.to_dict(), "seed_k": spec.seed_k + 1})
    with pytest.raises(CalibrationError):
        Codec(bad_seed, calib)
    bad_geom = FormatSpec(**{**spec.to_dict(), "n_layers": 2})
    with pytest.raises(CalibrationError):
        Codec(bad_geom, calib)
    bad_dim = FormatSpec(**{**spec.to_dict(), "head_dim": 128})
    with pytest.raises(CalibrationError):
        Codec(bad_dim, calib)


def test_stats_kind(synthetic):
    syn, codec = synthetic(n_tokens=8, n_layers=1, n_kv_heads=2, head_dim=64)
    mu, sigma = codec.stats(0, "v")
    assert torch.equal(mu, syn.calibration.mu_v[0]) and torch.equal(sigma, syn.calibration.sigma_v[0])
    with pytest.raises(ValueError):
        codec.stats(0, "q")


def test_codec_tree_matches_width(unit_codec):
    c = unit_codec(width=6)
    assert isinstance(c.tree, GaussianTree) and c.tree.depth == 6 and c.width == 6
    assert c.tree.boundaries().numel() == 63
    assert c.table("cpu").shape == (7, 64)
