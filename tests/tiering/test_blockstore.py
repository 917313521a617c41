"""The block store: LRU across tiers, leases, the commit rule, checksum on read, index rebuild."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest

from planekv.tiering import (
    FILE,
    MEMORY,
    BlockBusy,
    BlockExists,
    BlockKey,
    BlockKeyMismatch,
    BlockStore,
    BlockTooLarge,
    BlockUndeletable,
    ChecksumMismatch,
    IndexPublishError,
    PosixFileTier,
    StoreFull,
    StoreIOError,
    encode_frame,
    failpoints,
)

FID = "0123456789abcdef"
PAYLOAD = 3 * 4096 + 100  # frame = 4 KiB header + 16 KiB
FRAME = 4096 + 4 * 4096


def key(i: int, seq: str = "s") -> BlockKey:
    return BlockKey(FID, seq, "v", i, 0, 0, 8, 4, 8)


def frame(i: int, seq: str = "s", fill: int = 0) -> bytes:
    return encode_frame(key(i, seq), bytes([(i + fill) % 256]) * PAYLOAD)


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_put_get_contains_remove_and_a_miss_is_none():
    s = BlockStore(memory_bytes=10 * FRAME)
    assert s.get(key(0)) is None and not s.contains(key(0))
    r = s.put(key(0), frame(0))
    assert r.created and r.info.tiers == (MEMORY,) and r.info.size == FRAME
    assert s.get(key(0)) == frame(0) and key(0) in s
    assert s.remove(key(0)) and not s.remove(key(0))
    assert s.get(key(0)) is None


def test_blocks_are_immutable_and_put_is_idempotent():
    s = BlockStore(memory_bytes=10 * FRAME)
    s.put(key(0), frame(0))
    assert not s.put(key(0), frame(0)).created
    with pytest.raises(BlockExists, match="immutable"):
        s.put(key(0), frame(0, fill=1))


def test_put_verifies_the_frame_against_its_key():
    s = BlockStore(memory_bytes=10 * FRAME)
    with pytest.raises(BlockKeyMismatch):
        s.put(key(1), frame(0))
    bad = bytearray(frame(0))
    bad[-5000] ^= 1
    with pytest.raises(ChecksumMismatch):
        s.put(key(0), bytes(bad))
    with pytest.raises(BlockTooLarge):
        BlockStore(memory_bytes=FRAME - 1).put(key(0), frame(0))
    assert len(s) == 0


def test_lru_spills_to_the_file_tier_instead_of_losing_data(tmp_path):
    s = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    for i in range(5):
        s.put(key(i), frame(i))
    st = s.stats()
    assert (st.blocks, st.blocks_memory, st.blocks_file) == (5, 2, 3)
    assert st.memory_used_bytes == 2 * FRAME and st.file_used_bytes == 3 * FRAME
    assert [s.info(key(i)).tiers for i in range(5)] == [(FILE,)] * 3 + [(MEMORY,)] * 2  # oldest spilled
    assert all(s.get(key(i)) == frame(i) for i in range(5))
    assert st.counters["spills"] == 3 and st.counters["evictions_memory"] == 0


def test_lru_order_follows_reads(tmp_path):
    s = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    s.get(key(0))  # 0 is now the most recently used
    s.put(key(2), frame(2))
    assert s.info(key(0)).tiers == (MEMORY,) and s.info(key(1)).tiers == (FILE,)


def test_a_leased_block_is_never_evicted():
    s = BlockStore(memory_bytes=2 * FRAME)  # no file tier: eviction loses data
    s.put(key(0), frame(0))
    with s.lease(key(0)) as lease:
        for i in range(1, 6):
            s.put(key(i), frame(i))
        assert s.contains(key(0)) and lease.read() == frame(0)
        assert s.stats().counters["evictions_memory"] == 4
    # once released, block 0 is the LRU victim again
    s.put(key(9), frame(9))
    assert not s.contains(key(0))


def test_full_of_leased_blocks_refuses_with_store_full():
    s = BlockStore(memory_bytes=2 * FRAME)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    with s.lease(key(0)), s.lease(key(1)), pytest.raises(StoreFull, match="leased"):
        s.put(key(2), frame(2))
    assert s.stats().memory_used_bytes == 2 * FRAME
    s.put(key(2), frame(2))  # leases released: fine


def test_file_tier_full_evicts_its_own_lru(tmp_path):
    s = BlockStore(memory_bytes=FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=2 * FRAME)
    for i in range(5):
        s.put(key(i), frame(i))
    assert [s.contains(key(i)) for i in range(5)] == [False, False, True, True, True]
    assert s.stats().file_used_bytes == 2 * FRAME and len(files(tmp_path)) == 2


def test_remove_during_a_lease_lets_the_read_finish(tmp_path):
    s = BlockStore(memory_bytes=FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=4 * FRAME)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))  # 0 spills to the file tier
    lease = s.lease(key(0))
    assert lease is not None and lease.tier == FILE
    assert s.remove(key(0)) and files(tmp_path) == []  # unlinked at once
    assert lease.read() == frame(0)  # the open file outlives the unlink
    lease.release()
    assert s.stats().file_used_bytes == 0


def test_checksum_is_verified_on_every_read_and_a_corrupt_block_is_discarded(tmp_path):
    tier = PosixFileTier(tmp_path, fsync=False)
    s = BlockStore(memory_bytes=FRAME, file_tier=tier, file_bytes=4 * FRAME)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    p = tier.path(key(0))
    raw = bytearray(p.read_bytes())
    raw[8000] ^= 0xFF
    p.write_bytes(raw)
    with pytest.raises(ChecksumMismatch):
        s.get(key(0))
    assert s.get(key(0)) is None and s.stats().counters["corrupt"] == 1
    assert (p.parent / (p.name + ".corrupt")).exists()


def test_a_failed_file_write_publishes_nothing(tmp_path, monkeypatch):
    tier = PosixFileTier(tmp_path)
    s = BlockStore(memory_bytes=4 * FRAME, file_tier=tier, file_bytes=4 * FRAME, write_through=True)

    def torn_write(f, data):  # half the bytes reach the temp file, then the disk fails
        os.write(f.fileno() if hasattr(f, "fileno") else f, bytes(data)[: len(data) // 2])
        raise OSError(28, "No space left on device")

    import planekv.tiering.tiers as tiers_mod

    real_fdopen = tiers_mod.os.fdopen

    class Torn:
        def __init__(self, fd, *a, **kw):
            self._f = real_fdopen(fd, *a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def write(self, data):
            torn_write(self._f, data)

        def fileno(self):
            return self._f.fileno()

    monkeypatch.setattr(tiers_mod.os, "fdopen", Torn)
    with pytest.raises(StoreIOError, match="No space"):
        s.put(key(0), frame(0))
    monkeypatch.undo()
    assert not s.contains(key(0)) and s.get(key(0)) is None
    assert files(tmp_path) == []  # no torn temp file, no block file
    st = s.stats()
    assert st.memory_used_bytes == 0 and st.file_used_bytes == 0 and st.counters["put_failures"] == 1
    s.put(key(0), frame(0))  # the key is free again
    assert s.get(key(0)) == frame(0)


class _Listener:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.events = fail, []

    def on_commit(self, info, gen):
        self.events.append(("commit", str(info.key), info.tiers))
        if self.fail:
            raise ConnectionError("redis down")

    def on_change(self, info, gen):
        self.events.append(("change", str(info.key), info.tiers))

    def on_remove(self, info, gen, reason):
        self.events.append(("remove", str(info.key), reason))

    def on_rebuild(self, blocks):
        self.events.append(("rebuild", len(blocks)))


def test_a_failed_metadata_publish_undoes_the_write(tmp_path):
    lst = _Listener(fail=True)
    s = BlockStore(memory_bytes=4 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=4 * FRAME,
                   write_through=True, listener=lst)
    with pytest.raises(IndexPublishError, match="undone"):
        s.put(key(0), frame(0))
    assert not s.contains(key(0)) and files(tmp_path) == []
    assert lst.events[-1] == ("remove", str(key(0)), "undone")  # the half-published metadata is deleted
    assert s.stats().memory_used_bytes == 0 and s.stats().file_used_bytes == 0


def test_listener_sees_commit_spill_and_eviction(tmp_path):
    lst = _Listener()
    s = BlockStore(memory_bytes=FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=FRAME, listener=lst)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))  # 0 spills
    s.put(key(2), frame(2))  # 1 must spill, so 0 is evicted from the file tier
    k0, k1, k2 = (str(key(i)) for i in range(3))
    # each new block is committed before its victims are evicted (a failed put evicts nothing)
    assert lst.events == [("rebuild", 0), ("commit", k0, (MEMORY,)), ("commit", k1, (MEMORY,)), ("change", k0, (FILE,)),
                          ("commit", k2, (MEMORY,)), ("remove", k0, "evicted"), ("change", k1, (FILE,))]


def test_index_is_rebuilt_from_disk_at_restart(tmp_path):
    s = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    for i in range(4):
        s.put(key(i), frame(i))
    s.close()  # write-back: blocks held only in memory are persisted
    # a torn temporary file (a write that never committed) and a frame in the wrong place
    (tmp_path / FID / "s" / ".tmp-abc").write_bytes(b"half a frame")
    (tmp_path / FID / "s" / "v.9.0.0-8.4-8.blk").write_bytes(frame(1))
    s2 = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    assert sorted(s2.keys()) == [key(i) for i in range(4)]
    assert all(s2.get(key(i)) == frame(i) for i in range(4))
    names = files(tmp_path)
    assert ".tmp-abc" not in names and "v.9.0.0-8.4-8.blk.corrupt" in names


def test_without_close_only_spilled_blocks_survive(tmp_path):
    s = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    for i in range(4):
        s.put(key(i), frame(i))
    s2 = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path), file_bytes=10 * FRAME)
    assert sorted(s2.keys()) == [key(0), key(1)]


class _SlowDeleteTier(PosixFileTier):
    """A file tier whose deletes wait for ``go``: the window in which a late delete of a removed
    block's file could remove the file of a new block under the same key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.deleting, self.go = threading.Event(), threading.Event()

    def delete(self, key: BlockKey) -> None:
        self.deleting.set()
        assert self.go.wait(10)
        super().delete(key)


