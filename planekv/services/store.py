"""The store service: an HTTP face over :class:`planekv.tiering.BlockStore` (DESIGN section 6).

``PUT / GET / HEAD / DELETE /v1/blocks/{key}`` move framed blocks (the frame is the body, byte for
byte), ``POST /v1/blocks:batch-get`` returns several frames concatenated (each frame carries its
own key and length, so the body splits without an index; missing keys are simply absent).
The block index is published to Redis (metadata only) unless ``PLANEKV_STORE__REDIS_INDEX=false``.

Run: ``planekv store`` or ``python -m planekv.services.store``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Body, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, Field
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..settings import Settings, load_settings
from ..tiering import MEMORY, BlockCorrupt, BlockKey, BlockStore, Lease, PosixFileTier
from ..tiering.frame import KEY_PATTERN
from .arguments import add_store_arguments, store_settings
from .common import (
    METRICS_RESPONSES,
    RequestMetrics,
    bearer_auth,
    error_response,
    error_responses,
    install_error_handlers,
    metrics_response,
    new_registry,
    read_body,
    run_uvicorn,
)

log = logging.getLogger(__name__)

FRAME_MEDIA = "application/octet-stream"
FRAMES_MEDIA = "application/x-planekv-frames"
MAX_BATCH_KEYS = 256
_BINARY = {"schema": {"type": "string", "format": "binary"}}

KeyParam = Annotated[str, PathParam(
    pattern=KEY_PATTERN, max_length=200,
    description="format_id:sequence_id:k|v:layer:kv_head:page_start-page_end:plane_start-plane_end",
    examples=["0123456789abcdef:seq-1:k:0:1:0-16:2-8"])]


class BlockMeta(BaseModel):
    key: str
    size: int = Field(description="frame bytes (4 KiB header + payload padded to 4 KiB)")
    checksum: str = Field(description="xxh3-64 of the frame, hex")
    tiers: list[str]


class PutAnswer(BlockMeta):
    created: bool


class BlockList(BaseModel):
    blocks: list[BlockMeta]
    truncated: bool


class BatchGet(BaseModel):
    keys: list[str] = Field(min_length=1, max_length=MAX_BATCH_KEYS)


class TierUsage(BaseModel):
    capacity_bytes: int
    used_bytes: int
    blocks: int


class StoreStatsBody(BaseModel):
    store_id: str
    blocks: int
    leases: int
    memory: TierUsage
    file: TierUsage
    counters: dict[str, int]


class Health(BaseModel):
    status: str
    store_id: str
    blocks: int


def _meta(info: Any) -> dict[str, Any]:
    return {"key": str(info.key), "size": info.size, "checksum": f"{info.checksum:016x}", "tiers": list(info.tiers)}


class FrameResponse(Response):
    """One or more frames sent as they are (no copy), releasing the read leases once sent."""

    def __init__(self, frames: list[bytes], leases: list[Lease], headers: dict[str, str], media_type: str) -> None:
        self.frames, self.leases = frames, leases
        headers = {**headers, "content-length": str(sum(len(f) for f in frames))}
        super().__init__(content=None, headers=headers, media_type=media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            last = len(self.frames) - 1
            for i, frame in enumerate(self.frames):
                await send({"type": "http.response.body", "body": frame, "more_body": i < last})
            if last < 0:
                await send({"type": "http.response.body", "body": b""})
        finally:
            for lease in self.leases:
                lease.release()


class _StoreCollector:
    """Exports the block store's own counters and gauges at scrape time."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

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


def spill_dir(settings: Settings) -> Path:
    return settings.store.spill_dir or settings.data_dir / f"store-{settings.store.port}"


