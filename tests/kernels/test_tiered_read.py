"""The Triton reader over a tiered cache (interpreter): the FMA stages read the hot pools and the promotion
cache, cap every depth at the residency, and equal the reference reader with the same residency (depths,
caps, output); with every plane hot they equal the all-GPU read. Key refinement reads a chosen token at depth W
where its Key page is resident, else at its channels' resident depths, as the reference does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planekv.kernels import ReaderConfig, TritonReader
from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import HotPlanes, PlacementPolicy, TieredCache
from tests.kernels.test_reader import assert_same_depths

LENGTHS = [200, 97]  # 3 sealed pages + an open one; 1 sealed + an open one (64-token pages)
FMA = ReaderConfig(assembly="fma", key_int8=False, value_int8=False)


def _caches(hot_k: int, hot_v: int, v_run: int = 1, seed: int = 11, key_page_bytes: int = 0):
    syn = make_synthetic(n_tokens=max(LENGTHS), n_rows=2, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32,
                         seed=seed)
    spec = dataclasses.replace(syn.spec, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    flat = PlaneKVCache(spec, 2)
    placement = PlacementPolicy(hot_planes=HotPlanes(k=hot_k, v=hot_v), block_bytes=1 << 20)
    tiered = TieredCache(spec, 2, placement, max_tokens=256, promotion_bytes=4 * 3 * 1536,
                         key_page_bytes=key_page_bytes)
    for b, t in enumerate(LENGTHS):
        for cache in (flat, tiered):
            cache.append(0, kc[:, :t], vc[:, :t], seq=b)
    return codec, flat, tiered, syn.q[0].transpose(0, 1).contiguous()


def _compare(codec, tiered, q, policy, ref_cache=None):
    """Triton over the tiered cache against the reference with the cache's residency."""
    res = tiered.residency(0)
    ref, rst = readkv_decode(q, tiered if ref_cache is None else ref_cache, 0, codec, policy, residency=res)
    reader = TritonReader(codec, policy, config=FMA)
    plan = reader.plan(2, 256, "cpu", pages_per_program=2)
    plan.out.fill_(float("nan"))
    out, st = reader.decode_tiered(q, tiered, 0, plan=plan)
    assert torch.isfinite(out).all()
    assert_same_depths(st.k_depths, rst.k_depths)
    assert_same_depths(st.extra["k_wanted"], rst.extra["k_wanted"])
    swapped = not torch.equal(st.k_depths, rst.k_depths)
    for b in range(2):
        assert_same_depths(st.extra["v_depths"][b], rst.extra["v_depths"][b], policy.v_packet)
        swapped |= not torch.equal(st.extra["v_depths"][b], rst.extra["v_depths"][b])
    if not swapped:
        for key in ("k_caps", "v_caps", "wanted_bits"):
            assert torch.equal(st.extra[key], rst.extra[key]), key
        assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < (1e-3 if swapped else 1e-5), rel
    return st, out


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(4.0), ReadPolicy.flexible(2.0, k_share=0.75),
                                    ReadPolicy.constrained(2.0)], ids=["flexible-r4", "flexible-r2", "constrained-r2"])