def test_a_new_block_under_a_key_whose_old_file_is_being_deleted_waits_and_keeps_its_file(tmp_path):
    tier = _SlowDeleteTier(tmp_path)
    s = BlockStore(memory_bytes=10 * FRAME, file_tier=tier, file_bytes=10 * FRAME, write_through=True)
    s.put(key(0), frame(0))
    remover = threading.Thread(target=s.remove, args=(key(0),))
    remover.start()
    assert tier.deleting.wait(10)
    with pytest.raises(BlockBusy, match="retry"):  # the old file's delete is still in flight
        s.put(key(0), frame(0, fill=1))
    tier.go.set()
    remover.join(10)
    assert s.put(key(0), frame(0, fill=1)).created
    assert s.get(key(0)) == frame(0, fill=1)
    s2 = BlockStore(memory_bytes=10 * FRAME, file_tier=PosixFileTier(tmp_path, fsync=False), file_bytes=10 * FRAME)
    assert s2.get(key(0)) == frame(0, fill=1)  # the new block's file survived the old one's delete


def test_concurrent_puts_gets_and_removes_keep_the_books(tmp_path):
    s = BlockStore(memory_bytes=3 * FRAME, file_tier=PosixFileTier(tmp_path, fsync=False), file_bytes=6 * FRAME)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for r in range(30):
                i = (w * 7 + r) % 12
                try:
                    s.put(key(i), frame(i))
                except (StoreFull, BlockExists, BlockBusy):
                    pass
                got = s.get(key((i + 3) % 12))
                assert got is None or got == frame((i + 3) % 12)
                if r % 5 == 0:
                    with contextlib.suppress(BlockBusy):  # another remove of that key is in flight
                        s.remove(key((i + 1) % 12))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    st = s.stats()
    infos = s.infos()
    assert st.leases == 0
    assert st.memory_used_bytes == sum(i.size for i in infos if MEMORY in i.tiers) <= 3 * FRAME
    assert st.file_used_bytes == sum(i.size for i in infos if FILE in i.tiers) <= 6 * FRAME
    on_disk = {p.name for p in tmp_path.rglob("*.blk")}
    assert len(on_disk) == sum(FILE in i.tiers for i in infos)


