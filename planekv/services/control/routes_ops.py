"""Operations: ``/healthz`` (liveness), ``/readyz`` (readiness: Redis) and ``/metrics`` (no token:
for probes and scrapers) and ``/v1/stats`` (what is registered, the stores and the bytes per tier)."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import APIRouter
from starlette.responses import Response

from .. import index as ix
from ..common import (
    METRICS_RESPONSES,
    READINESS_RESPONSES,
    Readiness,
    error_responses,
    metrics_response,
    readiness_response,
)
from ..request_body import FiniteJSONRoute
from .context import Context, Metrics
from .schemas import Health, Stats, TierTotals

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 2.0  # a hung Redis makes /readyz answer 503 within this, not hang the probe

probes = APIRouter(tags=["ops"], route_class=FiniteJSONRoute)  # included without the bearer token
router = APIRouter(prefix="/v1", tags=["ops"], route_class=FiniteJSONRoute)


@probes.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Liveness: the process answers (Redis is not asked; /readyz does)."""
    return Health(status="ok", redis="not checked (liveness only; see /readyz)")


@probes.get("/readyz", response_model=Readiness, responses=READINESS_RESPONSES)
async def readyz(ctx: Context) -> Response:
    """Readiness: Redis answers a PING within READY_TIMEOUT_S; 503 names it otherwise."""
    try:
        await asyncio.wait_for(ctx.redis.ping(), READY_TIMEOUT_S)
        checks = {"redis": "ok"}
    except Exception as exc:
        checks = {"redis": f"unreachable: {type(exc).__name__}: {exc}"}
    return readiness_response(checks)


@probes.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
async def metrics(ctx: Context, prometheus: Metrics) -> Response:
    try:
        await prometheus.refresh(ctx.redis)
    except Exception as exc:  # metrics must still answer while Redis is down
        log.warning("metrics: redis gauges not refreshed: %s", exc)
    return metrics_response(prometheus.registry)


@router.get("/stats", response_model=Stats, responses=error_responses(503))
async def stats(ctx: Context) -> Stats:
    p = ctx.redis.pipeline(transaction=False)
    for key in (ix.K_FORMATS, ix.K_CALIBRATIONS, ix.K_POLICIES, ix.K_CACHES):
        p.zcard(key)
    p.hgetall(ix.K_STORES)
    p.hgetall(ix.K_TIERSTATS)
    nf, nc, np_, ncache, stores, tiers = await p.execute()
    tt: dict[str, dict[str, int]] = {}
    for k, v in tiers.items():
        tier, what = k.rsplit(":", 1)
        tt.setdefault(tier, {"blocks": 0, "bytes": 0})[what] = int(v)
    return Stats(formats=nf, calibrations=nc, policies=np_, caches=ncache,
                 stores={k: json.loads(v) for k, v in stores.items()},
                 tiers={t: TierTotals(**v) for t, v in tt.items()})
