"""Prefix reuse (docs/TIERING.md, "Prefix reuse"): whole sealed pages of a prompt prefix, found by a chained hash.

The key of page i of a sequence is ``blake2b(key of page i - 1 | token ids of page i)``, the chain starting from a
root that hashes the ``FormatSpec.format_id`` and a *producer* string (what else decided the codes: for the
transformers cache, the prefill's read mode, reader, read policy and tiering; ``planekv.models.hf``). The key of
page i therefore names the tokens of pages 0..i, the format and the producer; a different format (another
calibration, W, page size, codebook, layout) or producer never matches. As in vLLM's and LMCache's prefix caches,
only whole pages are keyed; a prefix shorter than a page has no key.

:class:`PrefixIndex` is the in-process form: per key it keeps a **copy** of the page as a
:class:`~planekv.kvstore.PlaneKVCache` pool holds it (:class:`PrefixPage`: the packed bit planes of every layer and
KV head, all W of them, host memory), not references to the hot pool or host-tier blocks of the cache that made
them, so an entry outlives that cache's sequence (freed, its blocks deleted). It is bounded (``capacity_bytes``;
least recently used pages go first). Loading pages into a PlaneKVCache (:func:`load_pages`) copies their planes
into pool pages: no code is packed again. A TieredCache still takes their codes (``TieredCache.load_prefix``): the
page's hot planes go to the hot pool and, once it seals, its refinement planes to that cache's host tier, as any
appended page's (a copy of the refinement planes too, not a shared block). A page is published once per key; a
later publisher of the same key leaves it as it is.

Another process or worker finds the pages through a remote tier (``PrefixIndex(remote=..., spec=...)``, e.g. the
store service): each page is two frames there (K and V planes), keyed by the format and the page key, each payload
headed by :data:`BLOB_MAGIC` and a layout version (:data:`BLOB_VERSION`); a payload of another layout (the bare codes
of version 1, which had no header) is refused (:class:`PrefixLayoutError`), never reinterpreted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kvstore import FormatSpec, PlaneKVCache
from ..kvstore.errors import FormatMismatch
from ..kvstore.planes import _planes_to_codes, pack_bits, plane_bits, unpack_bits, v_page_shape, v_planes
from .errors import BlockCorrupt
from .frame import BlockKey, decode_frame, encode_frame
from .remote_tier import RemoteTier
from .replace import stored_codes
from .tiered_cache import TieredCache

log = logging.getLogger(__name__)

DIGEST_BYTES = 16  # blake2b-128: collisions are not a concern at the numbers of pages an index holds
# A remote frame's payload: BLOB_MAGIC, one byte of layout version, then the page's packed planes (K or V, every
# layer and KV head). Version 1 (never marked: the bare codes [L, Hkv, P, d]) and any other version are refused.
BLOB_MAGIC = b"PKVPFX"
BLOB_VERSION = 2
BLOB_HEADER_BYTES = len(BLOB_MAGIC) + 1

PageCache = PlaneKVCache | TieredCache


def prefix_root(format_id: str, producer: str = "") -> bytes:
    """The chain's root: a hash of the format and of the producer (what else decided the codes; "" for none)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"planekv-prefix")
    h.update(format_id.encode())
    h.update(b"\0")
    h.update(producer.encode())
    return h.digest()


def page_keys(root: bytes, token_ids: Sequence[int] | torch.Tensor, page_size: int) -> list[bytes]:
    """Keys of the whole pages of ``token_ids`` (len(token_ids) // page_size of them): key i = hash(key i - 1,
    token ids of page i) with key -1 = ``root``. Token ids are hashed as little-endian int64."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).cpu()
    keys, parent = [], root
    for i in range(ids.numel() // page_size):
        h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(ids[i * page_size: (i + 1) * page_size].numpy().astype("<i8").tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixLayoutError(BlockCorrupt):
    """A stored prefix blob of another layout (version) than this reader's: refused, never reinterpreted."""