# ---- the commit and delete protocols under faults (failpoints: planekv.tiering.failpoints) ----


def _full_write_through_store(root: Path, listener: object = None) -> BlockStore:
    """Blocks 0 and 1 committed in a write-through store whose file tier is then full: a put of
    block 2 must evict block 0 from the file tier to fit."""
    s = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(root, fsync=False), file_bytes=2 * FRAME,
                   write_through=True, listener=listener)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    return s


@pytest.mark.parametrize("fault", ["disk full", "after file write", "index unreachable", "after publish"])
def test_a_failed_put_evicts_nothing(tmp_path, fault):
    lst = _Listener()
    s = _full_write_through_store(tmp_path, lst)
    before, stats_before = files(tmp_path), s.stats()
    events_before = len(lst.events)
    point, action, error = {"disk full": ("file.write", "oserror:ENOSPC", StoreIOError),
                            "after file write": ("put.after_file_write", "error", failpoints.FailpointError),
                            "index unreachable": (None, None, IndexPublishError),
                            "after publish": ("put.after_publish", "error", failpoints.FailpointError)}[fault]
    lst.fail = point is None
    with contextlib.ExitStack() as stack:
        if point is not None:
            stack.enter_context(failpoints.armed(point, action))
        with pytest.raises(error):
            s.put(key(2), frame(2))
    lst.fail = False
    # the acknowledged blocks are all still stored, served and listed; the failed one left no trace
    assert sorted(s.keys()) == [key(0), key(1)] and s.get(key(0)) == frame(0) and s.get(key(1)) == frame(1)
    assert files(tmp_path) == before
    st = s.stats()
    assert (st.memory_used_bytes, st.file_used_bytes) == (stats_before.memory_used_bytes, stats_before.file_used_bytes)
    assert st.counters["evictions_file"] == 0 and st.counters["put_failures"] == 1
    assert not [e for e in lst.events[events_before:] if e[0] == "remove" and e[1] != str(key(2))]
    # with the fault gone the same put commits, and only then evicts the LRU block
    s.put(key(2), frame(2))
    kept = sorted(s.keys())
    assert len(kept) == 2 and key(2) in kept and all(s.get(k) == frame(k.layer) for k in kept)
    assert s.stats().counters["evictions_file"] == 1 and ("remove", "evicted") in [e[0::2] for e in lst.events]


