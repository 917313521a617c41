"""TieredCache: hot planes in the pool, sealed pages' refinement planes framed in the host tier, promoted back on
demand; reads within the residency equal PlaneKVCache's bit for bit, reads past it are refused, budgets hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planekv.kvstore import CacheFull, Codec, FormatMismatch, PlaneKVCache, PlaneKVError, ReadPolicy, Residency
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import PlacementPolicy
from planekv.tiering.errors import TierFull
from planekv.tiering.frame import BlockKey, verify_frame
from planekv.tiering.placement import HotPlanes
from planekv.tiering.tiered_cache import TieredCache

LENGTHS = [300, 130]  # 4 sealed pages + an open one; 2 sealed + an open one (64-token pages)


def _data(v_run: int = 1, n_layers: int = 2):
    syn = make_synthetic(n_tokens=max(LENGTHS), n_rows=len(LENGTHS), n_layers=n_layers, n_q_heads=4, n_kv_heads=2,
                         head_dim=32, seed=3)
    spec = dataclasses.replace(syn.spec, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    codes = [(codec.encode_k(syn.k[i], i), codec.encode_v(syn.v[i], i)) for i in range(n_layers)]
    return codec, codes, syn.q[0].transpose(0, 1).contiguous()


def _fill(cache, codes, chunks=((0, 200), (200, 201), (201, None))):
    """Prefill, a decode token, the rest: each sequence up to its length, every layer."""
    for layer, (kc, vc) in enumerate(codes):
        for b, t in enumerate(LENGTHS):
            for a, e in chunks:
                e = t if e is None else min(e, t)
                if a < e:
                    cache.append(layer, kc[:, a:e], vc[:, a:e], seq=b)
    return cache


def _policy(hk: int = 4, hv: int = 2, **kw) -> PlacementPolicy:
    return PlacementPolicy(hot_planes=HotPlanes(k=hk, v=hv), block_bytes=1 << 20, **kw)


def test_with_every_plane_hot_it_reads_as_the_plane_cache() -> None:
    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(8, 8), max_tokens=512), codes)
    assert tiered.bytes().host == 0 and tiered.bytes().promotion == 0
    for layer in range(2):
        res = tiered.residency(layer)
        assert bool((res.k_depth == 8).all()) and bool((res.v_page_depth[tiered.page_table >= 0] == 8).all())
        for b in range(2):
            assert torch.equal(tiered.read_k(layer, b, 8), flat.read_k(layer, b, 8))
            assert torch.equal(tiered.read_v(layer, b, 8), flat.read_v(layer, b, 8))


@pytest.mark.parametrize("v_run", [1, 2])
def test_sealed_pages_go_to_the_host_tier_as_frames_and_promote_back(v_run: int) -> None:
    """Refinement planes of full pages are framed in the host tier (one block per stream here: 1 MiB holds them
    all, so none is sealed yet; a small block size seals them); the open page and the most recent sealed pages
    stay readable to W; promoting every Key channel-plane and Value page makes the whole cache readable, equal
    to the plane cache's codes."""
    codec, codes, _ = _data(v_run)
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 << 20), codes)
    assert tiered.counters["sealed"] == 2 * (4 + 2)  # per layer: 4 + 2 full pages
    res = tiered.residency(0)
    assert bool((res.k_depth == 4).all())  # no Key channel-plane promoted yet
    depth_v = res.v_page_depth[0, 0, :5].tolist()
    assert depth_v[4] == 8  # the open page
    with pytest.raises(PlaneKVError, match="past its residency"):
        tiered.read_k(0, 0, 5)
    hk_n, d = codec.spec.n_kv_heads, codec.spec.head_dim
    for layer in range(2):
        n_k = tiered.promote_keys(layer, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d)
                                          for j in range(4, 8)])
        assert n_k == 2 * hk_n * d * 4
        tiered.promote_values(layer, [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n)
                                      for s in range(t // 64)])
        res = tiered.residency(layer)
        assert bool((res.k_depth == 8).all())
        for b, t in enumerate(LENGTHS):
            assert bool((res.v_depth(b, t, 64) == 8).all())
            assert torch.equal(tiered.read_k(layer, b, 8), flat.read_k(layer, b, 8))
            assert torch.equal(tiered.read_v(layer, b, 8), flat.read_v(layer, b, 8))
    # blocks small enough to fill (a policy's are >= 1 MiB; here two Key pages of 4 planes x 32 channels x 8 bytes)
    small = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512)
    small.host.block_bytes = 4096 + 2 * 1024
    _fill(small, codes)
    frames = small.host.frames(("s0", "k", 0, 0))
    assert [key for key, _ in frames] == [BlockKey(codec.spec.format_id, "s0", "k", 0, 0, 0, 2, 4, 8),
                                          BlockKey(codec.spec.format_id, "s0", "k", 0, 0, 2, 4, 4, 8)]
    for key, buf in frames:  # intact frames of their pages' bytes
        verify_frame(buf.numpy(), key)
        assert torch.equal(buf[4096: 4096 + 1024], small.host.page(("s0", "k", 0, 0), key.page_start))


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(4.0, 0.5), ReadPolicy.constrained(4.0)],
                         ids=["flexible", "constrained"])