def page_shapes(spec: FormatSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a :class:`PrefixPage`'s K and V planes for ``spec``: [L, Hkv, W, d, P/8] and
    [L, Hkv, *V page] (the V page in the format's layout, ``planekv.kvstore.planes.v_page_shape``)."""
    lead = (spec.n_layers, spec.n_kv_heads)
    return (*lead, spec.width, spec.head_dim, spec.page_size // 8), (*lead, *v_page_shape(spec))


def page_nbytes(spec: FormatSpec) -> int:
    """Bytes of one :class:`PrefixPage` of ``spec`` (K and V planes, every layer)."""
    k, v = page_shapes(spec)
    return math.prod(k) + math.prod(v)


@dataclass(frozen=True)
class PrefixPage:
    """One page's K and V in the layout of a :class:`~planekv.kvstore.PlaneKVCache` page (the bit planes a pool
    holds, all W of them), for every layer and KV head: k [L, Hkv, W, d, P/8], v [L, Hkv, W, P, d/8] (with
    ``v_run`` = g > 1, [L, Hkv, W/g, P, g, d/8]); uint8, host memory, of format ``format_id``. Loading it into a
    cache is a copy of these planes (:func:`load_pages`), not a re-pack of codes."""

    format_id: str
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() + self.v.numel()

    @classmethod
    def from_codes(cls, spec: FormatSpec, k_codes: torch.Tensor, v_codes: torch.Tensor) -> PrefixPage:
        """The page of codes k/v [L, Hkv, P, d] (uint8) of format ``spec``."""
        if k_codes.dim() != 4 or k_codes.shape[2] != spec.page_size or k_codes.shape != v_codes.shape:
            raise ValueError(f"a page's codes are K and V [L, Hkv, {spec.page_size}, d] alike, got "
                             f"{tuple(k_codes.shape)} and {tuple(v_codes.shape)}")
        k, v = pack_pages(spec, k_codes.cpu(), v_codes.cpu())
        return cls(spec.format_id, k[:, :, 0], v[:, :, 0])

    def codes(self, spec: FormatSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The page's codes: K, V [L, Hkv, P, d] uint8."""
        _check_page(spec, self)
        k, v = unpack_pages(spec, self.k[:, :, None], self.v[:, :, None])
        return k, v


def pack_pages(spec: FormatSpec, k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [..., n * P, d] -> pages in the pool's layout: K [..., n, W, d, P/8], V [..., n, *V page]."""
    w, p, d, g = spec.width, spec.page_size, spec.head_dim, spec.v_run
    lead = k_codes.shape[:-2]
    n = k_codes.shape[-2] // p
    kc = k_codes.reshape(*lead, n, p, d)
    vc = v_codes.reshape(*lead, n, p, d)
    k = pack_bits(plane_bits(kc, w).movedim(-1, -3).transpose(-1, -2))  # [..., n, W, d, P] -> [..., n, W, d, P/8]
    v = pack_bits(plane_bits(vc, w).movedim(-1, -3))  # [..., n, W, P, d] -> [..., n, W, P, d/8]
    if g > 1:
        v = v.reshape(*v.shape[:-3], w // g, g, p, d // 8).transpose(-3, -2)
    return k.contiguous(), v.contiguous()


def unpack_pages(spec: FormatSpec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_pages`: pages K [..., n, W, d, P/8], V [..., n, *V page] -> codes [..., n * P, d]."""
    w, d = spec.width, spec.head_dim
    kb = unpack_bits(k)  # [..., n, W, d, P]
    kc = _planes_to_codes(kb.movedim(-3, 0), w).transpose(-1, -2)  # [..., n, P, d]
    vb = unpack_bits(v_planes(v, spec.v_run))  # [..., n, W, P, d]
    vc = _planes_to_codes(vb.movedim(-3, 0), w)
    lead = kc.shape[:-3]
    return kc.reshape(*lead, -1, d), vc.reshape(*lead, -1, d)


@dataclass
class PrefixStats:
    """Pages asked for and found by :meth:`PrefixIndex.match`, stored, evicted to stay bounded, and the remote
    tier's part."""

    hits: int = 0  # pages found (leading pages of a lookup)
    misses: int = 0  # lookups that stopped before their last whole page
    published: int = 0
    evicted: int = 0
    remote_written: int = 0  # pages written to the remote tier
    remote_failed: int = 0  # pages the remote tier did not take (kept here only)
    remote_hits: int = 0  # pages found at the remote tier (missing here)
    remote_rejected: int = 0  # remote frames refused (corrupt, wrong key or format, unreadable): misses


class PrefixIndex:
    """Page key -> the page's codes, in process memory, bounded by ``capacity_bytes`` (LRU). Thread-safe.

    A miss is ``None`` / a shorter match, never an exception; a page of another format is refused on ``put``
    (``FormatMismatch``) when the index is made for one format (``format_id``, or ``spec``).

    With ``remote`` (a :class:`~planekv.tiering.RemoteTier`, e.g. the store service's ``StoreRemoteTier``) the index
    is shared with other processes and workers: ``put`` also writes the page there (synchronously; a failure is
    logged and counted, the local copy stays) as two frames, K and V, under :func:`remote_block_key` (the format id
    is in the key and in the frame: a page of another format is never read), and ``match`` fetches a page missing
    here from it (the frame verified against its key; a corrupt, wrong or unreadable frame is a miss, counted).
    A remote index is for one format: ``spec`` gives its pages' shape."""

    def __init__(self, capacity_bytes: int = 1 << 30, format_id: str | None = None,
                 remote: RemoteTier | None = None, spec: FormatSpec | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if remote is not None and spec is None:
            raise ValueError("a prefix index over a remote tier is for one format: pass its FormatSpec (spec=)")
        if spec is not None:
            if format_id is not None and format_id != spec.format_id:
                raise FormatMismatch(f"format_id {format_id} is not the spec's format {spec.format_id}")
            format_id = spec.format_id
        self.capacity_bytes = capacity_bytes
        self.format_id = format_id
        self.spec = spec
        self.remote = remote
        self.stats = PrefixStats()
        self._pages: OrderedDict[bytes, PrefixPage] = OrderedDict()  # least recently used first
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pages

    def get(self, key: bytes) -> PrefixPage | None:
        with self._lock:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
            return page

    def put(self, key: bytes, page: PrefixPage) -> bool:
        """Store ``page`` under ``key`` unless it is there (pages are immutable: the first one stays); least
        recently used pages are evicted to make room; with a remote tier, write it there too. False when it was
        there already (here) or is larger than the index."""
        if self.format_id is not None and page.format_id != self.format_id:
            raise FormatMismatch(f"prefix index holds format {self.format_id}, the page is of {page.format_id}")
        if not self._keep(key, page):
            return False
        with self._lock:
            self.stats.published += 1
        if self.remote is not None:
            self._write_remote(key, page)
        return True

    def _keep(self, key: bytes, page: PrefixPage) -> bool:
        """Hold ``page`` here (False: it was here, or it is larger than the index)."""
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return False
            if page.nbytes > self.capacity_bytes:
                return False
            while self._used + page.nbytes > self.capacity_bytes:
                _, old = self._pages.popitem(last=False)
                self._used -= old.nbytes
                self.stats.evicted += 1
            self._pages[key] = page
            self._used += page.nbytes
            return True

    def remove(self, key: bytes) -> None:
        """Forget ``key`` here (a remote copy stays: other processes may be reading it)."""
        with self._lock:
            page = self._pages.pop(key, None)
            if page is not None:
                self._used -= page.nbytes

    def match(self, keys: Sequence[bytes], format_id: str) -> list[PrefixPage]:
        """The stored pages of the longest leading run of ``keys`` (whole pages, in order) of format ``format_id``
        (here, else fetched from the remote tier and kept here). Another format than the index's matches
        nothing."""
        out: list[PrefixPage] = []
        if self.format_id is None or format_id == self.format_id:
            for key in keys:
                page = self.get(key)
                if page is None and self.remote is not None:
                    page = self._read_remote(key)
                    if page is not None:
                        self._keep(key, page)
                if page is None or page.format_id != format_id:
                    break
                out.append(page)
        with self._lock:
            self.stats.hits += len(out)
            self.stats.misses += int(len(out) < len(keys))
        return out

    def _write_remote(self, key: bytes, page: PrefixPage) -> None:
        assert self.remote is not None
        try:
            for kind, planes in (("k", page.k), ("v", page.v)):
                payload = encode_page_blob(planes)
                self.remote.put_frame(encode_frame(remote_block_key(page.format_id, key, kind), payload))
        except Exception as exc:  # the local copy serves this process; the others miss and prefill
            log.warning("prefix page %s not written to the remote tier: %s: %s", key.hex(), type(exc).__name__, exc)
            with self._lock:
                self.stats.remote_failed += 1
            return
        with self._lock:
            self.stats.remote_written += 1

    def _read_remote(self, key: bytes) -> PrefixPage | None:
        assert self.remote is not None and self.spec is not None
        spec = self.spec
        planes = []
        for kind, shape in zip(("k", "v"), page_shapes(spec), strict=True):
            bk = remote_block_key(spec.format_id, key, kind)
            try:
                frame = self.remote.get_frame(bk)
                if frame is None:
                    return None
                _, payload = decode_frame(frame, bk)
                planes.append(decode_page_blob(payload, shape, str(bk)))
            except Exception as exc:  # a miss, never wrong codes: the suffix is prefilled instead
                log.warning("prefix page %s not read from the remote tier: %s: %s", key.hex(), type(exc).__name__,
                            exc)
                with self._lock:
                    self.stats.remote_rejected += 1
                return None
        with self._lock:
            self.stats.remote_hits += 1
        return PrefixPage(spec.format_id, planes[0], planes[1])


def encode_page_blob(planes: torch.Tensor) -> bytes:
    """A remote frame's payload for a page's K or V planes: :data:`BLOB_MAGIC`, :data:`BLOB_VERSION`, the bytes."""
    return BLOB_MAGIC + bytes([BLOB_VERSION]) + planes.contiguous().numpy().tobytes()


def decode_page_blob(payload: bytes | bytearray | memoryview, shape: tuple[int, ...], what: str = "") -> torch.Tensor:
    """The planes [``shape``] uint8 of a payload written by :func:`encode_page_blob`. A payload of another layout
    version (version 1, the bare codes, carries no header) raises :class:`PrefixLayoutError`; one of the wrong
    size ``BlockCorrupt``."""
    buf = memoryview(payload).cast("B")
    head = bytes(buf[:BLOB_HEADER_BYTES])
    if head[:len(BLOB_MAGIC)] != BLOB_MAGIC:
        raise PrefixLayoutError(f"prefix blob {what} is not of layout version {BLOB_VERSION} (no {BLOB_MAGIC!r} "
                                "header: an older PlaneKV wrote its codes, layout version 1); it is refused, not "
                                "reinterpreted: republish the prefix")
    if head[-1] != BLOB_VERSION:
        raise PrefixLayoutError(f"prefix blob {what} has layout version {head[-1]}; this reader takes version "
                                f"{BLOB_VERSION}: it is refused, not reinterpreted")
    body = buf[BLOB_HEADER_BYTES:]
    if body.nbytes != math.prod(shape):
        raise BlockCorrupt(f"prefix blob {what} holds {body.nbytes} bytes of planes, a page {math.prod(shape)}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(shape)


def remote_block_key(format_id: str, key: bytes, kind: str) -> BlockKey:
    """The block key of a prefix page's K or V at a remote tier: sequence ``prefix-<page key hex>``, page range
    [0, 1), planes [0, 8) (the payload is :func:`encode_page_blob` of the page's planes, every layer and KV head:
    ``layer`` and ``kv_head`` are 0)."""
    return BlockKey(format_id, f"prefix-{key.hex()}", kind, 0, 0, 0, 1, 0, 8)


def sealed_pages(cache: PageCache, b: int) -> int:
    """Whole pages sequence ``b`` holds in every layer (the pages a prefix index can take from it)."""
    return min(cache.length(layer, b) for layer in range(cache.spec.n_layers)) // cache.spec.page_size


def page_codes(cache: PageCache, b: int, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-depth codes of pages ``first .. first + n - 1`` of sequence ``b`` in every layer: K, V [L, Hkv, n * P,
    d] uint8 on the host, read from wherever their planes live (a TieredCache's hot pool, open page, host tier)."""
    p, w = cache.spec.page_size, cache.spec.width
    if first < 0 or n < 0 or first + n > sealed_pages(cache, b):
        raise ValueError(f"sequence {b} holds {sealed_pages(cache, b)} whole pages in every layer; asked for pages "
                         f"{first}..{first + n - 1}")
    ks, vs = [], []
    for layer in range(cache.spec.n_layers):
        if isinstance(cache, TieredCache):
            k, v = stored_codes(cache, layer, b)
        else:
            k, v = cache.read_k(layer, b, w), cache.read_v(layer, b, w)
        ks.append(k[:, first * p: (first + n) * p].cpu())
        vs.append(v[:, first * p: (first + n) * p].cpu())
    return torch.stack(ks), torch.stack(vs)


def publish_pages(index: PrefixIndex, cache: PageCache, b: int, keys: Sequence[bytes]) -> int:
    """Put the pages of sequence ``b`` that ``keys`` name (key i: page i; as many as it holds whole) into
    ``index``; pages already there are left as they are. Returns how many were added. From a
    :class:`~planekv.kvstore.PlaneKVCache` the pages' planes are copied out of its pools as they are; from a
    TieredCache the codes are gathered from its tiers and packed."""
    n = min(len(keys), sealed_pages(cache, b))
    todo = [i for i in range(n) if keys[i] not in index]
    if not todo:
        return 0
    first = todo[0]
    spec = cache.spec
    if isinstance(cache, TieredCache):
        k, v = pack_pages(spec, *page_codes(cache, b, first, n - first))  # [L, Hkv, n', W, d, P/8], ...
    else:
        slots = cache.page_table[b, :, first:n].to(cache.device)  # [Hkv, n']
        k, v = cache.k_pool[:, slots].cpu(), cache.v_pool[:, slots].cpu()
    added = 0
    for i in todo:
        s = i - first
        page = PrefixPage(spec.format_id, k[:, :, s].clone(), v[:, :, s].clone())
        added += int(index.put(keys[i], page))
    return added


def load_pages(cache: PageCache, b: int, pages: Sequence[PrefixPage]) -> int:
    """Load ``pages`` (a prefix: page 0 first) into the empty sequence ``b`` of ``cache`` in every layer; returns
    the tokens loaded. Into a :class:`~planekv.kvstore.PlaneKVCache` this is a copy of each page's planes into pool
    pages (no codes are packed again). A TieredCache gets their codes appended
    (``TieredCache.load_prefix``): it seals each page as it fills, so its hot planes are in the hot pool and its
    refinement planes in the host tier, as for any appended page."""
    if not pages:
        return 0
    spec = cache.spec
    for page in pages:
        _check_page(spec, page)
    if any(cache.length(layer, b) for layer in range(spec.n_layers)):
        raise ValueError(f"sequence {b} is not empty: a prefix loads into an empty sequence")
    n, p = len(pages), spec.page_size
    k = torch.stack([page.k for page in pages], 2)  # [L, Hkv, n, W, d, P/8]
    v = torch.stack([page.v for page in pages], 2)
    if isinstance(cache, TieredCache):
        cache.load_prefix(b, *unpack_pages(spec, k, v))
    else:
        cache._ensure_pages(b, n)
        slots = cache.page_table[b, :, :n].to(cache.device)  # [Hkv, n]: fresh pages (all zeros)
        cache.k_pool[:, slots] = k.to(cache.device)
        cache.v_pool[:, slots] = v.to(cache.device)
        cache.lengths[:, b] = n * p
    return n * p


def _check_page(spec: FormatSpec, page: PrefixPage) -> None:
    if page.format_id != spec.format_id:
        raise FormatMismatch(f"prefix page of format {page.format_id}; the cache's format is {spec.format_id}")
    k_shape, v_shape = page_shapes(spec)
    if tuple(page.k.shape) != k_shape or tuple(page.v.shape) != v_shape or page.k.dtype != torch.uint8 \
            or page.v.dtype != torch.uint8:
        raise ValueError(f"prefix page planes {tuple(page.k.shape)} / {tuple(page.v.shape)} "
                         f"({page.k.dtype}), expected uint8 planes {k_shape} / {v_shape} (the pool's page layout)")
