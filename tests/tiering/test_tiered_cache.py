"""TieredCache: hot planes in the pool, sealed pages' refinement planes framed in the host tier, promoted back on
demand; reads within the residency equal PlaneKVCache's bit for bit, reads past it are refused, budgets hold."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planekv.kvstore import CacheFull, Codec, FormatMismatch, PlaneKVCache, PlaneKVError, ReadPolicy, Residency
from planekv.kvstore.reference import readkv_decode, readkv_rows
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


@pytest.mark.parametrize("v_run,zero_copy", [(1, False), (2, False), (1, True)])
def test_sealed_pages_go_to_the_host_tier_as_frames_and_promote_back(v_run: int, zero_copy: bool) -> None:
    """Refinement planes of full pages are framed in the host tier (one block per stream here: 1 MiB holds them
    all, so none is sealed yet; a small block size seals them); the open page and the most recent sealed pages
    stay readable to W; promoting every Key channel-plane and Value page makes the whole cache readable, equal
    to the plane cache's codes, whether the host gathers the Key rows or the device reads them in place
    (``zero_copy``: Triton's interpreter on the CPU)."""
    codec, codes, _ = _data(v_run)
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 << 20,
                               zero_copy=zero_copy), codes)
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
        assert tiered.counters["k_zero_copy"] == (layer + 1) * n_k * zero_copy
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
    before = [(b, h, s) for b, h, s in sealed if int(tiered.residency(0).v_page_depth[b, h, s]) == 8]
    assert len(before) == 3  # the last pages sealed stay promoted
    assert tiered.promote_values(0, sealed) == 3
    res = tiered.residency(0)
    resident = [(b, h, s) for b, h, s in sealed if int(res.v_page_depth[b, h, s]) == 8]
    assert resident == [page for page in sealed if page not in before][-3:]  # the last three brought stay
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


