"""The control plane's ASGI app, put together: Redis connected in the lifespan, the routers of
each resource behind the bearer token, the body limit and request metrics; ``serve`` runs it."""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ...settings import Settings, load_settings
from ..arguments import add_control_arguments, control_settings
from ..common import RequestMetrics, bearer_auth, error_responses, install_error_handlers, run_uvicorn
from ..docs_page import install_docs
from ..exposure import check_exposure
from ..redis_client import check_redis, redact_url, redis_async
from . import routes_caches, routes_calibrations, routes_formats, routes_ops, routes_policies, routes_stores
from .body_limit import BodyLimit
from .context import ControlContext, calibration_dir
from .metrics import ControlMetrics
from .scripts import ControlScripts

log = logging.getLogger(__name__)

DESCRIPTION = ("The control plane (DESIGN section 6): formats, calibrations, placement policies, the cache "
               "registry and stats, over Redis (metadata only).")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    calib_dir = calibration_dir(settings)
    metrics = ControlMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r = redis_async(settings)
        try:
            await r.ping()
        except Exception as exc:
            await r.aclose()
            raise SystemExit(f"the control plane could not reach Redis at {redact_url(settings.redis_url)} ({exc}); "
                             "start redis-server or set PLANEKV_REDIS_URL") from None
        app.state.control = ControlContext(settings, r, ControlScripts.register(r), calib_dir)
        calib_dir.mkdir(parents=True, exist_ok=True)
        log.info("control plane up: redis %s, calibration artifacts in %s", redact_url(settings.redis_url),
                 calib_dir)
        try:
            yield
        finally:
            await r.aclose()

    app = FastAPI(title="PlaneKV control plane", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Formats, calibrations, placement policies, cache registry (metadata in Redis).")
    install_docs(app)
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=settings.control.max_calibration_bytes)
    app.add_middleware(RequestMetrics, registry=metrics.registry, prefix="planekv_control")

    app.include_router(routes_ops.probes)
    auth = bearer_auth(settings.api_token)
    # 400: FastAPI answers a body that is not JSON at all with 400 (invalid JSON is 422).
    common_errors = error_responses(400, 401) if settings.api_token else error_responses(400)
    for module in (routes_formats, routes_calibrations, routes_policies, routes_caches, routes_stores, routes_ops):
        app.include_router(module.router, dependencies=auth, responses=common_errors)
    return app


def serve(args: argparse.Namespace) -> int:
    """Run the control plane in the foreground until SIGINT/SIGTERM."""
    settings = control_settings(args)
    logging.getLogger().setLevel(settings.log_level)
    check_exposure("control plane", settings.control.host, settings)
    check_redis("control plane", settings)  # a bad password file or no Redis: one line, before uvicorn starts
    run_uvicorn(create_app(settings), settings.control.host, settings.control.port, settings.log_level,
                args.access_log)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planekv.services.control", description=DESCRIPTION)
    add_control_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args)
