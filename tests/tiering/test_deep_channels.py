"""Deep Key channels (``PlacementPolicy.deep_key_channels``): the Key channels the scores rank deepest keep planes
``[h_K, h_K + extra)`` of every token pinned on the device. They are resident for every token from the first
append, survive prefetch and LRU pressure and freeing, are counted apart in the device bytes, read as the plane
cache reads under the same residency, and bad options are refused with what to do."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.reference import readkv_decode
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import Prefetcher, StepTally, tiered_decode_step
from planekv.tiering.placement import DeepKeyChannels, HotPlanes, LayerOverride, PlacementPolicy
from planekv.tiering.tiered_cache import TieredCache

LENGTHS = [300, 130]  # 4 sealed pages + an open one; 2 sealed + an open one (64-token pages)
D = 32


def _data(n_layers: int = 2):
    syn = make_synthetic(n_tokens=max(LENGTHS), n_rows=len(LENGTHS), n_layers=n_layers, n_q_heads=4, n_kv_heads=2,
                         head_dim=D, seed=3)
    codec = Codec(syn.spec, syn.calibration)
    codes = [(codec.encode_k(syn.k[i], i), codec.encode_v(syn.v[i], i)) for i in range(n_layers)]
    return codec, codes, syn.q[0].transpose(0, 1).contiguous()


def _fill(cache, codes):
    for layer, (kc, vc) in enumerate(codes):
        for b, t in enumerate(LENGTHS):
            for a, e in ((0, 200), (200, 201), (201, t)):  # prefill, a decode token, the rest
                if a < min(e, t):
                    cache.append(layer, kc[:, a:min(e, t)], vc[:, a:min(e, t)], seq=b)
    return cache


def _policy(hk: int = 3, hv: int = 2, share: float = 0.25, extra: int = 4) -> PlacementPolicy:
    return PlacementPolicy(hot_planes=HotPlanes(k=hk, v=hv), block_bytes=1 << 20,
                           deep_key_channels=DeepKeyChannels(share=share, extra=extra))


def _scores(codec: Codec) -> torch.Tensor:
    return codec.calibration.sigma_k.clone()  # [L, Hkv, d]


def test_the_deep_channels_planes_are_resident_for_every_token_and_read_as_the_plane_cache() -> None:
    codec, codes, _ = _data()
    scores = _scores(codec)
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(), max_tokens=512, promotion_bytes=0,
                               key_channel_scores=scores), codes)
    n = 8  # 0.25 x 32 channels per KV head
    for layer in range(2):
        chans = tiered.deep_k_channels[layer]
        assert chans.shape == (2, n)
        for h in range(2):  # the channels with the highest scores
            assert set(chans[h].tolist()) == set(scores[layer, h].topk(n).indices.tolist())
        res = tiered.residency(layer)
        deep = torch.zeros(2, 2, D, dtype=torch.bool)
        deep[:, torch.arange(2)[:, None], chans] = True
        assert bool((res.k_depth[deep] == 7).all()) and bool((res.k_depth[~deep] == 3).all())
        assert torch.equal(tiered.pinned_k_depth(layer), res.k_depth)
        for b in range(2):  # every token, sealed pages (host tier) and the open one, reads to 7 in a deep channel
            depth = res.k_depth[b]
            assert torch.equal(tiered.read_k(layer, b, depth), flat.read_k(layer, b, depth))
    tb = tiered.bytes()
    assert tb.pinned == 2 * 2 * 2 * n * 4 * 8 * 8  # layers x B x Hkv x channels x planes x 8 pages x 8 bytes
    assert tb.pinned == tiered.pinned_bytes() and tb.device == tb.hot + tb.open + tb.promotion + tb.pinned
    assert tiered.promoted_bytes() == 0  # pinned planes are not the promotion cache's
    assert tiered.promotion_slots(0)[0] == 0  # nor its slots
    # the control plane's fit check counts them: hot_bytes of a sequence of max_tokens = its hot pages + pinned
    from planekv.tiering import hot_bytes

    one = TieredCache(codec.spec, 1, _policy(), max_tokens=512, promotion_bytes=0, key_channel_scores=scores)
    assert hot_bytes(_policy(), codec.spec, 512) == hot_bytes(_policy(3, 2, 0.25, 1).model_copy(
        update={"deep_key_channels": None}), codec.spec, 512) + one.pinned_bytes()


@pytest.mark.parametrize("policy", [ReadPolicy.flexible(4.0), ReadPolicy.flexible(2.0, k_share=0.75)],
                         ids=["flexible-r4", "flexible-r2"])
def test_a_read_with_deep_channels_equals_the_plane_cache_read_with_that_residency(policy: ReadPolicy) -> None:
    """Everything else equal (a few promoted channel-planes and Value pages, the rest in the host tier): the
    reference over the tiered cache gives the plane cache's read under the same residency, bit for bit."""
    codec, codes, q = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(), max_tokens=512, promotion_bytes=2 * 6 * 1536 + 2 * 2 * 512,
                               k_promotion_share=0.25, key_channel_scores=_scores(codec)), codes)
    free = [c for c in range(D) if c not in tiered.deep_k_channels[0][0].tolist()][:3]
    tiered.promote_keys(0, [(0, 0, c, 3) for c in free] + [(1, 1, free[0], 3), (1, 1, free[0], 4)])
    tiered.promote_values(0, [(0, 1, 1), (1, 0, 0)])
    res = tiered.residency(0)
    want, st_w = readkv_decode(q, flat, 0, codec, policy, residency=res)
    got, st_g = readkv_decode(q, tiered, 0, codec, policy, residency=res)
    assert torch.equal(got, want) and torch.equal(st_g.k_depths, st_w.k_depths)
    for key in ("k_caps", "v_caps", "wanted_bits"):
        assert torch.equal(st_g.extra[key], st_w.extra[key]), key
    assert bool((st_g.k_depths > 3).any())  # pinned or promoted planes were read