def test_key_pages_stay_promoted_on_sealing_within_their_budget_and_read_at_full_depth() -> None:
    """Key page slots (``key_page_bytes``, beside the promotion cache): the open page and the most recently sealed
    pages are resident in every channel, the least recently used is evicted past the budget, a promoted page
    reads to W per token and equals the plane cache there, and a depth past a page's residency is refused."""
    codec, codes, _ = _data()
    spec = codec.spec
    page = (spec.width - 4) * spec.head_dim * spec.page_size // 8  # one Key page's refinement planes
    tiered = _fill(TieredCache(spec, 2, _policy(4, 2), max_tokens=512, key_page_bytes=2 * 3 * page), codes)
    flat = _fill(PlaneKVCache(spec, 2), codes)
    assert tiered.key_page_slots(0) == 3 and tiered.bytes().promotion >= 2 * 3 * page
    res = tiered.residency(0)
    # 6 pages sealed per head pair, 3 slots: the most recently sealed stay; the open pages are always resident
    for b, t in enumerate(LENGTHS):
        n_slots = -(-t // spec.page_size)
        assert bool((res.k_page_depth[b, :, n_slots - 1] == spec.width).all())  # the open page
    assert int((res.k_page_depth[:, :, :5] == spec.width).sum()) == 2 * 2 + 3  # open pages + 3 slots
    assert tiered.counters["kp_evicted"] > 0
    tiered.promote_key_pages(0, [(0, 1, 0), (1, 0, 1)])
    res = tiered.residency(0)
    assert int(res.k_page_depth[0, 1, 0]) == spec.width and int(res.k_page_depth[1, 0, 1]) == spec.width
    for b, t in enumerate(LENGTHS):
        lim = torch.maximum(res.k_depth[b][:, None, :], res.k_token_depth(b, t, spec.page_size)[:, :, None])
        got = tiered.read_k(0, b, lim)  # per token and channel: W on resident Key pages, h_K elsewhere
        full = flat.read_k(0, b, 8)
        keep = lim == spec.width
        assert bool(keep.any()) and bool((~keep).any())
        assert torch.equal(got[keep], full[keep])
        assert torch.equal(got[~keep], full[~keep] & 0xF0)  # the hot planes
        with pytest.raises(PlaneKVError, match="residency"):
            tiered.read_k(0, b, torch.full_like(lim, spec.width))
    tiered.free(0)  # sequence 0's slots released: only sequence 1's pages hold Key page slots
    held = set((tiered.kp_slot[0] >= 0).nonzero().flatten().tolist())
    assert held and held <= set(tiered.page_table[1][tiered.page_table[1] >= 0].tolist())
    lru = tiered._kp_lru[0]  # 3 slots past the open pages', and the LRU's owners are the table's
    held = (lru.owner >= 0).nonzero().flatten()
    assert lru.capacity == 3 and torch.equal(tiered.kp_slot[0][lru.owner[held]].long(), held)
    assert int((tiered.kp_slot[0] >= lru.reserved).sum()) == held.numel() > 0


def test_key_refinement_over_the_tiered_cache_serves_resident_key_pages_and_caps_the_rest() -> None:
    """Flexible R = 2 with Key refinement under the cache's residency: every refined token of a promoted or open
    Key page reads at depth W, the others at their channels' resident depth (caps counted in ``kr_caps``, the
    unlimited choice kept); with every Key page and channel-plane promoted it equals the all-GPU read bit for
    bit."""
    codec, codes, q = _data()
    spec = codec.spec
    policy = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)
    flat = _fill(PlaneKVCache(spec, 2), codes)
    want, wst = readkv_decode(q, flat, 0, codec, policy)
    tiered = _fill(TieredCache(spec, 2, _policy(4, 2), max_tokens=512), codes)  # no Key page slots
    out, st = readkv_decode(q, tiered, 0, codec, policy, residency=tiered.residency(0))
    for b, t in enumerate(LENGTHS):
        wanted, full = st.extra["kr_wanted"][b], st.extra["kr_full"][b]
        sealed = t // spec.page_size * spec.page_size
        assert bool(wanted[:, :sealed].any()) and not bool(full[:, :sealed].any())  # capped on sealed pages
        assert torch.equal(full[:, sealed:], wanted[:, sealed:])  # the open page serves refinement
    assert float(st.extra["kr_caps"].sum()) > 0
    assert torch.equal(st.extra["wanted_bits"], st.k_bits + st.v_bits + st.extra["k_caps"] + st.extra["v_caps"]
                       + st.extra["kr_caps"])
    # every Key page resident, no channel-plane promoted: refined tokens and every channel read at W (as a read of
    # the plain codes with the same limits)
    paged = TieredCache(spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=64 << 20, key_page_bytes=16 << 20)
    _fill(paged, codes)
    sealed_pages = [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(spec.n_kv_heads)
                    for s in range(t // spec.page_size)]
    paged.promote_values(0, sealed_pages)
    paged.promote_key_pages(0, sealed_pages)
    res = paged.residency(0)
    out, st = readkv_decode(q, paged, 0, codec, policy, residency=res)
    # every page of every head on the device: each channel reads to W (its Key pages), nothing capped
    assert bool((res.k_depth == spec.width).all())
    assert float(st.extra["k_caps"].sum()) == 0 and float(st.extra["kr_caps"].sum()) == 0
    kc, vc = codes[0]
    for b, t in enumerate(LENGTHS):
        plain, _ = readkv_rows(q[b][:, None], kc[:, :t], vc[:, :t], codec, 0, policy, torch.tensor([t]),
                               k_max=res.k_depth[b], v_max=res.v_depth(b, t, spec.page_size),
                               k_page_max=res.k_token_depth(b, t, spec.page_size))
        assert torch.equal(out[b], plain[:, 0])
    # everything resident: Key pages for every sealed page, every channel-plane and Value page promoted
    everything = TieredCache(spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=64 << 20,
                             key_page_bytes=16 << 20)
    _fill(everything, codes)
    hk_n, d = spec.n_kv_heads, spec.head_dim
    everything.promote_keys(0, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d)
                                for j in range(4, 8)])
    pages = [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n) for s in range(t // spec.page_size)]
    everything.promote_values(0, pages)
    everything.promote_key_pages(0, pages)
    out, st = readkv_decode(q, everything, 0, codec, policy, residency=everything.residency(0))
    assert torch.equal(out, want)
    assert torch.equal(st.k_bits, wst.k_bits) and torch.equal(st.v_bits, wst.v_bits)
    assert all(torch.equal(a, b) for a, b in zip(st.extra["k_refined"], wst.extra["k_refined"], strict=True))
    assert float((st.extra["k_caps"] + st.extra["v_caps"] + st.extra["kr_caps"]).sum()) == 0


def test_a_key_channel_whose_every_page_is_on_the_device_reads_to_w() -> None:
    """Only the open page (40 tokens), h_K = h_V = 4, no promotion cache and no Key page budget: nothing is off
    the device, so a tiered step reads every Key channel to the depth it asks for (no caps) and equals the all-GPU
    read bit for bit. A head whose sealed pages all sit in Key page slots reads its channels to W too; one with a
    sealed page only in the host tier stays at h_K plus its promoted channel-planes."""
    from planekv.tiering.decode import tiered_decode_step

    codec, codes, q = _data()
    spec = codec.spec
    policy = ReadPolicy.flexible(4.0)
    flat, tiered = PlaneKVCache(spec, 2), TieredCache(spec, 2, _policy(4, 4), max_tokens=512)
    for layer, (kc, vc) in enumerate(codes):
        for cache in (flat, tiered):
            for b in range(2):
                cache.append(layer, kc[:, :40], vc[:, :40], seq=b)
    want, wst = readkv_decode(q, flat, 0, codec, policy)
    assert bool((tiered.residency(0).k_depth == spec.width).all())
    out, st = tiered_decode_step(q, tiered, 0, codec, policy)
    assert float(st.extra["k_caps"].sum()) == 0 and float(st.extra["v_caps"].sum()) == 0
    assert bool((st.k_depths > 4).any())  # channels read past h_K, from the open pages
    assert torch.equal(out, want) and torch.equal(st.k_depths, wst.k_depths)
    assert torch.equal(st.k_bits, wst.k_bits) and torch.equal(st.v_bits, wst.v_bits)
    # lengths per layer: layer 0 has sealed its first page (no Key page slot for it), layer 1 still appends to it
    for b in range(2):
        tiered.append(0, codes[0][0][:, 40:70], codes[0][1][:, 40:70], seq=b)
    assert bool((tiered.residency(0).k_depth == 4).all()) and bool((tiered.residency(1).k_depth == spec.width).all())
    # sealed pages: sequence 0's every page in a Key page slot for head 0, a sealed page of head 1 only on the host
    page = 4 * spec.head_dim * spec.page_size // 8
    paged = _fill(TieredCache(spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=64 << 20,
                              key_page_bytes=2 * 8 * page), codes)
    paged.promote_key_pages(0, [(0, 0, s) for s in range(LENGTHS[0] // spec.page_size)])
    paged.promote_keys(0, [(0, 1, 3, 4), (0, 1, 3, 5)])
    res = paged.residency(0)
    kp = paged.kp_slot[0][paged.page_table[0, 1, : -(-LENGTHS[0] // spec.page_size)]]
    assert bool((kp < 0).any())  # head 1 has a sealed page off the device
    assert bool((res.k_depth[0, 0] == spec.width).all())
    assert int(res.k_depth[0, 1, 3]) == 6 and bool((res.k_depth[0, 1, :3] == 4).all())
    kc, vc = codes[0]
    out, st = readkv_decode(q, paged, 0, codec, policy, residency=res)
    t = LENGTHS[0]
    plain, _ = readkv_rows(q[0][:, None], kc[:, :t], vc[:, :t], codec, 0, policy, torch.tensor([t]),
                           k_max=res.k_depth[0], v_max=res.v_depth(0, t, spec.page_size))
    assert torch.equal(out[0], plain[:, 0])


def test_tier_aware_key_refinement_chooses_within_each_tokens_limit() -> None:
    """``ReadPolicy.tier_aware``: the refinement's benefit and cost stop at each token's limit, so it refines tokens
    of capped pages too, never reads past the residency (the cache would refuse), stays within the budget, and
    still reports the unlimited choice's caps."""
    codec, codes, q = _data()
    policy = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3, tier_aware=True)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512), codes)
    out, st = readkv_decode(q, tiered, 0, codec, policy, residency=tiered.residency(0))
    assert torch.isfinite(out).all()
    assert st.bits_per_scalar <= policy.rate + 1e-9
    p = codec.spec.page_size
    for b, t in enumerate(LENGTHS):
        sealed = t // p * p
        assert bool(st.extra["k_refined"][b][:, :sealed].any())  # refined at the channels' resident depth
        assert not bool(st.extra["kr_full"][b][:, :sealed].any())
    assert float(st.extra["kr_caps"].sum()) > 0
    assert torch.equal(st.extra["wanted_bits"], st.k_bits + st.v_bits + st.extra["k_caps"] + st.extra["v_caps"]
                       + st.extra["kr_caps"])


@pytest.mark.parametrize("zero_copy", [False, True])
def test_a_host_tier_too_small_spills_to_files_and_everything_promotes_back_equal(tmp_path, zero_copy) -> None:
    """A host tier of a few small blocks with a spill tier (POSIX here): sealed blocks move to files, the cache
    counts them as NVMe bytes, and promoting every Key channel-plane and Value page from there reads the plane
    cache's codes (with ``zero_copy``, heads whose blocks are all in memory are read in place by the device, the
    others gathered on the host); without the spill tier the same host tier refuses the pages."""
    from planekv.tiering import SpillTier

    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = 4096 + 2 * 1024  # two Key pages of 4 planes x 32 channels x 8 bytes per block
    spill = SpillTier(tmp_path, capacity_bytes=16 << 20, backend="posix")
    tiered = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 << 20,
                         host_bytes=40 * block, spill=spill, zero_copy=zero_copy)
    tiered.host.block_bytes = block
    _fill(tiered, codes)
    tb = tiered.bytes()
    assert tb.nvme > 0 and tb.host <= 40 * block and list(spill.dir.glob("*.blk"))
    hk_n, d = codec.spec.n_kv_heads, codec.spec.head_dim
    for layer in range(2):
        tiered.promote_keys(layer, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d)
                                    for j in range(4, 8)])
        tiered.promote_values(layer, [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n)
                                      for s in range(t // 64)])
        for b in range(2):
            assert torch.equal(tiered.read_k(layer, b, 8), flat.read_k(layer, b, 8))
            assert torch.equal(tiered.read_v(layer, b, 8), flat.read_v(layer, b, 8))
    # both ways were taken: some heads in place, the spilled ones on the host
    assert 0 < tiered.counters["k_zero_copy"] < tiered.counters["k_promoted"] if zero_copy else \
        tiered.counters["k_zero_copy"] == 0
    no_spill = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, host_bytes=40 * block)
    no_spill.host.block_bytes = block
    with pytest.raises(TierFull, match="host tier full"):
        _fill(no_spill, codes)


class _DictRemote:
    """A RemoteTier in a dict (tests/tiering/test_remote_tier.py tests the writer and the host tier on their own)."""

    def __init__(self) -> None:
        self.frames: dict[BlockKey, bytes] = {}

    def put_frame(self, frame: bytes) -> None:
        self.frames[verify_frame(frame).key] = bytes(frame)

    def get_frame(self, key: BlockKey) -> bytes | None:
        return self.frames.get(key)

    def delete(self, key: BlockKey) -> None:
        self.frames.pop(key, None)


def test_a_host_tier_too_small_with_a_remote_tier_drops_written_blocks_and_everything_promotes_back_equal() -> None:
    """A host tier of a few small blocks with only a remote tier: every sealed block is written there, the blocks
    written are dropped from memory (counted as remote bytes), and promoting every Key channel-plane and Value
    page reads the plane cache's codes; freeing a sequence deletes its remote copies (replace_placement with a
    remote tier: tests/tiering/test_replace.py)."""
    from planekv.tiering import RemoteWriter

    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = 4096 + 2 * 1024  # two Key pages of 4 planes x 32 channels x 8 bytes per block
    remote = _DictRemote()
    writer = RemoteWriter(remote, submit_timeout_s=10.0)
    tiered = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 << 20,
                         host_bytes=40 * block, remote=writer)
    tiered.host.block_bytes = block
    _fill(tiered, codes)
    writer.flush(10.0)
    tb = tiered.bytes()
    assert tb.remote > 0 and tb.host <= 40 * block and tb.nvme == 0 and writer.stats.failed == 0
    assert len(remote.frames) == writer.stats.written > 0
    hk_n, d = codec.spec.n_kv_heads, codec.spec.head_dim
    for layer in range(2):
        tiered.promote_keys(layer, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d)
                                    for j in range(4, 8)])
        tiered.promote_values(layer, [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n)
                                      for s in range(t // 64)])
        for b in range(2):
            assert torch.equal(tiered.read_k(layer, b, 8), flat.read_k(layer, b, 8))
            assert torch.equal(tiered.read_v(layer, b, 8), flat.read_v(layer, b, 8))
    assert tiered.host.remote_fetches > 0
    first = tiered.sequence_ids[0]
    tiered.free(0)
    assert remote.frames and all(k.sequence_id != first for k in remote.frames)
    writer.close(10.0)
