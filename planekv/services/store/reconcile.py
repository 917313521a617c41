"""Reconciliation of the store's Redis block index with what its tiers really hold.

Rule (run at start, every ``reconcile_interval_s`` seconds and on ``POST /v1/reconcile``):

1. blocks held only on the file tier whose file is gone are dropped from the store (and the index);
2. an index entry of this store for a block it does not hold (or holds under another incarnation)
   is removed: the stuck state after a PUT during a hung Redis, or a crash between steps, where
   the control plane refuses to delete a cache "still held" by a store that answers 404;
3. a block the store holds that the index lacks (or lists with stale tiers) is republished.

Keys with a put, remove or file I/O in flight are left for the next run. The tiers are the truth:
blocks on disk are never deleted by a reconciliation. Counts go to the logs and to
``planekv_store_reconcile_*`` metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from ...tiering import BlockKey, BlockStore
from ..index import RedisBlockIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReconcileReport:
    """What one reconciliation changed."""

    missing_files: int  # blocks dropped because their file vanished from the file tier
    index_removed: int  # index entries of blocks this store does not hold
    republished: int  # held blocks missing from (or stale in) the index
    at: float  # unix time the run finished


class Reconciler:
    """Runs reconciliations of one store against its index (None: tiers only); thread-safe, one at
    a time. Keeps the totals, the last report and the last error for metrics and readiness."""

    def __init__(self, store: BlockStore, index: RedisBlockIndex | None) -> None:
        self.store, self.index = store, index
        self._lock = threading.Lock()
        self.runs = self.failures = 0
        self.totals = {"missing_files": 0, "index_removed": 0, "republished": 0}
        self.last: ReconcileReport | None = None
        self.last_error: str | None = None
        self._closed = False

    def close(self) -> None:
        """Wait for a run in flight, then refuse new ones (the store is shutting down and about to
        withdraw its entries: a late run must not republish them)."""
        with self._lock:
            self._closed = True

    def run_once(self) -> ReconcileReport:
        """Reconcile now; raises (and records) the index's error if Redis cannot be reached."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the store is shutting down: no more reconciliations")
            try:
                report = self._run()
            except Exception as exc:
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("reconciliation failed: %s", self.last_error)
                raise
            self.runs += 1
            self.last, self.last_error = report, None
            for k, v in asdict(report).items():
                if k in self.totals:
                    self.totals[k] += v
            if report.missing_files or report.index_removed or report.republished:
                log.warning("reconciliation: %d blocks whose file was gone dropped, %d stale index entries removed, "
                            "%d blocks republished", report.missing_files, report.index_removed, report.republished)
            return report

    def _run(self) -> ReconcileReport:
        missing = self.store.drop_missing_files()
        if self.index is None:
            return ReconcileReport(missing, 0, 0, time.time())
        published = self.index.published()  # read before the snapshot: see the module docstring
        held, busy = self.store.snapshot()
        removed = 0
        for field, (gen, _tiers) in published.items():
            key = BlockKey.parse(field.rsplit("@", 1)[0])
            if key in busy or key in held:
                continue
            self.index.withdraw(field, gen)
            if gen:  # (a bare set member, its entry already gone, is only tidied)
                removed += 1
        republished = 0
        for key, (info, gen) in held.items():
            if key in busy or published.get(self.index.field_of(info)) == (gen, info.tiers):
                continue
            now = self.store.state(key)
            if now is None:
                continue
            self.index.republish(*now)
            republished += 1
            if self.store.state(key) is None:  # removed while republishing: withdraw it again
                self.index.withdraw(self.index.field_of(now[0]), now[1])
        return ReconcileReport(missing, removed, republished, time.time())
