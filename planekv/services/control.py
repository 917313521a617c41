"""The control plane (DESIGN section 6): formats, calibrations, placement policies, the cache
registry and stats, over Redis (metadata only).

- **formats** keyed by ``format_id`` (the hash of a FormatSpec's canonical JSON): registering the
  same spec again is idempotent (200); a spec whose id is not the one it is registered under, or
  that contradicts a registered calibration, is a conflict (409).
- **calibrations** are immutable and content-addressed (``calibration_id``); each registration gets
  a version number. Artifact bytes live in ``<data_dir>/control/calibrations/`` (written, fsynced,
  renamed, *then* published in Redis); Redis holds their metadata and sha256.
- **placement policies** are named, versioned documents: create, update (a new version), activate,
  roll back (undo the last activation), history. Activation is published on ``pkv:policy-activated``.
- **caches**: sequences, their format, and the planes each tier holds (from the stores' block index).

Run: ``planekv control`` or ``python -m planekv.services.control``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..kvstore import Calibration, FormatSpec
from ..kvstore.atomic import atomic_write_bytes
from ..kvstore.errors import CalibrationError
from ..kvstore.format import LAYOUT_VERSION
from ..settings import Settings, load_settings
from ..tiering.placement import PlacementPolicy
from . import index as ix
from .common import (
    METRICS_RESPONSES,
    RequestMetrics,
    bearer_auth,
    error_responses,
    install_error_handlers,
    metrics_response,
    new_registry,
    read_body,
    run_uvicorn,
)

log = logging.getLogger(__name__)

ID16 = r"^[0-9a-f]{16}$"
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
SEQ = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$"
_BINARY = {"schema": {"type": "string", "format": "binary"}}
PolicyName = Annotated[str, PathParam(pattern=NAME)]
SeqId = Annotated[str, PathParam(pattern=SEQ)]

# ---------------------------------------------------------------- models


class FormatSpecBody(BaseModel):
    """A FormatSpec (planekv.kvstore.FormatSpec), validated by the same rules."""

    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(min_length=1, max_length=256)
    n_layers: int = Field(ge=1, le=65536)
    n_q_heads: int = Field(ge=1, le=65536)
    n_kv_heads: int = Field(ge=1, le=65536)
    head_dim: int = Field(ge=8, le=65536)
    calibration_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    model_revision: str = Field(default="unknown", max_length=256)
    position: Literal["rope-before-cache", "none"] = "rope-before-cache"
    rope_theta: int | float = Field(default=10000.0, gt=0, le=1e12, allow_inf_nan=False)
    seed_k: int = Field(default=FormatSpec.seed_k, ge=0, lt=1 << 63)
    seed_v: int = Field(default=FormatSpec.seed_v, ge=0, lt=1 << 63)
    codebook: Literal["gaussian-lloyd-tree"] = "gaussian-lloyd-tree"
    width: int = Field(default=8, ge=1, le=8)
    page_size: Literal[64, 128] = 64
    layout_version: int = Field(default=LAYOUT_VERSION, ge=1, le=LAYOUT_VERSION)
    v_run: Literal[1, 2, 4, 8] = 1

    @model_validator(mode="after")
    def _spec(self) -> FormatSpecBody:
        self.spec()  # FormatSpec's own checks (GQA multiple, head_dim multiple of 8, ...)
        return self

    def spec(self) -> FormatSpec:
        return FormatSpec.from_dict(self.model_dump())


class FormatEntry(BaseModel):
    format_id: str
    spec: dict[str, Any]
    created_at: float


class FormatList(BaseModel):
    formats: list[FormatEntry]


class CalibrationMeta(BaseModel):
    calibration_id: str
    version: int = Field(description="registration order on this control plane (1, 2, ...)")
    artifact_version: int = Field(description="version of the artifact format (planekv.kvstore.calibration)")
    sha256: str
    bytes: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    seed_k: int
    seed_v: int
    source: Literal["upload", "computed"]
    meta: dict[str, Any]
    created_at: float


class CalibrationList(BaseModel):
    calibrations: list[CalibrationMeta]


Stat3 = Annotated[list[Annotated[list[Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                                                Field(min_length=1, max_length=4096)]],
                                 Field(min_length=1, max_length=1024)]], Field(min_length=1, max_length=1024)]
Sample4 = Annotated[list[Annotated[list[Annotated[list[Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                                                                 Field(min_length=1, max_length=4096)]],
                                                  Field(min_length=2, max_length=65536)]],
                                   Field(min_length=1, max_length=1024)]], Field(min_length=1, max_length=1024)]


class CalibrationStats(BaseModel):
    """Per layer, KV head and channel: mean and scale of transformed K (after RoPE) and V."""

    model_config = ConfigDict(extra="forbid")
    mu_k: Stat3
    sigma_k: Stat3
    mu_v: Stat3
    sigma_v: Stat3


class CalibrationSamples(BaseModel):
    """K (after RoPE) and V samples, untransformed: [layers][kv_heads][tokens][head_dim]."""

    model_config = ConfigDict(extra="forbid")
    k: Sample4
    v: Sample4


class CalibrationCompute(BaseModel):
    """Compute a calibration from statistics or from samples (exactly one of the two)."""

    model_config = ConfigDict(extra="forbid")
    seed_k: int = Field(default=FormatSpec.seed_k, ge=0, lt=1 << 63)
    seed_v: int = Field(default=FormatSpec.seed_v, ge=0, lt=1 << 63)
    meta: dict[str, Any] = Field(default_factory=dict)
    statistics: CalibrationStats | None = None
    samples: CalibrationSamples | None = None

    @model_validator(mode="after")
    def _one(self) -> CalibrationCompute:
        if (self.statistics is None) == (self.samples is None):
            raise ValueError("give exactly one of 'statistics' and 'samples'")
        return self


class PolicyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    policy: PlacementPolicy
    comment: str = Field(default="", max_length=1000)


class PolicyUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: PlacementPolicy
    comment: str = Field(default="", max_length=1000)
    activate: bool = False


class PolicyActivate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)


class PolicyVersion(BaseModel):
    name: str
    version: int
    active: bool
    policy: PlacementPolicy
    comment: str
    sha256: str
    created_at: float


class PolicySummary(BaseModel):
    name: str
    active_version: int
    latest_version: int
    created_at: float
    active: PolicyVersion


class PolicyList(BaseModel):
    policies: list[PolicySummary]


class PolicyVersions(BaseModel):
    name: str
    versions: list[PolicyVersion]


class PolicyEvent(BaseModel):
    action: Literal["created", "updated", "activated", "rolled_back"]
    version: int
    previous: int | None = None
    at: float


class PolicyHistory(BaseModel):
    name: str
    events: list[PolicyEvent]


class HotPlanesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    k: int = Field(ge=0, le=8)
    v: int = Field(ge=0, le=8)


class CacheRegister(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format_id: str = Field(pattern=ID16)
    n_tokens: int | None = Field(default=None, ge=0, le=1 << 40)
    policy: str | None = Field(default=None, pattern=NAME, description="placement policy name")
    hot_planes: HotPlanesBody | None = Field(default=None, description="planes [0, h) kept on the GPU")


class TierPlanes(BaseModel):
    blocks: int
    bytes: int
    planes: dict[str, list[str]] = Field(description="plane ranges held, per kind ('k', 'v'), e.g. ['2-8']")
    stores: list[str]


class CacheEntry(BaseModel):
    sequence_id: str
    format_id: str
    created_at: float
    source: str
    n_tokens: int | None = None
    policy: str | None = None
    hot_planes: HotPlanesBody | None = None


class CacheDetail(CacheEntry):
    tiers: dict[str, TierPlanes]


class CacheList(BaseModel):
    caches: list[CacheEntry]
    total: int


class TierTotals(BaseModel):
    blocks: int
    bytes: int


class Stats(BaseModel):
    formats: int
    calibrations: int
    policies: int
    caches: int
    stores: dict[str, dict[str, Any]]
    tiers: dict[str, TierTotals]


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    redis: str


# ---------------------------------------------------------------- Lua (atomic metadata updates)

_FORMAT_PUT = """
local cur = redis.call('HGET', KEYS[1], 'spec')
if cur then
  if cur == ARGV[1] then return 0 end
  return -1
