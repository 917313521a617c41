"""Prefetch: what a step asked for past the hot planes is promoted for the next step of its layer; repeated
queries converge to the all-resident read; limits and the promotion cache's room hold; the tally adds up."""

from __future__ import annotations

import pytest
import torch

from planekv.kvstore import PlaneKVCache, PlaneKVError, ReadPolicy
from planekv.kvstore.reference import readkv_decode
from planekv.tiering.decode import tiered_decode_step
from planekv.tiering.prefetch import Prefetcher, StepTally
from planekv.tiering.tiered_cache import TieredCache
from tests.tiering.test_tiered_cache import LENGTHS, _data, _fill, _policy

POLICY = ReadPolicy.flexible(4.0, 0.5)


def _caches(promotion_bytes: int = 4 << 20):
    codec, codes, q = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    tiered = _fill(TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=promotion_bytes),
                   codes)
    return codec, q, flat, tiered


def test_a_repeated_query_converges_to_the_all_resident_read() -> None:
    """Step 1 caps what is not resident and prefetches what it asked for; by step 3 everything the query wants is
    resident: no caps, and the output equals the all-GPU read bit for bit."""
    codec, q, flat, tiered = _caches()
    want, _ = readkv_decode(q, flat, 0, codec, POLICY)
    tally, caps = StepTally(), []
    for _ in range(3):
        out, st = tiered_decode_step(q, tiered, 0, codec, POLICY, Prefetcher(), tally)
        caps.append(float((st.extra["k_caps"] + st.extra["v_caps"]).sum()))
    assert caps[0] > 0 and caps[2] == 0
    assert torch.equal(out, want)
    s = tally.summary()
    assert s["steps"] == 3 and s["fetched"] > 0 and s["fetched_used"] > 0
    assert s["capped_bits"] == sum(caps) and 0 < s["hit_rate"] < 1 and 0 < s["cap_rate"] < 1


def test_prefetch_cuts_caps_on_a_drifting_query_and_keeps_appending() -> None:
    """Queries that drift a little from step to step, a token appended to every sequence between steps: with
    prefetch the steps after the first cap much less than without, and most prefetched items are used when only
    what the step asked for is brought (``k_margin=0``); a Key margin of one plane caps less again, at the price of
    items brought and not read."""
    codec, q, _, exact = _caches()
    caches = [exact, _caches()[3], _caches()[3]]
    torch.manual_seed(0)
    qs = [q + 0.1 * q.std() * torch.randn_like(q) for _ in range(4)]
    kc, vc = (torch.randint(0, 256, (2, codec.spec.n_kv_heads, 1, codec.spec.head_dim), dtype=torch.uint8)
              for _ in range(2))
    prefetchers = [Prefetcher(k_margin=0), Prefetcher(k_margin=1), None]
    tallies = [StepTally() for _ in caches]
    for step, qq in enumerate(qs):
        for cache, tally, pf in zip(caches, tallies, prefetchers, strict=True):
            if step:
                cache.append(0, kc, vc)
            if step == 1:
                tally.restart()  # count from the second step: the first has nothing prefetched
            tiered_decode_step(qq, cache, 0, codec, POLICY, pf, tally)
    got, margin, base = (t.summary() for t in tallies)
    assert got["capped_bits"] < 0.5 * base["capped_bits"]
    assert got["hit_rate"] > base["hit_rate"] and got["fetched_used"] >= 0.5 * got["fetched"]
    assert margin["capped_bits"] < got["capped_bits"] and margin["fetched"] > got["fetched"]
    assert exact.length(0, 0) == LENGTHS[0] + 3


def test_the_key_margin_comes_after_what_was_asked_and_stays_within_w() -> None:
    """Margin planes are the planes [wanted, wanted + k_margin) of each channel that reaches past the hot planes,
    never past W; they are brought after every plane the step asked for and only into the room those leave."""
    codec, q, _, tiered = _caches()
    res = tiered.residency(0)
    _, st = readkv_decode(q, tiered, 0, codec, POLICY, residency=res)
    wanted = st.extra["k_wanted"]
    asked = Prefetcher(k_margin=0).plan(st, res, 4, 2, 64, 1000, 1000)
    wide = Prefetcher(k_margin=2).plan(st, res, 4, 2, 64, 1000, 1000)
    n = len(asked.k_fetch)
    assert torch.equal(wide.k_fetch[:n], asked.k_fetch) and len(wide.k_fetch) > n
    for b, h, c, j in wide.k_fetch[n:].tolist():
        assert max(4, int(wanted[b, h, c])) <= j < min(int(wanted[b, h, c]) + 2, 8)
    expect = int(((wanted + 2).clamp_max(8) - wanted.clamp_min(4)).clamp_min(0).sum())
    assert len(wide.k_fetch) - n == expect  # every channel past the hot planes, nothing resident yet
    tight = Prefetcher(k_margin=2).plan(st, res, 4, 2, 64, n + 3, 1000)
    assert torch.equal(tight.k_fetch, wide.k_fetch[: n + 3])  # the room left after the asked-for planes
    capped = Prefetcher(k_planes_per_step=n + 1, k_margin=2).plan(st, res, 4, 2, 64, 1000, 1000)
    assert torch.equal(capped.k_fetch, wide.k_fetch[: n + 1])
    with pytest.raises(ValueError, match="k_margin"):
        Prefetcher(k_margin=-1)