def test_a_read_within_the_residency_equals_the_plane_cache_read_with_it(policy: ReadPolicy) -> None:
    """The reference reader over the tiered cache, with its residency, gives the plane cache's read with the same
    residency: the same depths, caps and output, bit for bit (the tiered cache serves every plane it may)."""
    codec, codes, q = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 * 6 * 1536 + 2 * 2 * 512,
                               k_promotion_share=0.25), codes)  # small: most sealed pages stay in the host tier
    tiered.promote_keys(0, [(0, 0, c, 4) for c in range(0, 32, 3)] + [(1, 1, 5, 4), (1, 1, 5, 5)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    res = tiered.residency(0)
    want, st_w = readkv_decode(q, flat, 0, codec, policy, residency=res)
    got, st_g = readkv_decode(q, tiered, 0, codec, policy, residency=res)
    assert torch.equal(got, want) and torch.equal(st_g.k_depths, st_w.k_depths)
    assert torch.equal(st_g.extra["k_caps"], st_w.extra["k_caps"]) and torch.equal(st_g.extra["v_caps"],
                                                                                    st_w.extra["v_caps"])
    assert float(st_g.extra["v_caps"].sum()) > 0 and float(st_g.extra["k_caps"].sum()) > 0  # it limited this read


def test_promotion_is_bounded_and_least_recently_used_goes_first() -> None:
    codec, codes, _ = _data()
    page = (8 - 2) * 64 * 4  # a Value page's refinement planes: 6 planes x 64 tokens x 4 bytes
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512,
                               promotion_bytes=2 * 3 * page, k_promotion_share=0.0), codes)  # 3 page slots a layer
    sealed = [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(2) for s in range(t // 64)]
    tiered.promote_values(0, sealed)
    res = tiered.residency(0)
    resident = [(b, h, s) for b, h, s in sealed if int(res.v_page_depth[b, h, s]) == 8]
    assert resident == sealed[-3:]  # the last three brought stay
    assert tiered.promoted_bytes() == 2 * 3 * page  # layer 1 kept its last three sealed pages at sealing
    assert tiered.counters["v_evicted"] > 0
    assert tiered.promote_keys(0, [(0, 0, 0, 4)]) == 0  # no room for Key channel-planes at all


def test_bad_placements_and_full_tiers_are_refused_with_what_to_do() -> None:
    codec, codes, _ = _data(v_run=2)
    with pytest.raises(ValueError, match="whole number of V runs"):
        TieredCache(codec.spec, 2, _policy(4, 3), max_tokens=512)
    with pytest.raises(ValueError, match="holds no page"):
        TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, hot_bytes=100)
    with pytest.raises(FormatMismatch):
        TieredCache(codec.spec, 2, _policy(4, 2, format_id="0" * 16), max_tokens=512)
    with pytest.raises(ValueError, match="width"):
        TieredCache(codec.spec, 2, PlacementPolicy(width=6, hot_planes=HotPlanes(k=4, v=2)), max_tokens=512)
    tight = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, hot_bytes=2 * 2 * 3 * (4 * 32 * 8 + 2 * 64 * 4))
    with pytest.raises(CacheFull, match="hot pool holds"):
        _fill(tight, codes)
    full_host = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, host_bytes=0)
    with pytest.raises(TierFull, match="host tier full"):
        _fill(full_host, codes)
    with pytest.raises(CacheFull, match="made for"):
        TieredCache(codec.spec, 1, _policy(), max_tokens=64).append(0, codes[0][0][:, :65], codes[0][1][:, :65], seq=0)
    assert Residency.full(codec.spec, 2, 3).k_depth.shape == (2, 2, 32)
