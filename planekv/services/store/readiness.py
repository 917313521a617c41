"""The store's readiness: may a load balancer send it traffic? (``/readyz``; ``/healthz`` is
liveness only: the process answers.)

Ready means: the Redis block index answers (when the store publishes one), the file tier accepts a
write and its disk has at least ``min_free_bytes`` free, and a reconciliation has completed since
start. Each check names itself, so a 503 body says which dependency is failing.
"""

from __future__ import annotations

import shutil

from ...settings import StoreService
from ...tiering import BlockStore
from ..index import RedisBlockIndex
from .reconcile import Reconciler

OK = "ok"


def readiness_checks(config: StoreService, store: BlockStore, index: RedisBlockIndex | None,
                     reconciler: Reconciler) -> dict[str, str]:
    """Each dependency -> "ok" or what is wrong with it (blocking: run it in a thread)."""
    checks: dict[str, str] = {}
    if index is not None:
        try:
            index.r.ping()
            checks["redis"] = OK
        except Exception as exc:
            checks["redis"] = f"unreachable: {type(exc).__name__}: {exc}"
    if store.file is not None:
        checks["file_tier"] = _file_tier(store, config.min_free_bytes)
    if reconciler.last is not None:
        checks["reconciled"] = OK
    else:
        checks["reconciled"] = f"no reconciliation has completed yet ({reconciler.last_error or 'pending'})"
    return checks


def _file_tier(store: BlockStore, min_free_bytes: int) -> str:
    assert store.file is not None
    check = getattr(store.file, "check_writable", None)
    try:
        if check is not None:
            check()
        free = shutil.disk_usage(store.file.root).free
    except OSError as exc:
        return f"not writable: {exc}"
    if free < min_free_bytes:
        return f"{free} bytes free on {store.file.root}, below min_free_bytes={min_free_bytes}"
    return OK