def test_pinned_planes_survive_prefetch_lru_pressure_and_freeing() -> None:
    """A promotion cache of 2 channel-planes a layer under prefetch that wants many: the LRU slots churn, the
    pinned ones never move; prefetch neither keeps nor brings them; a freed and refilled sequence has them back."""
    codec, codes, q = _data()
    spec = codec.spec
    k_vec = 8 * 8  # a channel-plane: 8 pages x 8 bytes
    tiered = _fill(TieredCache(spec, 2, _policy(), max_tokens=512, promotion_bytes=2 * (2 * k_vec + 1536),
                               k_promotion_share=2 * k_vec / (2 * k_vec + 1536), key_channel_scores=_scores(codec)),
                   codes)
    assert tiered.promotion_slots(0)[0] == 2
    pinned_slots = tiered.k_slot[0][tiered.pinned_k_depth(0) > 3].clone()
    before = tiered.residency(0).k_depth.clone()
    pf, tally = Prefetcher(), StepTally()
    policy = ReadPolicy.flexible(4.0)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):  # drifting queries
        tiered_decode_step(q + 0.5 * q.std() * torch.randn(q.shape, generator=gen), tiered, 0, codec, policy, pf,
                           tally)
    tiered.promote_keys(0, [(b, h, c, j) for b in range(2) for h in range(2) for c in range(D) for j in (3, 4)])
    assert tiered.counters["k_promoted"] > 0 and tiered.counters["k_evicted"] > 0  # the LRU slots churned
    mask = tiered.pinned_k_depth(0) > 3
    assert torch.equal(tiered.k_slot[0][mask][:, :4], pinned_slots[:, :4])
    now = tiered.residency(0).k_depth
    assert bool((now[mask] >= 7).all()) and bool((now >= before).all())
    plan = pf.plan(_stats_of(tiered, q, codec, policy), tiered.residency(0), 3, 2, 64, 2, 0,
                   k_pinned=tiered.pinned_k_depth(0))
    for b, h, c, j in torch.cat([plan.k_keep, plan.k_fetch]).tolist():  # never a pinned plane
        assert j >= int(tiered.pinned_k_depth(0)[b, h, c])
    # free sequence 0 and fill it again: its deep channels are pinned and full again, the other's untouched
    tiered.free(0)
    assert bool((tiered.residency(0).k_depth[0][mask[0]] == 7).all())
    kc, vc = codes[0]
    tiered.append(0, kc[:, :150], vc[:, :150], seq=0)
    flat = PlaneKVCache(spec, 1)
    flat.append(0, kc[:, :150], vc[:, :150], seq=0)
    depth = tiered.pinned_k_depth(0)[0]
    assert torch.equal(tiered.read_k(0, 0, depth), flat.read_k(0, 0, depth))
    lru = tiered._k_lru[0]  # no pinned slot leaked in: the LRU's 2 slots and the table agree
    held = (lru.owner >= 0).nonzero().flatten()
    assert lru.n == 2 and torch.equal(tiered.k_slot[0].view(-1)[lru.owner[held]].long(), held)
    assert int(((tiered.k_slot[0] >= 0) & (tiered.k_slot[0] < 2)).sum()) == held.numel()


