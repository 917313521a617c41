"""The store service's ASGI app, put together: the block store built (and its index rebuilt from
the spill directory) in the lifespan, the block routes behind the bearer token, request metrics;
``serve`` runs it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool

from ...settings import Settings, load_settings
from ...tiering import BlockStore, PosixFileTier
from ..arguments import add_store_arguments, store_settings
from ..common import RequestMetrics, bearer_auth, error_responses, install_error_handlers, new_registry, run_uvicorn
from ..docs_page import install_docs
from ..exposure import check_exposure
from ..index import HEARTBEAT_INTERVAL_S
from ..redis_client import check_redis, redact_url
from . import routes
from .context import StoreContext
from .metrics import StoreCollector
from .reconcile import Reconciler

if TYPE_CHECKING:
    from ..index import RedisBlockIndex

log = logging.getLogger(__name__)

DESCRIPTION = "The store service: an HTTP face over :class:`planekv.tiering.BlockStore` (DESIGN section 6)."


def spill_dir(settings: Settings) -> Path:
    return settings.store.spill_dir or settings.data_dir / f"store-{settings.store.port}"


def store_id_of(settings: Settings) -> str:
    """The store's name in the block index: settings.store.store_id, else host:port."""
    return settings.store.store_id or f"{settings.store.host}:{settings.store.port}"


def build_store(settings: Settings) -> tuple[BlockStore, Any]:
    """The block store the service serves (rebuilding its index from the spill directory) and the
    Redis block index it publishes to (None if disabled)."""
    cfg = settings.store
    index = None
    if cfg.redis_index:
        from redis.exceptions import RedisError

        from ..index import RedisBlockIndex

        try:
            index = RedisBlockIndex.connect(settings, store_id_of(settings), {
                "url": cfg.url, "memory_bytes": cfg.memory_bytes, "file_bytes": cfg.file_bytes},
                require_format=cfg.require_registered_format)
        except RedisError as exc:
            raise SystemExit(f"the store could not reach Redis at {redact_url(settings.redis_url)} ({exc}); start "
                             "redis-server, set PLANEKV_REDIS_URL, or run without the index: "
                             "PLANEKV_STORE__REDIS_INDEX=false") from None
    file_tier = PosixFileTier(spill_dir(settings), fsync=cfg.fsync) if cfg.file_bytes > 0 else None
    store = BlockStore(cfg.memory_bytes, file_tier, cfg.file_bytes, write_through=cfg.write_through,
                       max_block_bytes=cfg.max_block_bytes, listener=index)
    return store, index


async def reconcile_every(reconciler: Reconciler, interval_s: float) -> None:
    """Reconcile now (at start), then every ``interval_s`` seconds; a failure is logged and retried
    at the next tick (readiness reports it until one succeeds)."""
    while True:
        with contextlib.suppress(Exception):  # logged and recorded by the reconciler
            await asyncio.to_thread(reconciler.run_once)
        await asyncio.sleep(interval_s)


async def heartbeat_every(index: RedisBlockIndex, reconciler: Reconciler) -> None:
    """Write the store's heartbeat every HEARTBEAT_INTERVAL_S seconds (the control plane forgets a store
    id only once it is old). A store that finds its record gone was forgotten while it could not beat
    (hung, partitioned): its entries were removed, so it republishes what it holds at once."""
    failing = False
    while True:
        try:
            forgotten = await asyncio.to_thread(index.beat)
            if failing:
                log.info("heartbeat written again")
            failing = False
            if forgotten:
                log.warning("this store's record was gone from the index (forgotten by POST /v1/stores/%s/forget "
                            "while its heartbeat was missing?): republishing its blocks", index.store_id)
                await asyncio.to_thread(reconciler.run_once)
        except Exception as exc:  # Redis down or hung: retried next tick, logged once
            if not failing:
                log.warning("heartbeat not written: %s", exc)
            failing = True
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    cfg = settings.store
    store_id = store_id_of(settings)
    registry = new_registry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store, index = build_store(settings)
        reconciler = Reconciler(store, index)
        app.state.store = StoreContext(cfg, store_id, store, index, reconciler)
        registry.register(StoreCollector(store, reconciler))
        log.info("store %s serving %d blocks (memory %d B, file tier %s, %d B)", store_id, len(store),
                 cfg.memory_bytes, spill_dir(settings) if cfg.file_bytes else "off", cfg.file_bytes)
        tasks = [asyncio.create_task(reconcile_every(reconciler, cfg.reconcile_interval_s))]
        if index is not None:
            tasks.append(asyncio.create_task(heartbeat_every(index, reconciler)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await run_in_threadpool(reconciler.close)  # a run still in its thread finishes first
            await run_in_threadpool(store.close)
            if index is not None:
                try:
                    index.drop_store(gone=True)
                except Exception as exc:  # Redis gone at shutdown: the next start republishes anyway
                    log.warning("could not withdraw this store's block index entries: %s", exc)

    app = FastAPI(title="PlaneKV store service", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Framed blocks of cold bit planes: a memory tier spilling to NVMe files.")
    install_docs(app)
    app.state.registry = registry
    install_error_handlers(app)
    app.add_middleware(RequestMetrics, registry=registry, prefix="planekv_store")

    app.include_router(routes.probes)
    app.include_router(routes.router, dependencies=bearer_auth(settings.api_token),
                       responses=error_responses(400, 401) if settings.api_token else error_responses(400))
    return app


def serve(args: argparse.Namespace) -> int:
    """Run the store in the foreground until SIGINT/SIGTERM (then persist and withdraw its index)."""
    settings = store_settings(args)
    logging.getLogger().setLevel(settings.log_level)
    check_exposure("store service", settings.store.host, settings)
    if settings.store.redis_index:
        check_redis("store service", settings)  # a bad password file or no Redis: one line, before uvicorn starts
    run_uvicorn(create_app(settings), settings.store.host, settings.store.port, settings.log_level, args.access_log)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.services.store", description=DESCRIPTION)
    add_store_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args)
