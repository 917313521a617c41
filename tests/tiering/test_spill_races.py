"""Requests that meet a block moving between tiers or leaving them, made deterministic with gated file I/O.

The load bench (`planekv bench load`) saw about one PUT a run answered 409: its client PUTs new bytes under a key
only after a GET answered 404 or a DELETE 204/404, and the store still had file I/O of the key's old block in
flight. Two interleavings (both reproduced below on the code before the fix):

- a DELETE while an LRU victim's spill was writing its file answered 204 at once; the spill's file landed after the
  answer and was deleted only then (a restart in between would bring the deleted block back), and a PUT meanwhile
  was refused (BlockBusy, 409);
- a block evicted from the file tier is unpublished first and its file deleted afterwards: a GET (404, a miss) or a
  DELETE (404) in between, then a PUT of new bytes, was refused (BlockBusy, 409) while that delete ran, and the
  DELETE's 404 came while the file was still there.

Each test gates the file tier's write or delete of one key (an Event, bounded waits) and watches the store's
condition variable to know when a request waits inside the store, so nothing depends on timing.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path

from planekv.tiering import FILE, MEMORY, BlockKey, BlockStore, PosixFileTier, encode_frame

FID = "0123456789abcdef"
PAYLOAD = 3 * 4096 + 100  # frame = 4 KiB header + 16 KiB
FRAME = 4096 + 4 * 4096
WAIT_S = 10.0  # every wait is bounded; none is the mechanism


def key(i: int) -> BlockKey:
    return BlockKey(FID, "races", "k", i, 0, 0, 8, 0, 8)


def frame(i: int, gen: int = 0) -> bytes:
    return encode_frame(key(i), bytes([(i * 7 + gen) % 256]) * PAYLOAD)


class _GatedTier(PosixFileTier):
    """A file tier whose write or delete of the key ``gate`` names stops until ``go`` is set (``fail``: the write
    then raises ENOSPC instead)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, fsync=False)
        self.gate: tuple[str, BlockKey] | None = None
        self.fail = False
        self.entered, self.go, self.done = threading.Event(), threading.Event(), threading.Event()

    def _gated(self, op: str, key: BlockKey) -> bool:
        if self.gate != (op, key):
            return False
        self.entered.set()
        assert self.go.wait(WAIT_S), f"the test never released the {op} of {key}"
        return True

    def write(self, key: BlockKey, frame: bytes) -> None:
        gated = self._gated("write", key)
        try:
            if gated and self.fail:
                raise OSError(errno.ENOSPC, "no space left (test)")
            super().write(key, frame)
        finally:
            if gated:
                self.done.set()

    def delete(self, key: BlockKey) -> None:
        gated = self._gated("delete", key)
        try:
            super().delete(key)
        finally:
            if gated:
                self.done.set()


class _WatchedCondition(threading.Condition):
    """The store's condition variable, telling when a thread starts waiting on it."""

    def __init__(self, lock: threading.Lock, event: threading.Event) -> None:
        super().__init__(lock)
        self.event = event

    def wait(self, timeout: float | None = None) -> bool:
        self.event.set()
        return super().wait(timeout)


def _watch(s: BlockStore) -> threading.Event:
    """An Event set when a request waits inside ``s`` (also set by the test's client thread when it is done)."""
    event = threading.Event()
    s._room = _WatchedCondition(s._lock, event)
    return event


