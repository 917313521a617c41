"""The block store: a memory tier that spills to a file tier, LRU, read leases, the commit rule.

Interface in the manner of LMCache's storage backends: ``contains / put / get / remove / close``,
a miss is ``None``, shared state is guarded by one lock. The protocol is Mooncake Store's:

- **put** verifies the frame, reserves room (choosing LRU victims that hold no lease and marking
  them *doomed*: still stored, still served, chosen by no other put), writes the new frame to the
  file tier (in write-through mode or when it is larger than the memory tier), then publishes the
  metadata (the listener, e.g. a Redis index, first). Only once the block is committed are the
  victims evicted (spilled to the file tier, dropped, or their files deleted); then the block
  enters memory and the local index. A failure before the commit undoes the reservation, deletes
  what was written and the metadata, releases the victims untouched, and raises: a failed put
  changes nothing else, and readers only ever see complete, immutable blocks.
- **capacity**: the memory tier's held + reserved bytes never exceed its capacity, also while
  puts evict. A put reserves only free room; the rest comes from its own victims, each one's bytes
  passing to it as its memory copy leaves (by the eviction after the commit, or by a DELETE
  meanwhile), never to another put; so the new frame enters memory only after its victims have
  left. A put whose room is held by puts in flight waits for them (``room_wait_s``). The file
  tier's accounting keeps the commit rule instead: a new frame written to it before the commit
  sits beside the victims it will evict, so the files may exceed ``file_bytes`` by the frames of
  such puts in flight (write-through or blocks larger than memory; spills are written after their
  victims' files are deleted). A put of a key whose previous incarnation's file is still being
  deleted (evicted from the file tier, or a failed put undone) waits for that delete
  (``room_wait_s``) rather than refusing.
- **remove** unpublishes from the listener first, then deletes the file, then the local entry; it
  returns only when the block is gone everywhere: if a spill of the block is writing its file, it
  waits for that write to land (or fail) and then deletes the file itself, so no copy is written
  after the answer; a key not stored whose previous incarnation's file is still being deleted
  answers False only once that file is gone. If the listener is unreachable nothing is
  deleted (IndexPublishError); if the file cannot be deleted the listener entry is restored and
  the block stays stored and listed (BlockUndeletable). Named failpoints (:mod:`.failpoints`) sit
  between the steps of both protocols.
- **get** takes a read *lease* under the lock (and opens the file, if the block is on the file
  tier), reads and verifies the checksum without the lock, and releases the lease. Eviction never
  chooses a leased block. ``remove`` unpublishes at once; a read already holding a lease finishes
  from its own reference (memory) or open file (POSIX). A block being spilled keeps its memory copy
  (served) until its file is complete, then is served from the file: never a miss while it moves.
- **eviction** is LRU per tier: the memory tier's victims spill to the file tier when it has room
  (evicting the file tier's own LRU blocks to make it), and are lost only when it cannot.
- **restart** rebuilds the index from the frames on the file tier (torn temporary files removed);
  if they exceed the capacity, the newest are deleted (a crash mid-put leaves its own frame in
  excess, and that put was never answered).
  On ``close()`` blocks held only in memory are written to the file tier (write-back mode).

Sizes are frame bytes (header + payload padded to 4 KiB).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..kvstore.errors import PlaneKVError
from . import failpoints
from .errors import (
    BlockBusy,
    BlockCorrupt,
    BlockError,
    BlockExists,
    BlockTooLarge,
    BlockUndeletable,
    IndexPublishError,
    StoreFull,
    StoreIOError,
)
from .frame import BlockKey, verify_frame
from .tiers import FILE, MEMORY, BlockReader, FileTier, MemoryTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockInfo:
    """Public metadata of a stored block; ``tiers`` lists where copies are (fastest first)."""

    key: BlockKey
    size: int
    checksum: int
    tiers: tuple[str, ...]


@dataclass(frozen=True)
class PutResult:
    info: BlockInfo
    created: bool  # False: the same block was already stored (idempotent put)


class BlockListener(Protocol):
    """Receives metadata changes (e.g. to publish a block index in Redis). ``gen`` identifies one
    incarnation of a key, so a late event of a deleted block cannot touch its successor."""

    def on_commit(self, info: BlockInfo, gen: str) -> None:
        """Called before the block becomes visible; raising undoes the put."""

    def on_change(self, info: BlockInfo, gen: str) -> None:
        """The block's tiers changed (spilled to the file tier, memory copy dropped)."""

    def on_remove(self, info: BlockInfo, gen: str, reason: str) -> None:
        """The block is gone (``reason``: deleted, evicted, corrupt, undone)."""

    def on_rebuild(self, blocks: list[tuple[BlockInfo, str]]) -> None:
        """The index was rebuilt from the file tier at start: these blocks are all there is."""


