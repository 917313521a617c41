"""The control plane's Prometheus registry: request metrics (filled by the RequestMetrics
middleware) and gauges of what is registered, refreshed from Redis when scraped."""

from __future__ import annotations

import redis.asyncio as aioredis
from prometheus_client import Gauge

from .. import index as ix
from ..common import new_registry

REGISTERED = ("formats", "calibrations", "policies", "caches")  # a gauge each, from the zset of each


class ControlMetrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        self.registered = {name: Gauge(f"planekv_control_{name}", f"registered {name}", registry=self.registry)
                           for name in REGISTERED}
        self.tier_blocks = Gauge("planekv_control_tier_blocks", "blocks per tier (block index)", ["tier"],
                                 registry=self.registry)
        self.tier_bytes = Gauge("planekv_control_tier_bytes", "bytes per tier (block index)", ["tier"],
                                registry=self.registry)

    async def refresh(self, redis: aioredis.Redis) -> None:
        """Set the gauges from Redis (raises if Redis does not answer)."""
        p = redis.pipeline(transaction=False)
        for key in (ix.K_FORMATS, ix.K_CALIBRATIONS, ix.K_POLICIES, ix.K_CACHES):
            p.zcard(key)
        p.hgetall(ix.K_TIERSTATS)
        *counts, tiers = await p.execute()
        for gauge, n in zip(self.registered.values(), counts, strict=True):
            gauge.set(n)
        for k, val in tiers.items():
            tier, what = k.rsplit(":", 1)
            (self.tier_blocks if what == "blocks" else self.tier_bytes).labels(tier).set(int(val))
