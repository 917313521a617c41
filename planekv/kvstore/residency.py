"""What a tiered cache can read now (docs/TIERING.md): per sequence, the deepest readable depth of every Key
channel (its planes are promoted for every page of the head alike, or none are), of every Value page, and of every
Key page in all its channels (a promoted Key page serves Key refinement: its tokens read at full depth).

A read within a residency never asks for a plane that is not there; the allocators leave the increments past
it out and count them as caps. ``Residency.full`` (every plane of every page) reads exactly as without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import FormatSpec


@dataclass(frozen=True)
class Residency:
    k_depth: torch.Tensor  # [B, Hkv, d] int64: planes readable per Key channel, every page of the head alike
    v_page_depth: torch.Tensor  # [B, Hkv, slots] int64: planes readable per Value page
    # [B, Hkv, slots] int64: planes readable in every channel of a Key page (W where its refinement planes are on
    # the device, else h_K); a token's Key channel c is readable to max(k_depth[c], its page's). None: no Key page
    k_page_depth: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.k_depth.dim() != 3 or self.v_page_depth.dim() != 3 \
                or self.k_depth.shape[:2] != self.v_page_depth.shape[:2]:
            raise ValueError(f"residency must be k_depth [B, Hkv, d] and v_page_depth [B, Hkv, slots], got "
                             f"{tuple(self.k_depth.shape)} and {tuple(self.v_page_depth.shape)}")
        if self.k_page_depth is not None and (self.k_page_depth.dim() != 3
                                              or self.k_page_depth.shape[:2] != self.k_depth.shape[:2]):
            raise ValueError(f"k_page_depth must be [B, Hkv, slots] like v_page_depth, got "
                             f"{tuple(self.k_page_depth.shape)}")

    @classmethod
    def full(cls, spec: FormatSpec, batch: int, slots: int) -> Residency:
        """Every plane of every page readable (an all-GPU cache)."""
        w = spec.width
        pages = torch.full((batch, spec.n_kv_heads, slots), w, dtype=torch.int64)
        return cls(torch.full((batch, spec.n_kv_heads, spec.head_dim), w, dtype=torch.int64), pages, pages.clone())

    def check(self, spec: FormatSpec, batch: int) -> None:
        """Raise ValueError unless this residency fits ``batch`` sequences of the format."""
        want = (batch, spec.n_kv_heads, spec.head_dim)
        if tuple(self.k_depth.shape) != want or tuple(self.v_page_depth.shape[:2]) != want[:2]:
            raise ValueError(f"residency for k_depth {tuple(self.k_depth.shape)} / v_page_depth "
                             f"{tuple(self.v_page_depth.shape)} does not fit {batch} sequences of "
                             f"{spec.n_kv_heads} KV heads, head_dim {spec.head_dim}")
        for name, t in (("k_depth", self.k_depth), ("v_page_depth", self.v_page_depth),
                        ("k_page_depth", self.k_page_depth)):
            if t is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) > spec.width):
                raise ValueError(f"residency {name} must lie in [0, W = {spec.width}]")

    def v_depth(self, b: int, n_tokens: int, page_size: int) -> torch.Tensor:
        """[Hkv, n_tokens]: the readable Value depth of each token of sequence ``b``."""
        need = -(-n_tokens // page_size)
        if self.v_page_depth.shape[2] < need:
            raise ValueError(f"residency covers {self.v_page_depth.shape[2]} pages, sequence {b} has {need}")
        return self.v_page_depth[b, :, :need].repeat_interleave(page_size, dim=1)[:, :n_tokens]

    def k_token_depth(self, b: int, n_tokens: int, page_size: int) -> torch.Tensor | None:
        """[Hkv, n_tokens]: the depth each token's Key page makes readable in every channel of sequence ``b``
        (None without Key pages: each channel's ``k_depth`` governs)."""
        if self.k_page_depth is None:
            return None
        need = -(-n_tokens // page_size)
        if self.k_page_depth.shape[2] < need:
            raise ValueError(f"residency covers {self.k_page_depth.shape[2]} Key pages, sequence {b} has {need}")
        return self.k_page_depth[b, :, :need].repeat_interleave(page_size, dim=1)[:, :n_tokens]