@dataclass(eq=False)
class _Entry:
    key: BlockKey
    size: int
    checksum: int
    gen: str
    data: bytes | None = None  # memory copy
    on_disk: bool = False
    leases: int = 0
    removed: bool = False
    removing: bool = False  # a remove() is in flight: a put of the key waits (BlockBusy)
    spilling: bool = False  # its memory copy is being written to the file tier: a remove() waits for it
    doomed: str | None = None  # the tier whose room an in-flight put will take from this victim
    doomer: _Plan | None = None  # that put (a memory victim's bytes go to it when its copy leaves memory)

    def info(self) -> BlockInfo:
        tiers = ((MEMORY,) if self.data is not None else ()) + ((FILE,) if self.on_disk else ())
        return BlockInfo(self.key, self.size, self.checksum, tiers)


@dataclass
class StoreStats:
    memory_capacity_bytes: int
    memory_used_bytes: int
    file_capacity_bytes: int
    file_used_bytes: int
    blocks: int
    blocks_memory: int
    blocks_file: int
    leases: int
    counters: dict[str, int] = field(default_factory=dict)


_COUNTERS = ("puts", "puts_existing", "put_bytes", "gets_memory", "gets_file", "misses", "get_bytes",
             "corrupt", "spills", "evictions_memory", "evictions_file", "deletes", "put_failures",
             "delete_failures", "spill_failures", "missing_files")


@dataclass
class _Plan:
    """The victims a put chose (doomed, untouched until the put commits) and the room it reserved
    (memory: the free part at once, the rest from its victims as their copies leave memory)."""

    spills: list[_Entry] = field(default_factory=list)  # memory victims moving to the file tier
    drop_copy: list[_Entry] = field(default_factory=list)  # memory victims already on the file tier
    lost: list[_Entry] = field(default_factory=list)  # memory victims with no room left anywhere
    evict_file: list[_Entry] = field(default_factory=list)  # file-tier victims, their files deleted
    file_reserved: int = 0  # file-tier bytes reserved (the new block if written there, the spills)
    mem_reserved: int = 0  # memory bytes reserved for the new block so far (counted in the tier's used bytes)
    mem_short: int = 0  # memory bytes it still lacks: they come from its victims as their copies leave memory


@dataclass
class _Eviction:
    """What a committed put's eviction does outside the lock."""

    file_deletes: list[BlockKey] = field(default_factory=list)
    spills: list[tuple[_Entry, bytes]] = field(default_factory=list)  # entry, its frame (taken under the lock)
    events: list[tuple[str, BlockInfo, str, str]] = field(default_factory=list)