def test_tiered_read_equals_the_reference_with_the_same_residency(policy: ReadPolicy) -> None:
    """h_K = 4, h_V = 2, a few Key channel-planes and Value pages promoted, most sealed pages' refinement planes
    only in the host tier: the kernels cap what the reference caps and read the same planes."""
    codec, _, tiered, q = _caches(4, 2)
    tiered.promote_keys(0, [(0, 0, c, 4) for c in range(0, 32, 3)] + [(1, 1, 5, 4), (1, 1, 5, 5), (0, 1, 7, 4)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    st, _ = _compare(codec, tiered, q, policy)
    assert float(st.extra["v_caps"].sum()) > 0  # the residency bit
    if policy.rate == 4.0:  # at R = 2 with an equal split no Key channel asks for more than 4 planes here
        assert float(st.extra["k_caps"].sum()) > 0
        assert bool((st.k_depths > 4).any())  # promoted Key planes were read


@pytest.mark.parametrize("v_run", [1, 2])
def test_everything_promoted_reads_as_the_plane_cache(v_run: int) -> None:
    """Every Key channel-plane and Value page promoted: no caps, and the same output as the all-GPU Triton read
    of the same codes."""
    codec, flat, tiered, q = _caches(4, 2, v_run=v_run)
    tiered = TieredCache(codec.spec, 2, tiered.placement, max_tokens=256, promotion_bytes=4 << 20)
    kc = [flat.read_k(0, b, 8) for b in range(2)]
    vc = [flat.read_v(0, b, 8) for b in range(2)]
    for b in range(2):
        tiered.append(0, kc[b], vc[b], seq=b)
    hk_n, d = codec.spec.n_kv_heads, codec.spec.head_dim
    tiered.promote_keys(0, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d) for j in range(4, 8)])
    tiered.promote_values(0, [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n) for s in range(t // 64)])
    policy = ReadPolicy.flexible(4.0)
    st, out = _compare(codec, tiered, q, policy)
    assert float((st.extra["k_caps"] + st.extra["v_caps"]).sum()) == 0
    reader = TritonReader(codec, policy, config=FMA)
    want, _ = reader.decode(q, flat, 0, plan=reader.plan(2, 256, "cpu", pages_per_program=2))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_tiered_reads_are_refused_where_the_kernels_do_not_run_them() -> None:
    codec, _, tiered, q = _caches(4, 2)
    with pytest.raises(ValueError, match="tier-aware"):
        TritonReader(codec, ReadPolicy.flexible(4.0, tier_aware=True), config=FMA).decode_tiered(q, tiered, 0)
    mma = TritonReader(codec, ReadPolicy.flexible(4.0), config=ReaderConfig(assembly="transpose"))
    with pytest.raises(ValueError, match="FMA stages"):
        mma.decode_tiered(q, tiered, 0)
    reader = TritonReader(codec, ReadPolicy.flexible(4.0), config=FMA)
    pools = tiered.pools(0)
    bad = dataclasses.replace(pools, k_slot=pools.k_slot.long())
    plan = reader.plan(2, 256, "cpu")
    pt = tiered.page_table.to(torch.int32)
    with pytest.raises(TypeError, match="k_slot must be int32"):
        reader.run(plan, q, bad.k_hot, bad.v_hot, pt, tiered.lengths[0].to(torch.int32), 0, tiers=bad)
    with pytest.raises(TypeError, match="kp_slot must be int32"):
        reader.run(plan, q, pools.k_hot, pools.v_hot, pt, tiered.lengths[0].to(torch.int32), 0,
                   tiers=dataclasses.replace(pools, kp_slot=pools.kp_slot.long()))
    with pytest.raises(ValueError, match="k_hot must be"):
        reader.run(plan, q, pools.v_hot, pools.v_hot, pt, tiered.lengths[0].to(torch.int32), 0,
                   tiers=dataclasses.replace(pools, k_hot=pools.v_hot))


def _compare_refined(codec, tiered, q, policy):
    """Key refinement over the tiered cache: the kernels choose the reference's tokens, read them at the same
    limits (depth W on resident Key pages), count the same caps and give the same output."""
    res = tiered.residency(0)
    ref, rst = readkv_decode(q, tiered, 0, codec, policy, residency=res)
    reader = TritonReader(codec, policy, config=FMA)
    plan = reader.plan(2, 256, "cpu", pages_per_program=2, block_tokens=64)
    plan.out.fill_(float("nan"))
    plan.logits.fill_(float("nan"))
    out, st = reader.decode_tiered(q, tiered, 0, plan=plan)
    assert torch.isfinite(out).all()
    assert torch.equal(st.k_depths, rst.k_depths) and torch.equal(st.extra["k_wanted"], rst.extra["k_wanted"])
    for b in range(2):
        for key in ("kr_wanted", "kr_full"):
            assert torch.equal(st.extra[key][b], rst.extra[key][b]), (key, b)
        assert torch.equal(st.extra["v_depths"][b], rst.extra["v_depths"][b])
    for key in ("k_caps", "v_caps", "kr_caps", "kr_wanted_bits", "wanted_bits"):
        assert torch.equal(st.extra[key], rst.extra[key]), key
    assert torch.equal(st.k_bits, rst.k_bits) and torch.equal(st.v_bits, rst.v_bits)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    return st, out


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(2.0, 0.875, key_refine=0.3),
                                    ReadPolicy.flexible(4.0, 0.75, key_refine=0.3)], ids=["flexible-r2", "flexible-r4"])
