"""A running TieredCache under a new placement policy: every code moves (wherever its planes lived: hot pool, open
page, host tier, spill files), the new cache reads as the plane cache, a policy that cannot fit leaves the old cache
as it was."""

from __future__ import annotations

import pytest
import torch

from planekv.kvstore import CacheFull, PlaneKVCache
from planekv.tiering import PlacementPolicy, SpillTier
from planekv.tiering.placement import HotPlanes
from planekv.tiering.replace import replace_placement, stored_codes
from planekv.tiering.tiered_cache import TieredCache

from .test_tiered_cache import LENGTHS, _data, _fill


def _policy(hk: int, hv: int) -> PlacementPolicy:
    return PlacementPolicy(hot_planes=HotPlanes(k=hk, v=hv), block_bytes=1 << 20)


def _every_code_equal(cache: TieredCache, flat: PlaneKVCache) -> None:
    for layer in range(cache.spec.n_layers):
        for b in range(cache.batch_size):
            k, v = stored_codes(cache, layer, b)
            assert torch.equal(k, flat.read_k(layer, b, 8)) and torch.equal(v, flat.read_v(layer, b, 8))


@pytest.mark.parametrize("before,after", [((4, 2), (2, 2)), ((2, 2), (6, 4)), ((4, 2), (8, 8)), ((8, 8), (3, 2)),
                                          ((4, 2), (4, 0)), ((0, 0), (4, 2))])
def test_every_code_moves_to_the_new_placement(before, after, tmp_path) -> None:
    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = 4096 + 2 * 1024
    old = TieredCache(codec.spec, 2, _policy(*before), max_tokens=512, host_bytes=40 * block,
                      spill=SpillTier(tmp_path, 16 << 20, backend="posix"))
    old.host.block_bytes = block  # small blocks: some spill to files
    _fill(old, codes)
    assert old.bytes().nvme > 0 or before == (8, 8)  # some refinement planes were in spill files
    _every_code_equal(old, flat)
    new = replace_placement(old, _policy(*after))
    assert (new.hot_k[0], new.hot_v[0]) == after and new.sequence_ids == old.sequence_ids
    assert [new.length(0, b) for b in range(2)] == LENGTHS
    _every_code_equal(new, flat)
    assert old.host.used_bytes == 0 and not old.host.spill.dir.exists()  # the old cache was freed
    # the new cache goes on appending and sealing under its policy
    more_k, more_v = codes[0][0][:, :70], codes[0][1][:, :70]
    new.append(0, more_k, more_v, seq=1)
    assert new.length(0, 1) == LENGTHS[1] + 70


def test_a_policy_that_does_not_fit_leaves_the_old_cache_as_it_was(tmp_path) -> None:
    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    page_hot_at_2 = 2 * (2 * 32 * 8 + 2 * 64 * 4)  # two layers' hot planes of one page at h_K = h_V = 2
    need = 2 * (5 + 3)  # pages of both sequences and both KV heads
    old = _fill(TieredCache(codec.spec, 2, _policy(2, 2), max_tokens=512, hot_bytes=need * page_hot_at_2), codes)
    with pytest.raises(CacheFull):
        replace_placement(old, _policy(8, 8))  # four times the hot bytes per page: the budget holds a quarter
    _every_code_equal(old, flat)