end
redis.call('HSET', KEYS[1], 'spec', ARGV[1], 'created_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""

# KEYS: calibration hash, calibrations zset, seq; ARGV: id, sha, now, then field/value pairs
_CALIB_PUT = """
local cur = redis.call('HGET', KEYS[1], 'sha256')
if cur then
  if cur == ARGV[2] then return {0, redis.call('HGET', KEYS[1], 'version')} end
  return {-1, cur}
end
local v = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'sha256', ARGV[2], 'created_at', ARGV[3], 'version', v)
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[2], v, ARGV[1])
return {1, v}
"""

# KEYS: policy hash, versions, stack, history, policies zset, channel; ARGV: name, version doc, now, sha
_POLICY_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'created_at', ARGV[3], 'active', 1, 'latest_sha', ARGV[4])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], 1)
redis.call('RPUSH', KEYS[4], '{"action":"created","version":1,"at":' .. ARGV[3] .. '}')
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
redis.call('PUBLISH', KEYS[6], ARGV[1] .. ':1')
return 1
"""

# KEYS: policy hash, versions, stack, history, channel; ARGV: name, version doc, now, sha, activate
_POLICY_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local n = redis.call('LLEN', KEYS[2])
if redis.call('HGET', KEYS[1], 'latest_sha') == ARGV[4] then return {n, 0} end
redis.call('RPUSH', KEYS[2], ARGV[2])
n = n + 1
redis.call('HSET', KEYS[1], 'latest_sha', ARGV[4])
redis.call('RPUSH', KEYS[4], '{"action":"updated","version":' .. n .. ',"at":' .. ARGV[3] .. '}')
if ARGV[5] == '1' then
  local cur = redis.call('HGET', KEYS[1], 'active')
  redis.call('HSET', KEYS[1], 'active', n)
  redis.call('RPUSH', KEYS[3], n)
  redis.call('RPUSH', KEYS[4],
    '{"action":"activated","version":' .. n .. ',"previous":' .. cur .. ',"at":' .. ARGV[3] .. '}')
  redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. n)
end
return {n, 1}
"""