def test_tiered_key_refinement_equals_the_reference_with_the_same_residency(policy: ReadPolicy) -> None:
    """h_K = 4, h_V = 2, Key page slots for 2 sealed pages (the latest sealed kept, one promoted) and a few Key
    channel-planes: refined tokens on resident Key pages read at W, the others at their channels' resident depths
    (some of them past h_K), both as the reference reads them."""
    page = 4 * 32 * 64 // 8
    codec, _, tiered, q = _caches(4, 2, key_page_bytes=2 * page)
    tiered.promote_keys(0, [(0, 0, c, 4) for c in range(0, 32, 3)] + [(1, 1, 5, 4), (1, 1, 5, 5), (0, 1, 7, 4)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    tiered.promote_key_pages(0, [(0, 0, 0)])
    st, _ = _compare_refined(codec, tiered, q, policy)
    full = torch.cat([f.flatten() for f in st.extra["kr_full"]])
    wanted = torch.cat([f.flatten() for f in st.extra["kr_wanted"]])
    assert bool(full.any()) and bool((wanted & ~full).any())  # both kinds of refined token
    assert float(st.extra["kr_caps"].sum()) > 0


def test_tiered_key_refinement_with_every_key_page_resident() -> None:
    """Every Key and Value page resident, no channel-plane promoted: refined tokens read at depth W from the Key
    pages and every channel is resident to W (its planes past h_K from the Key pages), in the kernels as in the
    reference, with nothing capped."""
    codec, _, tiered, q = _caches(4, 2, key_page_bytes=1 << 20)
    pages = [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(codec.spec.n_kv_heads) for s in range(t // 64)]
    tiered.promote_values(0, pages)
    tiered.promote_key_pages(0, pages)
    st, _ = _compare_refined(codec, tiered, q, ReadPolicy.flexible(4.0, 0.75, key_refine=0.3))
    assert float(st.extra["k_caps"].sum()) == 0 and float(st.extra["kr_caps"].sum()) == 0
    assert bool((st.k_depths > 4).any())  # channels read past h_K from the Key pages
    assert all(torch.equal(f, w) for f, w in zip(st.extra["kr_full"], st.extra["kr_wanted"], strict=True))


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(4.0), ReadPolicy.constrained(2.0),
                                    ReadPolicy.flexible(4.0, 0.75, key_refine=0.3)],
                         ids=["flexible-r4", "constrained-r2", "flexible-r4-refine"])
def test_channels_lifted_by_key_pages_read_their_planes_from_the_key_page_slots(policy: ReadPolicy) -> None:
    """Every page of sequence 0 (both heads) and of sequence 1 head 0 in a Key page slot (open or promoted),
    sequence 1 head 1's sealed page only on the host; a few channel-planes promoted in both kinds of head. The
    lifted heads' channels are resident to W: the Key stage reads plane j >= h_K from the channel-plane vector
    where it is promoted, else from each page's Key page slot, and equals the reference (depths, caps, output);
    the other head stays capped at h_K plus its promoted planes."""
    page = 4 * 32 * 64 // 8
    codec, _, tiered, q = _caches(4, 2, key_page_bytes=7 * page)  # slots for the 7 sealed pages promoted below
    tiered.promote_key_pages(0, [(0, h, s) for h in range(2) for s in range(LENGTHS[0] // 64)] + [(1, 0, 0)])
    assert int(tiered.kp_slot[0][tiered.page_table[1, 1, 0]]) < 0  # evicted: sequence 1 head 1 is not lifted
    tiered.promote_keys(0, [(0, 0, c, 4) for c in range(0, 32, 3)] + [(1, 1, 5, 4), (1, 1, 5, 5), (0, 1, 7, 4)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    res = tiered.residency(0)
    assert bool((res.k_depth[0] == 8).all()) and bool((res.k_depth[1, 0] == 8).all())
    assert int(res.k_depth[1, 1, 5]) == 6 and int(res.k_depth[1, 1].sum()) == 4 * 32 + 2
    st, _ = (_compare_refined if policy.key_refine else _compare)(codec, tiered, q, policy)
    assert float(st.extra["k_caps"][0]) == 0  # sequence 0: nothing capped
    assert torch.equal(st.k_depths[1, 0], st.extra["k_wanted"][1, 0])  # the lifted head of sequence 1 neither
    if policy.rate == 4.0:  # (constrained R = 2 asks for no channel past h_K here)
        assert bool((st.k_depths[0] > 5).any()) and bool((st.k_depths[1, 0] > 4).any())  # from Key page slots
        assert float(st.extra["k_caps"][1]) > 0  # sequence 1 head 1: capped at its promoted planes


def test_only_open_pages_read_as_the_plane_cache() -> None:
    """Sequences within their open page (40 and 64 tokens), h_K = h_V = 4, no promotion and no Key page budget:
    nothing is off the device, so the tiered read caps nothing and equals the all-GPU Triton read bit for bit."""
    codec, flat, _, q = _caches(4, 4)
    placement = PlacementPolicy(hot_planes=HotPlanes(k=4, v=4), block_bytes=1 << 20)
    tiered = TieredCache(codec.spec, 2, placement, max_tokens=256)
    short = PlaneKVCache(codec.spec, 2)
    for b, t in enumerate((40, 63)):
        for cache in (tiered, short):
            cache.append(0, flat.read_k(0, b, 8)[:, :t], flat.read_v(0, b, 8)[:, :t], seq=b)
    assert bool((tiered.residency(0).k_depth == 8).all())
    policy = ReadPolicy.flexible(4.0)
    st, out = _compare(codec, tiered, q, policy)
    assert float((st.extra["k_caps"] + st.extra["v_caps"]).sum()) == 0 and bool((st.k_depths > 4).any())
    reader = TritonReader(codec, policy, config=FMA)
    want, _ = reader.decode(q, short, 0, plan=reader.plan(2, 256, "cpu", pages_per_program=2))
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_everything_promoted_refines_as_the_plane_cache() -> None:
    """Every Key channel-plane, Value page and Key page promoted: no caps, and Key refinement gives the all-GPU
    Triton read's output bit for bit."""
    codec, flat, tiered, q = _caches(4, 2)
    tiered = TieredCache(codec.spec, 2, tiered.placement, max_tokens=256, promotion_bytes=4 << 20,
                         key_page_bytes=1 << 20)
    for b in range(2):
        tiered.append(0, flat.read_k(0, b, 8), flat.read_v(0, b, 8), seq=b)
    hk_n, d = codec.spec.n_kv_heads, codec.spec.head_dim
    tiered.promote_keys(0, [(b, h, c, j) for b in range(2) for h in range(hk_n) for c in range(d) for j in range(4, 8)])
    pages = [(b, h, s) for b, t in enumerate(LENGTHS) for h in range(hk_n) for s in range(t // 64)]
    tiered.promote_values(0, pages)
    tiered.promote_key_pages(0, pages)
    policy = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)
    st, out = _compare_refined(codec, tiered, q, policy)
    assert float((st.extra["k_caps"] + st.extra["v_caps"] + st.extra["kr_caps"]).sum()) == 0
    reader = TritonReader(codec, policy, config=FMA)
    want, wst = reader.decode(q, flat, 0, plan=reader.plan(2, 256, "cpu", pages_per_program=2, block_tokens=64))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(st.extra["k_refined"], wst.extra["k_refined"])


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(4.0), ReadPolicy.flexible(2.0, k_share=0.75)],
                         ids=["flexible-r4", "flexible-r2"])
def test_pinned_deep_key_channels_read_as_the_reference(policy: ReadPolicy) -> None:
    """Deep Key channels (``PlacementPolicy.deep_key_channels``): h_K = 3, a quarter of each head's channels pinned
    to depth 7 (ordinary channel-plane slots past the LRU's), a few more channel-planes and Value pages promoted:
    the kernels read the pinned planes and equal the reference with the same residency."""
    from planekv.tiering.placement import DeepKeyChannels

    syn = make_synthetic(n_tokens=max(LENGTHS), n_rows=2, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32, seed=11)
    codec = Codec(syn.spec, syn.calibration)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    placement = PlacementPolicy(hot_planes=HotPlanes(k=3, v=2), block_bytes=1 << 20,
                                deep_key_channels=DeepKeyChannels(share=0.25, extra=4))
    tiered = TieredCache(codec.spec, 2, placement, max_tokens=256, promotion_bytes=4 * 3 * 1536,
                         key_channel_scores=syn.calibration.sigma_k)
    for b, t in enumerate(LENGTHS):
        tiered.append(0, kc[:, :t], vc[:, :t], seq=b)
    deep = tiered.deep_k_channels[0]
    free = [c for c in range(32) if c not in deep[0].tolist()]
    tiered.promote_keys(0, [(0, 0, c, 3) for c in free[:4]] + [(1, 1, free[0], 3), (1, 1, free[0], 4)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    assert bool((tiered.residency(0).k_depth[:, torch.arange(2)[:, None], deep] == 7).all())
    st, _ = _compare(codec, tiered, syn.q[0].transpose(0, 1).contiguous(), policy)
    read_deep = st.k_depths[:, torch.arange(2)[:, None], deep]
    assert bool((read_deep > 3).any())  # pinned planes were read
