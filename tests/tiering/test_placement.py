"""hot_bytes / hot_page_bytes: the GPU bytes of a policy's hot planes, the same number a TieredCache holds."""

from __future__ import annotations

import dataclasses

import pytest

from planekv.kvstore import CacheFull, Codec
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import PlacementPolicy, hot_bytes, hot_page_bytes
from planekv.tiering.placement import HotPlanes, LayerOverride
from planekv.tiering.tiered_cache import TieredCache

N_TOKENS = 300  # 4 full 64-token pages and a partial one


def _codes(v_run: int = 1, n_layers: int = 3):
    syn = make_synthetic(n_tokens=N_TOKENS, n_rows=1, n_layers=n_layers, n_q_heads=4, n_kv_heads=2, head_dim=32,
                         seed=5)
    spec = dataclasses.replace(syn.spec, v_run=v_run)
    codec = Codec(spec, syn.calibration)
    return spec, [(codec.encode_k(syn.k[i], i), codec.encode_v(syn.v[i], i)) for i in range(n_layers)]


def _fill(cache: TieredCache, codes, n: int) -> TieredCache:
    for layer, (kc, vc) in enumerate(codes):
        cache.append(layer, kc[:, :n], vc[:, :n], seq=0)
    return cache


POLICIES = [
    PlacementPolicy(hot_planes=HotPlanes(k=4, v=2), block_bytes=1 << 20),
    PlacementPolicy(hot_planes=HotPlanes(k=3, v=2), block_bytes=1 << 20,
                    layer_overrides=[LayerOverride(layers=[0], hot_planes=HotPlanes(k=8, v=6))]),
]


@pytest.mark.parametrize("v_run", [1, 2])
@pytest.mark.parametrize("policy", POLICIES, ids=["uniform", "override"])
@pytest.mark.parametrize("n", [1, 64, N_TOKENS])
def test_hot_bytes_is_the_hot_pool_a_cache_of_that_many_tokens_holds(policy: PlacementPolicy, v_run: int,
                                                                     n: int) -> None:
    """A one-sequence cache given exactly hot_bytes as its hot-pool budget holds all n tokens, and its hot pools
    then take exactly that many bytes."""
    spec, codes = _codes(v_run)
    want = hot_bytes(policy, spec, n)
    cache = _fill(TieredCache(spec, 1, policy, max_tokens=N_TOKENS, hot_bytes=want), codes, n)
    assert hot_page_bytes(policy, spec) == cache.hot_page_bytes
    assert cache.bytes().hot == want
    assert want == -(-n // spec.page_size) * spec.n_kv_heads * cache.hot_page_bytes


def test_a_budget_of_hot_bytes_for_fewer_tokens_cannot_hold_more() -> None:
    spec, codes = _codes()
    policy = POLICIES[0]
    cache = TieredCache(spec, 1, policy, max_tokens=N_TOKENS, hot_bytes=hot_bytes(policy, spec, 256))
    with pytest.raises(CacheFull):
        _fill(cache, codes, 257)  # a fifth page


def test_hot_bytes_refuses_a_policy_the_format_cannot_take() -> None:
    spec, _ = _codes()
    assert hot_bytes(POLICIES[0], spec, 0) == 0
    with pytest.raises(ValueError, match="width"):
        hot_bytes(PlacementPolicy(width=4, hot_planes=HotPlanes(k=2, v=2)), spec, 64)
    with pytest.raises(ValueError, match="n_tokens"):
        hot_bytes(POLICIES[0], spec, -1)


def test_capacity_names_a_tier_or_none() -> None:
    p = PlacementPolicy()
    assert p.capacity("gpu") == 8 << 30 and p.capacity("store") is None