# KEYS: policy hash, versions, stack, history, channel; ARGV: name, version, now
_POLICY_ACTIVATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local v = tonumber(ARGV[2])
if v > redis.call('LLEN', KEYS[2]) then return -2 end
local cur = redis.call('HGET', KEYS[1], 'active')
if tonumber(cur) == v then return 0 end
redis.call('HSET', KEYS[1], 'active', v)
redis.call('RPUSH', KEYS[3], v)
redis.call('RPUSH', KEYS[4],
  '{"action":"activated","version":' .. v .. ',"previous":' .. cur .. ',"at":' .. ARGV[3] .. '}')
redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. v)
return 1
"""

# KEYS: policy hash, versions, stack, history, channel; ARGV: name, now
_POLICY_ROLLBACK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('LLEN', KEYS[3]) < 2 then return -2 end
local cur = redis.call('RPOP', KEYS[3])
local prev = redis.call('LINDEX', KEYS[3], -1)
redis.call('HSET', KEYS[1], 'active', prev)
redis.call('RPUSH', KEYS[4],
  '{"action":"rolled_back","version":' .. prev .. ',"previous":' .. cur .. ',"at":' .. ARGV[2] .. '}')
redis.call('PUBLISH', KEYS[5], ARGV[1] .. ':' .. prev)
return tonumber(prev)
"""

# KEYS: cache hash, caches zset; ARGV: format_id, now, then field/value pairs to set
_CACHE_PUT = """
local fid = redis.call('HGET', KEYS[1], 'format_id')
if fid and fid ~= ARGV[1] then return redis.error_reply('FORMAT ' .. fid) end
local created = 0
if not fid then
  redis.call('HSET', KEYS[1], 'format_id', ARGV[1], 'created_at', ARGV[2])
  redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[3])
  created = 1
end
redis.call('HSET', KEYS[1], 'source', 'api')
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return created
"""

# ---------------------------------------------------------------- helpers


