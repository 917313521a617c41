"""The host tier (docs/TIERING.md): the refinement planes of sealed pages in host memory, pinned on CUDA hosts.

Pages arrive one at a time, in page order, per (sequence, K or V, layer, KV head), and are appended to that
stream's open block. A block is laid out as a frame (``planekv.tiering.frame``: a 4 KiB header, then the
pages' bytes one after another, zero padding to 4 KiB); when it holds as many pages as ``block_bytes`` allows,
its header is written (key with page and plane range, checksum) and it is immutable from then on: the unit a
lower tier (NVMe, the store service) takes. Reads return views of a page's bytes in place.

Bounded: the blocks of every stream together never exceed ``capacity_bytes``. With a spill tier
(``planekv.tiering.SpillTier``, NVMe) a block that does not fit makes room by moving the least recently read
sealed blocks there (their pages then read from the file, checked); without one, or when the spill tier is full
too, the page is refused with ``TierFull`` and nothing already stored is touched.

With a remote tier (``remote=``, a ``planekv.tiering.RemoteWriter`` over a ``RemoteTier``, e.g. the store service)
every sealed block is also queued for writing there (write-behind); when memory is full and the spill tier cannot
make room (or there is none), sealed blocks whose remote write has completed are dropped from memory, least
recently read first, and their pages are read back from the remote tier (the frame verified against its key).

Reads with a deadline (:meth:`HostTier.fetch_within`, what prefetch calls under a step's deadline): the blocks held
only remotely that a promotion needs are fetched on a small thread pool with the time left (handed to the remote
tier as its timeout where it takes one, ``remote_tier.get_frame_within``); the caller waits no later than the
deadline, and what has not arrived (or failed) by then is reported missing (the promotion skips it and the read
that wanted it is capped), never waited for. Frames that arrived are cached back in memory where they fit, else
held until :meth:`release_staged`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import numpy as np
import torch

from ..kvstore.errors import FormatMismatch
from .errors import BlockCorrupt, BlockError, RemoteBlockMissing, TierFull
from .frame import HEADER_BYTES, BlockKey, aligned, frame_header, verify_frame
from .remote_tier import get_frame_within
from .remote_writer import RemoteWriter
from .spill_tier import SpillTier

log = logging.getLogger(__name__)

StreamKey = tuple[str, str, int, int]  # (sequence id, "k" | "v", layer, KV head)


@dataclass
class _Block:
    first_slot: int  # page slot (position in its sequence) of the block's first page
    buf: torch.Tensor | None  # uint8 [HEADER_BYTES + room for pages x page bytes, padded to 4 KiB]; grows while
    #                           open; None once spilled or held only remotely
    n_pages: int = 0
    key: BlockKey | None = None  # set when sealed (framed)
    last_read: int = 0  # the tier's read counter when a page of it was last read (or it was sealed)
    remote_only: bool = False  # dropped from memory: its only copy is the remote tier's


@dataclass
class _Stream:
    page_bytes: int
    planes: tuple[int, int]  # [plane_start, plane_end) held
    blocks: list[_Block] = field(default_factory=list)


class HostTier:
    """Sealed pages' refinement planes, per stream, in framed blocks of ``block_bytes`` (>= one page)."""

    def __init__(self, format_id: str, capacity_bytes: int, block_bytes: int = 4 << 20, pinned: bool = False,
                 spill: SpillTier | None = None, remote: RemoteWriter | None = None) -> None:
        if capacity_bytes < 0 or block_bytes <= HEADER_BYTES:
            raise ValueError(f"capacity_bytes must be >= 0 and block_bytes > {HEADER_BYTES}, got "
                             f"{capacity_bytes} and {block_bytes}")
        self.format_id = format_id
        self.capacity_bytes = capacity_bytes
        self.block_bytes = block_bytes
        self.pinned = pinned
        self.spill = spill
        self.remote = remote
        self.remote_skipped = 0  # sealed blocks not queued for the remote tier (its queue stayed full)
        self.remote_fetches = 0  # frames read back from the remote tier
        self.remote_deadline_misses = 0  # remote frames a deadline read did not get in time (or that failed)
        # bytes and seconds of the reads each place served (page() and deadline fetches): "host" (memory: the
        # bytes of the views handed out, no time), "nvme" (spill files), "remote" (whole frames fetched)
        self.read_bytes = {"host": 0, "nvme": 0, "remote": 0}
        self.read_s = {"host": 0.0, "nvme": 0.0, "remote": 0.0}
        self._staged: dict[BlockKey, torch.Tensor] = {}  # frames fetched within a deadline that memory had no room for
        self._pool: ThreadPoolExecutor | None = None
        # remote copies drop_sequence leaves in place: keys another cache also holds (replace_placement)
        self.keep_remote: set[BlockKey] = set()
        self._streams: dict[StreamKey, _Stream] = {}
        self._used = 0
        self._reads = 0
        self._lock = threading.RLock()

    @property
    def used_bytes(self) -> int:
        """Bytes of every block buffer allocated (an open block grows by doubling as pages arrive, up to a block)."""
        return self._used

    @property
    def spilled_bytes(self) -> int:
        """Bytes of this tier's blocks in the spill tier."""
        return self.spill.used_bytes if self.spill is not None else 0

    @property
    def remote_only_bytes(self) -> int:
        """Bytes of this tier's blocks held only by the remote tier (frames dropped from memory)."""
        return sum(HEADER_BYTES + aligned(b.n_pages * st.page_bytes) for st in self._streams.values()
                   for b in st.blocks if b.remote_only)

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
            assert blk.buf is not None  # an open block is never spilled
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
        """A zeroed block buffer of ``size`` bytes (pinned on CUDA hosts), counted; room is made by spilling sealed
        blocks where there is a spill tier; TierFull if it does not fit."""
        if self._used + size > self.capacity_bytes and self.spill is not None:
            try:
                self._spill_for(size)
            except TierFull:
                if self.remote is None:
                    raise
        if self._used + size > self.capacity_bytes and self.remote is not None:
            self._drop_remote_written(size)
        if self._used + size > self.capacity_bytes:
            where = " and the spill tier's sealed blocks cannot make room" if self.spill is not None else ""
            if self.remote is not None:
                where += " and no sealed block in memory has been written to the remote tier"
            raise TierFull(f"host tier full: {self._used} of {self.capacity_bytes} bytes used, a block needs "
                           f"{size}{where}; raise the memory tier's capacity or free sequences")
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
        blk.last_read = self._reads
        if self.remote is not None:  # write-behind copy; the block stays here until the write completes
            try:
                self.remote.submit(bytes(blk.buf[: HEADER_BYTES + aligned(blk.n_pages * st.page_bytes)].numpy()))
            except Exception as exc:  # noqa: BLE001 - RemoteQueueFull, a closed writer: the page is stored already
                self.remote_skipped += 1
                log.warning("host tier: %s not queued for the remote tier, kept in memory only: %s", key, exc)

    def _spill_for(self, size: int) -> None:
        """Move sealed blocks, least recently read first, to the spill tier until ``size`` more bytes fit (or no
        sealed block is left in memory). A block that cannot be written stays in memory (TierFull / OSError
        propagate: the caller's page is refused, nothing stored is lost)."""
        assert self.spill is not None
        sealed = sorted(((b.last_read, k, i) for k, st in self._streams.items() for i, b in enumerate(st.blocks)
                         if b.key is not None and b.buf is not None), key=lambda t: t[0])
        for _, stream, i in sealed:
            if self._used + size <= self.capacity_bytes:
                return
            st = self._streams[stream]
            blk = st.blocks[i]
            assert blk.buf is not None and blk.key is not None
            frame = blk.buf[: HEADER_BYTES + aligned(blk.n_pages * st.page_bytes)]
            self.spill.write(blk.key, frame, HEADER_BYTES, st.page_bytes)
            self._used -= blk.buf.numel()
            blk.buf = None

    def _drop_remote_written(self, size: int) -> None:
        """Drop sealed blocks in memory whose remote write has completed, least recently read first, until ``size``
        more bytes fit (or none is left). Where that is not enough and writes are pending, waits for them (up to
        the writer's ``submit_timeout_s``: back-pressure) and tries once more."""
        assert self.remote is not None
        self._drop_written(size)
        if self._used + size > self.capacity_bytes and self.remote.stats.queued_blocks:
            try:
                self.remote.flush(self.remote.submit_timeout_s)
            except TimeoutError as exc:
                log.warning("host tier full, remote writes pending: %s", exc)
            self._drop_written(size)

    def _drop_written(self, size: int) -> None:
        assert self.remote is not None
        sealed = sorted(((b.last_read, k, i) for k, st in self._streams.items() for i, b in enumerate(st.blocks)
                         if b.key is not None and b.buf is not None), key=lambda t: t[0])
        for _, stream, i in sealed:
            if self._used + size <= self.capacity_bytes:
                return
            blk = self._streams[stream].blocks[i]
            assert blk.buf is not None and blk.key is not None
            if self.remote.is_written(blk.key):
                self._used -= blk.buf.numel()
                blk.buf = None
                blk.remote_only = True

    def _fetch_remote(self, blk: _Block) -> torch.Tensor:
        """The frame of a block held only remotely (uint8 [frame bytes]), verified against its key; cached back
        in memory when it fits without dropping anything. RemoteBlockMissing / BlockCorrupt: never wrong bytes."""
        assert self.remote is not None and blk.key is not None
        staged = self._staged.get(blk.key)
        if staged is not None:
            return staged
        t0 = time.perf_counter()
        frame = self.remote.tier.get_frame(blk.key)
        self._count_remote(frame, time.perf_counter() - t0)
        return self._install(blk, frame)

    def _count_remote(self, frame: bytes | None, seconds: float) -> None:
        self.remote_fetches += 1
        self.read_bytes["remote"] += len(frame or b"")
        self.read_s["remote"] += seconds

    def _install(self, blk: _Block, frame: bytes | None, stage: bool = False) -> torch.Tensor:
        """``frame`` (fetched for ``blk``) verified and cached back in memory where it fits without dropping
        anything (else, with ``stage``, held until release_staged); RemoteBlockMissing / BlockCorrupt."""
        assert blk.key is not None
        if frame is None:
            raise RemoteBlockMissing(f"block {blk.key} is held only by the remote tier, which no longer has it")
        try:
            verify_frame(frame, blk.key)
        except (BlockError, FormatMismatch) as exc:
            raise BlockCorrupt(f"the remote tier's frame of {blk.key} does not check: {exc}") from exc
        buf = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        if self._used + buf.numel() <= self.capacity_bytes:
            blk.buf = buf.pin_memory() if self.pinned else buf
            self._used += buf.numel()
            blk.remote_only = False
        elif stage:
            self._staged[blk.key] = buf
        return buf

    def _find(self, stream: StreamKey, slot: int) -> _Block | None:
        st = self._streams.get(stream)
        if st is not None:
            for blk in st.blocks:
                if blk.first_slot <= slot < blk.first_slot + blk.n_pages:
                    return blk
        return None

    def fetch_within(self, pages: Iterable[tuple[StreamKey, int]], deadline: float) -> set[tuple[StreamKey, int]]:
        """Make ``pages`` ((stream, slot) pairs) readable without waiting on the remote tier, by ``deadline``
        (``time.monotonic()`` seconds): the blocks among them held only remotely are fetched concurrently, each
        with the time left as its timeout, and this returns no later than the deadline (plus the time to verify
        what arrived). Returns the pages still held only remotely (their fetch missed the deadline, failed, or
        the frame did not check: counted in ``remote_deadline_misses``, logged); a page of a block that arrived
        reads from memory (cached back, or staged until :meth:`release_staged`). Pages not held here are
        ignored (``page`` raises KeyError for them as before)."""
        if self.remote is None:
            return set()
        want: dict[BlockKey, tuple[_Block, list[tuple[StreamKey, int]]]] = {}
        with self._lock:
            for stream, slot in pages:
                blk = self._find(stream, slot)
                if blk is None or not blk.remote_only or blk.key is None or blk.key in self._staged:
                    continue
                want.setdefault(blk.key, (blk, []))[1].append((stream, slot))
        if not want:
            return set()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="planekv-remote-read")
        tier = self.remote.tier
        t0 = time.perf_counter()
        futs: dict[BlockKey, Future] = {}
        for key in want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            futs[key] = self._pool.submit(get_frame_within, tier, key, left)
        if futs:
            wait_futures(list(futs.values()), timeout=max(0.0, deadline - time.monotonic()))
        spent = time.perf_counter() - t0
        missing: set[tuple[StreamKey, int]] = set()
        got_bytes = 0
        with self._lock:
            for key, (blk, need) in want.items():
                fut = futs.get(key)
                frame, why = None, "the deadline passed before it was asked for"
                if fut is not None and fut.done() and not fut.cancelled():
                    try:
                        frame = fut.result()
                        why = "" if frame is not None else "the remote tier no longer has it"
                    except Exception as exc:  # noqa: BLE001 - a failed or timed-out fetch: capped, not raised
                        why = f"{type(exc).__name__}: {exc}"
                elif fut is not None:
                    fut.cancel()  # not started: never runs; running: its timeout ends it, the result is dropped
                    why = "it did not arrive by the deadline"
                if frame is not None:
                    got_bytes += len(frame)
                    self.remote_fetches += 1
                    if blk.remote_only and self._find(need[0][0], need[0][1]) is blk:  # still ours, still remote
                        try:
                            self._install(blk, frame, stage=True)
                            continue
                        except (BlockCorrupt, RemoteBlockMissing) as exc:
                            why = str(exc)
                    else:
                        continue
                self.remote_deadline_misses += 1
                log.info("host tier: %s not fetched within the deadline (%s); its pages read at the resident depth",
                         key, why)
                missing.update(need)
            self.read_bytes["remote"] += got_bytes
            self.read_s["remote"] += spent
        return missing

    def release_staged(self) -> None:
        """Forget the frames :meth:`fetch_within` held beside memory (after the promotions that needed them)."""
        with self._lock:
            self._staged.clear()

    def close(self) -> None:
        """Stop the deadline fetches' threads (a fetch still running ends at its timeout)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def page(self, stream: StreamKey, slot: int) -> torch.Tensor:
        """The bytes of the page at ``slot`` (uint8 [page bytes]: a view in memory, a fresh tensor read from the
        spill tier); KeyError if it is not held, BlockCorrupt if its spilled bytes do not check."""
        with self._lock:
            st = self._streams.get(stream)
            if st is not None:
                for blk in st.blocks:
                    if blk.first_slot <= slot < blk.first_slot + blk.n_pages:
                        self._reads += 1
                        blk.last_read = self._reads
                        off = HEADER_BYTES + (slot - blk.first_slot) * st.page_bytes
                        if blk.remote_only:
                            buf = self._fetch_remote(blk)
                            return blk.buf[off: off + st.page_bytes] if blk.buf is not None else \
                                buf[off: off + st.page_bytes].clone()
                        if blk.buf is None:  # spilled
                            assert self.spill is not None and blk.key is not None
                            t0 = time.perf_counter()
                            data = self.spill.read_page(blk.key, slot - blk.first_slot)
                            self.read_s["nvme"] += time.perf_counter() - t0
                            self.read_bytes["nvme"] += st.page_bytes
                            return data
                        self.read_bytes["host"] += st.page_bytes
                        return blk.buf[off: off + st.page_bytes]
        raise KeyError(f"the host tier holds no page {slot} of {stream}")

    def pages(self, stream: StreamKey, first: int, n: int) -> torch.Tensor:
        """The bytes of pages ``first .. first + n - 1`` of ``stream`` (uint8 [n, page bytes], a copy), a block at a
        time where :meth:`page` goes a page at a time (a Key channel-plane needs every page of its head); the same
        counts and errors as :meth:`page` (KeyError for a page not held); :meth:`gather_rows` reads some rows of
        each page."""
        with self._lock:
            st = self._stream_of(stream, first, n, "pages")
            out = torch.empty(n, st.page_bytes, dtype=torch.uint8)
            done = 0
            for blk in st.blocks:
                lo, hi = max(first, blk.first_slot), min(first + n, blk.first_slot + blk.n_pages)
                if lo >= hi:
                    continue
                dest = out[lo - first: hi - first]
                in_memory = blk.buf is not None
                run = self._run(st, blk, lo, hi, out=dest)  # spill reads land in dest
                if run is not None:  # a view of memory (or of a remote frame)
                    dest.copy_(run.view(hi - lo, -1))
                if in_memory:  # the bytes copied out of host memory
                    self.read_bytes["host"] += (hi - lo) * st.page_bytes
                done += hi - lo
            if done != n:
                raise KeyError(f"the host tier holds {done} of pages {first}..{first + n - 1} of {stream}")
            return out

    def gather_rows(self, stream: StreamKey, n: int, rows: np.ndarray, row_bytes: int, out: np.ndarray,
                    dest: np.ndarray) -> None:
        """Rows ``rows`` [m] (each page seen as [page bytes / row_bytes, row_bytes]) of pages ``0 .. n - 1`` of
        ``stream`` into ``out[dest[i], page] = row rows[i]`` (``out``: uint8 [items, >= n, row_bytes], ``dest`` [m]
        int64): Key channel-planes' rows of every page, written in place with numpy, whose indexing costs a few
        microseconds where torch's costs tens (a prefetch gathers the Key channel-planes of a hundred heads a step).
        The same counts and errors as :meth:`pages`."""
        with self._lock:
            st, spans = self._row_spans(stream, n, row_bytes, "gather_rows")
            for blk, lo, hi in spans:
                in_memory = blk.buf is not None
                run = self._run(st, blk, lo, hi)
                assert run is not None
                out[dest, lo:hi] = run.numpy().reshape(hi - lo, -1, row_bytes)[:, rows].swapaxes(0, 1)
                if in_memory:  # only the rows were copied out of host memory
                    self.read_bytes["host"] += (hi - lo) * rows.size * row_bytes

    def row_addresses(self, stream: StreamKey, n: int, rows: np.ndarray, row_bytes: int,
                      holds: list[torch.Tensor]) -> np.ndarray | None:
        """The host addresses of rows ``rows`` [m] (as :meth:`gather_rows` sees a page) of pages ``0 .. n - 1`` of
        ``stream``: int64 [m, n], for a device that reads pinned host memory in place
        (``planekv.kernels.host_gather``); the blocks read are appended to ``holds`` (the caller keeps them until
        the device has read them). None, with nothing counted, when a page is not in memory (spilled, or held only
        remotely): the caller gathers with :meth:`gather_rows` instead. The same counts and errors as
        :meth:`gather_rows` otherwise."""
        with self._lock:
            st, spans = self._row_spans(stream, n, row_bytes, "row_addresses")
            if any(blk.buf is None for blk, _, _ in spans):
                return None
            out = np.empty((rows.size, n), dtype=np.int64)
            row_off = rows.astype(np.int64) * row_bytes  # [m]
            for blk, lo, hi in spans:
                assert blk.buf is not None
                base = blk.buf.data_ptr() + HEADER_BYTES + (np.arange(lo, hi, dtype=np.int64) - blk.first_slot) \
                    * st.page_bytes  # [hi - lo] each page's first byte
                out[:, lo:hi] = base[None, :] + row_off[:, None]
                holds.append(blk.buf)
                self._reads += 1
                blk.last_read = self._reads
                self.read_bytes["host"] += (hi - lo) * rows.size * row_bytes
            return out

    def _row_spans(self, stream: StreamKey, n: int, row_bytes: int,
                   what: str) -> tuple[_Stream, list[tuple[_Block, int, int]]]:
        """For a read of rows of pages ``0 .. n - 1`` of ``stream``: the stream and its blocks' spans (block, first
        page slot, end), in page order; ValueError where ``row_bytes`` does not divide a page, KeyError where the
        spans do not cover the ``n`` pages. Under the lock."""
        st = self._stream_of(stream, 0, n, what)
        if row_bytes < 1 or st.page_bytes % row_bytes:
            raise ValueError(f"{what}: row_bytes must divide the page's {st.page_bytes} bytes, got {row_bytes}")
        spans = [(blk, blk.first_slot, min(n, blk.first_slot + blk.n_pages)) for blk in st.blocks]
        spans = [(blk, lo, hi) for blk, lo, hi in spans if lo < hi]
        held = sum(hi - lo for _, lo, hi in spans)
        if held != n:
            raise KeyError(f"the host tier holds {held} of pages 0..{n - 1} of {stream}")
        return st, spans

    def _stream_of(self, stream: StreamKey, first: int, n: int, what: str) -> _Stream:
        """The stream a read of ``n`` pages from ``first`` asks for (ValueError for n < 1, KeyError if not held)."""
        if n < 1:
            raise ValueError(f"{what}: n must be >= 1, got {n}")
        st = self._streams.get(stream)
        if st is None:
            raise KeyError(f"the host tier holds no page {first} of {stream}")
        return st

    def _run(self, st: _Stream, blk: _Block, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Pages ``lo .. hi - 1`` (page slots of the stream) of ``blk``, uint8 [(hi - lo) x page bytes]: a view of
        memory, or read from its spill file (into ``out`` [hi - lo, page bytes] where given: then None) or its
        remote frame; marks the block read and counts the spill reads. Under the lock."""
        if blk.buf is None and not blk.remote_only:  # spilled: one run of pages from its file
            assert self.spill is not None and blk.key is not None
            t0 = time.perf_counter()
            run = self.spill.read_pages(blk.key, lo - blk.first_slot, hi - lo, out=out)
            self.read_s["nvme"] += time.perf_counter() - t0
            self.read_bytes["nvme"] += (hi - lo) * st.page_bytes
            run = None if out is not None else run.reshape(-1)
        else:
            buf = self._fetch_remote(blk) if blk.remote_only else blk.buf
            assert buf is not None
            off = HEADER_BYTES + (lo - blk.first_slot) * st.page_bytes
            run = buf[off: off + (hi - lo) * st.page_bytes]
        self._reads += 1
        blk.last_read = self._reads
        return run

    def frames(self, stream: StreamKey) -> list[tuple[BlockKey, torch.Tensor]]:
        """The sealed blocks of ``stream`` as frames (key, the frame's bytes: a view), in page order."""
        st = self._streams.get(stream)
        if st is None:
            return []
        out = []
        for b in st.blocks:
            if b.key is None:
                continue
            if b.remote_only:
                with self._lock:
                    out.append((b.key, self._fetch_remote(b)[: HEADER_BYTES + aligned(b.n_pages * st.page_bytes)]))
            elif b.buf is None:  # spilled
                assert self.spill is not None
                out.append((b.key, torch.frombuffer(bytearray(self.spill.read_frame(b.key)), dtype=torch.uint8)))
            else:
                out.append((b.key, b.buf[: HEADER_BYTES + aligned(b.n_pages * st.page_bytes)]))
        return out

    def sealed_keys(self) -> set[BlockKey]:
        """The keys of every sealed block held (in memory, spilled or only remotely)."""
        with self._lock:
            return {b.key for st in self._streams.values() for b in st.blocks if b.key is not None}

    def drop_sequence(self, sequence_id: str) -> int:
        """Free every block of a sequence (their remote copies too, best effort, except those in
        ``keep_remote``); returns the bytes freed."""
        with self._lock:
            gone = [k for k in self._streams if k[0] == sequence_id]
            freed = sum(b.buf.numel() for k in gone for b in self._streams[k].blocks if b.buf is not None)
            for k in gone:
                for b in self._streams[k].blocks:
                    if b.key is not None:
                        self._staged.pop(b.key, None)
                    if b.buf is None and not b.remote_only and b.key is not None and self.spill is not None:
                        self.spill.delete(b.key)
                    if b.key is not None and self.remote is not None and b.key not in self.keep_remote:
                        self.remote.discard(b.key)
                del self._streams[k]
            self._used -= freed
        return freed
