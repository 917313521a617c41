"""``/v1/formats``: FormatSpecs keyed by their ``format_id`` (the hash of the spec's canonical
JSON). Registering the same spec again is idempotent (200); a spec whose id is not the one it is
registered under, that names a calibration not registered (``CalibrationNotRegistered``), or that
contradicts its registered calibration, is a conflict (409)."""

from __future__ import annotations

import json

import redis.asyncio as aioredis
from fastapi import APIRouter, HTTPException
from starlette.responses import Response

from ...kvstore import FormatSpec
from ...kvstore.errors import FormatMismatch
from .. import index as ix
from ..common import error_responses
from ..request_body import FiniteJSONRoute
from .context import Context, ControlContext
from .encoding import timestamp
from .params import HexId
from .schemas import FormatEntry, FormatList, FormatSpecBody


class CalibrationNotRegistered(FormatMismatch):
    """A format names a calibration the control plane does not have (answered 409, nothing registered)."""


def _no_calibration(spec: FormatSpec) -> CalibrationNotRegistered:
    cid = spec.calibration_id
    return CalibrationNotRegistered(
        f"format {spec.format_id} names calibration {cid}, which is not registered; register the calibration "
        f"first (PUT /v1/calibrations/{cid} with the artifact bytes, Calibration.to_bytes(), or POST "
        "/v1/calibrations with its statistics), then register the format again; nothing was registered")


router = APIRouter(prefix="/v1/formats", tags=["formats"], route_class=FiniteJSONRoute)


async def format_entry(redis: aioredis.Redis, fid: str) -> FormatEntry | None:
    """The registered format ``fid``, or None."""
    h = await redis.hgetall(ix.k_format(fid))
    if not h:
        return None
    return FormatEntry(format_id=fid, spec=json.loads(h["spec"]), created_at=float(h["created_at"]))


async def _register_format(ctx: ControlContext, spec: FormatSpec, claimed: str | None) -> Response:
    fid = spec.format_id
    if claimed is not None and claimed != fid:
        raise HTTPException(409, f"format_id {claimed} conflicts with the spec, whose format_id is {fid} "
                                 "(the sha256 of its canonical JSON); register it under /v1/formats/" + fid)
    c = await ctx.redis.hgetall(ix.k_calibration(spec.calibration_id))
    if c:
        got = (int(c["n_layers"]), int(c["n_kv_heads"]), int(c["head_dim"]), int(c["seed_k"]), int(c["seed_v"]))
        want = (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.seed_k, spec.seed_v)
        if got != want:
            raise HTTPException(409, f"the spec conflicts with calibration {spec.calibration_id}: (layers, "
                                     f"KV heads, head_dim, seed_k, seed_v) = {want}, the calibration has {got}")
    res = await ctx.scripts.format_put(keys=[ix.k_format(fid), ix.K_FORMATS, ix.k_calibration(spec.calibration_id)],
                                       args=[spec.canonical_json(), timestamp(), fid])
    if res == -2:  # checked inside the script, atomically with the write (a format already there stays 200)
        raise _no_calibration(spec)
    if res == -1:
        raise HTTPException(409, f"format {fid} is registered with another spec; formats are immutable")
    entry = await format_entry(ctx.redis, fid)
    assert entry is not None
    return Response(entry.model_dump_json(), 201 if res == 1 else 200, media_type="application/json")


@router.put("/{format_id}", status_code=201, response_model=FormatEntry,
            responses={200: {"model": FormatEntry, "description": "already registered (same spec)"},
                       **error_responses(409, 503)})
async def put_format(format_id: HexId, body: FormatSpecBody, ctx: Context) -> Response:
    """Register a format under its id (idempotent); 409 if the id is not the spec's, or its calibration is
    not registered (register it first) or contradicts it."""
    return await _register_format(ctx, body.spec(), format_id)


@router.post("", status_code=201, response_model=FormatEntry,
             responses={200: {"model": FormatEntry, "description": "already registered (same spec)"},
                        **error_responses(409, 503)})
async def post_format(body: FormatSpecBody, ctx: Context) -> Response:
    """Register a format; its id is computed (idempotent); 409 if its calibration is not registered (register
    it first) or contradicts it."""
    return await _register_format(ctx, body.spec(), None)


@router.get("", response_model=FormatList, responses=error_responses(503))
async def list_formats(ctx: Context) -> FormatList:
    ids = await ctx.redis.zrange(ix.K_FORMATS, 0, -1)
    entries = [await format_entry(ctx.redis, i) for i in ids]
    return FormatList(formats=[e for e in entries if e is not None])


@router.get("/{format_id}", response_model=FormatEntry, responses=error_responses(404, 503))
async def get_format(format_id: HexId, ctx: Context) -> FormatEntry:
    entry = await format_entry(ctx.redis, format_id)
    if entry is None:
        raise HTTPException(404, f"format {format_id} is not registered")
    return entry
