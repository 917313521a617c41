"""Hadamard-sign transform (DESIGN section 1, step 1).

``x~ = H diag(s) x / sqrt(n)`` per block: an orthonormal rotation that spreads outlier channels over
all channels so each transformed channel is close to Gaussian. Q and K share the Key signs (so
``q~ . k~ = q . k``); V has its own signs and the attention output is rotated back.

Head dims that are powers of two use one Sylvester Hadamard block. Any other head dim is split by
its binary expansion into power-of-two blocks, largest first (96 = 64 + 32, 80 = 64 + 16), and the
transform is block diagonal: still orthonormal, exactly invertible, and a no-op only for blocks of 1.
"""

from __future__ import annotations

import math
from functools import cache

import torch


def block_sizes(d: int) -> list[int]:
    """Power-of-two blocks of the block-diagonal Hadamard for head dim ``d``, largest first."""
    if d < 1:
        raise ValueError(f"head dim must be positive, got {d}")
    return [1 << b for b in range(d.bit_length() - 1, -1, -1) if d >> b & 1]


@cache
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@cache
def hadamard_matrix(d: int) -> torch.Tensor:
    """Orthonormal block-diagonal Hadamard [d, d] (float64)."""
    return torch.block_diag(*[_sylvester(n) / math.sqrt(n) for n in block_sizes(d)])


def random_signs(d: int, seed: int) -> torch.Tensor:
    """Fixed +-1 signs [d] (float64) drawn from ``seed`` with torch's CPU generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=g).to(torch.float64) * 2 - 1


class HadamardSign:
    """The rotation ``M = H diag(s)`` for one head dim and one sign seed; ``M`` is orthonormal."""

    def __init__(self, head_dim: int, seed: int) -> None:
        self.head_dim = head_dim
        self.seed = seed
        self.signs = random_signs(head_dim, seed)
        self.matrix = hadamard_matrix(head_dim) * self.signs[None, :]  # [d_out, d_in], float64
        self._cache: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _m(self, like: torch.Tensor) -> torch.Tensor:
        dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
        key = (dtype, like.device)
        if key not in self._cache:
            self._cache[key] = self.matrix.to(dtype=dtype, device=like.device)
        return self._cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> x~ [..., d] (float32, or float64 for float64 input)."""
        m = self._m(x)
        return x.to(m.dtype) @ m.T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """x~ [..., d] -> x [..., d]; exact up to floating-point rounding."""
        m = self._m(y)
        return y.to(m.dtype) @ m