def _start(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _store(tier: PosixFileTier, memory: int, file: int) -> BlockStore:
    return BlockStore(memory_bytes=memory * FRAME, file_tier=tier, file_bytes=file * FRAME)


def _consistent(s: BlockStore, tier: PosixFileTier) -> None:
    """The books match the tiers: no lease left, used bytes as listed, a file for exactly the listed blocks."""
    st, infos = s.stats(), s.infos()
    assert st.leases == 0
    assert st.memory_used_bytes == sum(i.size for i in infos if MEMORY in i.tiers) <= st.memory_capacity_bytes
    assert st.file_used_bytes == sum(i.size for i in infos if FILE in i.tiers)
    assert set(tier.root.rglob("*.blk")) == {tier.path(i.key) for i in infos if FILE in i.tiers}


def test_a_delete_during_a_spill_answers_once_the_spilled_file_is_deleted_and_a_new_put_is_stored(tmp_path):
    tier = _GatedTier(tmp_path)
    s = _store(tier, memory=2, file=10)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    tier.gate = ("write", key(0))
    waiting = _watch(s)
    putter = _start(lambda: s.put(key(2), frame(2)))  # key 0, the LRU block, is its victim: spilled
    seen: dict[str, object] = {}

    def client() -> None:  # what the bench's client does: DELETE, then new bytes under the key
        try:
            seen["delete"] = s.remove(key(0))
            seen["spill written at the answer"] = tier.done.is_set()
            seen["file at the answer"] = tier.path(key(0)).exists()
            seen["put"] = s.put(key(0), frame(0, gen=1)).created
        except Exception as exc:
            seen["error"] = exc
        finally:
            waiting.set()

    try:
        assert tier.entered.wait(WAIT_S)  # the spill is writing key 0's file
        assert s.get(key(0)) == frame(0)  # in transit: served from its memory copy
        c = _start(client)
        assert waiting.wait(WAIT_S)  # the client waits inside the store, or is done
        assert "delete" not in seen, f"DELETE answered while the spill was still writing the block's file: {seen}"
    finally:
        tier.go.set()
    c.join(WAIT_S)
    putter.join(WAIT_S)
    assert not c.is_alive() and not putter.is_alive()
    assert seen == {"delete": True, "spill written at the answer": True, "file at the answer": False, "put": True}
    assert s.get(key(0)) == frame(0, gen=1) and s.get(key(2)) == frame(2)
    _consistent(s, tier)
    s2 = _store(PosixFileTier(tmp_path, fsync=False), memory=2, file=10)  # a restart finds no deleted block
    assert s2.get(key(0)) in (None, frame(0, gen=1))


def test_a_delete_during_a_spill_that_fails_deletes_the_block_and_the_put_still_commits(tmp_path):
    tier = _GatedTier(tmp_path)
    s = _store(tier, memory=2, file=10)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    tier.gate, tier.fail = ("write", key(0)), True
    got: dict[str, object] = {}
    waiting = _watch(s)
    putter = _start(lambda: got.update(put=s.put(key(2), frame(2)).created))
    seen: dict[str, object] = {}
    try:
        assert tier.entered.wait(WAIT_S)
        c = _start(lambda: (seen.update(delete=s.remove(key(0))), waiting.set()))
        assert waiting.wait(WAIT_S)
    finally:
        tier.go.set()
    c.join(WAIT_S)
    putter.join(WAIT_S)
    assert seen == {"delete": True} and got == {"put": True}
    assert s.get(key(0)) is None and s.get(key(2)) == frame(2)
    assert not tier.path(key(0)).exists()
    _consistent(s, tier)


def test_a_block_in_transit_is_served_from_its_memory_copy_then_from_its_file_never_a_miss(tmp_path):
    tier = _GatedTier(tmp_path)
    s = _store(tier, memory=2, file=10)
    s.put(key(0), frame(0))
    s.put(key(1), frame(1))
    tier.gate = ("write", key(0))
    putter = _start(lambda: s.put(key(2), frame(2)))
    try:
        assert tier.entered.wait(WAIT_S)
        with s.lease(key(0)) as lease:  # the memory copy, while the file is being written
            assert lease.tier == MEMORY and lease.read() == frame(0)
        assert s.info(key(0)).tiers == (MEMORY,)
    finally:
        tier.go.set()
    assert tier.done.wait(WAIT_S)
    putter.join(WAIT_S)
    assert s.info(key(0)).tiers == (FILE,)
    with s.lease(key(0)) as lease:
        assert lease.tier == FILE and lease.read() == frame(0)
    assert s.stats().counters["misses"] == 0
    _consistent(s, tier)


def test_a_get_or_delete_miss_then_a_put_while_the_evicted_file_is_being_deleted(tmp_path):
    tier = _GatedTier(tmp_path)
    s = _store(tier, memory=2, file=1)
    for i in range(3):  # key 0 spilled to the file tier (full now); keys 1 and 2 in memory
        s.put(key(i), frame(i))
    assert s.info(key(0)).tiers == (FILE,)
    tier.gate = ("delete", key(0))
    # key 1 spills, so key 0 is evicted from the file tier: unpublished, then its file deleted (held here)
    waiting = _watch(s)
    putter = _start(lambda: s.put(key(3), frame(3)))
    seen: dict[str, object] = {}

    def client() -> None:  # GET 404 (a miss: evicted), DELETE 404, then new bytes under the key
        try:
            seen["get"] = s.get(key(0))
            seen["delete"] = s.remove(key(0))
            seen["file at the answer"] = tier.path(key(0)).exists()
            seen["put"] = s.put(key(0), frame(0, gen=1)).created
        except Exception as exc:
            seen["error"] = exc
        finally:
            waiting.set()

    try:
        assert tier.entered.wait(WAIT_S)
        c = _start(client)
        assert waiting.wait(WAIT_S)
        assert "delete" not in seen, f"DELETE answered while the evicted block's file was still there: {seen}"
    finally:
        tier.go.set()
    c.join(WAIT_S)
    putter.join(WAIT_S)
    assert not c.is_alive() and not putter.is_alive()
    assert seen == {"get": None, "delete": False, "file at the answer": False, "put": True}
    assert s.get(key(0)) == frame(0, gen=1)
    _consistent(s, tier)
    s.close()
    s2 = _store(PosixFileTier(tmp_path, fsync=False), memory=2, file=1)
    assert s2.get(key(0)) in (None, frame(0, gen=1))  # never the old bytes
