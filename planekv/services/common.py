"""What both REST services share: typed errors -> HTTP codes, the bearer token, Prometheus request
metrics, /healthz and /metrics, body reading with a limit, and running uvicorn."""

from __future__ import annotations

import hmac
import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from pydantic import BaseModel, Field
from redis.exceptions import RedisError
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..kvstore.errors import CalibrationError, FormatMismatch, PlaneKVError
from ..tiering.errors import (
    BadBlockKey,
    BlockBusy,
    BlockCorrupt,
    BlockExists,
    BlockKeyMismatch,
    BlockTooLarge,
    BlockUndeletable,
    IndexPublishError,
    PolicyDoesNotFit,
    StoreFull,
    StoreIOError,
    UnknownFrameVersion,
)

log = logging.getLogger(__name__)


class ErrorBody(BaseModel):
    """Every error this API answers itself (FastAPI's own 422 lists the invalid fields instead)."""

    detail: str
    error: str | None = None


# Typed errors -> status codes (the first match along the exception's MRO wins).
ERROR_STATUS: dict[type[BaseException], int] = {
    BadBlockKey: 400,
    BlockCorrupt: 400,
    UnknownFrameVersion: 400,
    BlockKeyMismatch: 400,
    CalibrationError: 400,
    FormatMismatch: 409,
    BlockExists: 409,
    BlockBusy: 409,
    BlockTooLarge: 413,
    StoreFull: 507,
    StoreIOError: 507,
    IndexPublishError: 503,
    BlockUndeletable: 503,
    PolicyDoesNotFit: 409,
}

_DESCRIPTIONS = {
    400: "Bad input: the message says what is wrong", 401: "Missing or wrong bearer token",
    404: "Not found", 409: "Conflicts with what is stored", 413: "Body too large",
    500: "Internal error: the message says what is inconsistent",
    503: "A dependency (Redis, the file tier) is unavailable; the message says what to fix, then retry",
    507: "No room in the store",
}


class Readiness(BaseModel):
    """The body of ``/readyz`` on both services (200 ready, 503 not ready)."""

    status: str = Field(description="ready, or not ready")
    failing: list[str] = Field(description="the dependencies whose check failed")
    checks: dict[str, str] = Field(description="each dependency: ok, or what is wrong")


def readiness_response(checks: dict[str, str]) -> Response:
    """200 if every check is "ok", else 503 naming the failing ones."""
    failing = sorted(k for k, v in checks.items() if v != "ok")
    body = Readiness(status="not ready" if failing else "ready", failing=failing, checks=checks)
    return Response(body.model_dump_json(), status_code=503 if failing else 200, media_type="application/json")


READINESS_RESPONSES: dict[int | str, dict[str, Any]] = {
    503: {"model": Readiness, "description": "a dependency is failing: see failing"}}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error codes (JSON ErrorBody)."""
    return {c: {"model": ErrorBody, "description": _DESCRIPTIONS.get(c, "Error")} for c in codes}


def error_response(status: int, detail: str, error: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail, "error": error}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def planekv_error(request: Request, exc: Exception) -> JSONResponse:
        for cls in type(exc).__mro__:
            if cls in ERROR_STATUS:
                return error_response(ERROR_STATUS[cls], str(exc), type(exc).__name__)
        log.exception("unmapped PlaneKV error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {exc}", type(exc).__name__)

    async def redis_error(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis error on %s %s: %s", request.method, request.url.path, exc)
        return error_response(503, f"the metadata store (Redis) is unreachable or failed: {exc}; retry when it is "
                                   "back", type(exc).__name__)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail), None, exc.headers)

    app.add_exception_handler(PlaneKVError, planekv_error)
    app.add_exception_handler(RedisError, redis_error)
    app.add_exception_handler(HTTPException, http_error)


def bearer_auth(token: str | None) -> list[Any]:
    """Route dependencies that require ``Authorization: Bearer <token>`` when a token is set
    (none when it is not, so the OpenAPI schema shows security only where it applies)."""
    if not token:
        return []
    scheme = HTTPBearer(auto_error=False, description="PLANEKV_API_TOKEN")

    async def check(creds: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if creds is None or not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                                     "token this service was started with (PLANEKV_API_TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})

    return [Depends(check)]


class RequestMetrics:
    """Pure-ASGI middleware: requests by method, route template and status; latency histogram."""

    def __init__(self, app: ASGIApp, registry: CollectorRegistry, prefix: str) -> None:
        self.app = app
        self.requests = Counter(f"{prefix}_http_requests", "HTTP requests", ["method", "route", "status"],
                                registry=registry)
        self.latency = Histogram(f"{prefix}_http_request_seconds", "HTTP request latency (until the body is sent)",
                                 ["method", "route"], registry=registry,
                                 buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.requests.labels(scope["method"], name, str(status[0])).inc()
            self.latency.labels(scope["method"], name).observe(time.perf_counter() - t0)


def new_registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    return reg


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes before reading them if possible."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise HTTPException(400, f"Content-Length {declared!r} is not a number") from None
        if n > limit:
            raise HTTPException(413, f"body of {n} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise HTTPException(413, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def run_uvicorn(app: FastAPI, host: str, port: int, log_level: str = "info", access_log: bool = False) -> None:
    """Serve ``app`` in this process (one worker: the store's memory tier lives in it)."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), access_log=access_log,
                timeout_graceful_shutdown=15, server_header=False)