def test_a_put_killed_before_it_commits_leaves_its_victims(tmp_path):
    """A crash between the reservation and the commit (simulated: the store object abandoned, then
    reopened from its directory) loses no acknowledged block."""
    s = _full_write_through_store(tmp_path)
    with failpoints.armed("put.after_file_write", "error"), pytest.raises(failpoints.FailpointError):
        s.put(key(2), frame(2))
    s2 = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path, fsync=False), file_bytes=2 * FRAME)
    assert sorted(s2.keys()) == [key(0), key(1)] and s2.get(key(0)) == frame(0)


class _ReadOnlyTier:
    """Makes ``root``'s deletes fail: chmod where that stops writes, else (running as root) the
    ``file.delete`` failpoint raising EROFS."""

    def __init__(self, root: Path) -> None:
        self.dirs = [p for p in root.rglob("*") if p.is_dir()]
        self.stack = contextlib.ExitStack()

    def __enter__(self) -> _ReadOnlyTier:
        for d in self.dirs:
            d.chmod(0o555)
        probe = self.dirs[-1] / "probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            self.stack.enter_context(failpoints.armed("file.delete", "oserror:EROFS"))  # root: chmod is ignored
        except PermissionError:
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.close()
        for d in self.dirs:
            d.chmod(0o755)


def test_a_delete_on_a_read_only_tier_is_refused_and_the_block_stays(tmp_path):
    lst = _Listener()
    s = _full_write_through_store(tmp_path, lst)
    with _ReadOnlyTier(tmp_path), pytest.raises(BlockUndeletable, match="kept"):
        s.remove(key(0))
    assert s.get(key(0)) == frame(0) and s.stats().counters["delete_failures"] == 1
    assert lst.events[-2:] == [("remove", str(key(0)), "deleted"), ("commit", str(key(0)), (MEMORY, FILE))]
    s2 = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path, fsync=False), file_bytes=2 * FRAME)
    assert s2.get(key(0)) == frame(0)  # still there after a restart: the refusal told the truth
    assert s.remove(key(0)) and s.get(key(0)) is None  # writable again: deleted everywhere
    s3 = BlockStore(memory_bytes=2 * FRAME, file_tier=PosixFileTier(tmp_path, fsync=False), file_bytes=2 * FRAME)
    assert sorted(s3.keys()) == [key(1)]


@pytest.mark.parametrize("fault", ["index unreachable", "after index"])
def test_a_delete_that_fails_part_way_keeps_the_block_listed(tmp_path, fault):
    lst = _Listener()
    s = _full_write_through_store(tmp_path, lst)
    if fault == "index unreachable":
        lst.on_remove = lambda info, gen, reason: (_ for _ in ()).throw(ConnectionError("redis down"))
        with pytest.raises(IndexPublishError, match="nothing was deleted"):
            s.remove(key(0))
        assert lst.events[-1] == ("commit", str(key(1)), (MEMORY, FILE))  # nothing was unpublished
    else:
        with failpoints.armed("delete.after_index", "error"), pytest.raises(failpoints.FailpointError):
            s.remove(key(0))
        assert lst.events[-1] == ("commit", str(key(0)), (MEMORY, FILE))  # listed again
    assert s.get(key(0)) == frame(0) and PosixFileTier(tmp_path).exists(key(0))
    with pytest.raises(BlockExists):  # still the stored block: the key is not free
        s.put(key(0), frame(0, fill=1))
