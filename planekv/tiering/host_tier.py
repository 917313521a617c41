"""The host tier (docs/TIERING.md): the refinement planes of sealed pages in host memory, pinned on CUDA hosts.

Pages arrive one at a time, in page order, per (sequence, K or V, layer, KV head), and are appended to that
stream's open block. A block is laid out as a frame (``planekv.tiering.frame``: a 4 KiB header, then the
pages' bytes one after another, zero padding to 4 KiB); when it holds as many pages as ``block_bytes`` allows,
its header is written (key with page and plane range, checksum) and it is immutable from then on: the unit a
lower tier (NVMe, the store service) takes. Reads return views of a page's bytes in place.

Bounded: the blocks of every stream together never exceed ``capacity_bytes``; a page that does not fit is
refused with ``TierFull`` and nothing already stored is touched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .errors import TierFull
from .frame import HEADER_BYTES, BlockKey, aligned, frame_header

StreamKey = tuple[str, str, int, int]  # (sequence id, "k" | "v", layer, KV head)


@dataclass
class _Block:
    first_slot: int  # page slot (position in its sequence) of the block's first page
    buf: torch.Tensor  # uint8 [HEADER_BYTES + room for pages x page bytes, padded to 4 KiB]; grows while open
    n_pages: int = 0
    key: BlockKey | None = None  # set when sealed (framed)


@dataclass
class _Stream:
    page_bytes: int
    planes: tuple[int, int]  # [plane_start, plane_end) held
    blocks: list[_Block] = field(default_factory=list)


class HostTier:
    """Sealed pages' refinement planes, per stream, in framed blocks of ``block_bytes`` (>= one page)."""

    def __init__(self, format_id: str, capacity_bytes: int, block_bytes: int = 4 << 20, pinned: bool = False) -> None:
        if capacity_bytes < 0 or block_bytes <= HEADER_BYTES:
            raise ValueError(f"capacity_bytes must be >= 0 and block_bytes > {HEADER_BYTES}, got "
                             f"{capacity_bytes} and {block_bytes}")
        self.format_id = format_id
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.pinned = pinned
        self._streams: dict[StreamKey, _Stream] = {}
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Bytes of every block buffer allocated (an open block grows by doubling as pages arrive, up to a block)."""
        return self._used

    def pages_per_block(self, page_bytes: int) -> int:
        return max(1, (self.block_bytes - HEADER_BYTES) // page_bytes)

    def put_page(self, stream: StreamKey, slot: int, planes: tuple[int, int], data: torch.Tensor) -> None:
        """Append the page at ``slot`` of ``stream`` (its refinement planes ``planes``, any shape, uint8; the next
        slot of the stream: pages arrive in order). Raises TierFull when a new block does not fit."""
        raw = data.detach().reshape(-1)
        if raw.dtype != torch.uint8:
            raise TypeError(f"page data must be uint8, got {raw.dtype}")
        with self._lock:
            st = self._streams.get(stream)
            if st is None:
                st = self._streams[stream] = _Stream(page_bytes=raw.numel(), planes=planes)
            if raw.numel() != st.page_bytes or planes != st.planes:
                raise ValueError(f"stream {stream} holds pages of {st.page_bytes} bytes, planes {st.planes}; got "
                                 f"{raw.numel()} bytes, planes {planes}")
            nxt = st.blocks[-1].first_slot + st.blocks[-1].n_pages if st.blocks else 0
            if slot != nxt:
                raise ValueError(f"stream {stream}: page {slot} arrived, page {nxt} was next (pages arrive in order)")
            per = self.pages_per_block(st.page_bytes)
            if not st.blocks or st.blocks[-1].key is not None:
                st.blocks.append(_Block(first_slot=slot, buf=self._alloc(self._block_size(st.page_bytes, 1, per))))
            blk = st.blocks[-1]
            if HEADER_BYTES + (blk.n_pages + 1) * st.page_bytes > blk.buf.numel():  # grow the open block
                grown = self._alloc(self._block_size(st.page_bytes, 2 * blk.n_pages, per))
                grown[: blk.buf.numel()] = blk.buf
                self._used -= blk.buf.numel()
                blk.buf = grown
            off = HEADER_BYTES + blk.n_pages * st.page_bytes
            blk.buf[off: off + st.page_bytes] = raw.cpu()
            blk.n_pages += 1
            if blk.n_pages == per:
                self._seal(stream, st, blk)

    def _block_size(self, page_bytes: int, pages: int, per_block: int) -> int:
        """Bytes of a block buffer for ``pages`` pages (at most a block's), header and 4 KiB padding included."""
        return HEADER_BYTES + aligned(min(max(pages, 1), per_block) * page_bytes)

    def _alloc(self, size: int) -> torch.Tensor:
        """A zeroed block buffer of ``size`` bytes (pinned on CUDA hosts), counted; TierFull if it does not fit."""
        if self._used + size > self.capacity_bytes:
            raise TierFull(f"host tier full: {self._used} of {self.capacity_bytes} bytes used, a block needs "
                           f"{size}; raise the memory tier's capacity or free sequences")
        buf = torch.zeros(size, dtype=torch.uint8)
        self._used += size
        return buf.pin_memory() if self.pinned else buf

    def _seal(self, stream: StreamKey, st: _Stream, blk: _Block) -> None:
        seq, kind, layer, head = stream
        key = BlockKey(self.format_id, seq, kind, layer, head, blk.first_slot, blk.first_slot + blk.n_pages,
                       st.planes[0], st.planes[1])
        payload = blk.buf[HEADER_BYTES: HEADER_BYTES + blk.n_pages * st.page_bytes].numpy()
        blk.buf[:HEADER_BYTES] = torch.frombuffer(bytearray(frame_header(key, payload)), dtype=torch.uint8)
        blk.key = key

    def page(self, stream: StreamKey, slot: int) -> torch.Tensor:
        """A view of the bytes of the page at ``slot`` (uint8 [page bytes]); KeyError if it is not held."""
        st = self._streams.get(stream)
        if st is not None:
            for blk in st.blocks:
                if blk.first_slot <= slot < blk.first_slot + blk.n_pages:
                    off = HEADER_BYTES + (slot - blk.first_slot) * st.page_bytes
                    return blk.buf[off: off + st.page_bytes]
        raise KeyError(f"the host tier holds no page {slot} of {stream}")

    def frames(self, stream: StreamKey) -> list[tuple[BlockKey, torch.Tensor]]:
        """The sealed blocks of ``stream`` as frames (key, the frame's bytes: a view), in page order."""
        st = self._streams.get(stream)
        if st is None:
            return []
        return [(b.key, b.buf[: HEADER_BYTES + aligned(b.n_pages * st.page_bytes)]) for b in st.blocks
                if b.key is not None]

    def drop_sequence(self, sequence_id: str) -> int:
        """Free every block of a sequence; returns the bytes freed."""
        with self._lock:
            gone = [k for k in self._streams if k[0] == sequence_id]
            freed = sum(b.buf.numel() for k in gone for b in self._streams[k].blocks)
            for k in gone:
                del self._streams[k]
            self._used -= freed
        return freed
