"""``/v1/caches``: the cache registry. A sequence is registered with its format (and optionally its
length, placement policy and the planes kept on the GPU); the planes the memory and file tiers hold
come from the stores' block index."""

from __future__ import annotations

import json
from typing import Annotated, Any

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException, Query
from starlette.responses import Response

from ...tiering.placement import PlacementPolicy
from .. import index as ix
from ..common import error_responses
from ..request_body import FiniteJSONRoute
from .context import Context, ControlContext
from .encoding import timestamp
from .params import SeqId
from .policy_fit import CacheLoad, check_fit
from .routes_stores import heartbeat_ages
from .schemas import CacheDetail, CacheEntry, CacheList, CacheRegister, TierPlanes

LISTED_STORES = 10  # stores checked and named in a refused DELETE

router = APIRouter(prefix="/v1/caches", tags=["caches"], route_class=FiniteJSONRoute)


def _cache_entry(seq: str, h: dict[str, str]) -> CacheEntry:
    hot = json.loads(h["hot_planes"]) if h.get("hot_planes") else None
    return CacheEntry(sequence_id=seq, format_id=h["format_id"], created_at=float(h["created_at"]),
                      source=h.get("source", "api"),
                      n_tokens=int(h["n_tokens"]) if h.get("n_tokens") else None,
                      policy=h.get("policy") or None, hot_planes=hot)


async def _cache_detail(redis: aioredis.Redis, seq: str) -> CacheDetail:
    h = await redis.hgetall(ix.k_cache(seq))
    if not h:
        raise HTTPException(404, f"sequence {seq} is not registered")
    tiers = ix.summarize_blocks(await redis.hgetall(ix.k_blocks(seq)))
    entry = _cache_entry(seq, h)
    if entry.hot_planes is not None:
        hp = entry.hot_planes
        tiers = {"gpu": {"blocks": 0, "bytes": 0, "stores": [],
                         "planes": {"k": [f"0-{hp.k}"] if hp.k else [], "v": [f"0-{hp.v}"] if hp.v else []}},
                 **tiers}
    return CacheDetail(**entry.model_dump(), tiers={t: TierPlanes(**v) for t, v in tiers.items()})


@router.put("/{sequence_id}", status_code=201, response_model=CacheDetail,
            responses={200: {"model": CacheDetail, "description": "updated (same format)"},
                       **error_responses(400, 409, 503)})
async def register_cache(sequence_id: SeqId, body: CacheRegister, ctx: Context) -> Response:
    """Register a sequence with its format (and optionally its length, policy, hot planes).
    A sequence has one format: another one answers 409. A length that would take the hot planes of the
    caches under its policy past the active version's gpu tier answers 409 (``policy_fit``)."""
    if not await ctx.redis.exists(ix.k_format(body.format_id)):
        raise HTTPException(400, f"format {body.format_id} is not registered; register it first "
                                 "(PUT /v1/formats/{format_id})")
    if body.policy is not None and not await ctx.redis.exists(ix.k_policy(body.policy)):
        raise HTTPException(400, f"policy {body.policy} does not exist; create it first (POST /v1/policies)")
    await _check_fit(ctx.redis, sequence_id, body)
    args: list[Any] = [body.format_id, timestamp(), sequence_id]
    if body.n_tokens is not None:
        args += ["n_tokens", body.n_tokens]
    if body.policy is not None:
        args += ["policy", body.policy]
    if body.hot_planes is not None:
        args += ["hot_planes", body.hot_planes.model_dump_json()]
    try:
        created = await ctx.scripts.cache_put(keys=[ix.k_cache(sequence_id), ix.K_CACHES], args=args)
    except aioredis.ResponseError as exc:
        if str(exc).startswith("FORMAT "):
            raise HTTPException(409, f"sequence {sequence_id} is registered with format {str(exc)[7:]}; a "
                                     "sequence has one format (use a new sequence id)") from None
        raise
    detail = await _cache_detail(ctx.redis, sequence_id)
    return Response(detail.model_dump_json(), 201 if created else 200, media_type="application/json")


