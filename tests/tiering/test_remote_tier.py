"""The remote tier below the host tier, against an in-memory fake ``RemoteTier``: the writer's queue is bounded
(submit waits, then refuses), failed writes are retried then counted with the local copy kept, a host tier too
small evicts remotely written blocks and reads every page back equal, and a bad remote frame is never served."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from planekv.tiering import (
    BlockCorrupt,
    BlockKey,
    HostTier,
    RemoteBlockMissing,
    RemoteQueueFull,
    RemoteTier,
    RemoteWriter,
    SpillTier,
    TierFull,
    decode_header,
    encode_frame,
)
from planekv.tiering.frame import HEADER_BYTES

FID = "0123456789abcdef"
PAGE = 1024  # bytes of one page's refinement planes
PER_BLOCK = 4  # pages per block
BLOCK = HEADER_BYTES + PER_BLOCK * PAGE  # a sealed block's frame: 8 KiB


class FakeRemote:
    """Frames by key in a dict; ``gate`` (when set up) holds every PUT until it opens; the first ``fail_puts``
    PUTs raise."""

    def __init__(self, gate: threading.Event | None = None, fail_puts: int = 0) -> None:
        self.frames: dict[BlockKey, bytes] = {}
        self.gate, self.fail_puts = gate, fail_puts
        self.puts = 0
        self.lock = threading.Lock()

    def put_frame(self, frame: bytes) -> None:
        if self.gate is not None:
            self.gate.wait()
        with self.lock:
            self.puts += 1
            if self.puts <= self.fail_puts:
                raise ConnectionError(f"injected failure of PUT {self.puts}")
            self.frames[decode_header(frame).key] = bytes(frame)

    def get_frame(self, key: BlockKey) -> bytes | None:
        with self.lock:
            return self.frames.get(key)

    def delete(self, key: BlockKey) -> None:
        with self.lock:
            self.frames.pop(key, None)


def _frame(i: int, payload_bytes: int = 4096) -> bytes:
    return encode_frame(BlockKey(FID, "seq-0", "k", 0, 0, i, i + 1, 4, 8), bytes([i % 251]) * payload_bytes)


def _page(stream: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * stream + i)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def test_the_fake_is_a_remote_tier():
    assert isinstance(FakeRemote(), RemoteTier)


@pytest.mark.parametrize("bound", ["blocks", "bytes"])
def test_a_slow_remote_tier_makes_submit_wait_then_refuse_and_memory_stays_bounded(bound):
    gate = threading.Event()  # the remote tier takes nothing until it opens
    frame_bytes = len(_frame(0))
    kw = dict(max_queued_blocks=2, max_queued_bytes=1 << 30) if bound == "blocks" else \
        dict(max_queued_blocks=100, max_queued_bytes=2 * frame_bytes + 100)
    writer = RemoteWriter(FakeRemote(gate), submit_timeout_s=0.3, **kw)
    try:
        writer.submit(_frame(0))
        writer.submit(_frame(1))  # one in flight (held at the gate), one waiting: the queue is full
        t0 = time.monotonic()
        with pytest.raises(RemoteQueueFull, match="stayed full for 0.3 s"):
            writer.submit(_frame(2))
        assert time.monotonic() - t0 >= 0.29  # it waited for room first (back-pressure)
        assert writer.stats.refused == 1 and writer.stats.queued_blocks == 2
        assert writer.stats.queued_bytes_peak == 2 * frame_bytes <= writer.max_queued_bytes

        threading.Timer(0.2, gate.set).start()  # room comes while a submit waits: it goes through
        writer.submit_timeout_s = 5.0
        t0 = time.monotonic()
        writer.submit(_frame(3))
        assert time.monotonic() - t0 >= 0.15
        writer.flush(5.0)
        assert writer.stats.written == 3 and writer.stats.queued_blocks == writer.stats.queued_bytes == 0
        assert writer.stats.queued_bytes_peak <= 2 * frame_bytes  # never more than the bound held
        assert all(writer.is_written(BlockKey(FID, "seq-0", "k", 0, 0, i, i + 1, 4, 8)) for i in (0, 1, 3))
    finally:
        gate.set()
        writer.close(5.0)


def test_a_frame_larger_than_the_queue_and_a_closed_writer_are_refused_clearly():
    writer = RemoteWriter(FakeRemote(), max_queued_bytes=HEADER_BYTES + 4096)
    with pytest.raises(ValueError, match="can never fit"):
        writer.submit(_frame(0, payload_bytes=8192))
    writer.close(5.0)
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(_frame(1))
    with pytest.raises(ValueError, match="max_queued_bytes"):
        RemoteWriter(FakeRemote(), max_queued_bytes=0)


def test_failed_writes_are_retried_then_counted_and_logged(caplog):
    remote = FakeRemote(fail_puts=2)
    writer = RemoteWriter(remote, retries=2, backoff_s=0.01)
    with caplog.at_level(logging.INFO, logger="planekv.tiering.remote_writer"):
        writer.submit(_frame(0))  # fails twice, the third try succeeds
        writer.flush(5.0)
        assert writer.stats.written == 1 and writer.stats.retried == 2 and writer.stats.failed == 0
        remote.fail_puts = 10 ** 6  # from now on every PUT fails
        writer.submit(_frame(1))
        writer.flush(5.0)
    assert writer.stats.failed == 1 and writer.stats.written == 1 and writer.stats.retried == 4
    assert not writer.is_written(decode_header(_frame(1)).key)
    assert "giving up (kept locally)" in caplog.text
    writer.close(5.0)


def test_a_host_tier_whose_remote_writes_fail_keeps_every_page_locally():
    writer = RemoteWriter(FakeRemote(fail_puts=10 ** 6), retries=1, backoff_s=0.0, submit_timeout_s=1.0)
    tier = HostTier(FID, capacity_bytes=3 * BLOCK, block_bytes=BLOCK, remote=writer)
    stream = ("seq-0", "v", 0, 0)
    with pytest.raises(TierFull, match="no sealed block in memory has been written to the remote tier"):
        for i in range(64):
            tier.put_page(stream, i, (4, 8), _page(0, i))
    held = i  # pages 0 .. i-1 went in
    assert held >= 2 * PER_BLOCK and writer.stats.failed >= 2 and tier.remote_only_bytes == 0
    assert all(torch.equal(tier.page(stream, j), _page(0, j)) for j in range(held))  # nothing lost
    writer.close(5.0)


@pytest.mark.parametrize("with_spill", [False, True])
def test_a_host_tier_too_small_evicts_remote_written_blocks_and_every_page_reads_back_equal(tmp_path, with_spill):
    remote = FakeRemote()
    writer = RemoteWriter(remote, max_queued_blocks=4, submit_timeout_s=10.0)
    spill = SpillTier(tmp_path, capacity_bytes=2 * BLOCK, backend="posix", fsync=False) if with_spill else None
    tier = HostTier(FID, capacity_bytes=3 * BLOCK, block_bytes=BLOCK, spill=spill, remote=writer)
    streams = [("seq-0", "k", 0, 0), ("seq-0", "v", 0, 0), ("seq-1", "k", 1, 2)]
    n_pages = 10 * PER_BLOCK
    for i in range(n_pages):
        for s, stream in enumerate(streams):
            tier.put_page(stream, i, (4, 8), _page(s, i))
            assert tier.used_bytes <= tier.capacity_bytes
    writer.flush(10.0)
    assert tier.remote_only_bytes > 0 and writer.stats.written == len(streams) * 10  # every sealed block
    if with_spill:
        assert tier.spilled_bytes == 2 * BLOCK  # the spill tier filled first
    for s, stream in enumerate(streams):
        for i in range(n_pages):
            assert torch.equal(tier.page(stream, i), _page(s, i)), (stream, i)  # bit for bit
            assert tier.used_bytes <= tier.capacity_bytes
    assert tier.remote_fetches > 0
    assert [k for k, _ in tier.frames(streams[2])] == [BlockKey(FID, "seq-1", "k", 1, 2, 4 * b, 4 * b + 4, 4, 8)
                                                       for b in range(10)]

    tier.drop_sequence("seq-0")  # its remote copies go too
    assert all(k.sequence_id == "seq-1" for k in remote.frames) and len(remote.frames) == 10
    assert writer.stats.deleted == 20
    writer.close(5.0)
    if spill is not None:
        spill.close()


def _evicted(remote: FakeRemote) -> tuple[HostTier, RemoteWriter, tuple[str, str, int, int], BlockKey]:
    """A host tier of 2 blocks after 4 blocks of one stream: the first block is held only remotely."""
    writer = RemoteWriter(remote, submit_timeout_s=10.0)
    tier = HostTier(FID, capacity_bytes=2 * BLOCK, block_bytes=BLOCK, remote=writer)
    stream = ("seq-0", "k", 0, 0)
    for i in range(4 * PER_BLOCK):
        tier.put_page(stream, i, (4, 8), _page(0, i))
    writer.flush(10.0)
    first = BlockKey(FID, "seq-0", "k", 0, 0, 0, PER_BLOCK, 4, 8)
    assert tier.remote_only_bytes > 0 and first in remote.frames
    return tier, writer, stream, first


def test_a_corrupted_or_wrong_or_missing_remote_frame_is_refused_never_served():
    remote = FakeRemote()
    tier, writer, stream, first = _evicted(remote)
    good = remote.frames[first]
    bad = bytearray(good)
    bad[HEADER_BYTES + 5] ^= 0xFF  # one payload byte
    remote.frames[first] = bytes(bad)
    with pytest.raises(BlockCorrupt, match="does not check.*checksum mismatch"):
        tier.page(stream, 1)
    other = BlockKey(FID, "seq-0", "k", 0, 0, PER_BLOCK, 2 * PER_BLOCK, 4, 8)
    remote.frames[first] = remote.frames[other]  # an intact frame of another block
    with pytest.raises(BlockCorrupt, match="does not check.*not"):
        tier.page(stream, 1)
    del remote.frames[first]
    with pytest.raises(RemoteBlockMissing, match="no longer has it"):
        tier.page(stream, 1)
    remote.frames[first] = good
    assert torch.equal(tier.page(stream, 1), _page(0, 1))
    writer.close(5.0)


def test_a_block_the_full_queue_refuses_stays_in_memory_and_its_page_is_stored(caplog):
    gate = threading.Event()  # the remote tier takes nothing: the queue stays full after one block
    writer = RemoteWriter(FakeRemote(gate), max_queued_blocks=1, submit_timeout_s=0.05)
    tier = HostTier(FID, capacity_bytes=64 * BLOCK, block_bytes=BLOCK, remote=writer)
    stream = ("seq-0", "k", 0, 0)
    with caplog.at_level(logging.WARNING, logger="planekv.tiering.host_tier"):
        for i in range(4 * PER_BLOCK):
            tier.put_page(stream, i, (4, 8), _page(0, i))  # never raises: the page is stored before the copy
    assert tier.remote_skipped == 3 and writer.stats.refused == 3 and "kept in memory only" in caplog.text
    assert all(torch.equal(tier.page(stream, i), _page(0, i)) for i in range(4 * PER_BLOCK))
    gate.set()
    writer.close(5.0)


class SlowRemote(FakeRemote):
    """A FakeRemote whose GETs wait for ``open`` (bounded: at most the timeout they are handed, else 10 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = threading.Event()
        self.open.set()
        self.timeouts: list[float] = []

    def get_frame(self, key: BlockKey, timeout_s: float | None = None) -> bytes | None:
        self.timeouts.append(timeout_s if timeout_s is not None else -1.0)
        if not self.open.wait(10.0 if timeout_s is None else timeout_s):
            raise TimeoutError(f"GET {key}: no answer within {timeout_s} s")
        return super().get_frame(key)


def test_a_deadline_read_of_a_stalled_remote_tier_returns_what_is_missing_and_serves_it_once_it_answers():
    remote = SlowRemote()
    tier, writer, stream, first = _evicted(remote)
    pages = [(stream, i) for i in range(PER_BLOCK)]  # the first block's pages, held only remotely
    remote.open.clear()  # the remote tier stalls
    t0 = time.monotonic()
    missing = tier.fetch_within(pages, time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 5.0  # returned at the deadline, not after the stall (bounded: no hang)
    assert missing == set(pages) and tier.remote_deadline_misses == 1
    assert remote.timeouts and 0 < remote.timeouts[0] <= 0.2  # the fetch got the time left as its timeout
    assert tier.fetch_within(pages, time.monotonic() - 1.0) == set(pages)  # a deadline already past: nothing asked
    remote.open.set()  # it answers again
    assert tier.fetch_within(pages, time.monotonic() + 10.0) == set()
    n = tier.remote_fetches
    assert all(torch.equal(tier.page(stream, i), _page(0, i)) for i in range(PER_BLOCK))  # from memory now
    assert tier.remote_fetches == n and tier.read_bytes["remote"] > 0
    tier.release_staged()
    tier.close()
    writer.close(5.0)


def test_a_frame_fetched_within_a_deadline_that_memory_has_no_room_for_is_staged_until_released():
    remote = SlowRemote()
    tier, writer, stream, first = _evicted(remote)
    tier.capacity_bytes = tier.used_bytes  # no room to cache it back
    assert tier.fetch_within([(stream, 0)], time.monotonic() + 10.0) == set()
    n = tier.remote_fetches
    assert torch.equal(tier.page(stream, 0), _page(0, 0)) and tier.remote_fetches == n  # the staged frame
    tier.release_staged()
    assert torch.equal(tier.page(stream, 0), _page(0, 0)) and tier.remote_fetches == n + 1  # fetched again
    remote.frames[first] = remote.frames[BlockKey(FID, "seq-0", "k", 0, 0, PER_BLOCK, 2 * PER_BLOCK, 4, 8)]
    assert tier.fetch_within([(stream, 0)], time.monotonic() + 10.0) == {(stream, 0)}  # a wrong frame: never served
    tier.close()
    writer.close(5.0)


def test_a_decode_step_over_a_stalled_remote_tier_caps_what_missed_its_deadline_and_counts_it():
    """The tiered decode step with a deadline over a TieredCache whose blocks are mostly remote-only: while the tier
    stalls, prefetch leaves out what it could not fetch in time (counted) and the reads are capped, equal to the
    plane cache's read under the same residency; once the tier answers, the same items are fetched and read."""
    import dataclasses

    from planekv.kvstore import PlaneKVCache, ReadPolicy
    from planekv.kvstore.reference import readkv_decode
    from planekv.tiering import Prefetcher, StepTally, TieredCache, tiered_decode_step

    from .test_tiered_cache import _data, _fill, _policy

    codec, codes, q = _data()
    flat = _fill(PlaneKVCache(codec.spec, 2), codes)
    block = HEADER_BYTES + 2 * 1024
    remote = SlowRemote()
    writer = RemoteWriter(remote, submit_timeout_s=10.0)
    cache = TieredCache(codec.spec, 2, _policy(4, 2), max_tokens=512, promotion_bytes=2 << 20,
                        host_bytes=12 * block, remote=writer)
    cache.host.block_bytes = block
    _fill(cache, codes)
    writer.flush(10.0)
    assert cache.bytes().remote > 0
    policy = ReadPolicy.flexible(4.0, 0.5, deadline_ms=150.0)
    pf, tally = Prefetcher(), StepTally()

    def step(pol: ReadPolicy) -> float:
        res = cache.residency(0)
        out, stats = tiered_decode_step(q.float(), cache, 0, codec, pol, pf, tally)
        ref, _ = readkv_decode(q.float(), flat, 0, codec, pol, residency=res)
        assert torch.equal(out, ref)  # capped exactly where the residency says, never other data
        return float(stats.extra["k_caps"].sum() + stats.extra["v_caps"].sum())

    remote.open.clear()  # the remote tier stalls
    t0 = time.monotonic()
    assert step(policy) > 0
    assert step(policy) > 0  # what the first step wanted is still not here: capped again
    assert time.monotonic() - t0 < 10.0  # bounded (each step: its deadline, plus the read)
    assert tally.missed > 0 and cache.host.remote_deadline_misses > 0
    remote.open.set()
    missed, fetches = tally.missed, cache.host.remote_fetches
    served = dataclasses.replace(policy, deadline_ms=30_000.0)
    step(served)
    assert tally.missed == missed and cache.host.remote_fetches > fetches
    assert bool((cache.residency(0).k_depth > 4).any())  # channel-planes over remote-only pages promoted
    step(served)
    cache.host.close()
    writer.close(5.0)
