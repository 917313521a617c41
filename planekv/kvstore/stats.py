"""What a read reports: bits requested, depths, workspace (DESIGN section 2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ReadStats:
    """Per query row (a decode step, or one position of a teacher-forced pass).

    ``k_bits`` / ``v_bits`` [rows] are the *logical* read (bits requested), summed over the layer's
    KV heads; ``tokens`` [rows] the tokens each row read. ``workspace_bytes`` is the peak temporary
    memory of one step (counted from the shapes, see accounting.two_stage_workspace_bytes).
    ``physical_bytes`` is counted from the layout when the read went through pages.
    """

    k_bits: torch.Tensor
    v_bits: torch.Tensor
    tokens: torch.Tensor
    n_kv_heads: int
    head_dim: int
    workspace_bytes: int = 0
    physical_bytes: int | None = None
    k_depths: torch.Tensor | None = None  # [rows, Hkv, d]
    v_depths: torch.Tensor | None = None  # [rows, Hkv, T] (padded with 0 past each row's tokens)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bits(self) -> torch.Tensor:
        return self.k_bits + self.v_bits

    @property
    def dense_bits(self) -> torch.Tensor:
        """Bits a 16-bit dense read of the same tokens would request, per row."""
        return 16.0 * 2 * self.tokens * self.head_dim * self.n_kv_heads

    @property
    def bits_per_scalar(self) -> float:
        """Average bits read per stored scalar over all rows (R as measured)."""
        return float(self.total_bits.sum() / (2.0 * self.tokens * self.head_dim * self.n_kv_heads).sum())

    @property
    def read_fraction(self) -> float:
        """Logical read as a fraction of a 16-bit dense read."""
        return float(self.total_bits.sum() / self.dense_bits.sum())

    @staticmethod
    def concat(parts: list[ReadStats]) -> ReadStats:
        """Join the rows of several reads of the same geometry (e.g. sequences of a batch)."""
        first = parts[0]
        return ReadStats(
            k_bits=torch.cat([p.k_bits for p in parts]),
            v_bits=torch.cat([p.v_bits for p in parts]),
            tokens=torch.cat([p.tokens for p in parts]),
            n_kv_heads=first.n_kv_heads,
            head_dim=first.head_dim,
            workspace_bytes=sum(p.workspace_bytes for p in parts),
            physical_bytes=None if any(p.physical_bytes is None for p in parts)
            else sum(p.physical_bytes for p in parts),  # type: ignore[misc]
        )
