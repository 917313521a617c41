"""Synthetic K/V/Q with the statistics that make KV compression hard: a few outlier channels in K
(large in magnitude in every token, as KIVI describes real keys: a big per-channel offset and twice
the spread), and queries that attend to a few tokens. Used by the demo
and the tests until real-model data is plugged in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .calibration import Calibration, calibrate
from .format import FormatSpec


@dataclass
class SyntheticKV:
    spec: FormatSpec
    calibration: Calibration
    q: torch.Tensor  # [layers, Hq, M, d]
    k: torch.Tensor  # [layers, Hkv, T, d]
    v: torch.Tensor  # [layers, Hkv, T, d]


@dataclass
class _Dist:
    k_scale: torch.Tensor  # [layers, Hkv, 1, d]: a few outlier channels
    k_offset: torch.Tensor  # [layers, Hkv, 1, d]
    v_scale: torch.Tensor  # [layers, Hkv, 1, d]

    @classmethod
    def draw(cls, gen: torch.Generator, layers: int, hk: int, d: int, outliers: int) -> _Dist:
        k_scale = torch.ones(layers, hk, 1, d)
        k_offset = 0.5 * torch.randn(layers, hk, 1, d, generator=gen)
        idx = torch.randperm(d, generator=gen)[:outliers]
        k_scale[..., idx] = 2.0
        k_offset[..., idx] = 8.0 * torch.sign(torch.randn(layers, hk, 1, outliers, generator=gen))
        return cls(k_scale, k_offset, 1 + 0.5 * torch.rand(layers, hk, 1, d, generator=gen))

    def sample(self, gen: torch.Generator, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers, hk, _, d = self.k_scale.shape
        k = torch.randn(layers, hk, t, d, generator=gen) * self.k_scale + self.k_offset
        v = torch.randn(layers, hk, t, d, generator=gen) * self.v_scale
        return k, v


def make_synthetic(n_tokens: int = 1024, n_rows: int = 4, n_layers: int = 2, n_q_heads: int = 8,
                   n_kv_heads: int = 2, head_dim: int = 64, outliers: int = 4, seed: int = 0,
                   page_size: int = 64, width: int = 8) -> SyntheticKV:
    """Calibration drawn from one sample, test K/V/Q from another of the same distribution.

    Queries are built to look at a few keys: each query row is a noisy copy of a few random keys of
    its group, so softmax mass is concentrated as in real long-context attention.
    """
    gen = torch.Generator().manual_seed(seed)
    dist = _Dist.draw(gen, n_layers, n_kv_heads, head_dim, outliers)
    kc, vc = dist.sample(gen, 2048)
    spec0 = FormatSpec(model_id="synthetic", n_layers=n_layers, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, calibration_id="-", page_size=page_size, width=width)
    calib = calibrate(kc, vc, spec0.seed_k, spec0.seed_v, meta={"source": "synthetic", "seed": seed})
    spec = FormatSpec(**{**spec0.to_dict(), "calibration_id": calib.calibration_id})
    gen = torch.Generator().manual_seed(seed + 1)
    k, v = dist.sample(gen, n_tokens)
    g = n_q_heads // n_kv_heads
    pick = torch.randint(0, n_tokens, (n_layers, n_kv_heads, g * n_rows, 3), generator=gen)
    lk = torch.gather(k, 2, pick.reshape(n_layers, n_kv_heads, -1, 1).expand(-1, -1, -1, head_dim))
    q = lk.reshape(n_layers, n_kv_heads, g * n_rows, 3, head_dim).sum(3) / 3
    q = q + 0.5 * torch.randn(q.shape, generator=gen)
    # Scale each row so its logits over all keys have a standard deviation of 2.5 (real decode
    # attention sits around 1-3): peaky on the planted keys without being one-hot everywhere.
    logits = q @ k.transpose(2, 3) / head_dim**0.5  # [layers, Hkv, G*rows, T]
    q = q * (2.5 / logits.std(-1, keepdim=True))
    q = q.reshape(n_layers, n_q_heads, n_rows, head_dim)
    return SyntheticKV(spec, calib, q, k, v)
