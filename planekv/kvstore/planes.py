"""Bit-plane layout and the paged cache object (DESIGN section 4, layout version 1).

A page holds P consecutive tokens of one sequence, layer and KV head. Within a page the plane index
is outermost, so the hot prefix of planes ``[0, h)`` of a page is one contiguous byte range in both
K and V (the tiering split is a slice, not a gather):

- K, channel-major: ``[W planes][d channels][P/8 bytes]``; bit ``i % 8`` of byte ``i // 8`` is
  token i of the page. Reading channel c at depth t touches t rows of P/8 bytes per page.
- V, token-major:   ``[W planes][P tokens][d/8 bytes]``; bit ``c % 8`` of byte ``c // 8`` is
  channel c. Reading token i at depth s touches s rows of d/8 bytes. With ``FormatSpec.v_run`` = g > 1
  each token holds its planes in runs of g rows: ``[W/g runs][P tokens][g planes][d/8 bytes]``, so a
  token's planes 0..g-1 are one contiguous g d/8-byte range (the hot prefix stays a slice when it is a
  whole number of runs).

Plane j of a W-bit code is bit ``W - 1 - j`` (plane 0 is the most significant, the first branch).
Pages of a sequence are shared by all layers' pools (one page id per sequence, KV head and page
slot); each layer keeps its own length so layers may append one after another.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import CacheFull, FormatMismatch
from .format import FormatSpec

_BIT = torch.arange(8, dtype=torch.uint8)  # bit weights within a byte: 1 << k


def plane_bits(codes: torch.Tensor, width: int, n_planes: int | None = None) -> torch.Tensor:
    """codes [...] uint8 -> bits [..., n_planes] (uint8 0/1), plane 0 first."""
    n = width if n_planes is None else n_planes
    shifts = torch.arange(width - 1, width - 1 - n, -1, device=codes.device, dtype=torch.uint8)
    return (codes[..., None] >> shifts) & 1


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bits [..., 8m] (0/1) -> bytes [..., m] with bit k of byte b = bits[8b + k]."""
    b = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.uint8)
    return (b << _BIT.to(bits.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """bytes [..., m] -> bits [..., 8m] (uint8 0/1); inverse of :func:`pack_bits`."""
    return ((data[..., None] >> _BIT.to(data.device)) & 1).reshape(*data.shape[:-1], -1)


def pack_k_page(codes: torch.Tensor, width: int) -> torch.Tensor:
    """One K page: codes [P, d] -> [W, d, P/8]."""
    bits = plane_bits(codes, width)  # [P, d, W]
    return pack_bits(bits.permute(2, 1, 0))


def pack_v_page(codes: torch.Tensor, width: int, v_run: int = 1) -> torch.Tensor:
    """One V page: codes [P, d] -> [W, P, d/8] (``v_run`` = g > 1: [W/g, P, g, d/8])."""
    bits = plane_bits(codes, width)  # [P, d, W]
    page = pack_bits(bits.permute(2, 0, 1))
    if v_run == 1:
        return page
    w, p, nb = page.shape
    return page.view(w // v_run, v_run, p, nb).transpose(1, 2).contiguous()


def _planes_to_codes(bits: torch.Tensor, width: int) -> torch.Tensor:
    """bits [n_planes, ...] (plane 0 first) -> codes [...] with missing low planes zero."""
    n = bits.shape[0]
    shifts = torch.arange(width - 1, width - 1 - n, -1, device=bits.device, dtype=torch.uint8)
    shape = (n,) + (1,) * (bits.dim() - 1)
    return (bits << shifts.view(shape)).sum(0, dtype=torch.uint8)


def write_k_planes(pool: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor) -> None:
    """OR Key bits into K pages: pool [pages, n, d, P/8] (its planes 0..n-1), pages [Hkv, m] (each token's
    page), offsets [m] (its position in the page), bits [Hkv, m, d, n] (0/1, pool plane order). The pages'
    bytes at these tokens must be zero (free pages are; no position is written twice), so a sum is the OR."""
    hk, m, d, n = bits.shape
    if n == 0 or m == 0:  # no planes (a tier holding none of them) or no tokens: nothing to write
        return
    p8 = pool.shape[3]
    dev = pool.device
    vals = bits << (offsets % 8).to(device=dev, dtype=torch.uint8)[None, :, None, None]
    j = torch.arange(n, device=dev)
    c = torch.arange(d, device=dev)
    flat = ((pages[:, :, None, None] * n + j[None, None, None, :]) * d + c[None, None, :, None]) * p8 \
        + (offsets // 8).to(dev)[None, :, None, None]
    pool.view(-1).index_put_((flat.reshape(-1),), vals.reshape(-1), accumulate=True)


def write_v_planes(pool: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, bits: torch.Tensor,
                   v_run: int = 1) -> None:
    """Write Value rows into V pages: pool [pages, n, P, d/8] (or [pages, n/g, P, g, d/8] with ``v_run`` = g),
    pages [Hkv, m], offsets [m], bits [Hkv, m, d, n] (0/1, pool plane order); each (plane, token) row whole."""
    hk, m, d, n = bits.shape
    if n == 0 or m == 0:  # no planes (a tier holding none of them) or no tokens: nothing to write
        return
    dev = pool.device
    rows = pack_bits(bits.permute(0, 1, 3, 2))  # [Hkv, m, n, d/8]
    j = torch.arange(n, device=dev)
    page_idx = pages[:, :, None].expand(hk, m, n)
    tok_idx = offsets.to(dev)[None, :, None].expand(hk, m, n)
    if v_run == 1:
        pool[page_idx, j[None, None, :].expand(hk, m, n), tok_idx] = rows
    else:  # run j // g, row j % g of the token's run
        pool[page_idx, (j // v_run)[None, None, :].expand(hk, m, n), tok_idx,
             (j % v_run)[None, None, :].expand(hk, m, n)] = rows


def v_page_shape(spec: FormatSpec, n_planes: int | None = None) -> tuple[int, ...]:
    """One V page's shape in the format's layout: (W, P, d/8), or (W/g, P, g, d/8) with ``spec.v_run`` = g > 1;
    with ``n_planes`` (a multiple of g), that many planes instead of W."""
    w, p, nb, g = spec.width if n_planes is None else n_planes, spec.page_size, spec.head_dim // 8, spec.v_run
    return (w, p, nb) if g == 1 else (w // g, p, g, nb)


def v_planes(v_pages: torch.Tensor, v_run: int) -> torch.Tensor:
    """V pages as the plane-major view [..., W, P, d/8]: themselves when ``v_run`` is 1, else grouped
    pages [..., W/g, P, g, d/8] (g = ``v_run``) rearranged (a copy)."""
    if v_run == 1:
        return v_pages
    *lead, r, p, g, nb = v_pages.shape
    if g != v_run:
        raise ValueError(f"V pages {tuple(v_pages.shape)} are not in runs of {v_run} planes")
    return v_pages.movedim(-2, -3).reshape(*lead, r * g, p, nb)


class PlaneKVCache:
    """Paged bit-plane storage of K and V codes for a batch of sequences, all layers of a model.

    ``k_pool[layer]`` is [pages, W, d, P/8] and ``v_pool[layer]`` [pages, W, P, d/8] (uint8; with
    ``spec.v_run`` = g > 1, [pages, W/g, P, g, d/8]: :func:`v_planes` gives the plane-major view);
    ``page_table`` [batch, kv_heads, slots] holds page ids (-1 = none). Free pages are all zeros,
    which is what lets an append OR bits into a partly filled page in place.
    """

    def __init__(self, spec: FormatSpec, batch_size: int, device: torch.device | str = "cpu",
                 max_pages: int | None = None, initial_pages: int = 64) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self.spec = spec
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.max_pages = max_pages
        w, d, p = spec.width, spec.head_dim, spec.page_size
        self._k_page = (w, d, p // 8)
        self._v_page = v_page_shape(spec)
        n = initial_pages if max_pages is None else min(initial_pages, max_pages)
        self.k_pool = torch.zeros((spec.n_layers, n, *self._k_page), dtype=torch.uint8, device=self.device)
        self.v_pool = torch.zeros((spec.n_layers, n, *self._v_page), dtype=torch.uint8, device=self.device)
        self.page_table = torch.full((batch_size, spec.n_kv_heads, 0), -1, dtype=torch.int64)
        self.lengths = torch.zeros((spec.n_layers, batch_size), dtype=torch.int64)
        self._free = list(range(n - 1, -1, -1))

    # ---- pages ----

    @property
    def n_pages(self) -> int:
        return self.k_pool.shape[1]

    @property
    def pages_in_use(self) -> int:
        return self.n_pages - len(self._free)

    def _grow(self, need: int) -> None:
        old = self.n_pages
        new = max(2 * old, old + need)
        if self.max_pages is not None:
            new = min(new, self.max_pages)
        if new - old < need:
            raise CacheFull(f"need {need} more pages; the pool is capped at {self.max_pages} pages")
        L = self.spec.n_layers
        self.k_pool = torch.cat([self.k_pool, self.k_pool.new_zeros((L, new - old, *self._k_page))], 1)
        self.v_pool = torch.cat([self.v_pool, self.v_pool.new_zeros((L, new - old, *self._v_page))], 1)
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _ensure_pages(self, b: int, n_slots: int) -> None:
        have = self.page_table.shape[2]
        if n_slots > have:
            pad = torch.full((self.batch_size, self.spec.n_kv_heads, n_slots - have), -1, dtype=torch.int64)
            self.page_table = torch.cat([self.page_table, pad], 2)
        missing = (self.page_table[b, :, :n_slots] < 0).nonzero().tolist()
        if len(missing) > len(self._free):
            self._grow(len(missing) - len(self._free))
        for h, s in missing:
            self.page_table[b, h, s] = self._free.pop()

    def free(self, b: int) -> None:
        """Release sequence b's pages (zeroed for reuse) and reset its lengths."""
        self._release(self.page_table[b][self.page_table[b] >= 0].unique())
        self.page_table[b] = -1
        self.lengths[:, b] = 0

    def _release(self, pages: torch.Tensor) -> None:
        """Zero ``pages`` (page ids [n]) in every layer and return them to the free list."""
        if pages.numel():
            idx = pages.to(self.device)
            self.k_pool[:, idx] = 0
            self.v_pool[:, idx] = 0
            self._free.extend(pages.tolist())

    # ---- batch edits (beam search, batch subsets, speculative rollback) ----

    def select(self, rows: torch.Tensor) -> None:
        """Make the batch the sequences ``rows`` [B'] (int64 indices into the current batch; repeats allowed):
        sequence i becomes sequence ``rows[i]``, every layer. The first occurrence of a sequence keeps its
        pages; each repeat gets a copy of them (appends write pages in place, so sequences never share one);
        the pages of sequences not selected are freed."""
        rows = torch.as_tensor(rows).cpu()
        if rows.dim() != 1 or rows.numel() == 0 or rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rows must be a non-empty 1-D integer tensor, got {tuple(rows.shape)} {rows.dtype}")
        rows = rows.long()
        if bool(((rows < 0) | (rows >= self.batch_size)).any()):
            raise IndexError(f"rows {rows.tolist()} out of range for a batch of {self.batch_size} sequences")
        seen: set[int] = set()
        repeat = torch.zeros(rows.numel(), dtype=torch.bool)  # [B']: a repeat of a sequence selected before
        for i, r in enumerate(rows.tolist()):
            repeat[i] = r in seen
            seen.add(r)
        dropped = torch.tensor([b not in seen for b in range(self.batch_size)])  # [B]
        old = self.page_table[dropped]
        self._release(old[old >= 0])  # first: the copies may take these pages
        table = self.page_table[rows].clone()  # [B', Hkv, slots]
        copies = table[repeat]  # [repeats, Hkv, slots]: source pages of the copies
        used = copies >= 0
        n = int(used.sum())
        if n > len(self._free):
            self._grow(n - len(self._free))
        fresh = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int64)
        if n:
            dst, src = fresh.to(self.device), copies[used].to(self.device)
            self.k_pool[:, dst] = self.k_pool[:, src]
            self.v_pool[:, dst] = self.v_pool[:, src]
        copies[used] = fresh
        table[repeat] = copies
        self.page_table = table
        self.lengths = self.lengths[:, rows].clone()
        self.batch_size = rows.numel()

    def truncate(self, b: int, length: int) -> None:
        """Sequence b keeps its first ``length`` tokens in every layer (a layer holding fewer keeps its own):
        the planes of the dropped tokens are cleared (a later append ORs bits into them) and pages that no layer
        uses any more are freed."""
        if not 0 <= b < self.batch_size or length < 0:
            raise ValueError(f"sequence {b} of {self.batch_size}, length {length}: out of range")
        p = self.spec.page_size
        slot, off = divmod(length, p)
        longer = [layer for layer in range(self.spec.n_layers) if self.length(layer, b) > length]
        if off and longer:  # the page holding token `length` keeps its first `off` tokens
            pages = self.page_table[b, :, slot].to(self.device)  # [Hkv]
            keep = pack_bits((torch.arange(p, device=self.device) < off).to(torch.uint8))  # [P/8]
            for layer in longer:
                self.k_pool[layer, pages] &= keep
                self.v_pool[layer, pages, :, off:] = 0
        gone = self.page_table[b, :, -(-length // p):]  # [Hkv, slots]: pages past the kept tokens
        self._release(gone[gone >= 0])
        gone.fill_(-1)
        self.lengths[:, b] = self.lengths[:, b].clamp(max=length)

    # ---- write path ----

    def length(self, layer: int, b: int) -> int:
        return int(self.lengths[layer, b])

    def append(self, layer: int, k_codes: torch.Tensor, v_codes: torch.Tensor, seq: int | None = None) -> None:
        """Append codes [B, Hkv, n, d] for every sequence (or [Hkv, n, d] for sequence ``seq``).

        One token (decode) or many (prefill); a partly filled page is completed in place.
        """
        if seq is None:
            if k_codes.dim() != 4 or k_codes.shape[0] != self.batch_size:
                raise ValueError(f"expected codes [{self.batch_size}, Hkv, n, d], got {tuple(k_codes.shape)}")
            for b in range(self.batch_size):
                self.append(layer, k_codes[b], v_codes[b], seq=b)
            return
        spec = self.spec
        check_sequence_codes(spec, k_codes, v_codes)
        n = k_codes.shape[1]
        if n == 0:
            return
        w, p = spec.width, spec.page_size
        start = self.length(layer, seq)
        pos = torch.arange(start, start + n)
        slot, off = pos // p, pos % p
        self._ensure_pages(seq, int(slot[-1]) + 1)
        dev = self.device
        pages = self.page_table[seq][:, slot].to(dev)  # [Hkv, n]
        off_d = off.to(dev)
        write_k_planes(self.k_pool[layer], pages, off_d, plane_bits(k_codes.to(dev), w))
        write_v_planes(self.v_pool[layer], pages, off_d, plane_bits(v_codes.to(dev), w), spec.v_run)
        self.lengths[layer, seq] += n

    # ---- read path ----

    def _pages(self, layer: int, b: int) -> tuple[torch.Tensor, int]:
        t = self.length(layer, b)
        n_slots = -(-t // self.spec.page_size)
        return self.page_table[b, :, :n_slots].to(self.device), t

    def read_k(self, layer: int, b: int, depth: torch.Tensor | int) -> torch.Tensor:
        """Key code prefixes of sequence b: depth [Hkv, d] (or an int) -> codes [Hkv, T, d].

        Only planes below each channel's depth are read; unread low bits are zero.
        """
        spec = self.spec
        pages, t = self._pages(layer, b)
        depth_t = torch.as_tensor(depth, device=self.device).expand(spec.n_kv_heads, spec.head_dim)
        top = int(depth_t.max()) if depth_t.numel() else 0
        hk, d, _p = spec.n_kv_heads, spec.head_dim, spec.page_size
        if top == 0 or t == 0:
            return torch.zeros((hk, t, d), dtype=torch.uint8, device=self.device)
        raw = self.k_pool[layer][pages][:, :, :top]  # [Hkv, slots, top, d, P/8]
        bits = unpack_bits(raw)  # [Hkv, slots, top, d, P]
        keep = torch.arange(top, device=self.device)[None, :, None] < depth_t[:, None, :]  # [Hkv, top, d]
        bits = bits * keep[:, None, :, :, None].to(torch.uint8)
        codes = _planes_to_codes(bits.permute(2, 0, 1, 4, 3), spec.width)  # [Hkv, slots, P, d]
        return codes.reshape(hk, -1, d)[:, :t]

    def read_v(self, layer: int, b: int, depth: torch.Tensor | int) -> torch.Tensor:
        """Value code prefixes of sequence b: depth [Hkv, T] (or an int) -> codes [Hkv, T, d]."""
        spec = self.spec
        pages, t = self._pages(layer, b)
        hk, d, _p = spec.n_kv_heads, spec.head_dim, spec.page_size
        depth_t = torch.as_tensor(depth, device=self.device).expand(hk, t)
        top = int(depth_t.max()) if depth_t.numel() else 0
        if top == 0 or t == 0:
            return torch.zeros((hk, t, d), dtype=torch.uint8, device=self.device)
        runs = -(-top // spec.v_run)  # the runs that hold planes 0..top-1, rearranged alone
        raw = v_planes(self.v_pool[layer][pages][:, :, :runs], spec.v_run)[:, :, :top]  # [Hkv, slots, top, P, d/8]
        bits = unpack_bits(raw)  # [Hkv, slots, top, P, d]
        bits = bits.permute(0, 1, 3, 2, 4).reshape(hk, -1, top, d)[:, :t]  # [Hkv, T, top, d]
        keep = torch.arange(top, device=self.device)[None, None, :] < depth_t[:, :, None]
        bits = bits * keep[..., None].to(torch.uint8)
        return _planes_to_codes(bits.permute(2, 0, 1, 3), spec.width)

    def physical_read_bytes(self, layer: int, b: int, k_depth: torch.Tensor, v_depth: torch.Tensor,
                            k_refined: torch.Tensor | None = None) -> int:
        """Bytes a read at these depths touches, counted from the layout: every (plane, channel)
        row of every K page (P/8 bytes) and every (plane, token) row of V (d/8 bytes). With Key
        refinement (``k_refined`` [Hkv, T] bool: tokens read at depth W), every page holding a refined
        token adds the rows of the planes below W that the channel depths left unread."""
        _, t = self._pages(layer, b)
        p = self.spec.page_size
        n_slots = -(-t // p)
        k = int(k_depth.sum()) * n_slots * (p // 8)
        if k_refined is not None:
            pad = torch.nn.functional.pad(k_refined[:, :t].bool(), (0, n_slots * p - t))
            pages = pad.view(pad.shape[0], n_slots, p).any(-1).sum(-1)  # [Hkv]
            k += int((pages * (self.spec.width - k_depth.cpu().long()).sum(-1)).sum()) * (p // 8)
        v = int(v_depth.sum()) * (self.spec.head_dim // 8)
        return k + v

    # ---- persistence ----

    def state_dict(self) -> dict[str, Any]:
        return {"format": "planekv-cache", "version": 1, "format_id": self.spec.format_id,
                "format_json": self.spec.canonical_json(), "batch_size": self.batch_size,
                "k_pool": self.k_pool.cpu(), "v_pool": self.v_pool.cpu(),
                "page_table": self.page_table, "lengths": self.lengths, "free": torch.tensor(self._free)}

    def save(self, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        torch.save(self.state_dict(), path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str], spec: FormatSpec, device: torch.device | str = "cpu") -> PlaneKVCache:
        """Open a saved cache; raises FormatMismatch if it was written under another format."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != "planekv-cache":
            raise ValueError(f"{path} is not a PlaneKV cache file")
        spec.check(data["format_id"], what=f"cache file {path}")
        cache = cls(spec, int(data["batch_size"]), device=device, initial_pages=1)
        cache.k_pool = data["k_pool"].to(device)
        cache.v_pool = data["v_pool"].to(device)
        cache.page_table = data["page_table"]
        cache.lengths = data["lengths"]
        cache._free = data["free"].tolist()
        return cache

    def check_format(self, format_id: str) -> None:
        """Raise FormatMismatch unless the reader's ``format_id`` is this cache's format."""
        if format_id != self.spec.format_id:
            raise FormatMismatch(
                f"cache holds format {self.spec.format_id}; the reader uses {format_id}."
                " Read it with the codec of the format it was written under")


def check_sequence_codes(spec: FormatSpec, k_codes: torch.Tensor, v_codes: torch.Tensor) -> None:
    """Raise unless K and V codes [Hkv, n, d] of one sequence fit ``spec``: shapes, uint8, at most W bits."""
    exp = (spec.n_kv_heads, spec.head_dim)
    if k_codes.shape != v_codes.shape or k_codes.dim() != 3 or (k_codes.shape[0], k_codes.shape[2]) != exp:
        raise ValueError(f"expected K and V codes [{exp[0]}, n, {exp[1]}], got "
                         f"{tuple(k_codes.shape)} and {tuple(v_codes.shape)}")
    if k_codes.dtype != torch.uint8 or v_codes.dtype != torch.uint8:
        raise TypeError("codes must be uint8 (encode with Codec.encode_k / encode_v first)")
    if (k_codes >> spec.width).any() or (v_codes >> spec.width).any():
        raise ValueError(f"codes exceed W = {spec.width} bits")
