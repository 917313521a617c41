"""The Triton reader over a tiered cache (interpreter): the FMA stages read the hot pools and the promotion
cache, cap every depth at the residency, and equal the reference reader with the same residency (depths,
caps, output); with every plane hot they equal the all-GPU read."""

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


def _caches(hot_k: int, hot_v: int, v_run: int = 1, seed: int = 11):
    syn = make_synthetic(n_tokens=max(LENGTHS), n_rows=2, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=32,
                         seed=seed)
    spec = dataclasses.replace(syn.spec, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    flat = PlaneKVCache(spec, 2)
    placement = PlacementPolicy(hot_planes=HotPlanes(k=hot_k, v=hot_v), block_bytes=1 << 20)
    tiered = TieredCache(spec, 2, placement, max_tokens=256, promotion_bytes=4 * 3 * 1536)
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
    refine = TritonReader(codec, ReadPolicy.flexible(2.0, key_refine=0.3), config=FMA)
    with pytest.raises(ValueError, match="Key refinement"):
        refine.decode_tiered(q, tiered, 0)
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
    with pytest.raises(ValueError, match="k_hot must be"):
        reader.run(plan, q, pools.v_hot, pools.v_hot, pt, tiered.lengths[0].to(torch.int32), 0,
                   tiers=dataclasses.replace(pools, k_hot=pools.v_hot))
