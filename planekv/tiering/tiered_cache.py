"""TieredCache (docs/TIERING.md): a paged bit-plane cache whose planes live in three places.

- **Hot pool** (the cache's device, a GPU in serving): planes ``[0, h)`` of every page, ``h`` per layer and per K
  / V from the ``PlacementPolicy``. Layer l's pools are ``k_hot[l]`` [pages, h_K, d, P/8] and ``v_hot[l]``
  [pages, h_V, P, d/8] (runs of ``v_run`` planes where the format says so).
- **Open pages**: the page each (sequence, KV head) is appending to keeps its refinement planes ``[h, W)`` on the
  device until it is full (K in ``k_open[l]``, V in its reserved Value promotion slot).
- **Host tier**: when a page fills (is sealed), its refinement planes go to ``planekv.tiering.HostTier``, in framed
  blocks per (sequence, K or V, layer, KV head).
- **Promotion cache** (device, bounded, LRU): refinement planes brought back for reads. Keys by channel-plane: plane
  j of channel c over every page of a (sequence, KV head) (``k_promo[l]`` [slots, pages per sequence, P/8],
  ``k_slot[l]`` [B, Hkv, d, W - h_K]); Values by page (``v_promo[l]`` [slots, W - h_V, P, d/8], ``v_slot[l]``
  [pages]).
- **Key pages** (device, bounded, LRU, a budget of their own beside the promotion cache's: ``key_page_bytes``): every
  channel's refinement planes of one Key page, for Key refinement, whose tokens want every channel at depth W
  (``kp_promo[l]`` [slots, W - h_K, d, P/8], ``kp_slot[l]`` [pages]); slots 0..B*Hkv-1 are the open pages
  (``k_open[l]`` is a view of them).
- **Deep Key channels** (``PlacementPolicy.deep_key_channels``, off by default): the Key channels ranked deepest keep
  planes ``[h_K, h_K + extra)`` of every token in pinned channel-plane slots past the LRU's in ``k_promo[l]``
  (``_pin_deep_key_channels``; bytes in ``TierBytes.pinned``).

``residency(layer)`` says what can be read now; ``read_k`` / ``read_v`` return code prefixes like
``PlaneKVCache``'s and refuse a depth past it (never a wrong value), so ``planekv.kvstore.reference.readkv_decode``
reads a TieredCache as it reads a PlaneKVCache, within its residency. With ``h = W`` nothing is tiered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kvstore import FormatSpec, PlaneKVError, Residency
from ..kvstore.errors import CacheFull, FormatMismatch
from ..kvstore.planes import (
    _planes_to_codes,
    check_sequence_codes,
    plane_bits,
    unpack_bits,
    v_page_shape,
    v_planes,
    write_k_planes,
    write_v_planes,
)
from ..kvstore.tiered_pools import TieredPools
from .host_tier import HostTier
from .placement import PlacementPolicy
from .remote_writer import RemoteWriter
from .slot_lru import SlotLru, first_occurrences
from .spill_tier import SpillTier

MiB = 1 << 20
Items = list[tuple[int, ...]] | torch.Tensor  # promotion requests: tuples, or an [n, 3 or 4] int64 tensor


def _as_items(items: Items, width: int) -> torch.Tensor:
    """Promotion requests as an [n, width] int64 CPU tensor."""
    return torch.as_tensor(items, dtype=torch.int64).reshape(-1, width).cpu()


@dataclass(frozen=True)
class TierBytes:
    """Bytes held per place (capacity counted whole: allocated pools, not their fill)."""

    hot: int  # hot pools of every layer
    open: int  # open pages' Key refinement planes (their Value ones are in promotion slots)
    promotion: int  # the promotion cache, K and V, every layer, and the sealed Key pages' slots
    host: int  # the host tier's blocks
    nvme: int = 0  # blocks the host tier spilled to its spill tier (files)
    remote: int = 0  # blocks held only by the remote tier (dropped from host memory; not local memory)
    pinned: int = 0  # deep Key channels' pinned channel-planes (PlacementPolicy.deep_key_channels), every layer

    @property
    def device(self) -> int:
        return self.hot + self.open + self.promotion + self.pinned


def promotion_slots(spec: FormatSpec, max_tokens: int, hot_k: int, hot_v: int, layer_bytes: int,
                    k_share: float) -> tuple[int, int]:
    """(Key channel-plane slots, sealed Value page slots) of one layer's promotion cache of ``layer_bytes``: a Key
    channel-plane is plane j of one channel over every page a sequence can hold, a Value page its W - h_V
    refinement planes; ``k_share`` of the bytes go to Keys."""
    w, p = spec.width, spec.page_size
    k_vec = math.ceil(max_tokens / p) * (p // 8)
    v_page = (w - hot_v) * p * (spec.head_dim // 8)
    n_k = int(layer_bytes * k_share) // k_vec if hot_k < w else 0
    n_v = int(layer_bytes * (1 - k_share)) // v_page if hot_v < w else 0
    return n_k, n_v


def key_page_slots(spec: FormatSpec, hot_k: int, layer_bytes: int) -> int:
    """Sealed Key pages one layer's ``layer_bytes`` of Key page slots hold (a page: W - h_K planes of every
    channel, d x P/8 bytes each)."""
    page = (spec.width - hot_k) * spec.head_dim * (spec.page_size // 8)
    return layer_bytes // page if hot_k < spec.width else 0


class TieredCache:
    """Hot planes on the device, refinement planes of sealed pages in the host tier, a promotion cache between."""

    def __init__(self, spec: FormatSpec, batch_size: int, placement: PlacementPolicy, max_tokens: int,
                 device: torch.device | str = "cpu", hot_bytes: int | None = None, promotion_bytes: int = 64 * MiB,
                 host_bytes: int | None = None, k_promotion_share: float = 0.5,
                 sequence_ids: list[str] | None = None, key_page_bytes: int = 0,
                 spill: SpillTier | None = None, remote: RemoteWriter | None = None,
                 key_channel_scores: torch.Tensor | None = None, zero_copy: bool | None = None) -> None:
        """``promotion_bytes``: the promotion cache (Key channel-planes and Value pages) over every layer;
        ``key_page_bytes``: sealed Key pages for Key refinement over every layer, beside it (0: a refined token
        of a sealed page reads at its channels' resident depths, a cap); ``spill``: where a full host tier moves
        its least recently read blocks (NVMe files; None: a full host tier refuses pages); ``remote``: the writer
        of a remote tier (the store service) that takes a copy of every sealed block and serves the blocks a full
        host tier drops (``HostTier``); ``key_channel_scores`` [layers, KV heads, d]: which Key channels are deep
        when the placement has ``deep_key_channels`` (:meth:`_pin_deep_key_channels`); ``zero_copy``: Key
        channel-planes are promoted by the device reading the host tier's pinned blocks in place
        (``planekv.kernels.host_gather``; None: on CUDA devices; on the CPU only under Triton's interpreter)."""
        if batch_size < 1 or max_tokens < 1:
            raise ValueError(f"batch_size and max_tokens must be >= 1, got {batch_size} and {max_tokens}")
        placement.check_format(spec.n_layers, spec.width)
        if placement.format_id is not None and placement.format_id != spec.format_id:
            raise FormatMismatch(f"placement policy is for format {placement.format_id}, the cache's format is "
                                 f"{spec.format_id}")
        if not 0.0 <= k_promotion_share <= 1.0 or promotion_bytes < 0 or key_page_bytes < 0:
            raise ValueError(f"k_promotion_share must be in [0, 1], promotion_bytes and key_page_bytes >= 0, got "
                             f"{k_promotion_share}, {promotion_bytes} and {key_page_bytes}")
        self.spec = spec
        self.batch_size = batch_size
        self.placement = placement
        # the budgets it was made with (planekv.tiering.replace makes its successor under another policy with them)
        self.budgets = {"hot_bytes": hot_bytes, "promotion_bytes": promotion_bytes, "host_bytes": host_bytes,
                        "k_promotion_share": k_promotion_share, "key_page_bytes": key_page_bytes}
        self.device = torch.device(device)
        self.zero_copy = self.device.type == "cuda" if zero_copy is None else zero_copy
        if self.zero_copy:  # the kernel needs Triton (an optional dependency): imported only where it is used
            from ..kernels._dispatch import interpreting

            if self.device.type != "cuda" and not interpreting():
                raise ValueError("zero_copy promotions need a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
        # per layer: the host blocks a zero-copy gather reads, kept until the event recorded after it has passed
        self._gather_holds: dict[int, tuple[torch.cuda.Event | None, list[torch.Tensor]]] = {}
        self.max_tokens = max_tokens
        self.sequence_ids = sequence_ids or [f"s{b}" for b in range(batch_size)]
        if len(self.sequence_ids) != batch_size or len(set(self.sequence_ids)) != batch_size:
            raise ValueError(f"sequence_ids must be {batch_size} distinct ids, got {self.sequence_ids}")
        w, d, p, g, hk_n, L = spec.width, spec.head_dim, spec.page_size, spec.v_run, spec.n_kv_heads, spec.n_layers
        self.hot_k = [placement.hot(layer).k for layer in range(L)]
        self.hot_v = [placement.hot(layer).v for layer in range(L)]
        for layer, hv in enumerate(self.hot_v):
            if hv % g:
                raise ValueError(f"layer {layer}: {hv} hot Value planes are not a whole number of V runs of {g} "
                                 "planes (FormatSpec.v_run); choose a multiple of it")
        self.max_slots = math.ceil(max_tokens / p)  # pages per (sequence, KV head)
        self.k_row = p // 8  # bytes of one (plane, channel) row of a K page
        self.v_row = d // 8  # bytes of one (plane, token) row of a V page
        page_hot = sum((hk * d * self.k_row) + (hv * p * self.v_row) for hk, hv in zip(self.hot_k, self.hot_v,
                                                                                       strict=True))
        need = batch_size * hk_n * self.max_slots
        if hot_bytes is None:
            self.max_pages = need
        else:
            self.max_pages = hot_bytes // max(1, page_hot)
            if self.max_pages < 1:
                raise ValueError(f"a hot-pool budget of {hot_bytes} bytes holds no page: one page's hot planes "
                                 f"take {page_hot} bytes over {L} layers; raise the budget or lower h")
        self.hot_page_bytes = page_hot
        dev = self.device
        n0 = min(self.max_pages, max(1, batch_size * hk_n))
        self.k_hot = [torch.zeros(n0, hk, d, self.k_row, dtype=torch.uint8, device=dev) for hk in self.hot_k]
        self.v_hot = [torch.zeros(n0, *v_page_shape(spec, hv), dtype=torch.uint8, device=dev) for hv in self.hot_v]
        n_open = batch_size * hk_n  # one open page per (sequence, KV head)
        # Key pages: per layer, the open pages' refinement planes (slots 0..n_open-1) and the promoted sealed ones
        self.kp_promo = [torch.zeros(n_open + key_page_slots(spec, hk, key_page_bytes // L), w - hk, d, self.k_row,
                                     dtype=torch.uint8, device=dev) for hk in self.hot_k]
        self.k_open = [t[:n_open] for t in self.kp_promo]  # views: a page appends into its reserved slot
        self.kp_slot = [torch.full((n0,), -1, dtype=torch.int32) for _ in self.hot_k]
        self._kp_lru = [SlotLru(t.shape[0], reserved=n_open) for t in self.kp_promo]
        # promotion: per layer, Key channel-plane vectors and Value pages (the open pages' slots reserved first)
        self.k_promo, self.v_promo, self.k_slot, self.v_slot = [], [], [], []
        self._k_lru, self._v_lru = [], []
        for hk, hv in zip(self.hot_k, self.hot_v, strict=True):
            n_k, n_sealed = promotion_slots(spec, max_tokens, hk, hv, promotion_bytes // L, k_promotion_share)
            n_v = n_open + n_sealed
            self.k_promo.append(torch.zeros(n_k, self.max_slots, self.k_row, dtype=torch.uint8, device=dev))
            self.v_promo.append(torch.zeros(n_v, *v_page_shape(spec, w - hv), dtype=torch.uint8, device=dev))
            self.k_slot.append(torch.full((batch_size, hk_n, d, w - hk), -1, dtype=torch.int32))
            self.v_slot.append(torch.full((n0,), -1, dtype=torch.int32))
            self._v_lru.append(SlotLru(n_v, reserved=n_open))  # slots 0..n_open-1: the open pages
            self._k_lru.append(SlotLru(n_k))
        self.host = HostTier(spec.format_id, (16 << 30) if host_bytes is None else host_bytes,
                             placement.block_bytes, pinned=self.device.type == "cuda", spill=spill,
                             remote=remote)
        self.page_table = torch.full((batch_size, hk_n, 0), -1, dtype=torch.int64)
        self.lengths = torch.zeros((L, batch_size), dtype=torch.int64)
        self._free = list(range(n0 - 1, -1, -1))
        # k_zero_copy: Key channel-planes promoted by the device reading pinned host blocks in place (of k_promoted)
        self.counters = {"k_promoted": 0, "v_promoted": 0, "kp_promoted": 0, "k_evicted": 0, "v_evicted": 0,
                         "kp_evicted": 0, "sealed": 0, "k_zero_copy": 0}
        self._pin_deep_key_channels(key_channel_scores)

    # ---- shapes and bytes ----

    def bytes(self) -> TierBytes:
        def total(ts: list[torch.Tensor]) -> int:
            return sum(t.numel() for t in ts)

        pinned = self.pinned_bytes()
        return TierBytes(hot=total(self.k_hot) + total(self.v_hot), open=total(self.k_open),
                         promotion=total(self.k_promo) + total(self.v_promo) + total(self.kp_promo)
                         - total(self.k_open) - pinned, host=self.host.used_bytes, nvme=self.host.spilled_bytes,
                         remote=self.host.remote_only_bytes, pinned=pinned)

    def promoted_bytes(self) -> int:
        """Bytes of the promotion cache in use now: promoted Key channel-planes, sealed Value pages and sealed Key
        pages (the open pages' reserved slots not counted)."""
        n_open = self.batch_size * self.spec.n_kv_heads
        total = 0
        for layer in range(self.spec.n_layers):
            k_vec = self.k_promo[layer][0].numel() if self.k_promo[layer].shape[0] else 0
            v_page = self.v_promo[layer][0].numel()
            k_on = (self.k_slot[layer] >= 0) & (self.k_slot[layer] < self._k_lru[layer].n)  # pinned ones not counted
            total += int(k_on.sum()) * k_vec + int((self.v_slot[layer] >= n_open).sum()) * v_page
            total += int((self.kp_slot[layer] >= n_open).sum()) * self.kp_promo[layer][0].numel()
        return total

    @property
    def n_pages(self) -> int:
        return self.k_hot[0].shape[0]

    # ---- pages ----

    def _grow(self, need: int) -> None:
        old = self.n_pages
        new = min(max(2 * old, old + need), self.max_pages)
        if new - old < need:
            raise CacheFull(f"the hot pool holds {self.max_pages} pages ({self.hot_page_bytes} bytes each over every "
                            f"layer); {need} more are needed: raise its byte budget or lower the hot planes")
        for i in range(self.spec.n_layers):
            self.k_hot[i] = torch.cat([self.k_hot[i], self.k_hot[i].new_zeros((new - old, *self.k_hot[i].shape[1:]))])
            self.v_hot[i] = torch.cat([self.v_hot[i], self.v_hot[i].new_zeros((new - old, *self.v_hot[i].shape[1:]))])
            self.v_slot[i] = torch.cat([self.v_slot[i], torch.full((new - old,), -1, dtype=torch.int32)])
            self.kp_slot[i] = torch.cat([self.kp_slot[i], torch.full((new - old,), -1, dtype=torch.int32)])
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _ensure_pages(self, b: int, n_slots: int) -> None:
        if n_slots > self.max_slots:
            raise CacheFull(f"sequence {b} would hold {n_slots} pages; the cache was made for {self.max_tokens} "
                            f"tokens ({self.max_slots} pages)")
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
        """Release sequence b: its pages, open buffers, promotion slots and host-tier blocks."""
        pages = self.page_table[b][self.page_table[b] >= 0].unique()
        hk_n = self.spec.n_kv_heads
        for i in range(self.spec.n_layers):
            if pages.numel():
                idx = pages.to(self.device)
                self.k_hot[i][idx] = 0
                self.v_hot[i][idx] = 0
                for table, promo, lru in ((self.v_slot[i], self.v_promo[i], self._v_lru[i]),
                                          (self.kp_slot[i], self.kp_promo[i], self._kp_lru[i])):
                    held = table[pages].long()
                    held = held[held >= 0]
                    promo.index_fill_(0, held.to(promo.device), 0)
                    lru.release(held)  # the open pages' reserved slots are not the LRU's
                    table[pages] = -1
            held = self.k_slot[i][b]
            held = held[held >= 0].long()
            self.k_promo[i].index_fill_(0, held.to(self.k_promo[i].device), 0)
            self._k_lru[i].release(held)  # pinned slots (deep Key channels) are not the LRU's
            self.k_slot[i][b] = -1
            self.k_open[i][b * hk_n: (b + 1) * hk_n] = 0
            self.v_promo[i][b * hk_n: (b + 1) * hk_n] = 0
        self._free.extend(pages.tolist())
        self.page_table[b] = -1
        self.lengths[:, b] = 0
        self.host.drop_sequence(self.sequence_ids[b])
        self._pin_sequence(b)  # the deep Key channels' slots stay the sequence's (zeroed above)

    # ---- write path ----

    def length(self, layer: int, b: int) -> int:
        return int(self.lengths[layer, b])

    def check_format(self, format_id: str) -> None:
        if format_id != self.spec.format_id:
            raise FormatMismatch(f"cache holds format {self.spec.format_id}; the reader uses {format_id}."
                                 " Read it with the codec of the format it was written under")

    def append(self, layer: int, k_codes: torch.Tensor, v_codes: torch.Tensor, seq: int | None = None) -> None:
        """Append codes [B, Hkv, n, d] for every sequence (or [Hkv, n, d] for sequence ``seq``), as
        PlaneKVCache.append; a page that fills is sealed (its refinement planes go to the host tier)."""
        if seq is None:
            if k_codes.dim() != 4 or k_codes.shape[0] != self.batch_size:
                raise ValueError(f"expected codes [{self.batch_size}, Hkv, n, d], got {tuple(k_codes.shape)}")
            for b in range(self.batch_size):
                self.append(layer, k_codes[b], v_codes[b], seq=b)
            return
        spec = self.spec
        check_sequence_codes(spec, k_codes, v_codes)
        p = spec.page_size
        start, n = self.length(layer, seq), k_codes.shape[1]
        if n == 0:
            return
        self._ensure_pages(seq, -(-(start + n) // p))
        done = 0
        while done < n:  # page by page: a page that fills is sealed before the next one opens
            pos = start + done
            m = min(n - done, p - pos % p)
            self._write(layer, seq, pos, k_codes[:, done: done + m], v_codes[:, done: done + m])
            done += m
            self.lengths[layer, seq] += m
            if (pos + m) % p == 0:
                self._seal(layer, seq, (pos + m) // p - 1)

    def load_prefix(self, b: int, k_codes: torch.Tensor, v_codes: torch.Tensor) -> None:
        """Load a stored prefix (``planekv.tiering.prefix``) into the empty sequence ``b``: codes [L, Hkv, n, d] of
        every layer, n a whole number of pages. Each page is appended and sealed as a computed one would be: its
        hot planes in the hot pool, its refinement planes in the host tier (a copy), the most recent pages kept
        promoted while slots are free."""
        spec = self.spec
        if k_codes.dim() != 4 or k_codes.shape[0] != spec.n_layers or k_codes.shape != v_codes.shape:
            raise ValueError(f"expected K and V codes [{spec.n_layers}, Hkv, n, d] alike, got "
                             f"{tuple(k_codes.shape)} and {tuple(v_codes.shape)}")
        if k_codes.shape[2] % spec.page_size:
            raise ValueError(f"a prefix is whole pages of {spec.page_size} tokens, got {k_codes.shape[2]} tokens")
        if any(self.length(layer, b) for layer in range(spec.n_layers)):
            raise ValueError(f"sequence {b} is not empty: a prefix loads into an empty sequence")
        for layer in range(spec.n_layers):
            self.append(layer, k_codes[layer].to(self.device), v_codes[layer].to(self.device), seq=b)

    def _write(self, layer: int, b: int, pos: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """Tokens pos.. of one page of sequence b: hot planes to the hot pool, refinement planes to the open
        buffers and to every promoted Key channel-plane of the head."""
        spec, dev = self.spec, self.device
        w, p, hk_n = spec.width, spec.page_size, spec.n_kv_heads
        hk, hv = self.hot_k[layer], self.hot_v[layer]
        m = kc.shape[1]
        slot, off0 = pos // p, pos % p
        off = torch.arange(off0, off0 + m, device=dev)
        pages = self.page_table[b, :, slot].to(dev)[:, None].expand(hk_n, m)  # [Hkv, m]
        opened = torch.arange(b * hk_n, (b + 1) * hk_n, device=dev)[:, None].expand(hk_n, m)
        kbits = plane_bits(kc.to(dev), w)  # [Hkv, m, d, W]
        vbits = plane_bits(vc.to(dev), w)
        write_k_planes(self.k_hot[layer], pages, off, kbits[..., :hk])
        write_v_planes(self.v_hot[layer], pages, off, vbits[..., :hv], spec.v_run)
        if hk < w:
            write_k_planes(self.k_open[layer], opened, off, kbits[..., hk:])
            self.kp_slot[layer][self.page_table[b, :, slot]] = opened[:, 0].int().cpu()
            promoted = (self.k_slot[layer][b] >= 0).nonzero().tolist()  # (h, c, j - hk) of the head's promoted planes
            if promoted:
                idx = torch.tensor(promoted, device=dev)
                slots = self.k_slot[layer][b][idx[:, 0], idx[:, 1], idx[:, 2]].long().to(dev)
                bits = kbits[idx[:, 0], :, idx[:, 1], hk + idx[:, 2]]  # [promoted, m]
                flat = (slots[:, None] * self.max_slots + slot) * self.k_row + (off // 8)[None, :]
                vals = bits << (off % 8).to(torch.uint8)[None, :]
                self.k_promo[layer].view(-1).index_put_((flat.reshape(-1),), vals.reshape(-1), accumulate=True)
        if hv < w:
            write_v_planes(self.v_promo[layer], opened, off, vbits[..., hv:], spec.v_run)
            self.v_slot[layer][self.page_table[b, :, slot]] = opened[:, 0].int().cpu()

    def _seal(self, layer: int, b: int, slot: int) -> None:
        """Page ``slot`` of sequence b is full in ``layer``: its refinement planes go to the host tier; its Value
        and Key refinement planes stay promoted, in the least recently used slots (the most recent pages)."""
        w, hk_n = self.spec.width, self.spec.n_kv_heads
        hk, hv = self.hot_k[layer], self.hot_v[layer]
        seq = self.sequence_ids[b]
        pages = self.page_table[b, :, slot]  # [Hkv]
        opened = torch.arange(b * hk_n, (b + 1) * hk_n)  # [Hkv] the heads' open-page slots
        for kind, depth, promo, table, lru, evict in (
                ("k", hk, self.kp_promo[layer], self.kp_slot[layer], self._kp_lru[layer], self._evict_kp),
                ("v", hv, self.v_promo[layer], self.v_slot[layer], self._v_lru[layer], self._evict_v)):
            if depth == w:
                continue
            for h in range(hk_n):
                self.host.put_page((seq, kind, layer, h), slot, (depth, w), promo[b * hk_n + h])
            kept, slots, evicted = lru.take(pages)
            evict(layer, evicted)
            table[pages] = -1
            table[pages[kept]] = slots.to(table.dtype)
            dev_slots, dev_open = slots.to(promo.device), opened[kept].to(promo.device)
            promo.index_copy_(0, dev_slots, promo.index_select(0, dev_open))  # (index_put is slow on CPU)
            promo.index_fill_(0, opened.to(promo.device), 0)
        self.counters["sealed"] += 1

    def _evict_v(self, layer: int, pages: torch.Tensor) -> None:
        self.v_slot[layer][pages] = -1
        self.counters["v_evicted"] += pages.numel()

    def _evict_kp(self, layer: int, pages: torch.Tensor) -> None:
        self.kp_slot[layer][pages] = -1
        self.counters["kp_evicted"] += pages.numel()

    # ---- deep Key channels (PlacementPolicy.deep_key_channels) ----

    def _pin_deep_key_channels(self, scores: torch.Tensor | None) -> None:
        """Per layer and KV head, the ``share`` of Key channels with the highest ``scores`` [layers, KV heads, d]
        (higher = read deeper) get planes ``[h_K, h_K + extra)`` of every token pinned on the device: channel-plane
        slots past the promotion cache's LRU slots of ``k_promo[l]`` (``k_slot`` points at them, so the reads and
        the Triton kernels need nothing new), filled by every append (``_write`` writes each promoted
        channel-plane of the head) and never evicted. Their bytes are a budget of their own beside the promotion
        cache's (``TierBytes.pinned``): share x d x extra channel-planes of ``max_tokens`` tokens per (sequence, KV
        head, layer), what ``share x extra`` more hot planes would take. Which statistic ranks the channels is the
        caller's: the calibration's Key scale ``sigma_k`` (the static factor of the Key stage's importance
        ``a_c = sum (q~_c sigma_c)^2``; after the transform it is close to flat, and on SmolLM2 it picks the deep
        channels barely better than chance) or the reader's Key depths on some queries (e.g. the prefill's last ones;
        closer on SmolLM2). Neither made the option measure better there (BENCHMARKS.md, "Tiering")."""
        deep = self.placement.deep_key_channels
        spec = self.spec
        n_layers, hk_n, d = spec.n_layers, spec.n_kv_heads, spec.head_dim
        self.deep_k_channels: list[torch.Tensor] = [torch.zeros(hk_n, 0, dtype=torch.int64) for _ in range(n_layers)]
        self._k_pinned = [0] * n_layers  # pinned slots per layer, after the LRU's
        if deep is None:
            return
        if scores is None:
            raise ValueError("the placement has deep_key_channels but no key_channel_scores were given: pass "
                             "[layers, KV heads, d] scores (higher = read deeper), e.g. the calibration's sigma_k")
        scores = torch.as_tensor(scores).detach().float().cpu()
        if tuple(scores.shape) != (n_layers, hk_n, d) or not bool(torch.isfinite(scores).all()):
            raise ValueError(f"key_channel_scores must be finite [{n_layers}, {hk_n}, {d}] (layers, KV heads, d), got "
                             f"{tuple(scores.shape)}")
        n = deep.count(d)
        for layer in range(n_layers):
            if self.hot_k[layer] + deep.extra > spec.width:  # the policy checks this too
                raise ValueError(f"layer {layer}: h_K {self.hot_k[layer]} + {deep.extra} pinned planes exceed W")
            order = torch.sort(scores[layer], dim=-1, descending=True, stable=True).indices
            self.deep_k_channels[layer] = order[:, :n].sort(-1).values.contiguous()  # [Hkv, n]
            self._k_pinned[layer] = self.batch_size * hk_n * n * deep.extra
            promo = self.k_promo[layer]
            self.k_promo[layer] = torch.cat([promo, promo.new_zeros((self._k_pinned[layer], *promo.shape[1:]))])
        self.budgets["key_channel_scores"] = scores
        for b in range(self.batch_size):
            self._pin_sequence(b)

    def _pin_sequence(self, b: int) -> None:
        """Point sequence b's deep Key channel-planes at their pinned slots (its slots: a fixed range per layer)."""
        deep = self.placement.deep_key_channels
        if deep is None:
            return
        hk_n = self.spec.n_kv_heads
        for layer in range(self.spec.n_layers):
            chans = self.deep_k_channels[layer]  # [Hkv, n]
            n = chans.shape[1]
            base = self._k_lru[layer].n + b * hk_n * n * deep.extra
            slots = base + torch.arange(hk_n * n * deep.extra, dtype=torch.int32).view(hk_n, n, deep.extra)
            self.k_slot[layer][b, torch.arange(hk_n)[:, None], chans, :deep.extra] = slots

    def pinned_k_depth(self, layer: int) -> torch.Tensor:
        """[B, Hkv, d] int64: the Key depth each channel of ``layer`` has pinned (h_K + extra for a deep channel,
        else h_K); prefetch neither keeps nor brings the planes below it."""
        hk = self.hot_k[layer]
        out = torch.full((self.batch_size, self.spec.n_kv_heads, self.spec.head_dim), hk, dtype=torch.int64)
        deep = self.placement.deep_key_channels
        if deep is not None:
            chans = self.deep_k_channels[layer]
            out[:, torch.arange(chans.shape[0])[:, None], chans] = hk + deep.extra
        return out

    def pinned_bytes(self) -> int:
        """Device bytes of the deep Key channels' pinned channel-planes over every layer (0 without them)."""
        return sum(n * self.max_slots * self.k_row for n in self._k_pinned)

    # ---- promotion ----

    def promotion_slots(self, layer: int) -> tuple[int, int]:
        """How many Key channel-planes and sealed Value pages ``layer``'s promotion cache holds."""
        return self._k_lru[layer].n, self.v_promo[layer].shape[0] - self.batch_size * self.spec.n_kv_heads

    def promote_values(self, layer: int, pages: Items) -> int:
        """Bring the refinement planes of sealed Value pages (sequence b, KV head h, page slot s; a list of tuples or
        an [n, 3] tensor) back to the device; returns how many were brought. Resident ones are touched first, in
        the order given, then missing ones take the least recently used slots (:meth:`_touch_and_take`)."""
        n = self._promote_pages(layer, pages, "v")
        self.counters["v_promoted"] += n
        return n

    def key_page_slots(self, layer: int) -> int:
        """How many sealed Key pages ``layer``'s Key page slots hold."""
        return self.kp_promo[layer].shape[0] - self.batch_size * self.spec.n_kv_heads

    def promote_key_pages(self, layer: int, pages: Items) -> int:
        """Bring every channel's refinement planes of sealed Key pages (sequence b, KV head h, page slot s; a list
        of tuples or an [n, 3] tensor) back to the device for Key refinement, as :meth:`promote_values` brings
        Value pages; returns how many were brought."""
        n = self._promote_pages(layer, pages, "k")
        self.counters["kp_promoted"] += n
        return n

    def _promote_pages(self, layer: int, pages: Items, kind: str) -> int:
        """Sealed pages' refinement planes from the host tier into their slots: Value pages (``kind`` "v": v_promo,
        v_slot) or Key pages ("k": kp_promo, kp_slot); returns how many were brought. Pages that do not exist or
        are open (always resident) are skipped; the rest as :meth:`_touch_and_take` says."""
        if kind == "v":
            hot, lru, table, promo, evict = self.hot_v[layer], self._v_lru[layer], self.v_slot[layer], \
                self.v_promo[layer], self._evict_v
        else:
            hot, lru, table, promo, evict = self.hot_k[layer], self._kp_lru[layer], self.kp_slot[layer], \
                self.kp_promo[layer], self._evict_kp
        items = _as_items(pages, 3)  # [n, 3] (b, h, s)
        if hot == self.spec.width or not items.shape[0]:
            return 0
        b, h, s = items.unbind(1)
        in_table = s < self.page_table.shape[2]
        page = torch.full_like(s, -1)
        page[in_table] = self.page_table[b[in_table], h[in_table], s[in_table]]
        sealed = s < self.lengths[layer][b] // self.spec.page_size
        ok = (page >= 0) & sealed
        items, page = items[ok], page[ok]
        taken, slots, evicted = self._touch_and_take(lru, page, table[page].long())
        evict(layer, evicted)
        table[page[taken]] = slots.to(table.dtype)
        fill = items[taken].tolist()
        if fill:  # the pages gathered on the host, then one copy to the device
            data = torch.stack([self.host.page((self.sequence_ids[b], kind, layer, h), s) for b, h, s in fill])
            promo.index_copy_(0, slots.to(promo.device), data.to(self.device).view(len(fill), *promo.shape[1:]))
        return len(fill)

    @staticmethod
    def _touch_and_take(lru: SlotLru, owners: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """owners [n] (the LRU's encoding of the items asked for, in order), current [n] their slots (-1: not
        resident) -> (taken [n] bool: brought now, slots [k] theirs, evicted owners). An item listed twice counts
        once, at its first place; resident items are touched first, in order; then missing ones take the least
        recently used slots in order (with more than the LRU holds, the last ones keep theirs)."""
        once = first_occurrences(owners)
        resident = once & (current >= 0)
        lru.touch(current[resident])
        missing = once & (current < 0)
        kept, slots, evicted = lru.take(owners[missing])
        taken = torch.zeros_like(once)
        taken[missing.nonzero().flatten()[kept]] = True
        return taken, slots, evicted

    def promote_keys(self, layer: int, planes: Items) -> int:
        """Bring Key channel-planes (sequence b, KV head h, channel c, plane j >= h_K; a list of tuples or an [n, 4]
        tensor) back to the device, over every page of the head; returns how many were brought. Resident ones are
        touched first, in the order given, then missing ones take the least recently used slots
        (:meth:`_touch_and_take`); a (sequence, KV head)'s pages are read from the host tier once for all of its
        channel-planes, and every plane brought goes to the device in one copy (:meth:`_k_vectors`)."""
        hk, w = self.hot_k[layer], self.spec.width
        items = _as_items(planes, 4)  # [n, 4] (b, h, c, j)
        if not items.shape[0]:
            return 0
        bad = (items[:, 3] < hk) | (items[:, 3] >= w)
        if bool(bad.any()):
            j = int(items[bad.nonzero()[0, 0], 3])
            raise ValueError(f"plane {j} of layer {layer} is not a refinement plane (hot: {hk}, W: {w})")
        table = self.k_slot[layer]  # [B, Hkv, d, W - h_K]
        flat = self._k_owner(layer, items)  # [n] index into table
        taken, slots, evicted = self._touch_and_take(self._k_lru[layer], flat, table.view(-1)[flat].long())
        table.view(-1)[evicted] = -1
        self.counters["k_evicted"] += evicted.numel()
        table.view(-1)[flat[taken]] = slots.to(table.dtype)
        fill = items[taken]
        if fill.shape[0]:
            self._fill_k_slots(layer, fill, slots)
        self.counters["k_promoted"] += fill.shape[0]
        return fill.shape[0]

    def _fill_k_slots(self, layer: int, items: torch.Tensor, slots: torch.Tensor) -> None:
        """``k_promo[layer][slots[i]]`` = the vector of ``items[i]`` (b, h, c, j) (:meth:`_k_vectors`). With
        ``zero_copy`` the device reads the rows of sealed pages from the host tier's pinned blocks in place
        (:meth:`HostTier.row_addresses`, ``planekv.kernels.host_gather``); items with a page out of memory (spilled,
        remote) and every item without ``zero_copy`` go through a host gather and one copy."""
        promo = self.k_promo[layer]
        dev = promo.device
        slots = slots.to(torch.int64)
        on_host = torch.ones(items.shape[0], dtype=torch.bool)  # [n] gathered on the host
        if self.zero_copy:
            from ..kernels.host_gather import gather_rows  # Triton: imported where a promotion runs on the device

            holds: list[torch.Tensor] = []
            table, on_host = self._k_row_table(layer, items, holds)
            direct = (~on_host).nonzero().flatten()
            if direct.numel():
                gather_rows(table[direct].to(dev), slots[direct].to(dev), promo)
                opened = self._open_k_rows(layer, items[direct])
                if opened is not None:
                    idx, page, rows = opened
                    promo[slots[direct][idx].to(dev), page.to(dev)] = rows.to(dev)
                self._hold(layer, holds)
                self.counters["k_zero_copy"] += direct.numel()
        if bool(on_host.any()):
            rest = on_host.nonzero().flatten()
            promo.index_copy_(0, slots[rest].to(dev), self._k_vectors(layer, items[rest]))

    def _hold(self, layer: int, holds: list[torch.Tensor]) -> None:
        """Keep the host blocks a zero-copy gather of ``layer`` reads until the device has passed it (an event on
        CUDA); the previous gather's are let go once its event has completed."""
        prev = self._gather_holds.pop(layer, None)
        if prev is not None and prev[0] is not None:
            prev[0].synchronize()
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._gather_holds[layer] = (event, holds)

    def _k_groups(self, layer: int, items: torch.Tensor) -> list[tuple[int, int, int, np.ndarray]]:
        """items [n, 4] (b, h, c, j) grouped by (sequence, KV head): (b, h, sealed pages of b, the items' indices)."""
        hk_n = self.spec.n_kv_heads
        it = items.cpu().numpy()
        head = it[:, 0] * hk_n + it[:, 1]  # [n] the (b, h) of each item
        order = np.argsort(head, kind="stable")
        heads, starts = np.unique(head[order], return_index=True)
        sealed_of = (self.lengths[layer] // self.spec.page_size).numpy()  # [B]
        ends = list(starts[1:]) + [len(order)]
        return [(hb // hk_n, hb % hk_n, int(sealed_of[hb // hk_n]), order[lo:hi])
                for hb, lo, hi in zip(heads.tolist(), starts.tolist(), ends, strict=True)]

    def _k_rows(self, layer: int, items: torch.Tensor) -> np.ndarray:
        """items [n, 4] -> [n] each item's row of a K page in the host tier ([W - h_K, d, P/8]: (plane, channel))."""
        it = items.cpu().numpy()
        return (it[:, 3] - self.hot_k[layer]) * self.spec.head_dim + it[:, 2]

    def _k_row_table(self, layer: int, items: torch.Tensor,
                     holds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """For items [n, 4]: the host address of each sealed page's row, [n, max_slots] int64 (0: no sealed page
        there), and which items have a page out of memory ([n] bool: to gather on the host instead)."""
        table = np.zeros((items.shape[0], self.max_slots), dtype=np.int64)
        on_host = np.zeros(items.shape[0], dtype=bool)
        row = self._k_rows(layer, items)
        for b, h, sealed, mine in self._k_groups(layer, items):
            if not sealed:
                continue
            addr = self.host.row_addresses((self.sequence_ids[b], "k", layer, h), sealed, row[mine], self.k_row,
                                           holds)
            if addr is None:
                on_host[mine] = True
            else:
                table[mine, :sealed] = addr
        return torch.from_numpy(table), torch.from_numpy(on_host)

    def _open_k_rows(self, layer: int, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The open pages' rows of items [n, 4] whose sequence has one: (their indices [m], the open page's slot
        [m], its rows [m, P/8] on the device where they live); None if no item's sequence has an open page."""
        p, hk_n = self.spec.page_size, self.spec.n_kv_heads
        lengths = self.lengths[layer][items[:, 0]]  # [n]
        idx = (lengths % p).nonzero().flatten()
        if not idx.numel():
            return None
        b, h, c, j = items[idx].unbind(1)
        dev = self.k_open[layer].device
        rows = self.k_open[layer][(b * hk_n + h).to(dev), (j - self.hot_k[layer]).to(dev), c.to(dev)]  # [m, P/8]
        return idx, lengths[idx] // p, rows

    def _k_owner(self, layer: int, items: torch.Tensor) -> torch.Tensor:
        """items [n, 4] (b, h, c, j) -> [n] their flat index into ``k_slot[layer]`` (the Key LRU's owner ids)."""
        _, hk_n, d, planes = self.k_slot[layer].shape
        b, h, c, j = items.unbind(1)
        return ((b * hk_n + h) * d + c) * planes + (j - self.hot_k[layer])

    def _k_vectors(self, layer: int, items: torch.Tensor) -> torch.Tensor:
        """Plane j of channel c over every page of (b, h), for each of ``items`` [n, 4] (b, h, c, j): [n, max_slots,
        P/8] on the device. Sealed pages' rows come from the host tier (:meth:`HostTier.gather_rows`, one call per
        (b, h) for all of its items) into one staging buffer (pinned on CUDA hosts) that goes to the device in one
        copy; the open pages' rows are gathered on the device, where they live."""
        n = items.shape[0]
        cuda = self.device.type == "cuda"
        staged = torch.zeros(n, self.max_slots, self.k_row, dtype=torch.uint8, pin_memory=cuda)
        out_np = staged.numpy()
        row = self._k_rows(layer, items)
        for b, h, sealed, mine in self._k_groups(layer, items):
            if sealed:
                self.host.gather_rows((self.sequence_ids[b], "k", layer, h), sealed, row[mine], self.k_row, out_np,
                                      mine)
        out = staged.to(self.device, non_blocking=cuda)
        opened = self._open_k_rows(layer, items)
        if opened is not None:
            idx, page, rows = opened
            out[idx.to(out.device), page.to(out.device)] = rows.to(out.device)
        return out

    # ---- residency and reads ----

    def residency(self, layer: int) -> Residency:
        """What ``layer`` can read now: per Key channel, the hot planes and the promoted ones that follow them, or W
        where every page of the head (``length(layer, b)`` tokens) has its Key page on the device (open or in a Key
        page slot), whichever is deeper; per Value page and per Key page, W if its refinement planes are on the
        device (promoted, or the open page), else h_V / h_K."""
        hk, hv, w = self.hot_k[layer], self.hot_v[layer], self.spec.width
        p = self.spec.page_size
        promoted = (self.k_slot[layer] >= 0).long()  # [B, Hkv, d, W - hk]
        k_depth = (hk + promoted.cumprod(-1).sum(-1)).to(torch.int64)
        pt = self.page_table
        on = torch.where(pt >= 0, self.v_slot[layer][pt.clamp_min(0)].long(), -1) >= 0
        v_depth = torch.where(on, w, hv).to(torch.int64)
        k_on = torch.where(pt >= 0, self.kp_slot[layer][pt.clamp_min(0)].long(), -1) >= 0
        k_page = torch.where(k_on, w, hk).to(torch.int64)  # [B, Hkv, slots]
        for b in range(self.batch_size):  # a channel is also readable to the depth every Key page of its head has
            n = -(-self.length(layer, b) // p)
            if n:
                k_depth[b] = torch.maximum(k_depth[b], k_page[b, :, :n].min(1).values[:, None])
        return Residency(k_depth, v_depth, k_page)

    def pools(self, layer: int) -> TieredPools:
        """``layer``'s device tensors as the Triton reader takes them (the slot tables copied to the device)."""
        dev = self.device
        return TieredPools(
            hot_k=self.hot_k[layer], hot_v=self.hot_v[layer], k_hot=self.k_hot[layer], v_hot=self.v_hot[layer],
            k_promo=self.k_promo[layer], k_slot=self.k_slot[layer].to(dev).contiguous(),
            k_max=self.residency(layer).k_depth.to(device=dev, dtype=torch.int32),
            v_promo=self.v_promo[layer], v_slot=self.v_slot[layer].to(dev).contiguous(),
            kp_promo=self.kp_promo[layer], kp_slot=self.kp_slot[layer].to(dev).contiguous())

    def _k_pages(self, layer: int, b: int, top: int, depth: torch.Tensor) -> torch.Tensor:
        """The head's K pages with planes 0..top-1 assembled: [Hkv, slots, top, d, P/8] (refinement planes from
        the Key page slots where a page has one, else from the promoted channel-planes; a depth past the
        residency refused). ``depth``: [Hkv, d] per channel, or [Hkv, T, d] per token."""
        spec, hk, p = self.spec, self.hot_k[layer], self.spec.page_size
        t = self.length(layer, b)
        res = self.residency(layer)
        lim = res.k_depth[b]  # [Hkv, d]
        page_lim = res.k_token_depth(b, t, p)  # [Hkv, T]
        if depth.dim() == 3:
            lim = torch.maximum(lim[:, None, :], page_lim[:, :, None])  # [Hkv, T, d]
        elif t:  # a channel is also readable to the depth every Key page of its head has
            lim = torch.maximum(lim, page_lim.min(1).values[:, None])
        if bool((depth.cpu() > lim).any()):
            raise PlaneKVError(f"layer {layer}, sequence {b}: a Key depth past its residency was asked for (the "
                               "tiered read caps at the resident depth; promote the planes first)")
        n_slots = -(-t // p)
        pages = self.page_table[b, :, :n_slots].to(self.device)
        raw = torch.zeros(spec.n_kv_heads, n_slots, top, spec.head_dim, self.k_row, dtype=torch.uint8,
                          device=self.device)
        raw[:, :, : min(top, hk)] = self.k_hot[layer][pages][:, :, : min(top, hk)]
        if top > hk:
            slots = self.k_slot[layer][b][:, :, : top - hk]  # [Hkv, d, top - hk]
            on = slots >= 0
            # [Hkv, d, j, slots, P/8]
            vec = self.k_promo[layer][slots.clamp_min(0).long().to(self.device)][:, :, :, :n_slots]
            vec = vec * on.to(self.device)[..., None, None]
            raw[:, :, hk:] = vec.permute(0, 3, 2, 1, 4)
            kp = self.kp_slot[layer][pages.cpu()].long()  # [Hkv, slots]: every channel's planes of a Key page
            whole = (kp >= 0).to(self.device)[..., None, None, None]
            raw[:, :, hk:] = torch.where(whole, self.kp_promo[layer][kp.clamp_min(0).to(self.device)][:, :, : top - hk],
                                         raw[:, :, hk:])
        return raw

    def read_k(self, layer: int, b: int, depth: torch.Tensor | int) -> torch.Tensor:
        """Key code prefixes [Hkv, T, d] of sequence b, as PlaneKVCache.read_k (depths within the residency):
        ``depth`` per channel [Hkv, d] (or an int), or per token and channel [Hkv, T, d] (Key refinement: a
        token of a promoted or open Key page reads to W in every channel)."""
        spec = self.spec
        t = self.length(layer, b)
        depth_t = torch.as_tensor(depth, device=self.device)
        if depth_t.dim() != 3:
            depth_t = depth_t.expand(spec.n_kv_heads, spec.head_dim)
        top = int(depth_t.max()) if depth_t.numel() else 0
        if top == 0 or t == 0:
            return torch.zeros((spec.n_kv_heads, t, spec.head_dim), dtype=torch.uint8, device=self.device)
        bits = unpack_bits(self._k_pages(layer, b, top, depth_t))  # [Hkv, slots, top, d, P]
        if depth_t.dim() == 3:  # per token: [Hkv, T, top, d]
            bits = bits.permute(0, 1, 4, 2, 3).reshape(spec.n_kv_heads, -1, top, spec.head_dim)[:, :t]
            keep = torch.arange(top, device=self.device)[None, None, :, None] < depth_t[:, :, None, :]
            codes = _planes_to_codes((bits * keep.to(torch.uint8)).permute(2, 0, 1, 3), spec.width)
            return codes  # [Hkv, T, d]
        keep = torch.arange(top, device=self.device)[None, :, None] < depth_t[:, None, :]
        bits = bits * keep[:, None, :, :, None].to(torch.uint8)
        codes = _planes_to_codes(bits.permute(2, 0, 1, 4, 3), spec.width)  # [Hkv, slots, P, d]
        return codes.reshape(spec.n_kv_heads, -1, spec.head_dim)[:, :t]

    def read_v(self, layer: int, b: int, depth: torch.Tensor | int) -> torch.Tensor:
        """Value code prefixes of sequence b, as PlaneKVCache.read_v (depths within the residency)."""
        spec = self.spec
        hk_n, d, p, hv, w = spec.n_kv_heads, spec.head_dim, spec.page_size, self.hot_v[layer], spec.width
        t = self.length(layer, b)
        depth_t = torch.as_tensor(depth, device=self.device).expand(hk_n, t)
        top = int(depth_t.max()) if depth_t.numel() else 0
        if top == 0 or t == 0:
            return torch.zeros((hk_n, t, d), dtype=torch.uint8, device=self.device)
        if bool((depth_t.cpu() > self.residency(layer).v_depth(b, t, p)).any()):
            raise PlaneKVError(f"layer {layer}, sequence {b}: a Value depth past its residency was asked for (the "
                               "tiered read caps at the resident depth; promote the pages first)")
        n_slots = -(-t // p)
        pages = self.page_table[b, :, :n_slots]
        raw = torch.zeros(hk_n, n_slots, w, p, self.v_row, dtype=torch.uint8, device=self.device)
        raw[:, :, :hv] = v_planes(self.v_hot[layer][pages.to(self.device)], spec.v_run)
        if hv < w:
            slots = self.v_slot[layer][pages.clamp_min(0)].long()  # [Hkv, slots]
            on = (slots >= 0).to(self.device)
            cold = v_planes(self.v_promo[layer][slots.clamp_min(0).to(self.device)], spec.v_run)
            raw[:, :, hv:] = cold * on[..., None, None, None]
        raw = raw[:, :, :top]
        bits = unpack_bits(raw).permute(0, 1, 3, 2, 4).reshape(hk_n, -1, top, d)[:, :t]  # [Hkv, T, top, d]
        keep = torch.arange(top, device=self.device)[None, None, :] < depth_t[:, :, None]
        bits = bits * keep[..., None].to(torch.uint8)
        return _planes_to_codes(bits.permute(2, 0, 1, 3), spec.width)

    def physical_read_bytes(self, layer: int, b: int, k_depth: torch.Tensor, v_depth: torch.Tensor,
                            k_refined: torch.Tensor | None = None) -> int:
        """Bytes a read at these depths touches, counted from the layout as PlaneKVCache counts them."""
        p = self.spec.page_size
        n_slots = -(-self.length(layer, b) // p)
        return int(k_depth.sum()) * n_slots * self.k_row + int(v_depth.sum()) * self.v_row
