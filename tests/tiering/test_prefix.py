"""Prefix reuse below the model: chained page keys (a format or producer of its own never matches, a prefix shorter
than a page has no key), the bounded prefix index, pages published from one cache and loaded into another (a
TieredCache puts their hot planes in the hot pool and their refinement planes in its host tier), and another worker
finding them at a remote tier (a corrupt or misfiled frame is a miss, a failed write keeps the local copy)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planekv.kvstore import CacheFull, FormatMismatch, PlaneKVCache
from planekv.kvstore import planes as planes_mod
from planekv.tiering import (
    PrefixIndex,
    PrefixPage,
    load_pages,
    page_codes,
    page_keys,
    prefix_root,
    publish_pages,
    remote_block_key,
    sealed_pages,
)
from planekv.tiering.frame import HEADER_BYTES, encode_frame
from planekv.tiering.prefix import (
    BLOB_MAGIC,
    PrefixLayoutError,
    decode_page_blob,
    encode_page_blob,
    pack_pages,
    page_shapes,
    unpack_pages,
)
from planekv.tiering.replace import stored_codes
from planekv.tiering.tiered_cache import TieredCache

from .test_remote_tier import FakeRemote
from .test_tiered_cache import _data, _policy

P = 64


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))


def test_page_keys_chain_the_whole_prefix() -> None:
    root = prefix_root("fmt-a")
    ids = _tokens(3 * P + 10)
    keys = page_keys(root, ids, P)
    assert len(keys) == 3 and len(set(keys)) == 3  # whole pages only: the last 10 tokens have no key
    assert page_keys(root, ids[: 2 * P], P) == keys[:2]  # a prompt's keys are a prefix of its extension's
    assert page_keys(root, ids[: P - 1], P) == []  # shorter than a page: nothing to reuse
    other = ids.clone()
    other[5] += 1  # one token of page 0 differs: every later page's key differs too (a chain, not per page)
    assert set(page_keys(root, other, P)).isdisjoint(keys)
    late = ids.clone()
    late[2 * P] += 1
    assert page_keys(root, late, P)[:2] == keys[:2] and page_keys(root, late, P)[2] != keys[2]
    # another format, or another producer (read mode, policy), roots another chain
    assert set(page_keys(prefix_root("fmt-b"), ids, P)).isdisjoint(keys)
    assert set(page_keys(prefix_root("fmt-a", "compressed R=4"), ids, P)).isdisjoint(keys)


def _page(fid: str = "f", fill: int = 0, shape: tuple[int, ...] = (2, 2, P, 32)) -> PrefixPage:
    return PrefixPage(fid, torch.full(shape, fill, dtype=torch.uint8), torch.full(shape, fill, dtype=torch.uint8))


def test_index_matches_the_longest_leading_run_and_stays_bounded() -> None:
    page_bytes = _page().nbytes
    index = PrefixIndex(capacity_bytes=3 * page_bytes, format_id="f")
    keys = page_keys(prefix_root("f"), _tokens(4 * P), P)
    assert index.match(keys, "f") == [] and index.stats.misses == 1
    for i in (0, 1, 3):  # page 2 missing: page 3 cannot be used without it
        assert index.put(keys[i], _page(fill=i))
    got = index.match(keys, "f")
    assert [int(p.k[0, 0, 0, 0]) for p in got] == [0, 1] and index.stats.hits == 2
    assert not index.put(keys[0], _page(fill=9))  # immutable: the first page stays
    assert int(index.get(keys[0]).k[0, 0, 0, 0]) == 0
    assert index.match(keys, "g") == []  # another format's pages never match
    with pytest.raises(FormatMismatch):
        index.put(keys[2], _page("g"))
    index.put(keys[2], _page(fill=2))  # full: the least recently used page (3) goes
    assert keys[3] not in index and index.used_bytes == 3 * page_bytes and index.stats.evicted == 1
    assert len(index.match(keys, "f")) == 3


def _prefix_codes(spec, n_pages: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [L, Hkv, n_pages * P, d] for a prefix and a different tail to append after it."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.n_layers, spec.n_kv_heads, n_pages * P, spec.head_dim)
    return (torch.randint(0, 256, shape, generator=g, dtype=torch.uint8),
            torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))


def _fill_one(cache, k: torch.Tensor, v: torch.Tensor, b: int = 0) -> None:
    for layer in range(k.shape[0]):
        cache.append(layer, k[layer], v[layer], seq=b)


@pytest.mark.parametrize("target", ["plane", "tiered"])
def test_published_pages_load_into_another_cache(target) -> None:
    codec, _, _ = _data()
    spec = codec.spec
    k, v = _prefix_codes(spec, 3, seed=1)
    src = TieredCache(spec, 1, _policy(4, 2), max_tokens=512)
    _fill_one(src, k[:, :, : 2 * P + 20], v[:, :, : 2 * P + 20])  # 2 sealed pages and an open one
    ids = _tokens(3 * P)
    keys = page_keys(prefix_root(spec.format_id), ids, P)
    index = PrefixIndex()
    assert sealed_pages(src, 0) == 2
    assert publish_pages(index, src, 0, keys) == 2 and len(index) == 2  # the open page is not published
    assert publish_pages(index, src, 0, keys) == 0  # already there

    dst = PlaneKVCache(spec, 2) if target == "plane" else TieredCache(spec, 2, _policy(4, 2), max_tokens=512)
    pages = index.match(keys, spec.format_id)
    assert load_pages(dst, 1, pages) == 2 * P
    tail_k, tail_v = _prefix_codes(spec, 1, seed=2)
    _fill_one(dst, tail_k[:, :, :30], tail_v[:, :, :30], b=1)  # the suffix appends after the loaded pages
    for layer in range(spec.n_layers):
        if target == "tiered":
            got_k, got_v = stored_codes(dst, layer, 1)
        else:
            got_k, got_v = dst.read_k(layer, 1, 8), dst.read_v(layer, 1, 8)
        assert torch.equal(got_k, torch.cat([k[layer, :, : 2 * P], tail_k[layer, :, :30]], 1))
        assert torch.equal(got_v, torch.cat([v[layer, :, : 2 * P], tail_v[layer, :, :30]], 1))
        assert dst.length(layer, 0) == 0  # the other sequence untouched
    got_k, _ = page_codes(dst, 1, 0, 2)
    assert torch.equal(got_k, k[:, :, : 2 * P])
    if target == "tiered":
        # a loaded page is a sealed page: its refinement planes are in the host tier, the hot ones in the hot pool
        assert dst.counters["sealed"] == 2 * spec.n_layers and dst.bytes().host > 0
        for layer in range(spec.n_layers):
            for h in range(spec.n_kv_heads):
                for s in range(2):
                    want = src.host.page((src.sequence_ids[0], "k", layer, h), s)
                    assert torch.equal(dst.host.page((dst.sequence_ids[1], "k", layer, h), s), want)
                    page = int(dst.page_table[1, h, s])
                    assert torch.equal(dst.k_hot[layer][page], src.k_hot[layer][int(src.page_table[0, h, s])])


def test_loading_refuses_another_format_and_a_sequence_in_use() -> None:
    codec, _, _ = _data()
    spec = codec.spec
    k, v = _prefix_codes(spec, 1, seed=3)
    page = PrefixPage.from_codes(spec, k, v)
    other = dataclasses.replace(spec, calibration_id=spec.calibration_id + "-other")
    assert other.format_id != spec.format_id
    with pytest.raises(FormatMismatch):
        load_pages(PlaneKVCache(other, 1), 0, [page])
    cache = TieredCache(spec, 1, _policy(4, 2), max_tokens=512)
    _fill_one(cache, k[:, :, :5], v[:, :, :5])
    with pytest.raises(ValueError, match="not empty"):
        load_pages(cache, 0, [page])
    with pytest.raises(ValueError, match="whole pages"):
        TieredCache(spec, 1, _policy(4, 2), max_tokens=512).load_prefix(0, k[:, :, :10], v[:, :, :10])
    # a page key is rooted in the format: the other format's lookup of the same tokens finds nothing
    index = PrefixIndex()
    ids = _tokens(P)
    index.put(page_keys(prefix_root(spec.format_id), ids, P)[0], page)
    assert index.match(page_keys(prefix_root(other.format_id), ids, P), other.format_id) == []


def _published_remote(remote) -> tuple[TieredCache, list[bytes], PrefixIndex]:
    """A worker's cache with 2 sealed pages published to ``remote`` through its prefix index."""
    codec, _, _ = _data()
    k, v = _prefix_codes(codec.spec, 3, seed=4)
    src = TieredCache(codec.spec, 1, _policy(4, 2), max_tokens=512)
    _fill_one(src, k[:, :, : 2 * P + 5], v[:, :, : 2 * P + 5])
    keys = page_keys(prefix_root(codec.spec.format_id), _tokens(2 * P + 5), P)
    index = PrefixIndex(remote=remote, spec=codec.spec)
    assert publish_pages(index, src, 0, keys) == 2
    return src, keys, index


