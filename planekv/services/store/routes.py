"""The store service's routes: ``/healthz`` (liveness), ``/readyz`` (readiness) and ``/metrics``
(no token), and under ``/v1`` the blocks (``PUT / GET / HEAD / DELETE /v1/blocks/{key}``,
``POST /v1/blocks:batch-get``, listing), the store's stats and ``POST /v1/reconcile``."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from starlette.responses import Response

from ...tiering import MEMORY, BlockCorrupt, BlockKey, Lease
from ...tiering.frame import KEY_PATTERN
from ..common import (
    METRICS_RESPONSES,
    READINESS_RESPONSES,
    Readiness,
    error_response,
    error_responses,
    metrics_response,
    read_body,
    readiness_response,
)
from ..request_body import FiniteJSONRoute
from .context import Context, Registry, StoreContext
from .frame_response import FrameResponse
from .readiness import readiness_checks
from .schemas import (
    BatchGet,
    BlockList,
    BlockMeta,
    Health,
    PutAnswer,
    ReconcileAnswer,
    StoreStatsBody,
    TierUsage,
    block_meta,
)

FRAME_MEDIA = "application/octet-stream"
FRAMES_MEDIA = "application/x-planekv-frames"
_BINARY = {"schema": {"type": "string", "format": "binary"}}

KeyParam = Annotated[str, PathParam(
    pattern=KEY_PATTERN, max_length=200,
    description="format_id:sequence_id:k|v:layer:kv_head:page_start-page_end:plane_start-plane_end",
    examples=["0123456789abcdef:seq-1:k:0:1:0-16:2-8"])]

probes = APIRouter(tags=["ops"], route_class=FiniteJSONRoute)  # included without the bearer token
router = APIRouter(prefix="/v1", tags=["blocks"], route_class=FiniteJSONRoute)


def parse_key(text: str) -> BlockKey:
    return BlockKey.parse(text)  # BadBlockKey -> 400 with what is wrong


def _json(model: BaseModel, status: int) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


@probes.get("/healthz", response_model=Health)
async def healthz(ctx: Context) -> Health:
    """Liveness: the process answers (whatever its dependencies do; see /readyz)."""
    return Health(status="ok", store_id=ctx.store_id, blocks=len(ctx.store))


@probes.get("/readyz", response_model=Readiness, responses=READINESS_RESPONSES)
async def readyz(ctx: Context) -> Response:
    """Readiness: Redis answers (if the index is on), the file tier is writable with free space
    above min_free_bytes, a reconciliation has completed. 503 names the failing dependencies."""
    return readiness_response(await run_in_threadpool(readiness_checks, ctx.config, ctx.store, ctx.index,
                                                      ctx.reconciler))


@probes.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
async def metrics(registry: Registry) -> Response:
    return metrics_response(registry)


@router.put("/blocks/{key}", status_code=201, response_model=PutAnswer,
            responses={200: {"model": PutAnswer, "description": "The same block was already stored"},
                       **error_responses(400, 409, 413, 503, 507)},
            openapi_extra={"requestBody": {"required": True, "content": {FRAME_MEDIA: _BINARY},
                                           "description": "the block frame (planekv.tiering.encode_frame)"}})
async def put_block(key: KeyParam, request: Request, ctx: Context) -> Response:
    """Store a framed block (verified: magic, version, key, length, checksum). Immutable:
    the same bytes again answer 200; other bytes under the key answer 409."""
    k = parse_key(key)
    body = await read_body(request, ctx.config.max_block_bytes)
    res = await run_in_threadpool(ctx.store.put, k, body)
    return _json(PutAnswer(**block_meta(res.info), created=res.created), 201 if res.created else 200)


@router.get("/blocks/{key}", response_class=Response,
            responses={200: {"content": {FRAME_MEDIA: _BINARY}, "description": "the frame"},
                       **error_responses(400, 404, 507)})
async def get_block(key: KeyParam, ctx: Context) -> Response:
    """The block's frame, checksum verified on this read; a read lease is held while it is sent."""
    return await _serve(ctx, parse_key(key))


@router.head("/blocks/{key}", response_class=Response,
             responses={200: {"description": "stored; Content-Length is the frame size"},
                        **error_responses(400, 404)})
async def head_block(key: KeyParam, ctx: Context) -> Response:
    k = parse_key(key)
    info = ctx.store.info(k)
    if info is None:
        raise HTTPException(404, f"block {k} is not stored")
    return Response(headers={"content-length": str(info.size), "x-planekv-tiers": ",".join(info.tiers)},
                    media_type=FRAME_MEDIA)


@router.delete("/blocks/{key}", status_code=204, response_class=Response,
               responses=error_responses(400, 404, 409, 503))
