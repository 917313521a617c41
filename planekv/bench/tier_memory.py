"""GPU-resident bytes of each system's KV cache, counted from the layouts, and the largest batch a budget holds.

A model of ``spec.n_layers`` layers keeps every layer's cache at once and one step's workspace (layers are read one
after another). Per system, for B sequences of T tokens (Hkv KV heads, head dim d, W planes, pages of P tokens):

- ``sdpa``: float16 K and V, 2 x 2 bytes a scalar pair;
- ``fp8``: one byte a scalar (per-head scales are negligible);
- ``readkv`` (all planes on the GPU): W bits a scalar, and the Triton reader's workspace;
- ``tiered`` (hot planes h_K / h_V on the GPU): h_K + h_V bits a scalar pair in the hot pools; each (sequence,
  KV head, layer)'s open page keeps its W - h refinement planes (K in an open buffer, V in a reserved promotion
  slot); the promotion cache (``promotion_bytes``, fixed); the same workspace as ``readkv``.

The formulas are the allocations :class:`planekv.tiering.TieredCache` makes (a test holds them to
``TieredCache.bytes()``); the workspace is the sum of the buffers of a :class:`planekv.kernels.Plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import TritonReader
from ..kvstore import Codec, FormatSpec, ReadPolicy
from ..tiering.tiered_cache import key_page_slots, promotion_slots


@dataclass(frozen=True)
class GpuBytes:
    """Device bytes of a system's cache: ``per_sequence`` grows with the batch, ``fixed`` does not."""

    per_sequence: float
    fixed: float

    def total(self, batch: int) -> float:
        return batch * self.per_sequence + self.fixed

    def max_batch(self, budget: float) -> int:
        """The largest batch whose bytes fit ``budget`` (0 if not even one)."""
        return max(0, math.floor((budget - self.fixed) / self.per_sequence)) if self.per_sequence > 0 else 0


def workspace_bytes_per_sequence(codec: Codec, policy: ReadPolicy, tokens: int) -> float:
    """The Triton reader's buffers for one sequence of ``tokens`` tokens (a plan of 2 sequences on the meta device,
    halved: the plan's buffers are per sequence)."""
    plan = TritonReader(codec, policy).plan(2, tokens, "meta")
    total = sum(t.numel() * t.element_size() for t in vars(plan).values() if isinstance(t, torch.Tensor))
    return total / 2


def gpu_bytes(system: str, g: FormatSpec, tokens: int, hot: tuple[int, int] | None = None,
              promotion_bytes: int = 0, k_promotion_share: float = 0.5,
              workspace_per_sequence: float = 0.0, key_page_bytes: int = 0) -> GpuBytes:
    """Device bytes of ``system`` ("sdpa", "fp8", "readkv" or "tiered", with ``hot`` = (h_K, h_V)) for sequences
    of ``tokens`` tokens in a model of ``g.n_layers`` layers (a tiered cache made for ``tokens`` tokens, its
    promotion cache of ``promotion_bytes`` split as TieredCache splits it, its Key page slots of
    ``key_page_bytes``)."""
    scalars = g.n_layers * 2 * g.n_kv_heads * tokens * g.head_dim  # K and V, every layer, one sequence
    if system == "sdpa":
        return GpuBytes(2.0 * scalars, 0.0)
    if system == "fp8":
        return GpuBytes(1.0 * scalars, 0.0)
    slots = math.ceil(tokens / g.page_size)
    plane_bytes = g.head_dim * g.page_size / 8  # one plane of one page of one KV head
    if system == "readkv":
        return GpuBytes(g.n_layers * g.n_kv_heads * slots * 2 * g.width * plane_bytes + workspace_per_sequence, 0.0)
    if system != "tiered" or hot is None:
        raise ValueError(f"unknown system {system!r} (tiered needs hot = (h_K, h_V))")
    hk, hv = hot
    pool = g.n_layers * g.n_kv_heads * slots * (hk + hv) * plane_bytes
    open_pages = g.n_layers * g.n_kv_heads * (2 * g.width - hk - hv) * plane_bytes
    n_k, n_v = promotion_slots(g, tokens, hk, hv, promotion_bytes // g.n_layers, k_promotion_share)
    promo = g.n_layers * (n_k * slots * g.page_size / 8 + n_v * (g.width - hv) * plane_bytes)
    promo += g.n_layers * key_page_slots(g, hk, key_page_bytes // g.n_layers) * (g.width - hk) * plane_bytes
    return GpuBytes(pool + open_pages + workspace_per_sequence, promo)


def four_bit_bytes(g: FormatSpec, tokens: int) -> float:
    """A 4-bit cache of the same tokens (the issue's yardstick): half a byte a scalar."""
    return 0.5 * g.n_layers * 2 * g.n_kv_heads * tokens * g.head_dim
