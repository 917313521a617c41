"""``/v1/policies``: placement policies, named and versioned documents. Create, update (a new
version), activate, roll back (undo the last activation), history. Every activation is published
on ``pkv:policy-activated`` as ``<name>:<version>``."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException
from fastapi import Path as PathParam
from starlette.responses import Response

from ...tiering.placement import PlacementPolicy
from .. import index as ix
from ..common import error_responses
from ..request_body import FiniteJSONRoute
from .context import Context
from .encoding import canonical_json, timestamp
from .params import PolicyName
from .policy_fit import check_fit
from .routes_formats import format_entry
from .schemas import (
    PolicyActivate,
    PolicyCreate,
    PolicyEvent,
    PolicyHistory,
    PolicyList,
    PolicySummary,
    PolicyUpdate,
    PolicyVersion,
    PolicyVersions,
)

router = APIRouter(prefix="/v1/policies", tags=["policies"], route_class=FiniteJSONRoute)


def _version_doc(policy: PlacementPolicy, comment: str) -> tuple[str, str]:
    """A version's stored document and the sha256 of its policy."""
    pol = policy.model_dump(mode="json")
    sha = hashlib.sha256(canonical_json(pol).encode()).hexdigest()
    return canonical_json({"policy": pol, "comment": comment, "sha256": sha, "created_at": time.time()}), sha


async def _validate_policy(redis: aioredis.Redis, name: str, policy: PlacementPolicy, what: str) -> None:
    """The checks every route runs before a version is stored or made active: the bound format (if any) and
    the fit of the hot planes of the caches registered under ``name`` in the gpu tier (``policy_fit``)."""
    if policy.format_id is not None:
        entry = await format_entry(redis, policy.format_id)
        if entry is None:
            raise HTTPException(400, f"the policy names format {policy.format_id}, which is not registered; "
                                     "register it first (PUT /v1/formats/{format_id})")
        try:
            policy.check_format(entry.spec["n_layers"], entry.spec["width"])
        except ValueError as exc:
            raise HTTPException(400, f"the policy does not fit format {policy.format_id}: {exc}") from None
    await check_fit(redis, name, policy, what)


def _keys(name: str) -> list[str]:
    """The policy's hash, versions list, activation stack and history list (the scripts' first KEYS)."""
    return [ix.k_policy(name), ix.k_policy(name, "versions"), ix.k_policy(name, "stack"),
            ix.k_policy(name, "history")]


async def _version(redis: aioredis.Redis, name: str, version: int, active: int | None = None) -> PolicyVersion | None:
    raw = await redis.lindex(ix.k_policy(name, "versions"), version - 1)
    if raw is None or version < 1:
        return None
    if active is None:
        active = int(await redis.hget(ix.k_policy(name), "active") or 0)
    d = json.loads(raw)
    return PolicyVersion(name=name, version=version, active=version == active, policy=d["policy"],
                         comment=d["comment"], sha256=d["sha256"], created_at=d["created_at"])


async def _summary(redis: aioredis.Redis, name: str) -> PolicySummary | None:
    h = await redis.hgetall(ix.k_policy(name))
    if not h:
        return None
    active = int(h["active"])
    latest = await redis.llen(ix.k_policy(name, "versions"))
    av = await _version(redis, name, active, active)
    assert av is not None
    return PolicySummary(name=name, active_version=active, latest_version=latest,
                         created_at=float(h["created_at"]), active=av)


async def _summary_or_404(redis: aioredis.Redis, name: str) -> PolicySummary:
    s = await _summary(redis, name)
    if s is None:
        raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
    return s


@router.post("", status_code=201, response_model=PolicySummary, responses=error_responses(400, 409, 503))
async def create_policy(body: PolicyCreate, ctx: Context) -> PolicySummary:
    """Create a policy; its first version is active."""
    await _validate_policy(ctx.redis, body.name, body.policy, f"policy {body.name}")
    doc, sha = _version_doc(body.policy, body.comment)
    ok = await ctx.scripts.policy_create(keys=[*_keys(body.name), ix.K_POLICIES, ix.CHANNEL_POLICY],
                                         args=[body.name, doc, timestamp(), sha])
    if not ok:
        raise HTTPException(409, f"policy {body.name} already exists; add a version with PUT /v1/policies/"
                                 f"{body.name}")
    return await _summary_or_404(ctx.redis, body.name)


@router.put("/{name}", status_code=201, response_model=PolicyVersion,
            responses={200: {"model": PolicyVersion, "description": "identical to the latest version"},
                       **error_responses(400, 404, 409, 503)})