class BodyLimit:
    """Refuse (413) request bodies over ``limit`` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                body = json.dumps({"detail": f"body of {int(value)} bytes exceeds the limit of {self.limit} bytes",
                                   "error": None}).encode()
                await send({"type": "http.response.start", "status": 413,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(413, f"body exceeds the limit of {self.limit} bytes")
            return msg

        await self.app(scope, limited, send)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _now() -> str:
    return f"{time.time():.6f}"


# ---------------------------------------------------------------- app


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    cfg = settings.control
    calib_dir = settings.data_dir / "control" / "calibrations"
    registry = new_registry()
    gauges = {name: Gauge(f"planekv_control_{name}", f"registered {name}", registry=registry)
              for name in ("formats", "calibrations", "policies", "caches")}
    tier_blocks = Gauge("planekv_control_tier_blocks", "blocks per tier (block index)", ["tier"], registry=registry)
    tier_bytes = Gauge("planekv_control_tier_bytes", "bytes per tier (block index)", ["tier"], registry=registry)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r = aioredis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=5,
                                    socket_connect_timeout=3)
        try:
            await r.ping()
        except Exception as exc:
            await r.aclose()
            raise SystemExit(f"the control plane could not reach Redis at {settings.redis_url} ({exc}); start "
                             "redis-server or set PLANEKV_REDIS_URL") from None
        state["r"] = r
        state["scripts"] = {name: r.register_script(src) for name, src in (
            ("format", _FORMAT_PUT), ("calib", _CALIB_PUT), ("create", _POLICY_CREATE), ("update", _POLICY_UPDATE),
            ("activate", _POLICY_ACTIVATE), ("rollback", _POLICY_ROLLBACK), ("cache", _CACHE_PUT))}
        calib_dir.mkdir(parents=True, exist_ok=True)
        log.info("control plane up: redis %s, calibration artifacts in %s", settings.redis_url, calib_dir)
        try:
            yield
        finally:
            await r.aclose()

    app = FastAPI(title="PlaneKV control plane", version="1", lifespan=lifespan,
                  description="Formats, calibrations, placement policies, cache registry (metadata in Redis).")
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=cfg.max_calibration_bytes)
    app.add_middleware(RequestMetrics, registry=registry, prefix="planekv_control")

    def R() -> aioredis.Redis:
        return state["r"]

    def script(name: str) -> Any:
        return state["scripts"][name]

    @app.get("/healthz", response_model=Health, tags=["ops"],
             responses={503: {"model": Health, "description": "Redis unreachable"}})
    async def healthz() -> Response:
        try:
            await R().ping()
        except Exception as exc:
            return Response(Health(status="degraded", redis=str(exc)).model_dump_json(), 503,
                            media_type="application/json")
        return Response(Health(status="ok", redis="ok").model_dump_json(), media_type="application/json")

    @app.get("/metrics", tags=["ops"], response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        try:
            p = R().pipeline(transaction=False)
            for key in (ix.K_FORMATS, ix.K_CALIBRATIONS, ix.K_POLICIES, ix.K_CACHES):
                p.zcard(key)
            p.hgetall(ix.K_TIERSTATS)
            *counts, tiers = await p.execute()
            for g, n in zip(gauges.values(), counts, strict=True):
                g.set(n)
            for k, val in tiers.items():
                tier, what = k.rsplit(":", 1)
                (tier_blocks if what == "blocks" else tier_bytes).labels(tier).set(int(val))
        except Exception as exc:  # metrics must still answer while Redis is down
            log.warning("metrics: redis gauges not refreshed: %s", exc)
        return metrics_response(registry)

    auth = bearer_auth(settings.api_token)
    # 400: FastAPI answers a body that is not JSON at all with 400 (invalid JSON is 422).
    common_errors = error_responses(400, 401) if settings.api_token else error_responses(400)
    formats = APIRouter(prefix="/v1/formats", tags=["formats"], dependencies=auth, responses=common_errors)
    calibs = APIRouter(prefix="/v1/calibrations", tags=["calibrations"], dependencies=auth, responses=common_errors)
    policies = APIRouter(prefix="/v1/policies", tags=["policies"], dependencies=auth, responses=common_errors)
    caches = APIRouter(prefix="/v1/caches", tags=["caches"], dependencies=auth, responses=common_errors)
    ops = APIRouter(prefix="/v1", tags=["ops"], dependencies=auth, responses=common_errors)

    # ---- formats

    async def _format_entry(fid: str) -> FormatEntry | None:
        h = await R().hgetall(ix.k_format(fid))
        if not h:
            return None
        return FormatEntry(format_id=fid, spec=json.loads(h["spec"]), created_at=float(h["created_at"]))

    async def _register_format(spec: FormatSpec, claimed: str | None) -> Response:
        fid = spec.format_id
        if claimed is not None and claimed != fid:
            raise HTTPException(409, f"format_id {claimed} conflicts with the spec, whose format_id is {fid} "
                                     "(the sha256 of its canonical JSON); register it under /v1/formats/" + fid)
        c = await R().hgetall(ix.k_calibration(spec.calibration_id))
        if c:
            got = (int(c["n_layers"]), int(c["n_kv_heads"]), int(c["head_dim"]), int(c["seed_k"]), int(c["seed_v"]))
            want = (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.seed_k, spec.seed_v)
            if got != want:
                raise HTTPException(409, f"the spec conflicts with calibration {spec.calibration_id}: (layers, "
                                         f"KV heads, head_dim, seed_k, seed_v) = {want}, the calibration has {got}")
        res = await script("format")(keys=[ix.k_format(fid), ix.K_FORMATS],
                                     args=[spec.canonical_json(), _now(), fid])
        if res == -1:
            raise HTTPException(409, f"format {fid} is registered with another spec; formats are immutable")
        entry = await _format_entry(fid)
        assert entry is not None
        return Response(entry.model_dump_json(), 201 if res == 1 else 200, media_type="application/json")

    @formats.put("/{format_id}", status_code=201, response_model=FormatEntry,
                 responses={200: {"model": FormatEntry, "description": "already registered (same spec)"},
                            **error_responses(409, 503)})
    async def put_format(format_id: Annotated[str, PathParam(pattern=ID16)], body: FormatSpecBody) -> Response:
        """Register a format under its id (idempotent); 409 if the id is not the spec's."""
        return await _register_format(body.spec(), format_id)

    @formats.post("", status_code=201, response_model=FormatEntry,
                  responses={200: {"model": FormatEntry, "description": "already registered (same spec)"},
                             **error_responses(409, 503)})
    async def post_format(body: FormatSpecBody) -> Response:
        """Register a format; its id is computed (idempotent)."""
        return await _register_format(body.spec(), None)

    @formats.get("", response_model=FormatList, responses=error_responses(503))
    async def list_formats() -> FormatList:
        ids = await R().zrange(ix.K_FORMATS, 0, -1)
        entries = [await _format_entry(i) for i in ids]
        return FormatList(formats=[e for e in entries if e is not None])

    @formats.get("/{format_id}", response_model=FormatEntry, responses=error_responses(404, 503))
    async def get_format(format_id: Annotated[str, PathParam(pattern=ID16)]) -> FormatEntry:
        entry = await _format_entry(format_id)
        if entry is None:
            raise HTTPException(404, f"format {format_id} is not registered")
        return entry

    # ---- calibrations

    def _calib_path(cid: str, sha: str) -> Path:
        return calib_dir / f"{cid}-{sha[:16]}.pt"

    def _meta(h: dict[str, str], cid: str) -> CalibrationMeta:
        return CalibrationMeta(
            calibration_id=cid, version=int(h["version"]), artifact_version=int(h["artifact_version"]),
            sha256=h["sha256"], bytes=int(h["bytes"]), n_layers=int(h["n_layers"]), n_kv_heads=int(h["n_kv_heads"]),
            head_dim=int(h["head_dim"]), seed_k=int(h["seed_k"]), seed_v=int(h["seed_v"]),
            source=h["source"], meta=json.loads(h["meta"]), created_at=float(h["created_at"]))  # type: ignore[arg-type]

    async def _store_calibration(calib: Calibration, blob: bytes, source: str) -> Response:
        from ..kvstore.calibration import CALIBRATION_VERSION

        cid = calib.calibration_id
        sha = hashlib.sha256(blob).hexdigest()
        existing = await R().hget(ix.k_calibration(cid), "sha256")
        if existing is not None and existing != sha:
            raise HTTPException(409, f"calibration {cid} is already registered with other bytes (sha256 "
                                     f"{existing[:16]}..., this upload {sha[:16]}...); calibrations are immutable")
        path = _calib_path(cid, sha)
        # Data first (temp file, fsync, rename), metadata last: a failure leaves nothing visible.
        await run_in_threadpool(atomic_write_bytes, path, blob)
        fields = {"artifact_version": CALIBRATION_VERSION, "bytes": len(blob), "file": path.name,
                  "n_layers": calib.n_layers, "n_kv_heads": calib.n_kv_heads, "head_dim": calib.head_dim,
                  "seed_k": calib.seed_k, "seed_v": calib.seed_v, "source": source,
                  "meta": _canonical(calib.meta)}
        args: list[Any] = [cid, sha, _now()]
        for k, v in fields.items():
            args += [k, v]
        try:
            created, info = await script("calib")(keys=[ix.k_calibration(cid), ix.K_CALIBRATIONS,
                                                         ix.K_CALIBRATION_SEQ], args=args)
        except Exception:
            if existing is None:  # our file is not referenced by any metadata
                path.unlink(missing_ok=True)
            raise
        if created == -1:  # a concurrent registration of other bytes won
            path.unlink(missing_ok=True)
            raise HTTPException(409, f"calibration {cid} is already registered with other bytes (sha256 "
                                     f"{str(info)[:16]}...); calibrations are immutable")
        meta = _meta(await R().hgetall(ix.k_calibration(cid)), cid)
        return Response(meta.model_dump_json(), 201 if created == 1 else 200, media_type="application/json")

    @calibs.put("/{calibration_id}", status_code=201, response_model=CalibrationMeta,
                responses={200: {"model": CalibrationMeta, "description": "already registered (same bytes)"},
                           **error_responses(400, 409, 413, 503)},
                openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": _BINARY},
                                               "description": "the artifact (Calibration.save / to_bytes)"}})
    async def put_calibration(calibration_id: Annotated[str, PathParam(pattern=ID16)], request: Request) -> Response:
        """Upload an artifact (verified: it loads, and its id is the one in the path). Immutable:
        the same bytes again answer 200 (and repair a missing file), other bytes answer 409."""
        blob = await read_body(request, cfg.max_calibration_bytes)
        if not blob:
            raise HTTPException(400, "empty body: send the calibration artifact bytes (Calibration.to_bytes())")
        if not blob.startswith(b"PK\x03\x04"):  # torch.save writes a zip archive
            raise HTTPException(400, "the body is not a calibration artifact (expected the zip archive that "
                                     "Calibration.save / Calibration.to_bytes writes)")
        try:
            calib = await run_in_threadpool(Calibration.from_bytes, blob)
        except CalibrationError as exc:
            raise HTTPException(400, f"the body is not a valid calibration artifact: {str(exc)[:400]}") from None
        if calib.calibration_id != calibration_id:
            raise HTTPException(400, f"the artifact's calibration id is {calib.calibration_id}, not {calibration_id}; "
                                     f"PUT it at /v1/calibrations/{calib.calibration_id}")
        return await _store_calibration(calib, blob, "upload")

    @calibs.post("", status_code=201, response_model=CalibrationMeta,
                 responses={200: {"model": CalibrationMeta, "description": "already registered (same bytes)"},
                            **error_responses(400, 409, 413, 503)})
    async def compute_calibration(body: CalibrationCompute) -> Response:
        """Compute a calibration from per-channel statistics or from K/V samples, store its artifact."""
        import torch

        from ..kvstore import calibrate

        def build() -> tuple[Calibration, bytes]:
            try:
                if body.statistics is not None:
                    s = body.statistics
                    t = {n: torch.tensor(getattr(s, n), dtype=torch.float32) for n in ("mu_k", "sigma_k", "mu_v",
                                                                                        "sigma_v")}
                    calib = Calibration(**t, seed_k=body.seed_k, seed_v=body.seed_v, meta=body.meta)
                else:
                    assert body.samples is not None
                    k = torch.tensor(body.samples.k, dtype=torch.float32)
                    v = torch.tensor(body.samples.v, dtype=torch.float32)
                    if k.shape != v.shape:
                        raise CalibrationError(f"k has shape {tuple(k.shape)}, v {tuple(v.shape)}; they must match")
                    calib = calibrate(k, v, seed_k=body.seed_k, seed_v=body.seed_v, meta=body.meta)
            except ValueError as exc:  # ragged nested lists
                raise CalibrationError(f"statistics/samples must be rectangular arrays: {exc}") from None
            except RuntimeError as exc:
                raise CalibrationError(f"cannot compute a calibration from these arrays: {exc}") from None
            return calib, calib.to_bytes()

        calib, blob = await run_in_threadpool(build)
        return await _store_calibration(calib, blob, "computed")

    @calibs.get("", response_model=CalibrationList, responses=error_responses(503))
    async def list_calibrations() -> CalibrationList:
        ids = await R().zrange(ix.K_CALIBRATIONS, 0, -1)
        out = []
        for cid in ids:
            h = await R().hgetall(ix.k_calibration(cid))
            if h:
                out.append(_meta(h, cid))
        return CalibrationList(calibrations=out)

    @calibs.get("/{calibration_id}", response_model=CalibrationMeta, responses=error_responses(404, 503))
    async def get_calibration(calibration_id: Annotated[str, PathParam(pattern=ID16)]) -> CalibrationMeta:
        h = await R().hgetall(ix.k_calibration(calibration_id))
        if not h:
            raise HTTPException(404, f"calibration {calibration_id} is not registered")
        return _meta(h, calibration_id)

    @calibs.get("/{calibration_id}/artifact", response_class=Response,
                responses={200: {"content": {"application/octet-stream": _BINARY}, "description": "the artifact"},
                           **error_responses(404, 503)})
    async def get_artifact(calibration_id: Annotated[str, PathParam(pattern=ID16)]) -> Response:
        """The artifact bytes (sha256 verified on read); load with Calibration.from_bytes."""
        h = await R().hgetall(ix.k_calibration(calibration_id))
        if not h:
            raise HTTPException(404, f"calibration {calibration_id} is not registered")
        path = calib_dir / h["file"]
        try:
            blob = await run_in_threadpool(path.read_bytes)
        except OSError:
            blob = b""
        if hashlib.sha256(blob).hexdigest() != h["sha256"]:
            raise HTTPException(503, f"the artifact file of calibration {calibration_id} is missing or damaged; "
                                     "PUT the same artifact again to repair it")
        return Response(blob, media_type="application/octet-stream",
                        headers={"x-planekv-sha256": h["sha256"]})

    # ---- placement policies

    def _version_doc(policy: PlacementPolicy, comment: str) -> tuple[str, str]:
        pol = policy.model_dump(mode="json")
        sha = hashlib.sha256(_canonical(pol).encode()).hexdigest()
        return _canonical({"policy": pol, "comment": comment, "sha256": sha, "created_at": time.time()}), sha

    async def _validate_policy(policy: PlacementPolicy) -> None:
        if policy.format_id is None:
            return
        entry = await _format_entry(policy.format_id)
        if entry is None:
            raise HTTPException(400, f"the policy names format {policy.format_id}, which is not registered; "
                                     "register it first (PUT /v1/formats/{format_id})")
        try:
            policy.check_format(entry.spec["n_layers"], entry.spec["width"])
        except ValueError as exc:
            raise HTTPException(400, f"the policy does not fit format {policy.format_id}: {exc}") from None

    def _pkeys(name: str) -> list[str]:
        return [ix.k_policy(name), ix.k_policy(name, "versions"), ix.k_policy(name, "stack"),
                ix.k_policy(name, "history")]

    async def _version(name: str, version: int, active: int | None = None) -> PolicyVersion | None:
        raw = await R().lindex(ix.k_policy(name, "versions"), version - 1)
        if raw is None or version < 1:
            return None
        if active is None:
            active = int(await R().hget(ix.k_policy(name), "active") or 0)
        d = json.loads(raw)
        return PolicyVersion(name=name, version=version, active=version == active, policy=d["policy"],
                             comment=d["comment"], sha256=d["sha256"], created_at=d["created_at"])

    async def _summary(name: str) -> PolicySummary | None:
        h = await R().hgetall(ix.k_policy(name))
        if not h:
            return None
        active = int(h["active"])
        latest = await R().llen(ix.k_policy(name, "versions"))
        av = await _version(name, active, active)
        assert av is not None
        return PolicySummary(name=name, active_version=active, latest_version=latest,
                             created_at=float(h["created_at"]), active=av)

    async def _summary_or_404(name: str) -> PolicySummary:
        s = await _summary(name)
        if s is None:
            raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
        return s

    @policies.post("", status_code=201, response_model=PolicySummary, responses=error_responses(400, 409, 503))
    async def create_policy(body: PolicyCreate) -> PolicySummary:
        """Create a policy; its first version is active."""
        await _validate_policy(body.policy)
        doc, sha = _version_doc(body.policy, body.comment)
        ok = await script("create")(keys=[*_pkeys(body.name), ix.K_POLICIES, ix.CHANNEL_POLICY],
                                    args=[body.name, doc, _now(), sha])
        if not ok:
            raise HTTPException(409, f"policy {body.name} already exists; add a version with PUT /v1/policies/"
                                     f"{body.name}")
        return await _summary_or_404(body.name)

    @policies.put("/{name}", status_code=201, response_model=PolicyVersion,
                  responses={200: {"model": PolicyVersion, "description": "identical to the latest version"},
                             **error_responses(400, 404, 503)})
    async def update_policy(name: PolicyName, body: PolicyUpdate) -> Response:
        """Add a version (201); the same document as the latest answers 200 with no new version.
        ``activate: true`` also activates it."""
        await _validate_policy(body.policy)
        doc, sha = _version_doc(body.policy, body.comment)
        version, created = await script("update")(keys=[*_pkeys(name), ix.CHANNEL_POLICY],
                                                  args=[name, doc, _now(), sha, "1" if body.activate else "0"])
        if version == -1:
            raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
        v = await _version(name, int(version))
        assert v is not None
        return Response(v.model_dump_json(), 201 if created else 200, media_type="application/json")

    @policies.get("", response_model=PolicyList, responses=error_responses(503))
    async def list_policies() -> PolicyList:
        names = await R().zrange(ix.K_POLICIES, 0, -1)
        out = [s for s in [await _summary(n) for n in names] if s is not None]
        return PolicyList(policies=out)

    @policies.get("/{name}", response_model=PolicySummary, responses=error_responses(404, 503))
    async def get_policy(name: PolicyName) -> PolicySummary:
        return await _summary_or_404(name)

    @policies.get("/{name}/active", response_model=PolicyVersion, responses=error_responses(404, 503))
    async def get_active(name: PolicyName) -> Response:
        """The active version (what workers apply); ETag ``"<name>:<version>"``."""
        s = await _summary_or_404(name)
        return Response(s.active.model_dump_json(), media_type="application/json",
                        headers={"etag": f'"{name}:{s.active_version}"'})

    @policies.get("/{name}/versions", response_model=PolicyVersions, responses=error_responses(404, 503))
    async def list_versions(name: PolicyName) -> PolicyVersions:
        s = await _summary_or_404(name)
        vs = [await _version(name, i, s.active_version) for i in range(1, s.latest_version + 1)]
        return PolicyVersions(name=name, versions=[v for v in vs if v is not None])

    @policies.get("/{name}/versions/{version}", response_model=PolicyVersion, responses=error_responses(404, 503))
    async def get_version(name: PolicyName, version: Annotated[int, PathParam(ge=1, le=1 << 31)]) -> PolicyVersion:
        await _summary_or_404(name)
        v = await _version(name, version)
        if v is None:
            raise HTTPException(404, f"policy {name} has no version {version}")
        return v

    @policies.post("/{name}/activate", response_model=PolicySummary, responses=error_responses(404, 503))
    async def activate(name: PolicyName, body: PolicyActivate) -> PolicySummary:
        """Make ``version`` the active one (idempotent)."""
        res = await script("activate")(keys=[*_pkeys(name), ix.CHANNEL_POLICY], args=[name, body.version, _now()])
        if res == -1:
            raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
        if res == -2:
            raise HTTPException(404, f"policy {name} has no version {body.version}")
        return await _summary_or_404(name)

    @policies.post("/{name}/rollback", response_model=PolicySummary, responses=error_responses(404, 409, 503))
    async def rollback(name: PolicyName) -> PolicySummary:
        """Undo the last activation: the version active before it becomes active again."""
        res = await script("rollback")(keys=[*_pkeys(name), ix.CHANNEL_POLICY], args=[name, _now()])
        if res == -1:
            raise HTTPException(404, f"policy {name} does not exist; create it with POST /v1/policies")
        if res == -2:
            raise HTTPException(409, f"policy {name} has no earlier activation to roll back to")
        return await _summary_or_404(name)

    @policies.get("/{name}/history", response_model=PolicyHistory, responses=error_responses(404, 503))
    async def history(name: PolicyName) -> PolicyHistory:
        await _summary_or_404(name)
        raw = await R().lrange(ix.k_policy(name, "history"), 0, -1)
        return PolicyHistory(name=name, events=[PolicyEvent(**json.loads(e)) for e in raw])

    # ---- cache registry

    def _cache_entry(seq: str, h: dict[str, str]) -> CacheEntry:
        hot = json.loads(h["hot_planes"]) if h.get("hot_planes") else None
        return CacheEntry(sequence_id=seq, format_id=h["format_id"], created_at=float(h["created_at"]),
                          source=h.get("source", "api"),
                          n_tokens=int(h["n_tokens"]) if h.get("n_tokens") else None,
                          policy=h.get("policy") or None, hot_planes=hot)

    async def _cache_detail(seq: str) -> CacheDetail:
        h = await R().hgetall(ix.k_cache(seq))
        if not h:
            raise HTTPException(404, f"sequence {seq} is not registered")
        tiers = ix.summarize_blocks(await R().hgetall(ix.k_blocks(seq)))
        entry = _cache_entry(seq, h)
        if entry.hot_planes is not None:
            hp = entry.hot_planes
            tiers = {"gpu": {"blocks": 0, "bytes": 0, "stores": [],
                             "planes": {"k": [f"0-{hp.k}"] if hp.k else [], "v": [f"0-{hp.v}"] if hp.v else []}},
                     **tiers}
        return CacheDetail(**entry.model_dump(), tiers={t: TierPlanes(**v) for t, v in tiers.items()})

    @caches.put("/{sequence_id}", status_code=201, response_model=CacheDetail,
                responses={200: {"model": CacheDetail, "description": "updated (same format)"},
                           **error_responses(400, 409, 503)})
    async def register_cache(sequence_id: SeqId, body: CacheRegister) -> Response:
        """Register a sequence with its format (and optionally its length, policy, hot planes).
        A sequence has one format: another one answers 409."""
        if not await R().exists(ix.k_format(body.format_id)):
            raise HTTPException(400, f"format {body.format_id} is not registered; register it first "
                                     "(PUT /v1/formats/{format_id})")
        if body.policy is not None and not await R().exists(ix.k_policy(body.policy)):
            raise HTTPException(400, f"policy {body.policy} does not exist; create it first (POST /v1/policies)")
        args: list[Any] = [body.format_id, _now(), sequence_id]
        if body.n_tokens is not None:
            args += ["n_tokens", body.n_tokens]
        if body.policy is not None:
            args += ["policy", body.policy]
        if body.hot_planes is not None:
            args += ["hot_planes", body.hot_planes.model_dump_json()]
        try:
            created = await script("cache")(keys=[ix.k_cache(sequence_id), ix.K_CACHES], args=args)
        except aioredis.ResponseError as exc:
            if str(exc).startswith("FORMAT "):
                raise HTTPException(409, f"sequence {sequence_id} is registered with format {str(exc)[7:]}; a "
                                         "sequence has one format (use a new sequence id)") from None
            raise
        detail = await _cache_detail(sequence_id)
        return Response(detail.model_dump_json(), 201 if created else 200, media_type="application/json")

    @caches.get("", response_model=CacheList, responses=error_responses(503))
    async def list_caches(limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
                          offset: Annotated[int, Query(ge=0, le=1 << 31)] = 0) -> CacheList:
        seqs = await R().zrange(ix.K_CACHES, offset, offset + limit - 1)
        total = await R().zcard(ix.K_CACHES)
        p = R().pipeline(transaction=False)
        for s in seqs:
            p.hgetall(ix.k_cache(s))
        hs = await p.execute()
        return CacheList(caches=[_cache_entry(s, h) for s, h in zip(seqs, hs, strict=True) if h], total=total)

    @caches.get("/{sequence_id}", response_model=CacheDetail, responses=error_responses(404, 503))
    async def get_cache(sequence_id: SeqId) -> CacheDetail:
        """The sequence's format and the planes each tier holds (GPU from the registration, memory
        and file from the stores' block index)."""
        return await _cache_detail(sequence_id)

    @caches.delete("/{sequence_id}", status_code=204, response_class=Response,
                   responses=error_responses(404, 409, 503))
    async def delete_cache(sequence_id: SeqId) -> Response:
        """Unregister a sequence; refused (409) while stores still hold blocks of it."""
        if not await R().exists(ix.k_cache(sequence_id)):
            raise HTTPException(404, f"sequence {sequence_id} is not registered")
        n = await R().hlen(ix.k_blocks(sequence_id))
        if n:
            raise HTTPException(409, f"stores still hold {n} blocks of sequence {sequence_id}; DELETE them at the "
                                     "store first")
        p = R().pipeline(transaction=True)
        p.delete(ix.k_cache(sequence_id))
        p.zrem(ix.K_CACHES, sequence_id)
        await p.execute()
        return Response(status_code=204)

    # ---- stats

    @ops.get("/stats", response_model=Stats, responses=error_responses(503))
    async def stats() -> Stats:
        p = R().pipeline(transaction=False)
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

    for router in (formats, calibs, policies, caches, ops):
        app.include_router(router)
    return app


# ---------------------------------------------------------------- entry points


def serve(args: argparse.Namespace) -> int:
    """Run the control plane in the foreground until SIGINT/SIGTERM."""
    from .arguments import control_settings

    settings = control_settings(args)
    logging.getLogger().setLevel(settings.log_level)
    run_uvicorn(create_app(settings), settings.control.host, settings.control.port, settings.log_level,
                args.access_log)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .arguments import add_control_arguments

    p = argparse.ArgumentParser(prog="python -m planekv.services.control", description=__doc__.splitlines()[0])
    add_control_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
