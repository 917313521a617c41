"""The remote tier's background writer (docs/TIERING.md, "Below the spill tier: the remote tier"): sealed blocks'
frames are PUT to a :class:`~planekv.tiering.remote_tier.RemoteTier` by one daemon thread, behind the cache.

Bounded: the frames waiting or being written never exceed ``max_queued_bytes`` nor ``max_queued_blocks``.
:meth:`RemoteWriter.submit` waits for room up to ``submit_timeout_s`` (back-pressure on whoever seals blocks),
then raises :class:`~planekv.tiering.errors.RemoteQueueFull`; memory never grows past the bound. A failed PUT is
tried again ``retries`` times (``backoff_s``, doubling), then counted in ``failed`` and logged; the caller keeps
its local copy (a block counts as remote only once :meth:`is_written` says so), so nothing is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from .errors import RemoteQueueFull
from .frame import BlockKey, decode_header
from .remote_tier import RemoteTier

log = logging.getLogger(__name__)


@dataclass
class RemoteWriterStats:
    written: int = 0  # frames the remote tier took
    failed: int = 0  # frames given up on after every retry (kept locally only)
    retried: int = 0  # PUT attempts that failed and were tried again
    refused: int = 0  # submits that timed out on a full queue (RemoteQueueFull)
    deleted: int = 0  # remote copies deleted (discard)
    queued_bytes: int = 0  # frames waiting or being written, now
    queued_blocks: int = 0
    queued_bytes_peak: int = 0


class RemoteWriter:
    """One daemon thread writing submitted frames to ``tier`` in submission order."""

    def __init__(self, tier: RemoteTier, max_queued_bytes: int = 64 << 20, max_queued_blocks: int = 64,
                 submit_timeout_s: float = 5.0, retries: int = 3, backoff_s: float = 0.05) -> None:
        if max_queued_bytes <= 0 or max_queued_blocks <= 0 or submit_timeout_s < 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"max_queued_bytes and max_queued_blocks must be > 0, submit_timeout_s, retries and "
                             f"backoff_s >= 0; got {max_queued_bytes}, {max_queued_blocks}, {submit_timeout_s}, "
                             f"{retries}, {backoff_s}")
        self.tier = tier
        self.max_queued_bytes, self.max_queued_blocks = max_queued_bytes, max_queued_blocks
        self.submit_timeout_s, self.retries, self.backoff_s = submit_timeout_s, retries, backoff_s
        self.stats = RemoteWriterStats()
        self._queue: deque[tuple[BlockKey, bytes]] = deque()
        self._in_flight: BlockKey | None = None
        self._cancelled: set[BlockKey] = set()  # discarded while in flight: delete once written
        self._written: set[BlockKey] = set()
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="planekv-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, frame: bytes) -> BlockKey:
        """Queue ``frame`` (a whole sealed frame; its key is read from the header) for writing; returns its key.
        Waits for room up to ``submit_timeout_s``, then raises RemoteQueueFull; ValueError for a frame larger
        than the whole queue; RuntimeError once closed."""
        key = decode_header(frame).key
        n = len(frame)
        if n > self.max_queued_bytes:
            raise ValueError(f"a frame of {n} bytes ({key}) can never fit the remote writer's queue of "
                             f"{self.max_queued_bytes} bytes; raise max_queued_bytes above the block size")
        deadline = time.monotonic() + self.submit_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError(f"the remote writer is closed; {key} was not queued")
                if (self.stats.queued_bytes + n <= self.max_queued_bytes
                        and self.stats.queued_blocks < self.max_queued_blocks):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats.refused += 1
                    raise RemoteQueueFull(
                        f"the remote writer's queue stayed full for {self.submit_timeout_s} s "
                        f"({self.stats.queued_blocks} of {self.max_queued_blocks} blocks, {self.stats.queued_bytes} "
                        f"of {self.max_queued_bytes} bytes): the remote tier writes slower than blocks are sealed; "
                        f"{key} is kept locally only")
                self._cond.wait(left)
            self._queue.append((key, frame))
            self.stats.queued_bytes += n
            self.stats.queued_blocks += 1
            self.stats.queued_bytes_peak = max(self.stats.queued_bytes_peak, self.stats.queued_bytes)
            self._cond.notify_all()
        return key

    def is_written(self, key: BlockKey) -> bool:
        """Whether the remote tier holds ``key``'s frame (its write completed)."""
        with self._cond:
            return key in self._written

    def discard(self, key: BlockKey) -> None:
        """Forget ``key``: drop it from the queue if it waits, delete the remote copy if written (best effort,
        a failure is logged), or delete it once its write in flight ends."""
        with self._cond:
            for i, (k, frame) in enumerate(self._queue):
                if k == key:
                    del self._queue[i]
                    self._release(len(frame))
                    return
            if self._in_flight == key:
                self._cancelled.add(key)
                return
            if key not in self._written:
                return
            self._written.discard(key)
        self._delete(key)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every frame submitted so far is written or given up on; TimeoutError past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the remote writer did not drain within {timeout_s} s: "
                                       f"{self.stats.queued_blocks} blocks ({self.stats.queued_bytes} bytes) left")
                self._cond.wait(left)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued (up to ``timeout_s``), then stop the thread; frames left are dropped, logged (their
        blocks are still held locally)."""
        try:
            self.flush(timeout_s)
        except TimeoutError as exc:
            log.warning("closing the remote writer with frames unwritten: %s", exc)
        with self._cond:
            self._closed = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if left:
            log.warning("remote writer closed: %d queued frames dropped (kept locally)", left)

    def _release(self, n: int) -> None:
        self.stats.queued_bytes -= n
        self.stats.queued_blocks -= 1
        self._cond.notify_all()

    def _delete(self, key: BlockKey) -> None:
        try:
            self.tier.delete(key)
        except Exception as exc:  # noqa: BLE001 - best effort: an orphan remote copy, never local data lost
            log.warning("could not delete the remote copy of %s: %s", key, exc)
        else:
            with self._cond:
                self.stats.deleted += 1

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key, frame = self._queue.popleft()
                self._in_flight = key
            ok = self._put(key, frame)
            with self._cond:
                self._in_flight = None
                cancelled = key in self._cancelled
                self._cancelled.discard(key)
                if ok and not cancelled:
                    self._written.add(key)
                    self.stats.written += 1
                elif not ok:
                    self.stats.failed += 1
                self._release(len(frame))
            if ok and cancelled:
                self._delete(key)

    def _put(self, key: BlockKey, frame: bytes) -> bool:
        for attempt in range(self.retries + 1):
            try:
                self.tier.put_frame(frame)
                return True
            except Exception as exc:  # noqa: BLE001 - any failure of the remote tier: retried, then counted
                if attempt == self.retries:
                    log.warning("remote tier: writing %s failed %d times, giving up (kept locally): %s", key,
                                attempt + 1, exc)
                    return False
                with self._cond:
                    self.stats.retried += 1
                delay = self.backoff_s * (2 ** attempt)
                log.info("remote tier: writing %s failed (%s); trying again in %.2f s", key, exc, delay)
                time.sleep(delay)
        return False
