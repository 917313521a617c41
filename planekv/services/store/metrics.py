"""The block store's own counters and gauges, exported to Prometheus when scraped."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ...tiering import BlockStore
from .reconcile import Reconciler


class StoreCollector:
    """Exports the block store's own counters and gauges at scrape time."""

    def __init__(self, store: BlockStore, reconciler: Reconciler | None = None) -> None:
        self.store, self.reconciler = store, reconciler

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Any:
        st = self.store.stats()
        used = GaugeMetricFamily("planekv_store_used_bytes", "frame bytes held per tier", labels=["tier"])
        cap = GaugeMetricFamily("planekv_store_capacity_bytes", "tier capacity", labels=["tier"])
        blocks = GaugeMetricFamily("planekv_store_blocks", "blocks per tier", labels=["tier"])
        for tier, u, c, b in (("memory", st.memory_used_bytes, st.memory_capacity_bytes, st.blocks_memory),
                              ("file", st.file_used_bytes, st.file_capacity_bytes, st.blocks_file)):
            used.add_metric([tier], u)
            cap.add_metric([tier], c)
            blocks.add_metric([tier], b)
        yield used
        yield cap
        yield blocks
        yield GaugeMetricFamily("planekv_store_leases", "read leases held now", value=st.leases)
        for name, val in st.counters.items():
            yield CounterMetricFamily(f"planekv_store_{name}", f"block store counter {name}", value=val)
        rc = self.reconciler
        if rc is not None:
            yield CounterMetricFamily("planekv_store_reconcile_runs", "reconciliations completed", value=rc.runs)
            yield CounterMetricFamily("planekv_store_reconcile_failures", "reconciliations failed", value=rc.failures)
            for name, val in rc.totals.items():
                yield CounterMetricFamily(f"planekv_store_reconcile_{name}", f"reconciliation total: {name}", value=val)
            yield GaugeMetricFamily("planekv_store_reconcile_last_success_seconds", "unix time of the last "
                                    "completed reconciliation (0: none yet)", value=rc.last.at if rc.last else 0.0)
