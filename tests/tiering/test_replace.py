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


@pytest.mark.parametrize("after", [(3, 2), (4, 2)])
def test_a_cache_with_a_remote_tier_moves_and_the_old_remote_copies_go_unless_the_new_cache_holds_them(after):
    """The old cache's blocks live mostly at the (in-process) remote tier; the new cache writes its own there through
    the same writer. Keys name content (plane range [h, W) included): a layer whose hot planes change gets other
    keys, the same hot planes the same keys (same bytes). After the swap the remote tier holds exactly the new
    cache's blocks, and every code reads back from the new cache."""
    from planekv.tiering import RemoteWriter
    from planekv.tiering.frame import verify_frame

    from .test_remote_tier import FakeRemote

    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = 4096 + 2 * 1024
    remote = FakeRemote()
    writer = RemoteWriter(remote, submit_timeout_s=10.0)
    old = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, host_bytes=40 * block, remote=writer)
    old.host.block_bytes = block
    _fill(old, codes)
    writer.flush(10.0)
    assert old.bytes().remote > 0  # some blocks are held only remotely
    old_keys = old.host.sealed_keys()
    assert set(remote.frames) == old_keys
    new = replace_placement(old, _policy(*after), block_bytes=block)
    writer.flush(10.0)
    new_keys = new.host.sealed_keys()
    assert new_keys and set(remote.frames) == new_keys  # the old cache's other copies were deleted
    if after == (4, 2):
        assert new_keys == old_keys  # same hot planes, same keys: the same bytes, kept
    else:  # h_K changed: every Key block has another plane range; the Value blocks (h_V = 2 kept) are shared
        assert {k for k in new_keys if k.kind == "k"}.isdisjoint(old_keys)
        assert {k for k in new_keys if k.kind == "v"} == {k for k in old_keys if k.kind == "v"}
    for key, frame in remote.frames.items():
        verify_frame(frame, key)
    _every_code_equal(new, flat)
    assert old.host.used_bytes == 0
    for b in range(2):
        new.free(b)
    assert not remote.frames
    writer.close(10.0)


def test_a_failed_move_with_a_remote_tier_leaves_the_old_remote_copies(tmp_path) -> None:
    from planekv.tiering import RemoteWriter

    from .test_remote_tier import FakeRemote

    codec, codes, _ = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = 4096 + 2 * 1024
    remote = FakeRemote()
    writer = RemoteWriter(remote, submit_timeout_s=10.0)
    page_hot_at_2 = 2 * (2 * 32 * 8 + 2 * 64 * 4)
    old = TieredCache(codec.spec, 2, _policy(2, 2), max_tokens=512, host_bytes=40 * block, remote=writer,
                      hot_bytes=16 * page_hot_at_2)
    old.host.block_bytes = block
    _fill(old, codes)
    writer.flush(10.0)
    before = dict(remote.frames)
    with pytest.raises(CacheFull):
        replace_placement(old, _policy(8, 8), block_bytes=block)
    writer.flush(10.0)
    assert remote.frames == before  # nothing of the old cache deleted, nothing of the failed one left
    _every_code_equal(old, flat)
    writer.close(10.0)