class Lease:
    """A read lease on one block: eviction will not choose it until :meth:`release`.

    ``read()`` returns the whole frame (verified: magic, version, key, length, checksum), without
    holding the store's lock. Use as a context manager.
    """

    def __init__(self, store: BlockStore, entry: _Entry, data: bytes | None, reader: BlockReader | None) -> None:
        self._store, self._entry, self._data, self._reader = store, entry, data, reader
        self.key, self.size, self.checksum = entry.key, entry.size, entry.checksum
        self.tier = MEMORY if data is not None else FILE
        self._released = False

    def read(self) -> bytes:
        try:
            if self._data is not None:
                frame = self._data
            else:
                assert self._reader is not None
                frame = self._reader.read()
            verify_frame(frame, self.key)
        except (BlockError, OSError) as exc:
            self._store._discard_corrupt(self._entry, exc)
            if isinstance(exc, BlockError):
                raise
            raise StoreIOError(f"reading block {self.key} from the file tier failed: {exc}") from exc
        self._store._count("gets_memory" if self.tier == MEMORY else "gets_file", 1, len(frame))
        return frame

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._reader is not None:
                self._reader.close()
            self._store._release(self._entry)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BlockStore:
    """Framed blocks in a memory tier of ``memory_bytes`` spilling to ``file_tier`` (capacity
    ``file_bytes``). Thread-safe; file I/O happens outside the lock. The memory tier's held and
    reserved bytes never exceed ``memory_bytes``; a put that finds the room held by puts in flight
    waits for them up to ``room_wait_s`` seconds before refusing (StoreFull)."""

    def __init__(self, memory_bytes: int, file_tier: FileTier | None = None, file_bytes: int = 0, *,
                 write_through: bool = False, max_block_bytes: int = 64 << 20,
                 listener: BlockListener | None = None, persist_on_close: bool = True,
                 room_wait_s: float = 10.0) -> None:
        if memory_bytes < 0 or file_bytes < 0:
            raise ValueError("tier capacities must be >= 0 bytes")
        if write_through and file_tier is None:
            raise ValueError("write_through needs a file tier")
        self.memory = MemoryTier()
        self.file = file_tier
        self.memory_capacity = memory_bytes
        self.file_capacity = file_bytes if file_tier is not None else 0
        self.write_through = write_through
        self.max_block_bytes = max_block_bytes
        self.listener = listener
        self.persist_on_close = persist_on_close
        self._lock = threading.Lock()
        # notified when a put finishes, a lease is released, or file I/O on a key (a spill, a delete) ends
        self._room = threading.Condition(self._lock)
        self.room_wait_s = room_wait_s
        self._index: dict[BlockKey, _Entry] = {}
        self._pending: set[BlockKey] = set()
        # keys with file I/O in flight outside the lock (a spill, a write, a delete), counted: a new
        # incarnation of such a key must wait, or a late delete of the old one could remove its file
        self._file_busy: dict[BlockKey, int] = {}
        self._mem_lru: OrderedDict[BlockKey, _Entry] = OrderedDict()  # oldest first
        self._file_lru: OrderedDict[BlockKey, _Entry] = OrderedDict()
        self._mem_used = 0
        self._file_used = 0
        # memory: held + reserved bytes, never above memory_capacity (a doomed victim's room is its put's alone);
        # file: bytes of doomed victims, still held, already promised to an in-flight put's room
        self._file_doomed = 0
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._closed = False
        if self.file is not None:
            self._rebuild()

    # ---- the LMCache-like interface ----

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._index

    def __contains__(self, key: object) -> bool:
        return isinstance(key, BlockKey) and self.contains(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def info(self, key: BlockKey) -> BlockInfo | None:
        with self._lock:
            e = self._index.get(key)
            return e.info() if e is not None else None

    def get(self, key: BlockKey) -> bytes | None:
        """The verified frame of ``key``, or None on a miss. Raises BlockCorrupt (and discards the
        block) if the stored bytes fail their checksum."""
        lease = self.lease(key)
        if lease is None:
            return None
        with lease:
            return lease.read()

    def lease(self, key: BlockKey) -> Lease | None:
        """A read lease on ``key`` (None on a miss); release it when done (context manager)."""
        with self._lock:
            e = self._index.get(key)
            if e is None:
                self._counters["misses"] += 1
                return None
            data, reader = e.data, None
            events: list[tuple[str, BlockInfo, str, str]] = []
            if data is not None:
                self._mem_lru.move_to_end(key)
            else:
                assert self.file is not None
                try:
                    reader = self.file.open(key)
                except OSError as exc:
                    if e.removing:  # its remove() deleted the file already
                        self._counters["misses"] += 1
                        return None
                    self._unpublish_locked(e)
                    self._counters["corrupt"] += 1
                    events = [("remove", e.info(), e.gen, "corrupt")]
                    log.error("block %s vanished from the file tier (%s); dropped from the index", key, exc)
                    reader = None
                else:
                    self._file_lru.move_to_end(key)
            if data is not None or reader is not None:
                e.leases += 1
                return Lease(self, e, data, reader)
        self._emit(events)
        return None

    def put(self, key: BlockKey, frame: bytes) -> PutResult:
        """Store the frame of ``key`` (verified first). Idempotent for identical bytes; raises
        BlockExists for different bytes (blocks are immutable), BlockBusy while another put of the
        key is in flight, BlockTooLarge, StoreFull, StoreIOError or IndexPublishError."""
        if not isinstance(frame, bytes):
            frame = bytes(frame)
        size = len(frame)
        if size > self.max_block_bytes:
            raise BlockTooLarge(f"block of {size} bytes exceeds the store's maximum of {self.max_block_bytes}")
        hdr = verify_frame(frame, key)
        to_memory = size <= self.memory_capacity
        write_file = self.write_through or not to_memory
        if write_file and (self.file is None or size > self.file_capacity):
            raise BlockTooLarge(f"block of {size} bytes does not fit the memory tier ({self.memory_capacity} bytes)"
                                f" nor the file tier ({self.file_capacity} bytes)")
        deadline = time.monotonic() + self.room_wait_s
        with self._lock:
            while True:
                if self._closed:
                    raise StoreIOError("the block store is closed")
                e = self._index.get(key)
                if e is not None:
                    if e.removing:
                        raise BlockBusy(f"a DELETE of block {key} is in flight; retry when it has finished")
                    if e.checksum == hdr.checksum and e.size == size:
                        self._counters["puts_existing"] += 1
                        return PutResult(e.info(), created=False)
                    raise BlockExists(f"block {key} is already stored with other bytes; blocks are immutable: "
                                      "DELETE it first or write under a new key")
                if key in self._pending:
                    raise BlockBusy(f"another PUT of block {key} is in flight; retry when it has finished")
                if key in self._file_busy:
                    # The previous incarnation's file is still being deleted (evicted from the file tier, a
                    # failed put undone): wait for it, or its late delete could remove this block's file.
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BlockBusy(f"block {key}'s previous copy is still being written or deleted on the "
                                        f"file tier after {self.room_wait_s:g} s; retry when it has finished")
                    self._room.wait(left)
                    continue
                try:
                    plan = self._plan_room_locked(size, to_memory, write_file)
                    break
                except StoreFull:
                    # The room is held by puts in flight (their victims, pinned or promised): wait for one
                    # to finish, within room_wait_s. With none in flight, waiting would not help.
                    left = deadline - time.monotonic()
                    if not self._pending or left <= 0:
                        raise
                    self._room.wait(left)
            self._pending.add(key)
        gen = uuid.uuid4().hex
        info = BlockInfo(key, size, hdr.checksum, ((MEMORY,) if to_memory else ()) + ((FILE,) if write_file else ()))
        written = committed = False
        try:
            if write_file:
                assert self.file is not None
                try:
                    self.file.write(key, frame)
                except OSError as exc:
                    raise StoreIOError(f"writing block {key} to the file tier failed: {exc}") from exc
                written = True
                failpoints.hit("put.after_file_write")
            if self.listener is not None:
                try:
                    self.listener.on_commit(info, gen)
                except PlaneKVError:  # a typed refusal (e.g. FormatMismatch): passed on as is
                    committed = True
                    raise
                except Exception as exc:
                    committed = True  # it may have half-published: undo below
                    raise IndexPublishError(f"publishing the metadata of block {key} failed ({exc}); "
                                            "the write was undone, retry when the index is reachable") from exc
                committed = True
                failpoints.hit("put.after_publish")
        except BaseException:
            with self._lock:
                self._pending.discard(key)
                self._room.notify_all()
                self._counters["put_failures"] += 1
                self._mem_used -= plan.mem_reserved
                self._file_used -= plan.file_reserved
                for v in plan.spills + plan.drop_copy + plan.lost + plan.evict_file:
                    self._undoom_locked(v)  # the victims stay as they were
                if written:
                    self._file_io_begin_locked(key)
            if written:
                self._delete_file(key)
                self._file_io_end(key)
            if committed and self.listener is not None:
                self._emit([("remove", info, gen, "undone")])
            raise
        # Committed: evict the victims, then (their memory room now the put's) make the block local.
        with self._lock:
            eviction = self._evict_locked(plan)
        self._run_eviction(eviction)
        with self._lock:
            events = self._claim_memory_locked(plan) if plan.mem_short else []
            self._room.notify_all()  # this put is no longer in flight: a put waiting for room retries
            if plan.mem_short:  # every other block is leased or promised: undo the put, as before its commit
                self._pending.discard(key)
                self._counters["put_failures"] += 1
                self._mem_used -= plan.mem_reserved
                if write_file:
                    self._file_used -= size
                    self._file_io_begin_locked(key)
            else:
                e = _Entry(key, size, hdr.checksum, gen, data=frame if to_memory else None, on_disk=write_file)
                self._index[key] = e
                if to_memory:
                    self.memory.put(key, frame)
                    self._mem_lru[key] = e
                if write_file:
                    self._file_lru[key] = e
                self._pending.discard(key)
                self._counters["puts"] += 1
                self._counters["put_bytes"] += size
        self._emit(events)
        if plan.mem_short:
            if write_file:
                self._delete_file(key)
                self._file_io_end(key)
            self._emit([("remove", info, gen, "undone")])
            raise StoreFull(f"memory tier full ({self.memory_capacity} bytes) of blocks leased by reads or promised "
                            f"to puts in flight; block {key} was not stored: retry shortly or raise "
                            "PLANEKV_STORE__MEMORY_BYTES")
        return PutResult(info, created=True)

    def remove(self, key: BlockKey) -> bool:
        """Delete ``key``: True once it is gone from the listener's index, the file tier and memory;
        False if it was not stored. Reads holding a lease finish undisturbed. A spill of the block in
        flight is waited for (its file is then deleted here, before the answer), and so is the delete
        of a previous incarnation's file before answering False: whatever the answer, no copy of the
        block is on any tier once it is given. Raises BlockBusy while another remove of the key is in
        flight (or a spill or delete waited for outlasts ``room_wait_s``: nothing deleted),
        IndexPublishError if the listener cannot unpublish it (nothing deleted), BlockUndeletable if
        its file cannot be deleted (the block is kept, still stored and listed)."""
        deadline = time.monotonic() + self.room_wait_s
        with self._lock:
            e = self._index.get(key)
            if e is None:
                # Not stored, but an evicted (or undone) incarnation's file may still be being deleted:
                # answer once it is gone (a restart would otherwise find it). A new incarnation
                # committed meanwhile ends the wait: the key was not stored when this remove began.
                if not self._wait_locked(lambda: key not in self._file_busy or key in self._index, deadline):
                    raise BlockBusy(f"block {key} is not stored but its previous copy's file is still being "
                                    f"deleted after {self.room_wait_s:g} s; retry")
                return False
            if e.removing:
                raise BlockBusy(f"another DELETE of block {key} is in flight; retry when it has finished")
            e.removing = True
            info = e.info()
        unpublished = file_deleted = False
        try:
            if self.listener is not None:
                try:
                    self.listener.on_remove(info, e.gen, "deleted")
                except Exception as exc:
                    raise IndexPublishError(f"unpublishing block {key} failed ({exc}); nothing was deleted, the "
                                            "block is still stored: retry when the index is reachable") from exc
                unpublished = True
            failpoints.hit("delete.after_index")
            with self._lock:
                # A spill (an LRU eviction from memory) may be writing its file right now: wait until the
                # file is complete (or the write failed), so that the file is deleted here, before the
                # answer, instead of landing after it. No new spill starts: eviction skips `removing`.
                if not self._wait_locked(lambda: not e.spilling, deadline):
                    raise BlockBusy(f"block {key} is being spilled to the file tier and its file was not written "
                                    f"after {self.room_wait_s:g} s; nothing was deleted, retry")
                on_disk = e.on_disk
            if self.file is not None and on_disk:
                try:
                    self.file.delete(key)
                except OSError as exc:
                    with self._lock:
                        self._counters["delete_failures"] += 1
                    raise BlockUndeletable(f"the file of block {key} could not be deleted ({exc}); the block is "
                                           "kept (still stored and listed): make the spill directory writable "
                                           "and DELETE again") from exc
                file_deleted = True
        except BaseException:
            with self._lock:
                e.removing = False
                info = e.info()
            if unpublished:  # the block is kept: list it again
                self._republish(info, e.gen)
            raise
        with self._lock:
            late_file = self._unpublish_locked(e) and not file_deleted  # written meanwhile (close())
            self._counters["deletes"] += 1
            if late_file:
                self._file_io_begin_locked(key)
        if late_file:
            self._delete_file(key)
            self._file_io_end(key)
        return True

    def _republish(self, info: BlockInfo, gen: str) -> None:
        """Put a block whose remove failed back into the listener's index (best effort: a later
        reconciliation republishes what this misses)."""
        if self.listener is None:
            return
        try:
            self.listener.on_commit(info, gen)
        except Exception as exc:
            log.error("block %s is kept but could not be republished to the index (%s); the next "
                      "reconciliation republishes it", info.key, exc)

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return list(self._index)

    def infos(self) -> list[BlockInfo]:
        with self._lock:
            return [e.info() for e in self._index.values()]

    def snapshot(self) -> tuple[dict[BlockKey, tuple[BlockInfo, str]], set[BlockKey]]:
        """The committed blocks (key -> (info, gen)) and the keys with a put, remove or file I/O in
        flight, whose index entries a reconciliation must leave alone this time."""
        with self._lock:
            held = {k: (e.info(), e.gen) for k, e in self._index.items() if not e.removing}
            busy = set(self._pending) | set(self._file_busy) | {k for k, e in self._index.items() if e.removing}
        return held, busy

    def state(self, key: BlockKey) -> tuple[BlockInfo, str] | None:
        """(info, gen) of ``key`` if it is stored and no remove of it is in flight, else None."""
        with self._lock:
            e = self._index.get(key)
            return (e.info(), e.gen) if e is not None and not e.removing else None

    def drop_missing_files(self) -> int:
        """Drop the blocks held only on the file tier whose file is gone (removed behind the store's
        back); returns how many (also counted as ``missing_files``)."""
        if self.file is None:
            return 0
        with self._lock:
            cands = [e for e in self._file_lru.values()
                     if e.data is None and not e.leases and not e.removing and not e.doomed]
        gone = [e for e in cands if not self.file.exists(e.key)]
        events: list[tuple[str, BlockInfo, str, str]] = []
        with self._lock:
            for e in gone:
                if self._index.get(e.key) is not e or e.data is not None or e.leases or e.removing or e.doomed:
                    continue
                self._unpublish_locked(e)
                self._counters["missing_files"] += 1
                events.append(("remove", e.info(), e.gen, "missing"))
        for _kind, info, _gen, _reason in events:
            log.warning("block %s is listed but its file is gone from %s; dropped", info.key, self.file.root)
        self._emit(events)
        return len(events)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                memory_capacity_bytes=self.memory_capacity, memory_used_bytes=self._mem_used,
                file_capacity_bytes=self.file_capacity, file_used_bytes=self._file_used,
                blocks=len(self._index), blocks_memory=len(self._mem_lru), blocks_file=len(self._file_lru),
                leases=sum(e.leases for e in self._index.values()), counters=dict(self._counters))

    def close(self) -> None:
        """Write blocks held only in memory to the file tier (if it has room), then refuse puts."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._room.notify_all()  # a put waiting for room gives up now
            todo = [e for e in self._mem_lru.values() if not e.on_disk] if self.persist_on_close else []
        if self.file is None or not todo:
            return
        kept = lost = 0
        for e in reversed(todo):  # most recently used first
            with self._lock:
                data = e.data
                if e.removed or e.removing or e.on_disk or data is None:
                    continue
                if self._file_used + e.size > self.file_capacity:
                    lost += 1
                    continue
                self._file_used += e.size
                self._file_io_begin_locked(e.key)
            try:
                try:
                    self.file.write(e.key, data)
                except OSError as exc:
                    log.error("could not persist block %s at close: %s", e.key, exc)
                    with self._lock:
                        self._file_used -= e.size
                    lost += 1
                    continue
                with self._lock:
                    gone = e.removed
                    if not gone:
                        e.on_disk = True
                        self._file_lru[e.key] = e
                    else:
                        self._file_used -= e.size
                if gone:
                    self._delete_file(e.key)
                else:
                    kept += 1
            finally:
                self._file_io_end(e.key)
        log.info("block store closed: %d memory-only blocks written to the file tier, %d did not fit", kept, lost)

    # ---- internals (the lock is held where the name says _locked) ----

    def _count(self, name: str, n: int, nbytes: int = 0) -> None:
        with self._lock:
            self._counters[name] += n
            if nbytes:
                self._counters["get_bytes"] += nbytes

    def _release(self, e: _Entry) -> None:
        with self._lock:
            e.leases -= 1
            self._room.notify_all()

    def _file_io_begin_locked(self, key: BlockKey) -> None:
        """File I/O on ``key`` is about to run outside the lock; a new put of ``key`` waits for it."""
        self._file_busy[key] = self._file_busy.get(key, 0) + 1

    def _file_io_end(self, key: BlockKey) -> None:
        with self._lock:
            n = self._file_busy[key] - 1
            if n:
                self._file_busy[key] = n
            else:
                del self._file_busy[key]
                self._room.notify_all()  # a put or remove of the key waiting for this I/O goes on

    def _wait_locked(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait (the lock released meanwhile) until ``ready()``; False if ``deadline`` passes first."""
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._room.wait(left)
        return True

    def _unpublish_locked(self, e: _Entry) -> bool:
        """Remove ``e`` from the index and the tiers' accounting; True if its file must be deleted.
        Idempotent: an entry already removed (and a successor under its key) is left alone."""
        if e.removed:
            self._undoom_locked(e)
            return False
        if self._index.get(e.key) is e:
            del self._index[e.key]
        e.removed = True
        if e.data is not None:
            self._drop_memory_locked(e)
        self._undoom_locked(e)
        on_disk = e.on_disk
        if on_disk:
            self._file_lru.pop(e.key, None)
            self._file_used -= e.size
            e.on_disk = False
        return on_disk

    def _drop_memory_locked(self, e: _Entry) -> None:
        """Drop ``e``'s memory copy. Its bytes go to the put that doomed it, up to what that put still
        lacks (so no other put can take them first); the rest are free."""
        self.memory.pop(e.key)
        self._mem_lru.pop(e.key, None)
        e.data = None
        plan = e.doomer if e.doomed == MEMORY else None
        give = min(e.size, plan.mem_short) if plan is not None else 0
        if plan is not None:
            plan.mem_short -= give
            plan.mem_reserved += give
        self._mem_used -= e.size - give

    def _doom_locked(self, e: _Entry, tier: str, plan: _Plan) -> None:
        e.doomed, e.doomer = tier, plan
        if tier == FILE:
            self._file_doomed += e.size

    def _undoom_locked(self, e: _Entry) -> None:
        if e.doomed == FILE:
            self._file_doomed -= e.size
        e.doomed = e.doomer = None

    def _claim_memory_locked(self, plan: _Plan) -> list[tuple[str, BlockInfo, str, str]]:
        """After the commit, the memory a put still lacks (a victim deleted by another request, or whose
        spill failed): free room first, then the LRU blocks' memory copies now (dropped if on the file
        tier, else lost). Returns the index events; ``plan.mem_short`` stays > 0 if all are leased or
        promised."""
        take = min(plan.mem_short, self.memory_capacity - self._mem_used)
        plan.mem_short -= take
        plan.mem_reserved += take
        self._mem_used += take
        events: list[tuple[str, BlockInfo, str, str]] = []
        for e in list(self._mem_lru.values()):
            if plan.mem_short <= 0:
                break
            if e.leases or e.doomed or e.removing:
                continue
            self._doom_locked(e, MEMORY, plan)
            if e.on_disk:
                self._drop_memory_locked(e)
                self._undoom_locked(e)
                events.append(("change", e.info(), e.gen, ""))
            else:
                self._unpublish_locked(e)
                events.append(("remove", e.info(), e.gen, "evicted"))
                self._counters["evictions_memory"] += 1
                log.warning("evicted block %s from memory with no room on the file tier: its data is lost", e.key)
        return events

    def _plan_room_locked(self, size: int, to_memory: bool, write_file: bool) -> _Plan:
        """Choose victims so the new block fits and doom them (they stay stored and served until the
        put commits), reserve the room; raise StoreFull if no room can be made."""
        plan = _Plan()
        victims: list[_Entry] = []
        if to_memory:
            # Only free room counts: a doomed victim's bytes are promised to the put that doomed it.
            need = self._mem_used + size - self.memory_capacity
            if need > 0:
                for e in self._mem_lru.values():
                    if e.leases or e.doomed or e.removing:
                        continue
                    victims.append(e)
                    need -= e.size
                    if need <= 0:
                        break
                if need > 0:
                    raise StoreFull(
                        f"memory tier full ({self._mem_used} of {self.memory_capacity} bytes) and the "
                        "remaining blocks are leased by reads or puts in flight; retry shortly or raise "
                        "PLANEKV_STORE__MEMORY_BYTES")
        victim_ids = {id(v) for v in victims}
        free = self.file_capacity - (self._file_used - self._file_doomed)
        file_cands = [e for e in self._file_lru.values()
                      if not e.leases and not e.doomed and not e.removing and id(e) not in victim_ids]
        evictable = sum(e.size for e in file_cands)
        new_file = size if write_file else 0
        if new_file > free + evictable:
            raise StoreFull(f"file tier full ({self._file_used} of {self.file_capacity} bytes) and the remaining "
                            "blocks are leased; retry shortly or raise PLANEKV_STORE__FILE_BYTES")
        budget = free + evictable - new_file
        for v in reversed(victims):  # the most recently used victims get the file tier's room first
            if v.on_disk:
                plan.drop_copy.append(v)
            elif self.file is not None and v.size <= budget:
                plan.spills.append(v)
                budget -= v.size
            else:
                plan.lost.append(v)
        need_file = new_file + sum(v.size for v in plan.spills) - free
        for e in file_cands:
            if need_file <= 0:
                break
            need_file -= e.size
            plan.evict_file.append(e)
            self._doom_locked(e, FILE, plan)
        for v in victims:
            self._doom_locked(v, MEMORY, plan)
        if to_memory:  # the free part now; the rest as the victims' copies leave memory
            plan.mem_reserved = min(size, self.memory_capacity - self._mem_used)
            plan.mem_short = size - plan.mem_reserved
            self._mem_used += plan.mem_reserved
        plan.file_reserved = new_file + sum(v.size for v in plan.spills)
        self._file_used += plan.file_reserved
        return plan

    def _evict_locked(self, plan: _Plan) -> _Eviction:
        """The put has committed: evict its victims (those not deleted meanwhile). Applies the
        accounting; returns the file I/O and index events to run outside the lock."""
        ev = _Eviction()
        for e in plan.evict_file:
            if e.doomed != FILE or e.removing:  # deleted meanwhile, or a DELETE of it is running
                self._undoom_locked(e)
                continue
            self._unpublish_locked(e)
            ev.file_deletes.append(e.key)
            self._file_io_begin_locked(e.key)
            ev.events.append(("remove", e.info(), e.gen, "evicted"))
            self._counters["evictions_file"] += 1
        for v in plan.drop_copy:
            if v.doomed != MEMORY:
                continue
            if v.data is not None:
                self._drop_memory_locked(v)
                ev.events.append(("change", v.info(), v.gen, ""))
            self._undoom_locked(v)
        for v in plan.lost:
            if v.doomed != MEMORY or v.removing:
                self._undoom_locked(v)
                continue
            self._unpublish_locked(v)
            ev.events.append(("remove", v.info(), v.gen, "evicted"))
            self._counters["evictions_memory"] += 1
            log.warning("evicted block %s from memory with no room on the file tier: its data is lost", v.key)
        for v in plan.spills:
            if v.doomed != MEMORY or v.data is None or v.removing:
                self._undoom_locked(v)
                self._file_used -= v.size  # its reserved file room is not needed
                continue
            v.leases += 1  # pinned until written; it stays doomed so no other put picks it
            v.spilling = True  # a remove() of it now waits for the write (see remove)
            self._file_io_begin_locked(v.key)
            ev.spills.append((v, v.data))
        return ev

    def _run_eviction(self, ev: _Eviction) -> None:
        try:
            failpoints.hit("put.during_evict")
        except Exception as exc:  # only a kill means something here; keep the books either way
            log.error("eviction interrupted by %s; continuing", exc)
        self._emit(ev.events)  # the index first, as in remove()
        for k in ev.file_deletes:  # unpublished already
            self._delete_file(k)
            self._file_io_end(k)
        for v, data in ev.spills:
            try:
                self._spill_one(v, data)
            finally:
                self._file_io_end(v.key)

    def _spill_one(self, v: _Entry, data: bytes) -> None:
        """Write one pinned, doomed victim to the file tier and drop its memory copy (its room goes to
        its put); if the write fails it stays in memory, released, and its put claims room from the
        LRU blocks instead (:meth:`_claim_memory_locked`)."""
        try:
            assert self.file is not None
            self.file.write(v.key, data)
        except OSError as exc:
            with self._lock:
                v.leases -= 1
                v.spilling = False
                self._room.notify_all()
                self._file_used -= v.size
                self._undoom_locked(v)
                self._counters["spill_failures"] += 1
            log.error("spilling block %s to the file tier failed (%s); it stays in memory", v.key, exc)
            return
        except BaseException:  # not an I/O error (a failpoint, an interrupt): a remove() waiting for it goes on
            with self._lock:
                v.spilling = False
                self._room.notify_all()
            raise
        with self._lock:
            v.leases -= 1
            v.spilling = False
            self._room.notify_all()  # a remove() waiting for this spill goes on (and deletes the file)
            if v.removed:  # discarded (corrupt) while spilling: its file must go too
                self._file_used -= v.size
                delete, event = True, None
            else:
                self._drop_memory_locked(v)
                self._undoom_locked(v)
                v.on_disk = True
                self._file_lru[v.key] = v
                self._counters["spills"] += 1
                delete, event = False, ("change", v.info(), v.gen, "")
        if delete:
            self._delete_file(v.key)
        if event is not None:
            self._emit([event])

    def _delete_file(self, key: BlockKey) -> None:
        if self.file is not None:
            try:
                self.file.delete(key)
            except OSError as exc:
                log.error("could not delete the file of block %s: %s", key, exc)

    def _discard_corrupt(self, e: _Entry, exc: BaseException) -> None:
        with self._lock:
            self._counters["corrupt"] += 1
            if e.removed or self._index.get(e.key) is not e:
                return
            on_disk = self._unpublish_locked(e) and self.file is not None
            if on_disk:
                self._file_io_begin_locked(e.key)
        log.error("block %s failed verification on read (%s); discarded", e.key, exc)
        if on_disk:
            self._quarantine(e.key)
            self._file_io_end(e.key)
        self._emit([("remove", e.info(), e.gen, "corrupt")])

    def _quarantine(self, key: BlockKey) -> None:
        path = getattr(self.file, "path", None)
        if callable(path):
            p = path(key)
            try:
                os.replace(p, p.with_name(p.name + ".corrupt"))
                return
            except OSError:
                pass
        self._delete_file(key)

    def _emit(self, events: list[tuple[str, BlockInfo, str, str]]) -> None:
        if self.listener is None:
            return
        for kind, info, gen, reason in events:
            try:
                if kind == "change":
                    self.listener.on_change(info, gen)
                else:
                    self.listener.on_remove(info, gen, reason)
            except Exception as exc:  # best effort: the local index stays the truth for reads
                log.warning("block index update (%s %s) failed: %s", kind, info.key, exc)

    def _rebuild(self) -> None:
        assert self.file is not None
        scanned = sorted(self.file.scan(), key=lambda s: s.mtime)  # oldest first = LRU order
        for s in scanned:
            e = _Entry(s.key, s.size, s.header.checksum, uuid.uuid4().hex, on_disk=True)
            self._index[s.key] = e
            self._file_lru[s.key] = e
            self._file_used += s.size
        # Over capacity only after a crash between a put's file write and its eviction (or a smaller
        # capacity): the newest files give way, as they belong to puts that were never answered.
        over = list(self._file_lru.values())
        while self._file_used > self.file_capacity and over:
            e = over.pop()
            self._unpublish_locked(e)
            self._delete_file(e.key)
            self._counters["evictions_file"] += 1
        if scanned:
            log.info("block index rebuilt from %s: %d blocks, %d bytes", self.file.root, len(self._index),
                     self._file_used)
        if self.listener is not None:
            try:
                self.listener.on_rebuild([(e.info(), e.gen) for e in self._index.values()])
            except Exception as exc:
                raise IndexPublishError(f"publishing the rebuilt block index failed: {exc}") from exc


__all__ = ["BlockCorrupt", "BlockInfo", "BlockListener", "BlockStore", "Lease", "PutResult", "StoreStats"]
