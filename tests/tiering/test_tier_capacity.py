"""The memory tier's capacity is a hard bound, also while puts evict: a put reserves its bytes before its
block enters memory, only from free room or from its own victims as their copies leave memory (after the
commit), never from another put's victims. Checked at every step by a memory tier that measures itself."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from planekv.tiering import (
    FILE,
    MEMORY,
    BlockBusy,
    BlockKey,
    BlockStore,
    MemoryTier,
    PosixFileTier,
    StoreFull,
    encode_frame,
    failpoints,
)

FID = "0123456789abcdef"
PAGE = 4096
JOIN_S = 60.0  # every thread and wait is bounded by this (seconds); a healthy run takes well under one


def key(w: int, i: int) -> BlockKey:
    return BlockKey(FID, f"w{w}", "v", i, 0, 0, 8, 4, 8)


def frame(w: int, i: int, pages: int) -> bytes:
    """A frame of 1 header page + ``pages`` payload pages, its bytes unique to (w, i)."""
    return encode_frame(key(w, i), bytes([(w * 31 + i) % 251 + 1]) * (pages * PAGE - 100))


class MeasuredMemoryTier(MemoryTier):
    """A memory tier that records every time its own bytes exceed ``capacity`` (it is called under the
    store's lock, so it sees each step of every put and eviction)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.held, self.peak, self.observations = capacity, 0, 0, 0
        self.violations: list[str] = []

    def _observe(self, what: str) -> None:
        self.observations += 1
        self.peak = max(self.peak, self.held)
        if self.held > self.capacity:
            self.violations.append(f"{what}: {self.held} bytes held in memory, capacity {self.capacity}")

    def put(self, key: BlockKey, frame: bytes) -> None:
        old = self.get(key)
        super().put(key, frame)
        self.held += len(frame) - (len(old) if old is not None else 0)
        self._observe(f"put {key}")

    def pop(self, key: BlockKey) -> bytes | None:
        data = super().pop(key)
        self.held -= len(data) if data is not None else 0
        self._observe(f"pop {key}")
        return data


class StatsListener:
    """Checks the store's reported memory use against the capacity at every index event (outside the lock)."""

    def __init__(self) -> None:
        self.store: BlockStore | None = None
        self.violations: list[str] = []
        self.pause_key: BlockKey | None = None  # on_commit of this key waits for `resume`
        self.paused, self.resume = threading.Event(), threading.Event()

    def _check(self, what: str) -> None:
        if self.store is not None:
            st = self.store.stats()
            if st.memory_used_bytes > st.memory_capacity_bytes:
                self.violations.append(f"{what}: used {st.memory_used_bytes} > {st.memory_capacity_bytes}")

    def on_commit(self, info, gen):
        self._check(f"commit {info.key}")
        if info.key == self.pause_key:
            self.paused.set()
            assert self.resume.wait(JOIN_S), "the test never resumed the paused put"

    def on_change(self, info, gen):
        self._check(f"change {info.key}")

    def on_remove(self, info, gen, reason):
        self._check(f"remove {info.key} ({reason})")

    def on_rebuild(self, blocks):
        pass


def measured_store(memory: int, root: Path | None, file_bytes: int = 0, write_through: bool = False
                   ) -> tuple[BlockStore, MeasuredMemoryTier, StatsListener]:
    lst = StatsListener()
    tier = PosixFileTier(root, fsync=False) if root is not None else None
    s = BlockStore(memory, tier, file_bytes, write_through=write_through, listener=lst)
    s.memory = MeasuredMemoryTier(memory)  # empty store: nothing to carry over
    lst.store = s
    return s, s.memory, lst


def test_a_put_waiting_for_its_commit_holds_no_room_beyond_the_capacity_and_its_victim_stays_served(tmp_path):
    s, mem, lst = measured_store(2 * 2 * PAGE, tmp_path, 8 * 2 * PAGE)
    a, b, x, y = (frame(0, i, 1) for i in range(4))
    s.put(key(0, 0), a)
    s.put(key(0, 1), b)  # memory full: a (LRU), b
    lst.pause_key = key(0, 2)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(s.put(key(0, 2), x)))
    t.start()
    try:
        assert lst.paused.wait(JOIN_S)
        # x has chosen a as its victim and waits for its commit: a is still stored and served, and x's
        # bytes are not counted on top of a's (the reported use stays at the capacity)
        st = s.stats()
        assert st.memory_used_bytes <= st.memory_capacity_bytes and s.get(key(0, 0)) == a
        assert s.info(key(0, 0)).tiers == (MEMORY,) and s.get(key(0, 2)) is None
        # another put cannot take the room a will leave: it makes its own (b spills to the file tier)
        s.put(key(0, 3), y)
        assert s.info(key(0, 1)).tiers == (FILE,) and s.get(key(0, 1)) == b
        assert s.stats().memory_used_bytes <= s.stats().memory_capacity_bytes
    finally:
        lst.resume.set()
        t.join(JOIN_S)
    assert not t.is_alive() and len(result) == 1
    assert [s.get(key(0, i)) for i in range(4)] == [a, b, x, y]
    assert s.info(key(0, 0)).tiers == (FILE,) and s.info(key(0, 2)).tiers == (MEMORY,)
    assert not mem.violations and not lst.violations and mem.peak == 2 * 2 * PAGE


