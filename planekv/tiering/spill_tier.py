"""The spill tier (NVMe): sealed host-tier blocks as files, read back a page at a time (docs/TIERING.md).

When the host tier is full, its least recently read sealed blocks move here. A block is written whole, as its
frame (4 KiB aligned), crash-atomically (``planekv.kvstore.atomic``: a temporary file, fsync, rename); its
pages are read back one at a time at their offset in the frame, each checked against the checksum taken when
the block was written (a mismatch raises ``BlockCorrupt``: never wrong bytes).

Two ways to read, one interface, chosen when the tier opens and logged:

- ``kvikio`` (CUDA hosts with kvikio installed, the ``gpu`` extra): ``CuFile.pread`` into pinned host memory,
  through GPUDirect Storage where the host has it, kvikio's compatibility mode (POSIX reads in its thread pool)
  where it has not.
- ``posix`` (everywhere else): ``os.pread`` into host memory.

The files belong to one process's caches: each tier writes under its own directory ``<root>/<pid>-<random>``
and removes it on :meth:`SpillTier.close`; opening a tier removes the directories of processes that are gone
(their caches died with them). Bounded: blocks together never exceed ``capacity_bytes`` (``TierFull``, nothing
already stored touched).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ..kvstore.atomic import atomic_write_bytes
from .errors import BlockCorrupt, TierFull
from .frame import BlockKey, decode_header

log = logging.getLogger(__name__)

POSIX = "posix"
KVIKIO = "kvikio"
BACKENDS = (POSIX, KVIKIO)
MAX_OPEN_FILES = 64  # default bound of the open-handle cache
KVIKIO_CHUNK_BYTES = 256 << 10  # kvikio reads larger than this go as preads of about this size, checked as they land


def _page_checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


class SpillTier:
    """Framed blocks as files under a directory of this process; ``backend``: "posix", "kvikio" or "auto"
    (kvikio where it imports and CUDA is up, else POSIX). Each block file's open handle (a ``kvikio.CuFile`` or
    an ``os.open`` descriptor) is kept in an LRU of at most ``max_open_files``, closed when its block is deleted or
    rewritten, when it falls out of the LRU (once no read is using it) and on :meth:`close`."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int, backend: str = "auto",
                 fsync: bool = True, max_open_files: int = MAX_OPEN_FILES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if isinstance(max_open_files, bool) or not isinstance(max_open_files, int) or max_open_files < 1:
            raise ValueError(f"max_open_files must be an integer >= 1, got {max_open_files!r}")
        if backend not in (*BACKENDS, "auto"):
            raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {backend!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        _remove_dead_owners(self.root)
        self.dir = self.root / f"{os.getpid()}-{secrets.token_hex(4)}"
        self.dir.mkdir()
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.backend, self._io, self.compat_mode = _open_backend(backend)
        self.max_open_files = max_open_files
        self._handles: OrderedDict[BlockKey, _Handle] = OrderedDict()  # least recently used first
        self._sizes: dict[BlockKey, int] = {}  # bytes on disk per block
        self._page_sums: dict[BlockKey, tuple[int, int, list[int]]] = {}  # (first page offset, page bytes, sums)
        self._used = 0
        self._mru: _Handle | None = None  # the handle read last (last in self._handles while it is there)
        self._lock = threading.Lock()
        log.info("spill tier at %s: %s reads, capacity %d bytes", self.dir, self.backend, capacity_bytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def open_handles(self) -> int:
        """Block files whose handle the cache holds open now."""
        with self._lock:
            return len(self._handles)

    def path(self, key: BlockKey) -> Path:
        return self.dir / (f"{key.sequence_id}.{key.kind}.{key.layer}.{key.kv_head}.{key.page_start}-"
                           f"{key.page_end}.{key.plane_start}-{key.plane_end}.blk")

    def write(self, key: BlockKey, frame: torch.Tensor, page_offset: int, page_bytes: int) -> None:
        """Store the sealed block ``key`` (its frame: uint8 [4 KiB multiple], on the host), whose pages are
        ``page_bytes`` each from byte ``page_offset``. TierFull when it does not fit; an I/O error propagates
        and leaves nothing under the key."""
        raw = frame.detach().reshape(-1).numpy()
        hdr = decode_header(raw)
        if hdr.key != key or raw.nbytes != hdr.frame_bytes:
            raise BlockCorrupt(f"the frame handed to the spill tier is {hdr.key} of {hdr.frame_bytes} bytes, "
                               f"expected {key} of {raw.nbytes}")
        with self._lock:
            if self._used + raw.nbytes > self.capacity_bytes:
                raise TierFull(f"spill tier full: {self._used} of {self.capacity_bytes} bytes used, a block needs "
                               f"{raw.nbytes}; raise the NVMe tier's capacity or free sequences")
            self._used += raw.nbytes  # reserved while written
        try:
            atomic_write_bytes(self.path(key), memoryview(raw), fsync=self.fsync)
        except BaseException:
            with self._lock:
                self._used -= raw.nbytes
            raise
        sums = [_page_checksum(memoryview(raw)[page_offset + i * page_bytes: page_offset + (i + 1) * page_bytes])
                for i in range(key.n_pages)]
        with self._lock:
            self._drop_handle(key)  # a handle of a file this one replaced would read the old bytes
            self._sizes[key] = raw.nbytes
            self._page_sums[key] = (page_offset, page_bytes, sums)

    def read_page(self, key: BlockKey, index: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Page ``index`` of block ``key`` (uint8 [page bytes], in ``out`` when given: contiguous host memory, pinned
        for kvikio's fastest path), checked against its checksum; KeyError if the block is not here."""
        h, (offset, page_bytes, sums) = self._acquire(key)
        try:
            if not 0 <= index < len(sums):
                raise IndexError(f"block {key} holds {len(sums)} pages, asked for page {index}")
            if out is None:
                out = torch.empty(page_bytes, dtype=torch.uint8)
            bad = self._io.read(h.obj, _host_array(out, 1, page_bytes), offset + index * page_bytes, page_bytes,
                                sums, index)
        finally:
            self._release(h)
        if bad is not None:
            raise self._corrupt(key, index)
        return out

    def read_pages(self, key: BlockKey, first: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pages ``first .. first + n - 1`` of block ``key`` (uint8 [n, page bytes], in ``out`` when given: contiguous
        host memory), each checked against its checksum. kvikio: the run is read as a few large preads (chunks of
        about ``chunk_bytes``, a page's pieces when pages are larger), all in flight, each chunk's pages checked
        (hashed progressively within a page) as it lands while the later chunks are still being read; POSIX: one read
        of the run, then the checks. KeyError if the block is not here, BlockCorrupt naming the first page that does
        not match (no bytes of a run that fails are to be used)."""
        h, (offset, page_bytes, sums) = self._acquire(key)
        try:
            if n < 1 or first < 0 or first + n > len(sums):
                raise IndexError(f"block {key} holds {len(sums)} pages, asked for {n} from page {first}")
            if out is None:
                out = torch.empty(n, page_bytes, dtype=torch.uint8)
            bad = self._io.read(h.obj, _host_array(out, n, page_bytes), offset + first * page_bytes, page_bytes,
                                sums, first)
        finally:
            self._release(h)
        if bad is not None:
            raise self._corrupt(key, first + bad)
        return out if out.shape == (n, page_bytes) else out.view(n, page_bytes)

    def _corrupt(self, key: BlockKey, page: int) -> BlockCorrupt:
        return BlockCorrupt(f"page {page} of spilled block {key} at {self.path(key)} does not match what was "
                            "written")

    def read_frame(self, key: BlockKey) -> bytes:
        """The whole frame of block ``key`` (as written)."""
        return self.path(key).read_bytes()

    def delete(self, key: BlockKey) -> None:
        """Remove block ``key``'s file (absent: nothing to do); other failures raise OSError and keep the books."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))
        with self._lock:
            self._drop_handle(key)
            self._used -= self._sizes.pop(key, 0)
            self._page_sums.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def close(self) -> None:
        """Close every cached handle (one in use by a read closes when that read ends); remove this tier's files
        and directory."""
        with self._lock:
            for key in list(self._handles):
                self._drop_handle(key)
        shutil.rmtree(self.dir, ignore_errors=True)
        with self._lock:
            self._sizes.clear()
            self._page_sums.clear()
            self._used = 0


    # The handle cache. Every method below but _acquire and _release runs under self._lock.

    def _acquire(self, key: BlockKey) -> tuple[_Handle, tuple[int, int, list[int]]]:
        """The open handle of ``key``'s file (opened and cached if it is not), marked in use, and the block's
        (first page offset, page bytes, checksums) read under the same lock; KeyError if the block is not here."""
        with self._lock:
            sums = self._page_sums[key]
            h = self._handles.get(key)
            if h is None:
                h = _Handle(self._io.open(self.path(key)))
                self._handles[key] = h
                while len(self._handles) > self.max_open_files:
                    self._drop_handle(next(iter(self._handles)))
            elif h is not self._mru:  # the most recently used handle is last already: no reordering
                self._handles.move_to_end(key)
            self._mru = h
            h.users += 1
            return h, sums

    def _release(self, h: _Handle) -> None:
        with self._lock:
            h.users -= 1
            if h.dropped and h.users == 0:
                self._close(h)

    def _drop_handle(self, key: BlockKey) -> None:
        """Take ``key``'s handle out of the cache; closed now, or by the last read using it."""
        h = self._handles.pop(key, None)
        if h is None:
            return
        h.dropped = True
        if h.users == 0:
            self._close(h)

    def _close(self, h: _Handle) -> None:
        if h.obj is None:
            return
        obj, h.obj = h.obj, None
        try:
            self._io.close(obj)
        except Exception:  # noqa: BLE001 - closing a read-only handle: nothing to lose, keep the books
            log.warning("spill tier: closing a file handle failed", exc_info=True)


@dataclass
class _Handle:
    obj: Any  # the backend's open file (an fd, a kvikio.CuFile); None once closed
    users: int = 0  # reads using it now
    dropped: bool = False  # out of the cache: close when the last read ends


def _remove_dead_owners(root: Path) -> None:
    """Remove ``<root>/<pid>-<random>`` directories whose process is gone."""
    for d in root.iterdir():
        pid = d.name.split("-", 1)[0]
        if not d.is_dir() or not pid.isdigit() or _alive(int(pid)):
            continue
        log.info("removing %s: the spill files of process %s, which is gone", d, pid)
        shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_array(out: torch.Tensor, n: int, page_bytes: int) -> np.ndarray:
    """``out`` as a flat uint8 numpy view (what the reads write into) after checking it holds ``n`` pages of
    ``page_bytes`` in contiguous host memory (ValueError if not: a read never lands in a copy)."""
    try:
        arr = out.numpy()  # refuses a tensor on another device
    except (TypeError, RuntimeError):
        arr = None
    if arr is None or arr.dtype != np.uint8 or arr.size != n * page_bytes or not arr.flags.c_contiguous:
        shape = f"[{n}, {page_bytes}]" if n > 1 else f"[{page_bytes}]"
        raise ValueError(f"out must be uint8 {shape} in contiguous host memory, got {out.dtype} {tuple(out.shape)} "
                         f"on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}")
    return arr if arr.ndim == 1 else arr.reshape(-1)


def _first_bad(buf: np.ndarray, got: int, page_bytes: int, sums: list[int], first: int) -> int | None:
    """The first of the pages in ``buf`` (``page_bytes`` each, pages ``first ..`` of their block; ``got`` bytes of
    it read) read short or not matching its checksum; None when every one is good."""
    if buf.size == page_bytes:
        return None if got == page_bytes and _page_checksum(buf) == sums[first] else 0
    mv = memoryview(buf)
    for i, lo in enumerate(range(0, buf.size, page_bytes)):
        hi = lo + page_bytes
        if got < hi or _page_checksum(mv[lo:hi]) != sums[first + i]:
            return i
    return None


class _PosixIO:
    """``os.open`` once per file, ``os.preadv`` into the host tensor's numpy view."""

    @staticmethod
    def open(path: Path) -> int:
        return os.open(path, os.O_RDONLY)

    @staticmethod
    def pread(fd: int, out: np.ndarray, offset: int) -> int:
        view = memoryview(out).cast("B")  # raises for a non-contiguous buffer (never reads into a copy)
        done = 0
        while done < view.nbytes:
            n = os.preadv(fd, [view[done:]] if done else [view], offset + done)
            if n == 0:
                break
            done += n
        return done

    @classmethod
    def read(cls, fd: int, flat: np.ndarray, offset: int, page_bytes: int, sums: list[int], first: int) -> int | None:
        """``flat`` (whole pages ``first ..`` of ``page_bytes``) from ``offset`` in one read, then each page checked;
        the index in ``flat`` of the first page read short or failing its check (None: every page good)."""
        return _first_bad(flat, cls.pread(fd, flat, offset), page_bytes, sums, first)

    @staticmethod
    def close(fd: int) -> None:
        os.close(fd)


@functools.lru_cache(maxsize=1024)
def _spans(total: int, page_bytes: int, chunk: int) -> tuple[tuple[int, int], ...]:
    """The byte ranges ``[lo, hi)`` of a run of ``total`` bytes (whole pages of ``page_bytes``) read one pread
    each: runs of whole pages of about ``chunk`` bytes (at least one page) when pages are smaller than a chunk,
    else each page in pieces of ``chunk`` bytes (its last piece shorter); never a range across a page boundary
    unless it holds whole pages."""
    if page_bytes <= chunk:
        step = chunk // page_bytes * page_bytes
        return tuple((lo, min(lo + step, total)) for lo in range(0, total, step))
    return tuple((lo, min(lo + chunk, p + page_bytes)) for p in range(0, total, page_bytes)
                 for lo in range(p, p + page_bytes, chunk))


class _KvikioIO:
    """``kvikio.CuFile`` once per file, ``CuFile.pread`` into the host tensor's numpy view (pinned: kvikio's
    fastest path). A read of at most ``chunk_bytes`` is one pread, checked once it lands; a larger one is a few
    preads of about ``chunk_bytes`` (whole pages, or pieces of one large page), all issued at once, kvikio's thread
    pool reading them while this thread checks those that have landed (xxhash runs without the GIL; a large page
    is hashed piece by piece with a streaming xxh3, whose digest equals the one-shot checksum)."""

    def __init__(self, kvikio: Any, chunk_bytes: int = KVIKIO_CHUNK_BYTES) -> None:
        self.kvikio = kvikio
        self.chunk_bytes = chunk_bytes

    def open(self, path: Path) -> Any:
        return self.kvikio.CuFile(path, "r")

    def read(self, f: Any, flat: np.ndarray, offset: int, page_bytes: int, sums: list[int],
             first: int) -> int | None:
        """``flat`` (whole pages ``first ..`` of ``page_bytes``) from ``offset``; the index in ``flat`` of the first
        page read short or failing its check (None: every page good). Returns only once every pread it issued has
        ended: none still writes into ``flat``."""
        total = flat.size
        if total <= self.chunk_bytes:
            return _first_bad(flat, f.pread(flat, total, offset).get(), page_bytes, sums, first)
        spans = _spans(total, page_bytes, self.chunk_bytes)
        futures: list[Any] = []
        waited = 0
        bad = None
        try:
            for lo, hi in spans:
                futures.append(f.pread(flat[lo:hi], hi - lo, offset + lo))
            mv = memoryview(flat)
            pos = 0  # bytes checked (or, within a page, hashed) so far
            stream = None  # the streaming hash of the page at ``pos`` when it is read in pieces
            for fut, (lo, hi) in zip(futures, spans, strict=True):
                waited += 1
                got = fut.get()
                if bad is not None:
                    continue  # only waited for
                end = lo + got
                while pos < end:
                    page, into = divmod(pos, page_bytes)
                    page_end = pos - into + page_bytes
                    if into == 0 and page_end <= end:  # a whole page landed
                        if _page_checksum(mv[pos:page_end]) != sums[first + page]:
                            bad = page
                            break
                        pos = page_end
                        continue
                    stop = min(page_end, end)  # a piece of a page
                    if stream is None:
                        stream = xxhash.xxh3_64()
                    stream.update(mv[pos:stop])
                    pos = stop
                    if stop == page_end:
                        if stream.intdigest() != sums[first + page]:
                            bad = page
                            break
                        stream.reset()
                if bad is None and got < hi - lo:
                    bad = end // page_bytes  # read short: the page holding the first byte missing
        finally:
            for fut in futures[waited:]:  # a pread or a check raised: the reads still in flight end first
                with contextlib.suppress(Exception):
                    fut.get()
        return bad

    @staticmethod
    def close(f: Any) -> None:
        f.close()


def _compat_mode(defaults: Any) -> str:
    """kvikio's compatibility mode as words: "ON", "OFF" or "AUTO", and with AUTO whether it falls back to POSIX
    reads here (no GPUDirect Storage). kvikio >= 25 has ``defaults.get("compat_mode")`` (an enum) and
    ``is_compat_mode_preferred()``; older releases ``defaults.compat_mode()`` (a bool)."""
    if hasattr(defaults, "get"):
        mode = defaults.get("compat_mode")
        name = getattr(mode, "name", str(mode))
        if hasattr(defaults, "is_compat_mode_preferred"):
            name += f" (POSIX reads: {bool(defaults.is_compat_mode_preferred())})"
        return name
    return "ON" if defaults.compat_mode() else "OFF"


def _open_backend(backend: str) -> tuple[str, Any, str | None]:
    """The backend's name, its I/O (open, pread, close) and kvikio's compatibility mode (None for POSIX): kvikio
    where asked (or "auto" and it works here), else POSIX."""
    if backend == POSIX:
        return POSIX, _PosixIO(), None
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        import kvikio  # the gpu extra
        import kvikio.defaults

        compat = _compat_mode(kvikio.defaults)
    except Exception as exc:  # noqa: BLE001 - any reason kvikio cannot serve here
        if backend == KVIKIO:
            raise RuntimeError(f"the kvikio spill backend was asked for and cannot run here: {exc}") from exc
        log.info("spill tier: kvikio unavailable (%s); POSIX reads", exc)
        return POSIX, _PosixIO(), None
    log.info("spill tier: kvikio reads (compatibility mode: %s)", compat)
    return KVIKIO, _KvikioIO(kvikio), str(compat)