async def delete_block(key: KeyParam, ctx: Context) -> Response:
    """Delete the block: 204 only once it is gone from the index, the file tier and memory; reads
    already under way finish. 503 if the index is unreachable or the file cannot be deleted (the
    block is kept, still stored and listed); 409 while another DELETE of it is in flight."""
    k = parse_key(key)
    if not await run_in_threadpool(ctx.store.remove, k):
        raise HTTPException(404, f"block {k} is not stored")
    return Response(status_code=204)


@router.post("/blocks:batch-get", response_class=Response,
             responses={200: {"content": {FRAMES_MEDIA: _BINARY},
                              "description": "the frames found, concatenated in request order; "
                                             "X-PlaneKV-Missing counts the keys not found"},
                        **error_responses(400, 413, 507)})
async def batch_get(req: Annotated[BatchGet, Body()], ctx: Context) -> Response:
    """Several blocks in one response (each frame carries its key; absent keys are skipped)."""
    keys = [parse_key(k) for k in req.keys]
    max_block_bytes = ctx.config.max_block_bytes
    leases: list[Lease] = []
    frames: list[bytes] = []
    try:
        for k in keys:
            lease = ctx.store.lease(k)
            if lease is not None:
                leases.append(lease)
        total = sum(lease.size for lease in leases)
        if total > 4 * max_block_bytes:
            raise HTTPException(413, f"the blocks asked for total {total} bytes, more than one batch may carry "
                                     f"({4 * max_block_bytes}); ask for fewer keys")
        kept: list[Lease] = []
        for lease in leases:
            try:
                frames.append(lease.read() if lease.tier == MEMORY else await run_in_threadpool(lease.read))
                kept.append(lease)
            except BlockCorrupt:
                lease.release()
        leases = kept
    except BaseException:
        for lease in leases:
            lease.release()
        raise
    return FrameResponse(frames, leases, {"x-planekv-found": str(len(frames)),
                                          "x-planekv-missing": str(len(keys) - len(frames))}, FRAMES_MEDIA)


@router.get("/blocks", response_model=BlockList)
async def list_blocks(ctx: Context, sequence_id: Annotated[str | None, Query(max_length=128)] = None,
                      format_id: Annotated[str | None, Query(max_length=16)] = None,
                      limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> BlockList:
    """Blocks held by this store, optionally of one sequence and/or format."""
    infos = [i for i in ctx.store.infos()
             if (sequence_id is None or i.key.sequence_id == sequence_id)
             and (format_id is None or i.key.format_id == format_id)]
    infos.sort(key=lambda i: i.key)
    return BlockList(blocks=[BlockMeta(**block_meta(i)) for i in infos[:limit]], truncated=len(infos) > limit)


@router.post("/reconcile", response_model=ReconcileAnswer, tags=["ops"], responses=error_responses(503))
async def reconcile(ctx: Context) -> ReconcileAnswer:
    """Reconcile the block index with the tiers now (it also runs at start and every
    reconcile_interval_s): entries of blocks this store lacks are removed, held blocks missing from
    the index are republished, blocks whose file vanished are dropped."""
    report = await run_in_threadpool(ctx.reconciler.run_once)
    return ReconcileAnswer(**asdict(report))


@router.get("/stats", response_model=StoreStatsBody, tags=["ops"])
async def stats(ctx: Context) -> StoreStatsBody:
    st = ctx.store.stats()
    return StoreStatsBody(
        store_id=ctx.store_id, blocks=st.blocks, leases=st.leases, counters=st.counters,
        memory=TierUsage(capacity_bytes=st.memory_capacity_bytes, used_bytes=st.memory_used_bytes,
                         blocks=st.blocks_memory),
        file=TierUsage(capacity_bytes=st.file_capacity_bytes, used_bytes=st.file_used_bytes,
                       blocks=st.blocks_file))


async def _serve(ctx: StoreContext, k: BlockKey) -> Response:
    """One block's frame, sent under a read lease (404 if absent or if it fails verification)."""
    lease = ctx.store.lease(k)
    if lease is None:
        raise HTTPException(404, f"block {k} is not stored")
    try:
        frame = lease.read() if lease.tier == MEMORY else await run_in_threadpool(lease.read)
    except BlockCorrupt as exc:
        lease.release()
        return error_response(404, f"block {k} failed verification on read and was discarded ({exc}); "
                                   "PUT it again", type(exc).__name__)
    except BaseException:
        lease.release()
        raise
    return FrameResponse([frame], [lease], {"x-planekv-tier": lease.tier,
                                            "x-planekv-checksum": f"{lease.checksum:016x}"}, FRAME_MEDIA)
