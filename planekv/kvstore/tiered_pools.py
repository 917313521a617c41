"""One layer of a tiered cache as the readers take it (docs/TIERING.md): its device tensors, no bookkeeping.

A tiered cache (``planekv.tiering.TieredCache``) keeps planes [0, h) of every page in hot pools (h planes a page
instead of W) and brings refinement planes into a promotion cache. A read caps each Key channel at its resident
depth (``k_max``: h_K and the promoted planes that follow it) and each Value token at its page's (W where the page
holds a promotion slot, else h_V); planes >= h come from the promotion cache. Key refinement reads a refined token
at depth W where its Key page holds a slot (``kp_slot``: promoted, or the open page), else at its channels' resident
depths. Nothing past the residency is read, so nothing is waited for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TieredPools:
    hot_k: int  # h_K: Key planes a page in the hot pool
    hot_v: int  # h_V: Value planes a page in the hot pool (a multiple of the format's v_run)
    k_hot: torch.Tensor  # [pages, h_K, d, P/8] uint8
    v_hot: torch.Tensor  # [pages, h_V, P, d/8] uint8 ([pages, h_V/g, P, g, d/8] with v_run g > 1)
    k_promo: torch.Tensor  # [slots, pages per sequence, P/8] uint8: promoted Key channel-planes over every page
    k_slot: torch.Tensor  # [B, Hkv, d, W - h_K] int32: each (channel, plane >= h_K)'s slot in k_promo, -1 if none
    k_max: torch.Tensor  # [B, Hkv, d] int32: each channel's resident depth
    v_promo: torch.Tensor  # [slots, W - h_V, P, d/8] uint8 (runs as v_hot): promoted pages' planes >= h_V
    v_slot: torch.Tensor  # [pages] int32: each physical page's slot in v_promo, -1 if none (resident depth h_V)
    kp_promo: torch.Tensor  # [slots, W - h_K, d, P/8] uint8: Key pages' planes >= h_K, every channel (refinement)
    kp_slot: torch.Tensor  # [pages] int32: each physical page's slot in kp_promo, -1 if none
