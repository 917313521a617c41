"""Bit-plane layout and the paged cache (DESIGN 4, layout version 1): appends in any order give the same
logical pages, reads return code prefixes at per-channel (K) / per-token (V) depths, batches of ragged
sequences across page boundaries, free and re-append, persistence and format identity."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from planekv.kvstore import CacheFull, FormatMismatch, FormatSpec, PlaneKVCache, pack_k_page, pack_v_page
from planekv.kvstore.planes import pack_bits, plane_bits, unpack_bits


def _spec(n_layers: int = 1, n_kv_heads: int = 2, head_dim: int = 16, page_size: int = 64, width: int = 8,
          model_id: str = "planes") -> FormatSpec:
    return FormatSpec(model_id=model_id, n_layers=n_layers, n_q_heads=2 * n_kv_heads, n_kv_heads=n_kv_heads,
                      head_dim=head_dim, calibration_id="c0", page_size=page_size, width=width)


def _codes(gen: torch.Generator, spec: FormatSpec, n: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.randint(0, 1 << spec.width, (*lead, spec.n_kv_heads, n, spec.head_dim), generator=gen,
                         dtype=torch.int64).to(torch.uint8)


def _prefix(codes: torch.Tensor, depth: torch.Tensor, width: int) -> torch.Tensor:
    """(code >> (W - t)) << (W - t), elementwise with depth broadcast to codes."""
    sh = (width - depth).long()
    return ((codes.long() >> sh) << sh).to(torch.uint8)


def _logical_pages(cache: PlaneKVCache, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V page contents in (head, slot) order, whatever physical pages were assigned."""
    t = cache.length(layer, b)
    n_slots = -(-t // cache.spec.page_size)
    ids = cache.page_table[b, :, :n_slots]
    assert bool((ids >= 0).all())
    return cache.k_pool[layer][ids], cache.v_pool[layer][ids]


def _expected_pages(kc: torch.Tensor, vc: torch.Tensor, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_k_page / pack_v_page of each page's codes, the tail page padded with zeros."""
    hk, t, d = kc.shape
    p = spec.page_size
    n_slots = -(-t // p)

    def pages(codes: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(hk, n_slots * p, d, dtype=torch.uint8)
        padded[:, :t] = codes
        return padded.view(hk, n_slots, p, d)

    pk, pv = pages(kc), pages(vc)
    k = torch.stack([torch.stack([pack_k_page(pk[h, s], spec.width) for s in range(n_slots)]) for h in range(hk)])
    v = torch.stack([torch.stack([pack_v_page(pv[h, s], spec.width) for s in range(n_slots)]) for h in range(hk)])
    return k, v


def test_pack_unpack_roundtrip(gen):
    bits = torch.randint(0, 2, (3, 5, 64), generator=gen).to(torch.uint8)
    packed = pack_bits(bits)
    assert packed.shape == (3, 5, 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed), bits)
    codes = torch.randint(0, 256, (4, 7), generator=gen).to(torch.uint8)
    pb = plane_bits(codes, 8)
    assert torch.equal((pb.long() << torch.arange(7, -1, -1)).sum(-1), codes.long())


def test_explicit_bit_layout():
    """K: bit i%8 of byte i//8 of (plane j, channel c) is token i; plane j is bit W-1-j of the code.
    V: bit c%8 of byte c//8 of (plane j, token i) is channel c."""
    p, d = 64, 16
    codes = torch.zeros(p, d, dtype=torch.uint8)
    codes[0, 0] = 0b1000_0000  # plane 0 of token 0, channel 0
    codes[9, 3] = 0b0100_0000  # plane 1 of token 9, channel 3
    codes[63, 15] = 0b0000_0001  # plane 7 of token 63, channel 15
    k = pack_k_page(codes, 8)
    assert k.shape == (8, d, p // 8)
    assert int(k[0, 0, 0]) == 1 and int(k[1, 3, 1]) == 2 and int(k[7, 15, 7]) == 128
    assert int(k.long().sum()) == 1 + 2 + 128
    v = pack_v_page(codes, 8)
    assert v.shape == (8, p, d // 8)
    assert int(v[0, 0, 0]) == 1 and int(v[1, 9, 0]) == 8 and int(v[7, 63, 1]) == 128
    assert int(v.long().sum()) == 1 + 8 + 128
    # W = 5: plane 0 is bit 4
    k5 = pack_k_page(torch.full((p, d), 0b10000, dtype=torch.uint8), 5)
    assert k5.shape == (5, d, p // 8)
    assert bool((k5[0] == 255).all()) and int(k5[1:].sum()) == 0


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 200])
def test_full_depth_read_is_exact(gen, page_size, length):
    spec = _spec(page_size=page_size)
    cache = PlaneKVCache(spec, 1)
    kc, vc = _codes(gen, spec, length), _codes(gen, spec, length)
    cache.append(0, kc, vc, seq=0)
    assert cache.length(0, 0) == length
    assert torch.equal(cache.read_k(0, 0, 8), kc)
    assert torch.equal(cache.read_v(0, 0, 8), vc)
    assert torch.equal(cache.read_k(0, 0, torch.full((2, 16), 8)), kc)
    assert torch.equal(cache.read_v(0, 0, torch.full((2, length), 8)), vc)
    # the pages hold exactly the documented layout
    k_pages, v_pages = _logical_pages(cache, 0, 0)
    ek, ev = _expected_pages(kc, vc, spec)
    assert torch.equal(k_pages, ek) and torch.equal(v_pages, ev)


@pytest.mark.parametrize("width", [8, 5])
@pytest.mark.parametrize("length", [1, 64, 65, 200])
def test_prefix_reads_at_per_channel_and_per_token_depths(gen, width, length):
    spec = _spec(width=width)
    cache = PlaneKVCache(spec, 1)
    kc, vc = _codes(gen, spec, length), _codes(gen, spec, length)
    cache.append(0, kc, vc, seq=0)
    for _ in range(3):
        tk = torch.randint(0, width + 1, (2, 16), generator=gen)
        got = cache.read_k(0, 0, tk)
        assert got.shape == kc.shape and got.dtype == torch.uint8
        assert torch.equal(got, _prefix(kc, tk[:, None, :], width))
        sv = torch.randint(0, width + 1, (2, length), generator=gen)
        got = cache.read_v(0, 0, sv)
        assert torch.equal(got, _prefix(vc, sv[:, :, None], width))
    for t in range(width + 1):
        assert torch.equal(cache.read_k(0, 0, t), _prefix(kc, torch.tensor(t), width))
        assert torch.equal(cache.read_v(0, 0, t), _prefix(vc, torch.tensor(t), width))


def test_token_by_token_bulk_and_mixed_appends_agree(gen):
    spec = _spec(n_layers=2)
    n = 200
    kc, vc = _codes(gen, spec, n, (2,)), _codes(gen, spec, n, (2,))  # [layers, Hkv, n, d]
    bulk = PlaneKVCache(spec, 1)
    single = PlaneKVCache(spec, 1)
    mixed = PlaneKVCache(spec, 1, initial_pages=1)  # also exercises pool growth
    for layer in range(2):
        bulk.append(layer, kc[layer], vc[layer], seq=0)
    for i in range(n):
        for layer in (1, 0):
            single.append(layer, kc[layer, :, i:i + 1], vc[layer, :, i:i + 1], seq=0)
    cuts = [0, 1, 63, 64, 65, 66, 130, 199, 200]
    for s, e in pairwise(cuts):
        mixed.append(0, kc[0, :, s:e], vc[0, :, s:e], seq=0)
    for s, e in zip([0, 150], [150, 200], strict=True):  # layer 1 prefilled in two chunks, later
        mixed.append(1, kc[1, :, s:e][None], vc[1, :, s:e][None])
    for layer in range(2):
        want = _logical_pages(bulk, layer, 0)
        for other in (single, mixed):
            got = _logical_pages(other, layer, 0)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(other.read_k(layer, 0, 8), kc[layer])
            assert torch.equal(other.read_v(layer, 0, 8), vc[layer])
    # pages are shared by the layers: 4 slots x 2 heads, whatever the order
    assert bulk.pages_in_use == single.pages_in_use == mixed.pages_in_use == 8


def test_batch_of_ragged_sequences(gen):
    spec = _spec(n_layers=2)
    lengths = [1, 63, 64, 65, 200]
    cache = PlaneKVCache(spec, len(lengths))
    data = {b: (_codes(gen, spec, n, (2,)), _codes(gen, spec, n, (2,))) for b, n in enumerate(lengths)}
    # interleave: every sequence grows a little at a time, layers in turn
    pos = [0] * len(lengths)
    step = 0
    while any(p < n for p, n in zip(pos, lengths, strict=True)):
        for b, n in enumerate(lengths):
            if pos[b] >= n:
                continue
            m = min(n - pos[b], [1, 7, 64, 3][step % 4])
            for layer in range(2):
                kc, vc = data[b]
                cache.append(layer, kc[layer, :, pos[b]:pos[b] + m], vc[layer, :, pos[b]:pos[b] + m], seq=b)
            pos[b] += m
        step += 1
    assert cache.lengths.tolist() == [lengths, lengths]
    for b, n in enumerate(lengths):
        kc, vc = data[b]
        for layer in range(2):
            assert torch.equal(cache.read_k(layer, b, 8), kc[layer])
            assert torch.equal(cache.read_v(layer, b, 8), vc[layer])
            tk = torch.randint(0, 9, (2, 16), generator=gen)
            assert torch.equal(cache.read_k(layer, b, tk), _prefix(kc[layer], tk[:, None, :], 8))
            sv = torch.randint(0, 9, (2, n), generator=gen)
            assert torch.equal(cache.read_v(layer, b, sv), _prefix(vc[layer], sv[:, :, None], 8))
    # page ids are distinct across sequences and heads
    used = cache.page_table[cache.page_table >= 0]
    assert used.numel() == used.unique().numel() == 2 * sum(-(-n // 64) for n in lengths)


def test_batched_append_equals_per_sequence(gen):
    spec = _spec()
    kc, vc = _codes(gen, spec, 70, (3,)), _codes(gen, spec, 70, (3,))
    a, b = PlaneKVCache(spec, 3), PlaneKVCache(spec, 3)
    a.append(0, kc, vc)
    for s in range(3):
        b.append(0, kc[s], vc[s], seq=s)
    for s in range(3):
        assert torch.equal(a.read_k(0, s, 8), kc[s]) and torch.equal(b.read_v(0, s, 8), vc[s])
        for x, y in zip(_logical_pages(a, 0, s), _logical_pages(b, 0, s), strict=True):
            assert torch.equal(x, y)


def test_free_then_reappend(gen):
    spec = _spec(n_layers=2)
    cache = PlaneKVCache(spec, 2)
    a = [_codes(gen, spec, 130, (2,)) for _ in range(2)]
    b = [_codes(gen, spec, 70, (2,)) for _ in range(2)]
    for layer in range(2):
        cache.append(layer, a[0][layer], a[1][layer], seq=0)
        cache.append(layer, b[0][layer], b[1][layer], seq=1)
    in_use = cache.pages_in_use
    old_pages = cache.page_table[0][cache.page_table[0] >= 0]
    cache.free(0)
    assert cache.length(0, 0) == 0 and cache.length(1, 0) == 0
    assert cache.pages_in_use == in_use - old_pages.numel()
    assert bool((cache.page_table[0] == -1).all())
    assert int(cache.k_pool[:, old_pages].sum()) == 0 and int(cache.v_pool[:, old_pages].sum()) == 0
    assert cache.read_k(0, 0, 8).shape == (2, 0, 16)
    # the other sequence is untouched
    assert torch.equal(cache.read_k(1, 1, 8), b[0][1]) and torch.equal(cache.read_v(0, 1, 8), b[1][0])
    # re-append other data, longer than before: reused pages hold only the new bits
    c = [_codes(gen, spec, 140, (2,)) for _ in range(2)]
    for layer in range(2):
        cache.append(layer, c[0][layer][:, :5], c[1][layer][:, :5], seq=0)
        cache.append(layer, c[0][layer][:, 5:], c[1][layer][:, 5:], seq=0)
        assert torch.equal(cache.read_k(layer, 0, 8), c[0][layer])
        assert torch.equal(cache.read_v(layer, 0, 8), c[1][layer])
        assert torch.equal(cache.read_k(layer, 1, 8), b[0][layer])
    assert cache.pages_in_use == in_use - old_pages.numel() + 2 * 3


def test_cache_full():
    spec = _spec()
    cache = PlaneKVCache(spec, 1, max_pages=2)
    z = torch.zeros(2, 64, 16, dtype=torch.uint8)
    cache.append(0, z, z, seq=0)  # one slot x 2 heads = 2 pages
    with pytest.raises(CacheFull):
        cache.append(0, z[:, :1], z[:, :1], seq=0)


def test_append_validates(gen):
    spec = _spec(width=5)
    cache = PlaneKVCache(spec, 2)
    good = _codes(gen, spec, 4)
    with pytest.raises(TypeError):
        cache.append(0, good.long(), good.long(), seq=0)
    with pytest.raises(ValueError):
        cache.append(0, good | 32, good, seq=0)  # a sixth bit with W = 5
    with pytest.raises(ValueError):
        cache.append(0, good[:, :, :8], good[:, :, :8], seq=0)
    with pytest.raises(ValueError):
        cache.append(0, good, good[:, :3], seq=0)
    with pytest.raises(ValueError):
        cache.append(0, good, good)  # no seq: needs [B, Hkv, n, d]
    with pytest.raises(ValueError):
        PlaneKVCache(spec, 0)
    cache.append(0, good[:, :0], good[:, :0], seq=0)
    assert cache.length(0, 0) == 0


def test_save_load_roundtrip(gen, tmp_path):
    spec = _spec(n_layers=2)
    cache = PlaneKVCache(spec, 2)
    d = {}
    for s, n in enumerate((65, 130)):
        d[s] = (_codes(gen, spec, n, (2,)), _codes(gen, spec, n, (2,)))
        for layer in range(2):
            cache.append(layer, d[s][0][layer], d[s][1][layer], seq=s)
    cache.free(0)
    path = cache.save(tmp_path / "cache.pt")
    loaded = PlaneKVCache.load(path, spec)
    assert torch.equal(loaded.k_pool, cache.k_pool) and torch.equal(loaded.v_pool, cache.v_pool)
    assert torch.equal(loaded.page_table, cache.page_table) and torch.equal(loaded.lengths, cache.lengths)
    assert loaded.pages_in_use == cache.pages_in_use
    for layer in range(2):
        assert torch.equal(loaded.read_v(layer, 1, 8), d[1][1][layer])
    # both keep working identically after the load
    more = (_codes(gen, spec, 100, (2,)), _codes(gen, spec, 100, (2,)))
    for c in (cache, loaded):
        for layer in range(2):
            c.append(layer, more[0][layer], more[1][layer], seq=0)
            c.append(layer, more[0][layer][:, :3], more[1][layer][:, :3], seq=1)
    assert torch.equal(loaded.k_pool, cache.k_pool) and torch.equal(loaded.page_table, cache.page_table)
    assert torch.equal(loaded.read_k(1, 1, 8), torch.cat([d[1][0][1], more[0][1][:, :3]], 1))


def test_load_with_other_format_raises(gen, tmp_path):
    spec = _spec()
    cache = PlaneKVCache(spec, 1)
    cache.append(0, _codes(gen, spec, 10), _codes(gen, spec, 10), seq=0)
    path = cache.save(tmp_path / "cache.pt")
    for other in (_spec(model_id="other"), _spec(page_size=128)):
        with pytest.raises(FormatMismatch):
            PlaneKVCache.load(path, other)
    torch.save({"format": "something-else"}, tmp_path / "x.pt")
    with pytest.raises(ValueError):
        PlaneKVCache.load(tmp_path / "x.pt", spec)


def test_check_format():
    spec = _spec()
    cache = PlaneKVCache(spec, 1)
    cache.check_format(spec.format_id)
    with pytest.raises(FormatMismatch):
        cache.check_format(_spec(model_id="other").format_id)


def test_physical_read_bytes(gen):
    spec = _spec()
    cache = PlaneKVCache(spec, 1)
    cache.append(0, _codes(gen, spec, 130), _codes(gen, spec, 130), seq=0)
    kd = torch.randint(0, 9, (2, 16), generator=gen)
    vd = torch.randint(0, 9, (2, 130), generator=gen)
    # 3 pages per head; a K row is P/8 bytes per page, a V row d/8 bytes
    assert cache.physical_read_bytes(0, 0, kd, vd) == int(kd.sum()) * 3 * 8 + int(vd.sum()) * 2


def test_hot_prefix_is_a_contiguous_slice(gen):
    """Plane index outermost within a page: planes [0, h) of a page are its first bytes."""
    spec = _spec()
    cache = PlaneKVCache(spec, 1)
    kc, vc = _codes(gen, spec, 64), _codes(gen, spec, 64)
    cache.append(0, kc, vc, seq=0)
    page = int(cache.page_table[0, 1, 0])
    h = 3
    hot_k = cache.k_pool[0, page].reshape(-1)[: h * 16 * 8]
    assert torch.equal(hot_k, pack_k_page(_prefix(kc[1], torch.tensor(h), 8), 8)[:h].reshape(-1))
    hot_v = cache.v_pool[0, page].reshape(-1)[: h * 64 * 2]
    assert torch.equal(hot_v, pack_v_page(_prefix(vc[1], torch.tensor(h), 8), 8)[:h].reshape(-1))


@pytest.mark.parametrize("v_run", [2, 4, 8])
def test_v_runs_keep_each_tokens_planes_together(gen, tmp_path, v_run):
    """``v_run`` = g: a V page is [W/g, P, g, d/8], token i's planes rg..rg+g-1 one range of g d/8 bytes in
    run r; appends across pages, prefix reads, the hot prefix of g planes (a slice) and persistence as
    for the plane-major layout."""
    spec = FormatSpec(model_id="planes", n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=16, calibration_id="c0",
                      v_run=v_run)
    cache = PlaneKVCache(spec, 1)
    kc, vc = _codes(gen, spec, 130), _codes(gen, spec, 130)
    cache.append(0, kc[:, :37], vc[:, :37], seq=0)
    cache.append(0, kc[:, 37:], vc[:, 37:], seq=0)
    assert tuple(cache.v_pool.shape[2:]) == (8 // v_run, 64, v_run, 2)
    page = int(cache.page_table[0, 1, 1])  # head 1, tokens 64..127
    plain = pack_v_page(vc[1, 64:128], 8)  # [W, P, d/8]
    got = cache.v_pool[0, page]
    assert torch.equal(got, pack_v_page(vc[1, 64:128], 8, v_run))
    i = 5
    assert torch.equal(got[1 if v_run < 8 else 0].reshape(64, -1)[i],
                       plain[(v_run if v_run < 8 else 0):][:v_run, i].reshape(-1))
    hot = got.reshape(-1)[: 64 * v_run * 2]  # run 0 = planes [0, g) of every token
    assert torch.equal(hot, pack_v_page(_prefix(vc[1, 64:128], torch.tensor(v_run), 8), 8, v_run)[0].reshape(-1))
    for _ in range(3):
        sv = torch.randint(0, 9, (2, 130), generator=gen)
        assert torch.equal(cache.read_v(0, 0, sv), _prefix(vc, sv[:, :, None], 8))
    assert torch.equal(cache.read_k(0, 0, 8), kc)
    loaded = PlaneKVCache.load(cache.save(tmp_path / "c.pt"), spec)
    assert torch.equal(loaded.read_v(0, 0, 8), vc)
    with pytest.raises(FormatMismatch):
        PlaneKVCache.load(tmp_path / "c.pt", _spec(n_kv_heads=2))


def test_select_reorders_repeats_and_drops_sequences(gen):
    """select(rows): sequence i becomes sequence rows[i] in every layer; a repeat is a copy (its appends
    leave the original alone) and the pages of dropped sequences are freed, zeroed, before copies take pages."""
    spec = _spec(n_layers=2)
    cache = PlaneKVCache(spec, 3, max_pages=12)  # room for 3 sequences of 2 slots x 2 heads, no more
    data = [[(_codes(gen, spec, 70), _codes(gen, spec, 70)) for _ in range(2)] for _ in range(3)]  # [seq][layer]
    for s in range(3):
        for layer in range(2):
            cache.append(layer, *data[s][layer], seq=s)
    cache.select(torch.tensor([1, 0, 1]))
    assert cache.batch_size == 3 and cache.pages_in_use == 3 * 2 * 2  # 3 sequences x 2 heads x 2 slots
    for i, s in enumerate([1, 0, 1]):
        for layer in range(2):
            assert torch.equal(cache.read_k(layer, i, 8), data[s][layer][0])
            assert torch.equal(cache.read_v(layer, i, 8), data[s][layer][1])
    more = _codes(gen, spec, 3), _codes(gen, spec, 3)
    cache.append(0, *more, seq=2)
    assert torch.equal(cache.read_k(0, 2, 8), torch.cat([data[1][0][0], more[0]], 1))
    assert torch.equal(cache.read_k(0, 0, 8), data[1][0][0])  # the original is untouched
    dropped = cache.page_table[:2][cache.page_table[:2] >= 0]
    cache.select(torch.tensor([2]))
    assert cache.batch_size == 1 and cache.length(0, 0) == 73 and cache.length(1, 0) == 70
    assert cache.pages_in_use == 2 * 2  # one sequence x 2 heads x 2 slots
    assert int(cache.k_pool[:, dropped].sum()) == 0 and int(cache.v_pool[:, dropped].sum()) == 0
    with pytest.raises(IndexError):
        cache.select(torch.tensor([1]))


@pytest.mark.parametrize("keep", [0, 40, 64, 100])
def test_truncate_clears_dropped_tokens(gen, keep):
    """truncate(b, n) keeps the first n tokens of every layer; appending after it equals appending to a
    cache that never held the dropped tokens, and pages past the kept tokens are freed."""
    spec = _spec(n_layers=2)
    cache, fresh = PlaneKVCache(spec, 2), PlaneKVCache(spec, 2)
    kc, vc = _codes(gen, spec, 130, (2,)), _codes(gen, spec, 130, (2,))
    tail_k, tail_v = _codes(gen, spec, 30), _codes(gen, spec, 30)
    for layer in range(2):
        cache.append(layer, kc[layer], vc[layer], seq=0)
        cache.append(layer, kc[layer], vc[layer], seq=1)
        fresh.append(layer, kc[layer][:, :keep], vc[layer][:, :keep], seq=0)
    cache.truncate(0, keep)
    assert cache.pages_in_use == 2 * 3 + 2 * -(-keep // 64)
    for c in (cache, fresh):
        c.append(0, tail_k, tail_v, seq=0)
    assert torch.equal(cache.read_k(0, 0, 8), fresh.read_k(0, 0, 8))
    assert torch.equal(cache.read_v(0, 0, 8), fresh.read_v(0, 0, 8))
    assert torch.equal(_logical_pages(cache, 0, 0)[0], _logical_pages(fresh, 0, 0)[0])
    assert cache.length(1, 0) == keep and torch.equal(cache.read_v(1, 0, 8), vc[1][:, :keep])
    assert torch.equal(cache.read_k(0, 1, 8), kc[0])  # the other sequence is untouched
    cache.truncate(1, 500)  # longer than it holds: nothing changes
    assert cache.length(0, 1) == 130 and torch.equal(cache.read_v(0, 1, 8), vc[0])
    with pytest.raises(ValueError, match="out of range"):
        cache.truncate(2, 0)
