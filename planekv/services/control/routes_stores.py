"""``/v1/stores``: the store ids the block index knows, and forgetting one that never comes back.

A store that dies for good (its data directory gone, or restarted under another id: the default id is
host:port) leaves its block index entries behind, and ``DELETE /v1/caches/{sequence_id}`` refuses while
any entry names the sequence: no store can delete them. Rule (planekv/services/index.py): every running
store writes a heartbeat each ``HEARTBEAT_INTERVAL_S``; ``POST /v1/stores/{store_id}/forget`` removes the
entries of a store id only if its heartbeat is older than ``grace_s`` (default ``FORGET_GRACE_S``, at
least ``FORGET_MIN_GRACE_S``), checked in the same Lua script that removes them (409 otherwise). A live
store forgotten while it could not beat republishes its blocks at its next heartbeat.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException, Query

from .. import index as ix
from ..common import error_responses
from ..request_body import FiniteJSONRoute
from .context import Context, ControlContext
from .params import StoreId
from .schemas import StoreEntry, StoreForgotten, StoreList

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/stores", tags=["stores"], route_class=FiniteJSONRoute)

CHUNK = 500  # index entries removed per script call (each call is atomic and short)
MAX_ROUNDS = 8  # passes over the store's keys set before giving up (entries appear only while it beats)


async def _redis_now(ctx: ControlContext) -> float:
    sec, usec = await ctx.redis.time()
    return sec + usec / 1e6


async def heartbeat_ages(ctx: ControlContext, store_ids: list[str]) -> dict[str, float | None]:
    """Seconds since each store's last heartbeat (Redis time), None where none is recorded."""
    if not store_ids:
        return {}
    beats = await ctx.redis.hmget(ix.K_HEARTBEATS, store_ids)
    now = await _redis_now(ctx)
    return {s: (round(max(0.0, now - float(b)), 3) if b is not None else None) for s, b in zip(store_ids, beats,
                                                                                                strict=True)}


@router.get("", response_model=StoreList, responses=error_responses(503))
async def list_stores(ctx: Context) -> StoreList:
    """Every store id with a record or a heartbeat: its record, heartbeat age and index entries."""
    records = await ctx.redis.hgetall(ix.K_STORES)
    ids = sorted(set(records) | set(await ctx.redis.hkeys(ix.K_HEARTBEATS)))
    ages = await heartbeat_ages(ctx, ids)
    p = ctx.redis.pipeline(transaction=False)
    for s in ids:
        p.scard(ix.k_store_keys(s))
    counts = await p.execute()
    return StoreList(stores=[StoreEntry(store_id=s, record=json.loads(records[s]) if s in records else None,
                                        heartbeat_age_s=ages[s], index_entries=n)
                             for s, n in zip(ids, counts, strict=True)],
                     heartbeat_interval_s=ix.HEARTBEAT_INTERVAL_S, forget_grace_s=ix.FORGET_GRACE_S)


@router.post("/{store_id}/forget", response_model=StoreForgotten, responses=error_responses(404, 409, 503))
async def forget_store(store_id: StoreId, ctx: Context,
                       grace_s: Annotated[float, Query(ge=ix.FORGET_MIN_GRACE_S, le=30 * 86400)] = ix.FORGET_GRACE_S
                       ) -> StoreForgotten:
    """Remove every block index entry of a store that is gone for good (its blocks are no longer anywhere a
    store can serve or delete them), so the caches they name can be deleted. Refused (409) while the store's
    heartbeat is at most ``grace_s`` seconds old: a live store's blocks are deleted at the store."""
    keyset = ix.k_store_keys(store_id)
    p = ctx.redis.pipeline(transaction=False)
    p.exists(keyset)
    p.hexists(ix.K_STORES, store_id)
    p.hexists(ix.K_HEARTBEATS, store_id)
    if not any(await p.execute()):
        raise HTTPException(404, f"store {store_id} is not known to the block index (no entries, record or "
                                 "heartbeat); GET /v1/stores lists the ones it knows")
    removed, age = 0, None
    for _ in range(MAX_ROUNDS):
        fields = sorted(await ctx.redis.smembers(keyset))
        chunks = [fields[i:i + CHUNK] for i in range(0, len(fields), CHUNK)] + [[]]  # [] last: forget the record
        for chunk in chunks:
            keys = [ix.K_HEARTBEATS, ix.K_STORES, ix.K_TIERSTATS, keyset,
                    *(ix.k_blocks(f.rsplit("@", 1)[0].split(":")[1]) for f in chunk)]
            try:
                n, age_s = await ctx.scripts.store_forget(keys=keys, args=[store_id, grace_s, *chunk])
            except aioredis.ResponseError as exc:
                if not str(exc).startswith("ALIVE "):
                    raise
                raise HTTPException(409, f"store {store_id} sent a heartbeat {str(exc)[6:]} s ago (within grace_s="
                                         f"{grace_s:g} s): it is alive, so it is not forgotten ({removed} entries "
                                         "were removed before it came back); DELETE its blocks at the store") from None
            removed += int(n)
            age = None if float(age_s) < 0 else float(age_s)
        if not await ctx.redis.exists(keyset):
            break
    else:
        raise HTTPException(409, f"store {store_id} kept adding index entries while being forgotten ({removed} "
                                 "removed): it is running; DELETE its blocks at the store")
    log.warning("store %s forgotten (heartbeat %s): %d block index entries removed", store_id,
                "never recorded" if age is None else f"{age:.1f} s old", removed)
    return StoreForgotten(store_id=store_id, index_entries_removed=removed, heartbeat_age_s=age)