def build_store(settings: Settings) -> tuple[BlockStore, Any]:
    """The block store the service serves (rebuilding its index from the spill directory) and the
    Redis block index it publishes to (None if disabled)."""
    cfg = settings.store
    store_id = cfg.store_id or f"{cfg.host}:{cfg.port}"
    index = None
    if cfg.redis_index:
        from redis.exceptions import RedisError

        from .index import RedisBlockIndex

        try:
            index = RedisBlockIndex.connect(settings.redis_url, store_id, {
                "url": cfg.url, "memory_bytes": cfg.memory_bytes, "file_bytes": cfg.file_bytes})
        except RedisError as exc:
            raise SystemExit(f"the store could not reach Redis at {settings.redis_url} ({exc}); start "
                             "redis-server, set PLANEKV_REDIS_URL, or run without the index: "
                             "PLANEKV_STORE__REDIS_INDEX=false") from None
    file_tier = PosixFileTier(spill_dir(settings), fsync=cfg.fsync) if cfg.file_bytes > 0 else None
    store = BlockStore(cfg.memory_bytes, file_tier, cfg.file_bytes, write_through=cfg.write_through,
                       max_block_bytes=cfg.max_block_bytes, listener=index)
    return store, index


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    cfg = settings.store
    store_id = cfg.store_id or f"{cfg.host}:{cfg.port}"
    registry = new_registry()
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store, index = build_store(settings)
        state["store"], state["index"] = store, index
        registry.register(_StoreCollector(store))
        log.info("store %s serving %d blocks (memory %d B, file tier %s, %d B)", store_id, len(store),
                 cfg.memory_bytes, spill_dir(settings) if cfg.file_bytes else "off", cfg.file_bytes)
        try:
            yield
        finally:
            await run_in_threadpool(store.close)
            if index is not None:
                try:
                    index.drop_store()
                except Exception as exc:  # Redis gone at shutdown: the next start republishes anyway
                    log.warning("could not withdraw this store's block index entries: %s", exc)

    app = FastAPI(title="PlaneKV store service", version="1", lifespan=lifespan,
                  description="Framed blocks of cold bit planes: a memory tier spilling to NVMe files.")
    install_error_handlers(app)
    app.add_middleware(RequestMetrics, registry=registry, prefix="planekv_store")

    def store() -> BlockStore:
        return state["store"]

    def parse_key(text: str) -> BlockKey:
        return BlockKey.parse(text)  # BadBlockKey -> 400 with what is wrong

    @app.get("/healthz", response_model=Health, tags=["ops"])
    async def healthz() -> Health:
        return Health(status="ok", store_id=store_id, blocks=len(store()))

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        return metrics_response(registry)

    api = APIRouter(prefix="/v1", dependencies=bearer_auth(settings.api_token), tags=["blocks"],
                    responses=error_responses(400, 401) if settings.api_token else error_responses(400))

    @api.put("/blocks/{key}", status_code=201, response_model=PutAnswer,
             responses={200: {"model": PutAnswer, "description": "The same block was already stored"},
                        **error_responses(400, 409, 413, 503, 507)},
             openapi_extra={"requestBody": {"required": True, "content": {FRAME_MEDIA: _BINARY},
                                            "description": "the block frame (planekv.tiering.encode_frame)"}})
    async def put_block(key: KeyParam, request: Request) -> Response:
        """Store a framed block (verified: magic, version, key, length, checksum). Immutable:
        the same bytes again answer 200; other bytes under the key answer 409."""
        k = parse_key(key)
        body = await read_body(request, cfg.max_block_bytes)
        res = await run_in_threadpool(store().put, k, body)
        return _json(PutAnswer(**_meta(res.info), created=res.created), 201 if res.created else 200)

    @api.get("/blocks/{key}", response_class=Response,
             responses={200: {"content": {FRAME_MEDIA: _BINARY}, "description": "the frame"},
                        **error_responses(400, 404, 507)})
    async def get_block(key: KeyParam) -> Response:
        """The block's frame, checksum verified on this read; a read lease is held while it is sent."""
        return await _serve(parse_key(key))

    @api.head("/blocks/{key}", response_class=Response,
              responses={200: {"description": "stored; Content-Length is the frame size"},
                         **error_responses(400, 404)})
    async def head_block(key: KeyParam) -> Response:
        k = parse_key(key)
        info = store().info(k)
        if info is None:
            raise HTTPException(404, f"block {k} is not stored")
        return Response(headers={"content-length": str(info.size), "x-planekv-tiers": ",".join(info.tiers)},
                        media_type=FRAME_MEDIA)

    @api.delete("/blocks/{key}", status_code=204, response_class=Response, responses=error_responses(400, 404))
    async def delete_block(key: KeyParam) -> Response:
        """Unpublish and delete the block; reads already under way finish."""
        k = parse_key(key)
        if not await run_in_threadpool(store().remove, k):
            raise HTTPException(404, f"block {k} is not stored")
        return Response(status_code=204)

    @api.post("/blocks:batch-get", response_class=Response,
              responses={200: {"content": {FRAMES_MEDIA: _BINARY},
                               "description": "the frames found, concatenated in request order; "
                                              "X-PlaneKV-Missing counts the keys not found"},
                         **error_responses(400, 413, 507)})
    async def batch_get(req: Annotated[BatchGet, Body()]) -> Response:
        """Several blocks in one response (each frame carries its key; absent keys are skipped)."""
        keys = [parse_key(k) for k in req.keys]
        leases: list[Lease] = []
        frames: list[bytes] = []
        try:
            for k in keys:
                lease = store().lease(k)
                if lease is not None:
                    leases.append(lease)
            total = sum(lease.size for lease in leases)
            if total > 4 * cfg.max_block_bytes:
                raise HTTPException(413, f"the blocks asked for total {total} bytes, more than one batch may carry "
                                         f"({4 * cfg.max_block_bytes}); ask for fewer keys")
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

    @api.get("/blocks", response_model=BlockList)
    async def list_blocks(sequence_id: Annotated[str | None, Query(max_length=128)] = None,
                          format_id: Annotated[str | None, Query(max_length=16)] = None,
                          limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> BlockList:
        """Blocks held by this store, optionally of one sequence and/or format."""
        infos = [i for i in store().infos()
                 if (sequence_id is None or i.key.sequence_id == sequence_id)
                 and (format_id is None or i.key.format_id == format_id)]
        infos.sort(key=lambda i: i.key)
        return BlockList(blocks=[BlockMeta(**_meta(i)) for i in infos[:limit]], truncated=len(infos) > limit)

    @api.get("/stats", response_model=StoreStatsBody, tags=["ops"])
    async def stats() -> StoreStatsBody:
        st = store().stats()
        return StoreStatsBody(
            store_id=store_id, blocks=st.blocks, leases=st.leases, counters=st.counters,
            memory=TierUsage(capacity_bytes=st.memory_capacity_bytes, used_bytes=st.memory_used_bytes,
                             blocks=st.blocks_memory),
            file=TierUsage(capacity_bytes=st.file_capacity_bytes, used_bytes=st.file_used_bytes,
                           blocks=st.blocks_file))

    async def _serve(k: BlockKey) -> Response:
        lease = store().lease(k)
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

    app.include_router(api)
    return app


def _json(model: BaseModel, status: int) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


def serve(args: argparse.Namespace) -> int:
    """Run the store in the foreground until SIGINT/SIGTERM (then persist and withdraw its index)."""
    settings = store_settings(args)
    logging.getLogger().setLevel(settings.log_level)
    run_uvicorn(create_app(settings), settings.store.host, settings.store.port, settings.log_level, args.access_log)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.services.store", description=__doc__.splitlines()[0])
    add_store_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