def test_limits_and_the_cache_room_bound_what_is_brought() -> None:
    codec, q, flat, tiered = _caches(promotion_bytes=4 * 3 * 1536)  # a layer: 3 Value pages, 72 Key channel-planes
    res = tiered.residency(0)
    _, st = readkv_decode(q, tiered, 0, codec, POLICY, residency=res)
    k_slots, v_slots = tiered.promotion_slots(0)
    assert (k_slots, v_slots) == (72, 3)
    cached = Prefetcher().plan(st, res, 4, 2, 64, k_slots, v_slots)
    assert len(cached.v_keep) == 3 and not len(cached.v_fetch)  # bringing more would evict what the plan keeps
    full = Prefetcher().plan(st, res, 4, 2, 64, 1000, 1000)  # a larger cache: everything asked for
    assert len(full.k_fetch) > k_slots and len(full.v_fetch) and torch.equal(full.v_keep, cached.v_keep)
    assert torch.equal(cached.k_fetch, full.k_fetch[:k_slots])  # the deepest-wanted channels first
    few = Prefetcher(k_planes_per_step=3, v_pages_per_step=1).plan(st, res, 4, 2, 64, 1000, 1000)
    assert torch.equal(few.k_fetch, full.k_fetch[:3]) and torch.equal(few.v_fetch, full.v_fetch[:1])
    with pytest.raises(ValueError, match="v_pages_per_step"):
        Prefetcher(v_pages_per_step=-1)
    with pytest.raises(PlaneKVError, match="past its residency"):  # the tiered cache refuses an unlimited read
        readkv_decode(q, tiered, 0, codec, POLICY)
    _, plain = readkv_decode(q, flat, 0, codec, POLICY)
    with pytest.raises(ValueError, match="under a residency"):
        Prefetcher().plan(plain, res, 4, 2, 64, k_slots, v_slots)


def test_key_pages_of_the_refined_tokens_are_prefetched_and_counted() -> None:
    """Key refinement: after a step the sealed Key pages holding the tokens it chose are promoted (most chosen
    tokens first, within the Key page slots), so a repeated query's refinement is served at full depth; the
    tally counts the chosen tokens, those served (the Key page hit rate) and the pages fetched and used."""
    codec, codes, q = _data()
    spec = codec.spec
    policy = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)
    page = (spec.width - 4) * spec.head_dim * spec.page_size // 8
    tiered = TieredCache(spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=4 << 20,
                         key_page_bytes=2 * 8 * page)
    tiered.counters["kp_evicted"] = 0
    _fill(tiered, codes)
    for layer in range(2):  # nothing sealed kept from the fill: start cold
        for s in tiered.kp_slot[layer][tiered.kp_slot[layer] >= 2 * spec.n_kv_heads].tolist():
            tiered._kp_lru[layer].release(s)
        tiered.kp_slot[layer][tiered.kp_slot[layer] >= 2 * spec.n_kv_heads] = -1
    tally, kr_caps = StepTally(), []
    for _ in range(3):
        _, st = tiered_decode_step(q, tiered, 0, codec, policy, Prefetcher(), tally)
        kr_caps.append(float(st.extra["kr_caps"].sum()))
    assert kr_caps[0] > 0 and kr_caps[2] < 0.25 * kr_caps[0]
    s = tally.summary()
    assert s["fetched_kp"] > 0 and s["fetched_used"] > 0
    assert 0 < s["kr_served"] < s["kr_wanted"] and 0 < s["kr_hit_rate"] < 1
    assert s["capped_bits"] >= sum(kr_caps)
    # a limit holds
    limited = Prefetcher(k_pages_per_step=1).plan(st, tiered.residency(0), 4, 2, spec.page_size, 0, 0,
                                                 tiered.key_page_slots(0))
    assert len(limited.kp_fetch) <= 1