@pytest.mark.parametrize("mode", ["write-back", "memory only", "write-through"])
def test_concurrent_puts_keep_the_memory_tier_within_its_capacity_at_every_step(tmp_path, mode):
    memory = 10 * PAGE  # 2 to 5 blocks of 2 to 4 pages: every put past the first few evicts
    root = None if mode == "memory only" else tmp_path
    s, mem, lst = measured_store(memory, root, 24 * PAGE if root else 0, write_through=mode == "write-through")
    acked: dict[BlockKey, bytes] = {}
    removed: set[BlockKey] = set()
    wrong: list[str] = []
    errors: list[BaseException] = []
    refused = [0]
    book = threading.Lock()

    def worker(w: int) -> None:
        rng = random.Random(w)
        mine: list[BlockKey] = []
        try:
            for i in range(25):
                k, f = key(w, i), frame(w, i, rng.randint(1, 3))
                try:
                    s.put(k, f)
                except (StoreFull, BlockBusy):  # every other block leased or promised: refused, nothing stored
                    with book:
                        refused[0] += 1
                    continue
                with book:
                    acked[k] = f
                mine.append(k)
                for _ in range(2):  # reads take leases, so victims are sometimes unavailable
                    r = rng.choice(mine)
                    got = s.get(r)
                    if got is not None and got != acked[r]:
                        wrong.append(f"{r}: {len(got)} bytes, not the {len(acked[r])} put")
                st = s.stats()
                if st.memory_used_bytes > memory:
                    wrong.append(f"after put {k}: used {st.memory_used_bytes} > {memory}")
                if i % 7 == 6:
                    gone = mine.pop(0)
                    if s.remove(gone):
                        with book:
                            removed.add(gone)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert not wrong and not mem.violations and not lst.violations, (wrong, mem.violations, lst.violations)
    assert mem.observations >= len(acked) and 0 < mem.peak <= memory  # the checks ran, at every step
    assert len(acked) > 50 and refused[0] < len(acked)
    # every acknowledged block reads back exactly, or is a clean miss (evicted; deleted ones are misses)
    kept = 0
    for k, f in acked.items():
        got = s.get(k)
        assert got is None or (got == f and k not in removed), k
        kept += got is not None
    st = s.stats()
    infos = s.infos()
    assert st.memory_used_bytes == sum(i.size for i in infos if MEMORY in i.tiers) <= memory
    assert st.leases == 0 and kept == len(infos) and kept > 0
    if mode != "memory only":  # victims spill: what the file tier holds is served
        assert st.file_used_bytes == sum(i.size for i in infos if FILE in i.tiers) <= 24 * PAGE
        assert any(FILE in i.tiers for i in infos)


def test_a_victim_deleted_while_its_put_waits_for_the_commit_leaves_its_room_to_that_put():
    s, mem, lst = measured_store(2 * 2 * PAGE, None)  # memory only: a victim would be lost
    a, b, x = (frame(0, i, 1) for i in range(3))
    s.put(key(0, 0), a)
    s.put(key(0, 1), b)
    lst.pause_key = key(0, 2)
    result: list[object] = []
    t = threading.Thread(target=lambda: result.append(s.put(key(0, 2), x)))
    t.start()
    try:
        assert lst.paused.wait(JOIN_S)
        assert s.remove(key(0, 0)) and s.get(key(0, 0)) is None  # x's victim deleted meanwhile
        # its bytes went to x's reservation, not back to free room another put could take
        assert s.stats().memory_used_bytes == 2 * 2 * PAGE
    finally:
        lst.resume.set()
        t.join(JOIN_S)
    assert not t.is_alive() and len(result) == 1
    assert s.get(key(0, 1)) == b and s.get(key(0, 2)) == x  # nothing else was evicted for x
    assert s.stats().counters["evictions_memory"] == 0
    assert not mem.violations and not lst.violations and mem.peak <= 2 * 2 * PAGE


def test_a_victim_whose_spill_fails_is_dropped_rather_than_kept_over_the_capacity(tmp_path):
    s, mem, lst = measured_store(2 * 2 * PAGE, tmp_path, 8 * 2 * PAGE)
    a, b, x = (frame(0, i, 1) for i in range(3))
    s.put(key(0, 0), a)
    s.put(key(0, 1), b)
    with failpoints.armed("file.write", "oserror:ENOSPC"):  # write-back: the only file write is a's spill
        s.put(key(0, 2), x)
    # x is stored and a, which could not spill, gave its room (it is a clean miss now, never wrong bytes)
    assert s.get(key(0, 0)) is None and s.get(key(0, 1)) == b and s.get(key(0, 2)) == x
    st = s.stats()
    assert st.counters["spill_failures"] == 1 and st.counters["evictions_memory"] == 1
    assert st.memory_used_bytes == 2 * 2 * PAGE and not mem.violations and not lst.violations
