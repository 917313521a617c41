"""Accounting (DESIGN section 2): capacity, logical read, workspace, write amortization.

Units are in the names: ``*_bits`` are bits, ``*_bytes`` bytes; tokens are tokens (not pages).
GQA counts each physical KV head once.
"""

from __future__ import annotations

from dataclasses import dataclass

from .format import FormatSpec


def codebook_bytes(width: int) -> int:
    """float32 levels of every depth 0..W plus the 2**W - 1 thresholds."""
    return 4 * (sum(1 << t for t in range(width + 1)) + (1 << width) - 1)


@dataclass(frozen=True)
class Capacity:
    """Stored bytes, per tier, for one model's cache."""

    hot_bytes: int  # planes [0, h): GPU page pool
    cold_bytes: int  # planes [h, W): packed blocks in host memory, NVMe or the store
    metadata_bytes: int  # calibration statistics and the codebook

    @property
    def total_bytes(self) -> int:
        return self.hot_bytes + self.cold_bytes + self.metadata_bytes


def capacity(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int, width: int = 8,
             hot_planes: int | None = None, calibration_bytes: int = 0) -> Capacity:
    """``2 x layers x batch x tokens x kv_heads x head_dim x W / 8`` bytes, split at ``hot_planes``
    (default: all planes hot), plus calibration and codebook bytes."""
    h = width if hot_planes is None else hot_planes
    if not 0 <= h <= width:
        raise ValueError(f"hot_planes must be in 0..{width}")
    scalars = 2 * n_layers * batch * tokens * n_kv_heads * head_dim
    return Capacity(hot_bytes=scalars * h // 8, cold_bytes=scalars * (width - h) // 8,
                    metadata_bytes=calibration_bytes + codebook_bytes(width))


def capacity_for(spec: FormatSpec, batch: int, tokens: int, hot_planes: int | None = None) -> Capacity:
    """Capacity of ``batch`` sequences of ``tokens`` tokens under ``spec`` (calibration included:
    four float32 statistics per layer, KV head and channel)."""
    calib = 4 * 4 * spec.n_layers * spec.n_kv_heads * spec.head_dim
    return capacity(spec.n_layers, batch, tokens, spec.n_kv_heads, spec.head_dim, spec.width,
                    hot_planes, calib)


def dense_bytes(n_layers: int, batch: int, tokens: int, n_kv_heads: int, head_dim: int, bits: int = 16) -> int:
    """Bytes of a dense K/V cache at ``bits`` per scalar."""
    return 2 * n_layers * batch * tokens * n_kv_heads * head_dim * bits // 8


def logical_read_bits(tokens: int, head_dim: int, budget_k: int, budget_v: int) -> int:
    """K bits + V bits requested by one step of one KV head: ``T B_K + d B_V``."""
    return tokens * budget_k + head_dim * budget_v


def rate(tokens: int, head_dim: int, budget_k: int, budget_v: int) -> float:
    """R = (T B_K + d B_V) / (2 T d): average bits read per stored scalar."""
    return logical_read_bits(tokens, head_dim, budget_k, budget_v) / (2 * tokens * head_dim)


def two_stage_workspace_bytes(n_q_heads: int, n_kv_heads: int, tokens: int, head_dim: int, batch: int = 1) -> int:
    """Peak temporaries of one two-stage read step, per the reference reader's buffers:
    float32 logits and probabilities [Hq, T], Value importance [Hkv, T] (float32) and depths
    [Hkv, T] (uint8), Key importance [Hkv, d] (float32) and depths [Hkv, d] (uint8), and the float32
    output [Hq, d]."""
    per_seq = (4 * 2 * n_q_heads * tokens + (4 + 1) * n_kv_heads * tokens
               + (4 + 1) * n_kv_heads * head_dim + 4 * n_q_heads * head_dim)
    return batch * per_seq


def history_reads(n_prompt: int, n_decode: int) -> int:
    """S = L N + L (L - 1) / 2: token reads over L decode steps after an N-token prompt."""
    return n_decode * n_prompt + n_decode * (n_decode - 1) // 2


def write_amortization(n_prompt: int, n_decode: int, w: float, r: float) -> float:
    """Extra bits of storing W instead of R per scalar, over the bits read:
    ``(W - R)(N + L) / (R S)``. (8192, 128, 8, 4) gives 0.00787. It never shrinks capacity."""
    if n_prompt < 0 or n_decode < 1 or r <= 0:
        raise ValueError("need n_prompt >= 0, n_decode >= 1 and r > 0")
    return (w - r) * (n_prompt + n_decode) / (r * history_reads(n_prompt, n_decode))