def test_another_worker_finds_the_pages_at_the_remote_tier() -> None:
    remote = FakeRemote()
    src, keys, first = _published_remote(remote)
    spec = src.spec
    assert first.stats.remote_written == 2 and len(remote.frames) == 4  # K and V of each page
    assert all(k.format_id == spec.format_id and k.sequence_id.startswith("prefix-") for k in remote.frames)
    other = PrefixIndex(remote=remote, spec=spec)  # another process: nothing of its own yet
    pages = other.match(keys, spec.format_id)
    assert len(pages) == 2 and other.stats.remote_hits == 2
    want_k, want_v = page_codes(src, 0, 0, 2)
    assert torch.equal(torch.cat([p.codes(spec)[0] for p in pages], 2), want_k)
    assert torch.equal(torch.cat([p.codes(spec)[1] for p in pages], 2), want_v)
    assert len(other.match(keys, spec.format_id)) == 2 and other.stats.remote_hits == 2  # kept here since
    dst = TieredCache(spec, 1, _policy(4, 2), max_tokens=512)
    assert load_pages(dst, 0, pages) == 2 * P
    # another format: its own keys and its own block keys; it finds nothing, even asking with these page keys
    fmt = dataclasses.replace(spec, codebook="uniform-linear-c3")
    stranger = PrefixIndex(remote=remote, spec=fmt)
    assert stranger.match(keys, fmt.format_id) == [] and stranger.match(keys, spec.format_id) == []
    assert stranger.stats.remote_hits == 0