def _stats_of(tiered: TieredCache, q: torch.Tensor, codec: Codec, policy: ReadPolicy):
    return readkv_decode(q, tiered, 0, codec, policy, residency=tiered.residency(0))[1]


def test_bad_deep_channel_options_are_refused_with_what_to_do() -> None:
    for share in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValidationError, match="share"):
            DeepKeyChannels(share=share, extra=2)
    with pytest.raises(ValidationError, match="extra"):
        DeepKeyChannels(share=0.5, extra=0)
    with pytest.raises(ValidationError, match=r"past the width W=8: lower deep_key_channels.extra to at most 2"):
        _policy(hk=6, share=0.5, extra=3)
    with pytest.raises(ValidationError, match=r"layers \[1\].*past the width"):
        PlacementPolicy(hot_planes=HotPlanes(k=3, v=2), deep_key_channels=DeepKeyChannels(share=0.5, extra=4),
                        layer_overrides=[LayerOverride(layers=[1], hot_planes=HotPlanes(k=5, v=2))])
    codec, _, _ = _data()
    with pytest.raises(ValueError, match="no key_channel_scores"):
        TieredCache(codec.spec, 2, _policy(), max_tokens=512)
    with pytest.raises(ValueError, match="key_channel_scores must be finite"):
        TieredCache(codec.spec, 2, _policy(), max_tokens=512, key_channel_scores=torch.ones(2, 2, 16))
    assert DeepKeyChannels(share=1.0, extra=1).count(64) == 64 and DeepKeyChannels(share=0.01, extra=1).count(64) == 1
    assert PlacementPolicy().deep_key_channels is None  # off by default


def test_replace_placement_keeps_the_scores() -> None:
    """A cache made again under another policy (``replace_placement``) ranks the channels with the same scores."""
    from planekv.tiering.replace import replace_placement

    codec, codes, _ = _data()
    tiered = _fill(TieredCache(codec.spec, 2, _policy(), max_tokens=512, key_channel_scores=_scores(codec)), codes)
    new = replace_placement(tiered, _policy(hk=2, share=0.5, extra=2))
    assert new.deep_k_channels[0].shape == (2, 16)
    assert bool((new.residency(0).k_depth[new.pinned_k_depth(0) > 2] >= 4).all())


def test_the_bench_rows_compare_at_equal_hot_and_pinned_bytes() -> None:
    """``planekv bench tiering --deep-key-channels``: each option's row has h_K = h - share x extra and the hot pages
    plus pinned planes of the uniform row (the open pages' buffers hold the extra refinement planes)."""
    from planekv.bench.tiering import deep_hot_k, parse_deep, run_decode
    from planekv.evaluation.decode_data import synthetic_data

    data = synthetic_data(n_tokens=256, n_steps=2, n_layers=1)
    rows = run_decode(data, ["flex-r2"], [4], promotion_mib=1.0, deep=[parse_deep("0.5:2"), parse_deep("0.25:4")],
                      deep_rank="profile")
    assert [r.system for r in rows] == ["tiered-h4-flex-r2", "tiered-hk3+0.5x2-hv4-flex-r2",
                                        "tiered-hk3+0.25x4-hv4-flex-r2"]
    same = {r.extra["gpu_bytes"]["hot_in_use"] + r.extra["gpu_bytes"]["pinned"] for r in rows}
    assert len(same) == 1 and rows[1].extra["gpu_bytes"]["pinned"] > 0
    with pytest.raises(ValueError, match="SHARE:EXTRA"):
        parse_deep("0.5")
    with pytest.raises(ValueError, match="share"):
        parse_deep("2:1")
    with pytest.raises(ValueError, match="a whole number at most h = 4"):
        deep_hot_k(4, DeepKeyChannels(share=0.3, extra=2))