async def _check_fit(redis: aioredis.Redis, seq: str, body: CacheRegister) -> None:
    """The registration as it will be stored (a field left out keeps its registered value) checked against
    the active version of its policy."""
    old_policy, old_n = await redis.hmget(ix.k_cache(seq), "policy", "n_tokens")
    policy = body.policy if body.policy is not None else old_policy
    n_tokens = body.n_tokens if body.n_tokens is not None else (int(old_n) if old_n else None)
    if not policy or not n_tokens:
        return
    active = await redis.hget(ix.k_policy(policy), "active")
    raw = await redis.lindex(ix.k_policy(policy, "versions"), int(active) - 1) if active else None
    if raw is None:
        return
    await check_fit(redis, policy, PlacementPolicy.model_validate(json.loads(raw)["policy"]),
                    f"registering cache {seq} ({n_tokens} tokens) under policy {policy} (active version {active})",
                    CacheLoad(seq, body.format_id, n_tokens))


@router.get("", response_model=CacheList, responses=error_responses(503))
async def list_caches(ctx: Context, limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
                      offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0) -> CacheList:
    seqs = await ctx.redis.zrange(ix.K_CACHES, offset, offset + limit - 1)
    total = await ctx.redis.zcard(ix.K_CACHES)
    p = ctx.redis.pipeline(transaction=False)
    for s in seqs:
        p.hgetall(ix.k_cache(s))
    hs = await p.execute()
    return CacheList(caches=[_cache_entry(s, h) for s, h in zip(seqs, hs, strict=True) if h], total=total)


@router.get("/{sequence_id}", response_model=CacheDetail, responses=error_responses(404, 503))
async def get_cache(sequence_id: SeqId, ctx: Context) -> CacheDetail:
    """The sequence's format and the planes each tier holds (GPU from the registration, memory
    and file from the stores' block index)."""
    return await _cache_detail(ctx.redis, sequence_id)


async def _silent_stores(ctx: ControlContext, seq: str) -> str:
    """For a refused DELETE: the stores named by the sequence's entries whose heartbeat is older than the
    forget grace period, and how to forget them ("" if none)."""
    stores = sorted({f.rsplit("@", 1)[1] for f in await ctx.redis.hkeys(ix.k_blocks(seq))})[:LISTED_STORES]
    ages = await heartbeat_ages(ctx, stores)
    silent = [f"{s} ({'no heartbeat' if a is None else f'last heartbeat {a:.0f} s ago'})" for s, a in ages.items()
              if a is None or a > ix.FORGET_GRACE_S]
    if not silent:
        return ""
    return (f"; stores without a recent heartbeat: {', '.join(silent)}. If a store is gone for good (its data "
            "lost), POST /v1/stores/{store_id}/forget removes its entries, then DELETE the cache again")


@router.delete("/{sequence_id}", status_code=204, response_class=Response,
               responses=error_responses(404, 409, 503))
async def delete_cache(sequence_id: SeqId, ctx: Context) -> Response:
    """Unregister a sequence; refused (409) while stores still hold blocks of it."""
    if not await ctx.redis.exists(ix.k_cache(sequence_id)):
        raise HTTPException(404, f"sequence {sequence_id} is not registered")
    n = await ctx.redis.hlen(ix.k_blocks(sequence_id))
    if n:
        raise HTTPException(409, f"stores still hold {n} blocks of sequence {sequence_id}; DELETE them at the "
                                 "store first" + await _silent_stores(ctx, sequence_id))
    p = ctx.redis.pipeline(transaction=True)
    p.delete(ix.k_cache(sequence_id))
    p.zrem(ix.K_CACHES, sequence_id)
    await p.execute()
    return Response(status_code=204)