def test_a_corrupt_remote_page_is_a_miss_and_a_failed_write_keeps_the_local_copy() -> None:
    remote = FakeRemote()
    src, keys, _ = _published_remote(remote)
    bad = remote_block_key(src.spec.format_id, keys[1], "v")
    frame = bytearray(remote.frames[bad])
    frame[HEADER_BYTES + 7] ^= 1
    remote.frames[bad] = bytes(frame)
    reader = PrefixIndex(remote=remote, spec=src.spec)
    assert len(reader.match(keys, src.spec.format_id)) == 1  # page 1's frame is refused: only page 0 loads
    assert reader.stats.remote_rejected == 1
    # a frame filed under another page's key is refused too (the key is in the frame)
    remote.frames[remote_block_key(src.spec.format_id, keys[0], "k")] = remote.frames[
        remote_block_key(src.spec.format_id, keys[1], "k")]
    assert PrefixIndex(remote=remote, spec=src.spec).match(keys, src.spec.format_id) == []

    failing = FakeRemote(fail_puts=1)
    _, keys2, writer = _published_remote(failing)
    assert writer.stats.remote_failed == 1 and writer.stats.remote_written == 1 and len(writer) == 2
    assert len(writer.match(keys2, src.spec.format_id)) == 2  # served from this process's copy
    with pytest.raises(ValueError, match="spec"):
        PrefixIndex(remote=failing)