async def update_policy(name: PolicyName, body: PolicyUpdate, ctx: Context) -> Response:
    """Add a version (201); the same document as the latest answers 200 with no new version.
    ``activate: true`` also activates it. A version whose hot planes do not fit the gpu tier (with the caches
    registered under this policy) is refused, 409, activated or not."""
    await _validate_policy(ctx.redis, name, body.policy, f"the new version of policy {name}")
    doc, sha = _version_doc(body.policy, body.comment)
    version, created = await ctx.scripts.policy_update(keys=[*_keys(name), ix.CHANNEL_POLICY],
                                                       args=[name, doc, timestamp(), sha,
                                                             "1" if body.activate else "0"])
    if version == -1:
        raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
    v = await _version(ctx.redis, name, int(version))
    assert v is not None
    return Response(v.model_dump_json(), 201 if created else 200, media_type="application/json")


@router.get("", response_model=PolicyList, responses=error_responses(503))
async def list_policies(ctx: Context) -> PolicyList:
    names = await ctx.redis.zrange(ix.K_POLICIES, 0, -1)
    out = [s for s in [await _summary(ctx.redis, n) for n in names] if s is not None]
    return PolicyList(policies=out)


@router.get("/{name}", response_model=PolicySummary, responses=error_responses(404, 503))
async def get_policy(name: PolicyName, ctx: Context) -> PolicySummary:
    return await _summary_or_404(ctx.redis, name)


@router.get("/{name}/active", response_model=PolicyVersion, responses=error_responses(404, 503))
async def get_active(name: PolicyName, ctx: Context) -> Response:
    """The active version (what workers apply); ETag ``"<name>:<version>"``."""
    s = await _summary_or_404(ctx.redis, name)
    return Response(s.active.model_dump_json(), media_type="application/json",
                    headers={"etag": f'"{name}:{s.active_version}"'})


@router.get("/{name}/versions", response_model=PolicyVersions, responses=error_responses(404, 503))
async def list_versions(name: PolicyName, ctx: Context) -> PolicyVersions:
    s = await _summary_or_404(ctx.redis, name)
    vs = [await _version(ctx.redis, name, i, s.active_version) for i in range(1, s.latest_version + 1)]
    return PolicyVersions(name=name, versions=[v for v in vs if v is not None])


@router.get("/{name}/versions/{version}", response_model=PolicyVersion, responses=error_responses(404, 503))
async def get_version(name: PolicyName, version: Annotated[int, PathParam(ge=1, le=1 << 31)],
                      ctx: Context) -> PolicyVersion:
    await _summary_or_404(ctx.redis, name)
    v = await _version(ctx.redis, name, version)
    if v is None:
        raise HTTPException(404, f"policy {name} has no version {version}")
    return v


async def _check_version(ctx: Context, name: str, version: int) -> None:
    """Run the route checks on a stored version about to become active (caches may have grown since it was
    added); 404 if it does not exist."""
    v = await _version(ctx.redis, name, version)
    if v is None:
        raise HTTPException(404, f"policy {name} has no version {version}")
    await _validate_policy(ctx.redis, name, v.policy, f"version {version} of policy {name}")


@router.post("/{name}/activate", response_model=PolicySummary, responses=error_responses(400, 404, 409, 503))
async def activate(name: PolicyName, body: PolicyActivate, ctx: Context) -> PolicySummary:
    """Make ``version`` the active one (idempotent); refused (409) if it does not fit the gpu tier."""
    await _summary_or_404(ctx.redis, name)
    await _check_version(ctx, name, body.version)
    res = await ctx.scripts.policy_activate(keys=[*_keys(name), ix.CHANNEL_POLICY],
                                            args=[name, body.version, timestamp()])
    if res == -1:
        raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
    if res == -2:
        raise HTTPException(404, f"policy {name} has no version {body.version}")
    return await _summary_or_404(ctx.redis, name)


@router.post("/{name}/rollback", response_model=PolicySummary, responses=error_responses(400, 404, 409, 503))
async def rollback(name: PolicyName, ctx: Context) -> PolicySummary:
    """Undo the last activation: the version active before it becomes active again, unless it no longer fits
    the gpu tier (409)."""
    await _summary_or_404(ctx.redis, name)
    target = await ctx.redis.lindex(ix.k_policy(name, "stack"), -2)
    if target is not None:
        await _check_version(ctx, name, int(target))
    # the script rolls back only onto the version checked here (another activation in between: -3)
    res = await ctx.scripts.policy_rollback(keys=[*_keys(name), ix.CHANNEL_POLICY],
                                            args=[name, timestamp(), target or ""])
    if res == -1:
        raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
    if res == -2:
        raise HTTPException(409, f"policy {name} has no earlier activation to roll back to")
    if res == -3:
        raise HTTPException(409, f"policy {name} was activated by another request during this rollback; nothing "
                                 "was rolled back: read /active and retry")
    return await _summary_or_404(ctx.redis, name)


@router.get("/{name}/history", response_model=PolicyHistory, responses=error_responses(404, 503))
async def history(name: PolicyName, ctx: Context) -> PolicyHistory:
    await _summary_or_404(ctx.redis, name)
    raw = await ctx.redis.lrange(ix.k_policy(name, "history"), 0, -1)
    return PolicyHistory(name=name, events=[PolicyEvent(**json.loads(e)) for e in raw])
