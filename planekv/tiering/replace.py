"""A running cache under a new placement policy (docs/TIERING.md, "Live policy").

``replace_placement(cache, policy)`` copies every stored code of a :class:`TieredCache` into a new one made under
``policy`` with the same budgets, layer by layer: a layer's codes are assembled from wherever their planes live
(hot pool, open pages, host tier or its spill files) and appended to the new cache, whose pages seal and ship
their refinement planes as its policy says. The new cache holds exactly the codes the old one held. Only when
every layer has moved is the old cache freed; if anything fails on the way (a budget the new policy overflows),
the new cache is dropped and the old one is untouched. Peak memory: both caches at once (device pools, host tiers;
the new one spills to its own directory beside the old one's). A policy change is rare and happens between decode
steps.

With a remote tier the new cache writes its sealed blocks through the same ``RemoteWriter``. A block's key names
its content: format, sequence, K or V, layer, KV head, page range and plane range ``[h, W)``, so a layer whose hot
depth changes gets keys of other planes, and a key both caches hold (a layer whose hot depth and block size stay)
names the same bytes (the same codes of the same pages and planes), written once more by the new cache (the store
takes the same bytes again as a no-op). After the swap the old cache's remote copies are deleted except the keys the
new cache holds; if the move fails, the new cache's copies are deleted except the keys the old cache holds. Old
copies being read by the move are fetched before anything is deleted.
"""

from __future__ import annotations

import torch

from ..kvstore.planes import _planes_to_codes, unpack_bits, v_planes
from .placement import PlacementPolicy
from .spill_tier import SpillTier
from .tiered_cache import TieredCache


def stored_codes(cache: TieredCache, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code of sequence ``b`` in ``layer`` at full depth, whatever is resident: (K [Hkv, T, d], V [Hkv, T,
    d]) uint8, read from the hot pool, the open page and the host tier (its spill files included)."""
    spec = cache.spec
    w, d, p, hk_n, g = spec.width, spec.head_dim, spec.page_size, spec.n_kv_heads, spec.v_run
    hk, hv = cache.hot_k[layer], cache.hot_v[layer]
    t = cache.length(layer, b)
    if t == 0:
        empty = torch.zeros((hk_n, 0, d), dtype=torch.uint8, device=cache.device)
        return empty, empty.clone()
    n_slots, sealed = -(-t // p), t // p
    pages = cache.page_table[b, :, :n_slots].to(cache.device)  # [Hkv, slots]
    seq = cache.sequence_ids[b]
    k_raw = torch.zeros(hk_n, n_slots, w, d, cache.k_row, dtype=torch.uint8, device=cache.device)
    v_raw = torch.zeros(hk_n, n_slots, w, p, cache.v_row, dtype=torch.uint8, device=cache.device)
    k_raw[:, :, :hk] = cache.k_hot[layer][pages]
    v_raw[:, :, :hv] = v_planes(cache.v_hot[layer][pages], g)
    v_page = cache.v_promo[layer].shape[1:]  # one Value page's refinement planes as stored
    for h in range(hk_n):
        o = b * hk_n + h
        for s in range(sealed):
            if hk < w:
                k_raw[h, s, hk:] = cache.host.page((seq, "k", layer, h), s).view(w - hk, d, cache.k_row)
            if hv < w:
                v_raw[h, s, hv:] = v_planes(cache.host.page((seq, "v", layer, h), s).view(v_page), g)
        if sealed < n_slots:  # the open page keeps its refinement planes on the device
            if hk < w:
                k_raw[h, sealed, hk:] = cache.k_open[layer][o]
            if hv < w:
                v_raw[h, sealed, hv:] = v_planes(cache.v_promo[layer][o], g)
    k_bits = unpack_bits(k_raw)  # [Hkv, slots, W, d, P]
    k = _planes_to_codes(k_bits.permute(2, 0, 1, 4, 3), w).reshape(hk_n, -1, d)[:, :t]
    v_bits = unpack_bits(v_raw).permute(0, 1, 3, 2, 4).reshape(hk_n, -1, w, d)[:, :t]  # [Hkv, T, W, d]
    v = _planes_to_codes(v_bits.permute(2, 0, 1, 3), w)
    return k, v


def replace_placement(cache: TieredCache, policy: PlacementPolicy, block_bytes: int | None = None) -> TieredCache:
    """A new TieredCache under ``policy`` (same format, batch, tokens, budgets and sequence ids; a spill tier of
    the same root and capacity) holding every code of ``cache``, which is then freed. Anything that fails leaves
    ``cache`` as it was (the exceptions TieredCache raises: a policy that does not fit the format, CacheFull,
    TierFull). With a remote tier the new cache shares the old one's ``RemoteWriter``; the old cache's remote copies
    whose keys the new cache does not hold are deleted after the swap (the module docstring). ``block_bytes``: the
    new host tier's block size (default: the policy's)."""
    writer = cache.host.remote
    old_spill = cache.host.spill
    spill = None if old_spill is None else SpillTier(old_spill.root, old_spill.capacity_bytes, old_spill.backend,
                                                     old_spill.fsync)
    new: TieredCache | None = None
    try:
        new = TieredCache(cache.spec, cache.batch_size, policy, cache.max_tokens, device=cache.device,
                          sequence_ids=list(cache.sequence_ids), spill=spill, remote=writer, **cache.budgets)
        if block_bytes is not None:
            new.host.block_bytes = block_bytes
        for layer in range(cache.spec.n_layers):
            for b in range(cache.batch_size):
                k, v = stored_codes(cache, layer, b)
                new.append(layer, k, v, seq=b)
    except BaseException:
        if writer is not None and new is not None:
            new.host.keep_remote = cache.host.sealed_keys()  # the old cache's copies stay
            for b in range(new.batch_size):
                new.free(b)
        if spill is not None:
            spill.close()
        raise
    if writer is not None:
        cache.host.keep_remote = new.host.sealed_keys()  # the same keys name the same bytes: the new cache's now
    for b in range(cache.batch_size):
        cache.free(b)
    if old_spill is not None:
        old_spill.close()
    return new
