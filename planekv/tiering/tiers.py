"""Where block bytes live: the memory tier (host RAM) and the file tier (NVMe or any POSIX directory).

Tiers only store and fetch frames; capacity, LRU order, leases and the commit protocol are the
:class:`~planekv.tiering.blockstore.BlockStore`'s. A file tier is anything that satisfies
:class:`FileTier` (a kvikio/GDS implementation reading straight into GPU memory can replace
:class:`PosixFileTier` later without touching the store).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..kvstore.atomic import atomic_write_bytes
from . import failpoints
from .errors import BlockCorrupt, BlockError
from .frame import HEADER_BYTES, BlockKey, FrameHeader, decode_header

log = logging.getLogger(__name__)

MEMORY = "memory"
FILE = "file"


class BlockReader(Protocol):
    """An open handle on one stored frame, obtained while the store's lock is held (so removal or
    eviction afterwards cannot pull the bytes away) and read afterwards without the lock."""

    def read(self) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ScannedBlock:
    key: BlockKey
    header: FrameHeader
    size: int  # bytes on disk (the frame, 4 KiB aligned)
    mtime: float


class FileTier(Protocol):
    """Durable, crash-atomic storage of frames by key (the file tier's contract)."""

    name: str
    root: Path

    def write(self, key: BlockKey, frame: bytes) -> None:
        """Store ``frame`` so that after a crash either the whole frame or nothing is under ``key``."""

    def open(self, key: BlockKey) -> BlockReader:
        """Open the stored frame of ``key``; raises FileNotFoundError if absent."""

    def delete(self, key: BlockKey) -> None:
        """Remove ``key``'s frame; absent is not an error, any other failure raises OSError (a
        read-only tier, a permission error). Open readers keep working."""

    def exists(self, key: BlockKey) -> bool:
        """Whether a frame is stored under ``key`` (without reading it)."""

    def scan(self) -> Iterator[ScannedBlock]:
        """Every intact-looking frame on the tier (header parsed, size checked). Removes torn
        temporary files and renames unreadable files to ``*.corrupt`` so they are not rescanned."""


class MemoryTier:
    """Frames as immutable ``bytes`` in host RAM. Not thread-safe: the block store's lock guards it."""

    name = MEMORY

    def __init__(self) -> None:
        self._frames: dict[BlockKey, bytes] = {}

    def put(self, key: BlockKey, frame: bytes) -> None:
        self._frames[key] = frame

    def get(self, key: BlockKey) -> bytes | None:
        return self._frames.get(key)

    def pop(self, key: BlockKey) -> bytes | None:
        return self._frames.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._frames

    def __len__(self) -> int:
        return len(self._frames)


class _PosixReader:
    def __init__(self, fd: int, size: int) -> None:
        self._fd, self._size = fd, size

    def read(self) -> bytes:
        chunks, off = [], 0
        while off < self._size:
            b = os.pread(self._fd, self._size - off, off)
            if not b:
                break  # shorter than its size on open: the frame check reports truncation
            chunks.append(b)
            off += len(b)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class PosixFileTier:
    """Frames as files ``root/<format_id>/<sequence_id>/<kind>.<layer>.<head>.<p0>-<p1>.<b0>-<b1>.blk``.

    A write goes to a temporary file in the same directory, is fsynced, then renamed into place
    (and the directory fsynced), so a crash leaves the whole frame or nothing; readers never see a
    partial file under a block's name.
    """

    name = FILE
    TMP_PREFIX = ".tmp-"

    def __init__(self, root: str | os.PathLike[str], fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: BlockKey) -> Path:
        name = f"{key.kind}.{key.layer}.{key.kv_head}.{key.page_start}-{key.page_end}.{key.plane_start}-{key.plane_end}"
        return self.root / key.format_id / key.sequence_id / f"{name}.blk"

    def write(self, key: BlockKey, frame: bytes) -> None:
        failpoints.hit("file.write")
        atomic_write_bytes(self.path(key), frame, fsync=self.fsync, tmp_prefix=self.TMP_PREFIX)

    def open(self, key: BlockKey) -> BlockReader:
        fd = os.open(self.path(key), os.O_RDONLY)
        return _PosixReader(fd, os.fstat(fd).st_size)

    def delete(self, key: BlockKey) -> None:
        failpoints.hit("file.delete")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def exists(self, key: BlockKey) -> bool:
        return self.path(key).is_file()

    def check_writable(self) -> None:
        """Create and delete a probe file in the root; raises OSError if the tier cannot be written."""
        failpoints.hit("file.write")
        probe = self.root / f"{self.TMP_PREFIX}probe-{os.getpid()}"  # a leftover is removed by scan()
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
        failpoints.hit("file.delete")
        os.unlink(probe)

    def scan(self) -> Iterator[ScannedBlock]:
        for dirpath, _dirs, files in os.walk(self.root):
            for name in sorted(files):
                p = Path(dirpath) / name
                if name.startswith(self.TMP_PREFIX):
                    log.info("removing torn temporary file %s (a write that never committed)", p)
                    with contextlib.suppress(OSError):
                        p.unlink()
                    continue
                if not name.endswith(".blk"):
                    continue
                try:
                    st = p.stat()
                    with open(p, "rb") as f:
                        hdr = decode_header(f.read(HEADER_BYTES))
                    if p != self.path(hdr.key):
                        raise BlockCorrupt(f"holds block {hdr.key}, which belongs at {self.path(hdr.key)}")
                    if st.st_size != hdr.frame_bytes:
                        raise BlockCorrupt(f"is {st.st_size} bytes, its header promises {hdr.frame_bytes}")
                except (OSError, BlockError) as exc:
                    log.warning("quarantining %s: %s", p, exc)
                    with contextlib.suppress(OSError):
                        os.replace(p, p.with_name(p.name + ".corrupt"))
                    continue
                yield ScannedBlock(hdr.key, hdr, st.st_size, st.st_mtime)