@pytest.mark.parametrize("v_run", [1, 2])
def test_a_page_holds_the_pools_planes_and_a_plain_load_is_a_copy(v_run, monkeypatch) -> None:
    """A published page is the pool's page as it is (packed planes, every layer and KV head); loading it into a
    PlaneKVCache copies it into pool pages and never packs codes again (the packers raise here)."""
    codec, _, _ = _data(v_run=v_run)
    spec = codec.spec
    k, v = _prefix_codes(spec, 3, seed=5)
    src = PlaneKVCache(spec, 1)
    _fill_one(src, k[:, :, : 2 * P + 9], v[:, :, : 2 * P + 9])
    keys = page_keys(prefix_root(spec.format_id), _tokens(3 * P), P)
    index = PrefixIndex()
    assert publish_pages(index, src, 0, keys) == 2
    pages = index.match(keys, spec.format_id)
    k_shape, v_shape = page_shapes(spec)
    for i, page in enumerate(pages):
        assert tuple(page.k.shape) == k_shape and tuple(page.v.shape) == v_shape
        slots = src.page_table[0, :, i]
        assert torch.equal(page.k, src.k_pool[:, slots]) and torch.equal(page.v, src.v_pool[:, slots])
        want = (k[:, :, i * P: (i + 1) * P], v[:, :, i * P: (i + 1) * P])
        assert all(torch.equal(a, b) for a, b in zip(page.codes(spec), want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(pack_pages(spec, *want), (page.k[:, :, None],
                                                                              page.v[:, :, None]), strict=True))
    def no_repack(*args, **kwargs):
        raise AssertionError("a load re-packed codes")

    for name in ("plane_bits", "write_k_planes", "write_v_planes"):
        monkeypatch.setattr(planes_mod, name, no_repack)
    dst = PlaneKVCache(spec, 2, initial_pages=1)  # grows as the load needs
    assert load_pages(dst, 1, pages) == 2 * P
    monkeypatch.undo()
    for layer in range(spec.n_layers):
        assert dst.length(layer, 1) == 2 * P and dst.length(layer, 0) == 0
        assert torch.equal(dst.read_k(layer, 1, 8), k[layer, :, : 2 * P])
        assert torch.equal(dst.read_v(layer, 1, 8), v[layer, :, : 2 * P])
    tail_k, tail_v = _prefix_codes(spec, 1, seed=6)
    _fill_one(dst, tail_k[:, :, :70], tail_v[:, :, :70], b=1)  # the suffix appends after the loaded pages
    for layer in range(spec.n_layers):
        assert torch.equal(dst.read_k(layer, 1, 8), torch.cat([k[layer, :, : 2 * P], tail_k[layer, :, :70]], 1))
        assert torch.equal(dst.read_v(layer, 1, 5), torch.cat([v[layer, :, : 2 * P], tail_v[layer, :, :70]], 1)
                           & 0b11111000)
    # a TieredCache source publishes the same bytes (its codes gathered from the tiers and packed)
    tiered = TieredCache(spec, 1, _policy(4, 2), max_tokens=512)
    _fill_one(tiered, k[:, :, : 2 * P], v[:, :, : 2 * P])
    again = PrefixIndex()
    assert publish_pages(again, tiered, 0, keys) == 2
    for key, page in zip(keys, pages, strict=False):
        assert torch.equal(again.get(key).k, page.k) and torch.equal(again.get(key).v, page.v)
    codes_k, codes_v = unpack_pages(spec, torch.stack([p.k for p in pages], 2), torch.stack([p.v for p in pages], 2))
    assert torch.equal(codes_k, k[:, :, : 2 * P]) and torch.equal(codes_v, v[:, :, : 2 * P])


def test_a_load_that_does_not_fit_keeps_the_index_and_leaves_the_cache_usable() -> None:
    codec, _, _ = _data()
    spec = codec.spec
    k, v = _prefix_codes(spec, 2, seed=7)
    index = PrefixIndex()
    keys = page_keys(prefix_root(spec.format_id), _tokens(2 * P), P)
    for i in range(2):
        index.put(keys[i], PrefixPage.from_codes(spec, k[:, :, i * P: (i + 1) * P], v[:, :, i * P: (i + 1) * P]))
    small = PlaneKVCache(spec, 1, max_pages=spec.n_kv_heads, initial_pages=1)  # one page per KV head
    with pytest.raises(CacheFull):
        load_pages(small, 0, index.match(keys, spec.format_id))
    small.free(0)
    assert len(index) == 2 and len(index.match(keys, spec.format_id)) == 2  # nothing stored is lost
    assert load_pages(small, 0, index.match(keys, spec.format_id)[:1]) == P
    assert torch.equal(small.read_k(0, 0, 8), k[0, :, :P])


def test_a_page_of_another_layout_is_refused() -> None:
    codec, _, _ = _data()
    spec = codec.spec
    k, v = _prefix_codes(spec, 1, seed=8)
    with pytest.raises(ValueError, match="pool's page layout"):  # codes where planes belong
        load_pages(PlaneKVCache(spec, 1), 0, [PrefixPage(spec.format_id, k, v)])
    page = PrefixPage.from_codes(spec, k, v)
    k_shape, _ = page_shapes(spec)
    assert torch.equal(decode_page_blob(encode_page_blob(page.k), k_shape), page.k)
    # a blob an older PlaneKV wrote (layout version 1: the bare codes, of the same size when W = 8)
    with pytest.raises(PrefixLayoutError, match="layout version"):
        decode_page_blob(k.numpy().tobytes(), k_shape)
    with pytest.raises(PrefixLayoutError, match="layout version 3"):
        decode_page_blob(BLOB_MAGIC + bytes([3]) + page.k.numpy().tobytes(), k_shape)
    # at the remote tier, such a blob is a miss (counted), never misread
    remote = FakeRemote()
    key = page_keys(prefix_root(spec.format_id), _tokens(P), P)[0]
    for kind, codes in (("k", k), ("v", v)):
        bk = remote_block_key(spec.format_id, key, kind)
        remote.frames[bk] = encode_frame(bk, codes.contiguous().numpy().tobytes())
    reader = PrefixIndex(remote=remote, spec=spec)
    assert reader.match([key], spec.format_id) == [] and reader.stats.remote_rejected == 1
