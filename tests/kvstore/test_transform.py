"""Hadamard-sign transform (DESIGN 1.1): orthonormal, exactly invertible, block-diagonal for head dims
that are not powers of two, and inner-product preserving only when Q and K share the signs."""

from __future__ import annotations

import math

import pytest
import torch

from planekv.kvstore.transform import HadamardSign, block_sizes, hadamard_matrix, random_signs

HEAD_DIMS = [64, 128, 256, 96, 80]


def test_block_sizes_rule():
    assert block_sizes(64) == [64]
    assert block_sizes(128) == [128]
    assert block_sizes(256) == [256]
    assert block_sizes(96) == [64, 32]
    assert block_sizes(80) == [64, 16]
    assert block_sizes(7) == [4, 2, 1]
    assert block_sizes(1) == [1]
    for d in range(1, 300):
        b = block_sizes(d)
        assert sum(b) == d
        assert b == sorted(b, reverse=True)
        assert all(x & (x - 1) == 0 for x in b)
        assert len(set(b)) == len(b)


@pytest.mark.parametrize("d", [0, -8])
def test_block_sizes_rejects_non_positive(d):
    with pytest.raises(ValueError):
        block_sizes(d)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_roundtrip_float64(d, gen):
    rot = HadamardSign(d, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    x = torch.randn(3, 41, d, generator=gen, dtype=torch.float64) * 5
    y = rot.forward(x)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert (rot.inverse(y) - x).abs().max().item() < 1e-12
    assert (rot.forward(rot.inverse(x)) - x).abs().max().item() < 1e-12
    # a rotation, not the identity
    assert (y - x).abs().max().item() > 0.1
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=0)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_float32_roundtrip(d, gen):
    rot = HadamardSign(d, seed=3)
    x = torch.randn(17, d, generator=gen)
    y = rot.forward(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(rot.inverse(y), x, rtol=0, atol=1e-5)
    # half-precision input is computed in float32
    assert rot.forward(x.half()).dtype == torch.float32


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_matrix_orthonormal(d):
    m = HadamardSign(d, seed=11).matrix
    eye = torch.eye(d, dtype=torch.float64)
    assert (m @ m.T - eye).abs().max().item() < 1e-12
    assert (m.T @ m - eye).abs().max().item() < 1e-12


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_matrix_is_hadamard_times_signs(d):
    rot = HadamardSign(d, seed=5)
    s = rot.signs
    assert set(s.tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(rot.matrix, hadamard_matrix(d) * s[None, :], rtol=0, atol=0)
    # forward(x) = H diag(s) x
    x = torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    torch.testing.assert_close(rot.forward(x), hadamard_matrix(d) @ (s * x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("d", [96, 80])
def test_non_power_of_two_is_block_diagonal(d):
    h = hadamard_matrix(d)
    start = 0
    for n in block_sizes(d):
        blk = h[start:start + n, start:start + n]
        # every entry of a block is +-1/sqrt(n): a full Hadamard block, not a partial one
        torch.testing.assert_close(blk.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))
        torch.testing.assert_close(blk, hadamard_matrix(n))
        off = h[start:start + n].clone()
        off[:, start:start + n] = 0
        assert off.abs().max().item() == 0.0
        start += n


def test_sylvester_structure():
    h = hadamard_matrix(4) * 2
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64)
    torch.testing.assert_close(h, expected)


def test_signs_are_seeded():
    a = random_signs(128, 1)
    assert torch.equal(a, random_signs(128, 1))
    assert not torch.equal(a, random_signs(128, 2))
    # roughly balanced
    assert 32 < int((a > 0).sum()) < 96


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_inner_product_preserved_with_shared_signs(d, gen):
    q = torch.randn(200, d, generator=gen, dtype=torch.float64)
    k = torch.randn(200, d, generator=gen, dtype=torch.float64)
    rot_q = HadamardSign(d, seed=0x5EED_0001)
    rot_k = HadamardSign(d, seed=0x5EED_0001)
    ref = (q * k).sum(-1)
    got = (rot_q.forward(q) * rot_k.forward(k)).sum(-1)
    assert (got - ref).abs().max().item() < 1e-10
    # all pairs, as attention logits
    torch.testing.assert_close(rot_q.forward(q) @ rot_k.forward(k).T, q @ k.T, rtol=0, atol=1e-10)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_inner_product_not_preserved_with_other_signs(d, gen):
    q = torch.randn(200, d, generator=gen, dtype=torch.float64)
    k = torch.randn(200, d, generator=gen, dtype=torch.float64)
    ref = (q * k).sum(-1)
    got = (HadamardSign(d, seed=1).forward(q) * HadamardSign(d, seed=2).forward(k)).sum(-1)
    # the error is of the order of the products themselves, not rounding
    assert (got - ref).abs().mean().item() > 0.3 * ref.abs().mean().item()
