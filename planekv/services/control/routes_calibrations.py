"""``/v1/calibrations``: calibration artifacts, immutable and content-addressed (``calibration_id``);
each registration gets a version number. The bytes live in the calibration directory (written,
fsynced, renamed, *then* published in Redis); Redis holds their metadata and sha256."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import Response

from ...kvstore import Calibration, calibrate
from ...kvstore.atomic import atomic_write_bytes
from ...kvstore.calibration import CALIBRATION_VERSION
from ...kvstore.errors import CalibrationError
from .. import index as ix
from ..common import error_responses, read_body
from ..request_body import FiniteJSONRoute
from .context import Context, ControlContext
from .encoding import canonical_json, timestamp
from .params import HexId
from .schemas import CalibrationCompute, CalibrationList, CalibrationMeta

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/calibrations", tags=["calibrations"], route_class=FiniteJSONRoute)

_BINARY = {"schema": {"type": "string", "format": "binary"}}


def _artifact_path(ctx: ControlContext, cid: str, sha: str) -> Path:
    return ctx.calibration_dir / f"{cid}-{sha[:16]}.pt"


def _recorded_artifact(ctx: ControlContext, cid: str, name: str) -> Path:
    """The artifact file a calibration's record names, refused (500) unless it lies in the calibration
    directory: the record comes from Redis, which this service does not alone control."""
    root = ctx.calibration_dir.resolve()
    path = (root / name).resolve()
    if path.parent != root:
        log.error("calibration %s: its record in Redis names the file %r, outside %s; not served", cid, name, root)
        raise HTTPException(500, f"the record of calibration {cid} in Redis names an artifact file outside the "
                                 "calibration directory, so it is not served: the record was altered; restore its "
                                 "'file' field (the artifact's file name, <calibration_id>-<sha256[:16]>.pt)")
    return path


def _meta(h: dict[str, str], cid: str) -> CalibrationMeta:
    return CalibrationMeta(
        calibration_id=cid, version=int(h["version"]), artifact_version=int(h["artifact_version"]),
        sha256=h["sha256"], bytes=int(h["bytes"]), n_layers=int(h["n_layers"]), n_kv_heads=int(h["n_kv_heads"]),
        head_dim=int(h["head_dim"]), seed_k=int(h["seed_k"]), seed_v=int(h["seed_v"]),
        source=h["source"], meta=json.loads(h["meta"]), created_at=float(h["created_at"]))  # type: ignore[arg-type]


async def _store_calibration(ctx: ControlContext, calib: Calibration, blob: bytes, source: str) -> Response:
    cid = calib.calibration_id
    sha = hashlib.sha256(blob).hexdigest()
    existing = await ctx.redis.hget(ix.k_calibration(cid), "sha256")
    if existing is not None and existing != sha:
        raise HTTPException(409, f"calibration {cid} is already registered with other bytes (sha256 "
                                 f"{existing[:16]}..., this upload {sha[:16]}...); calibrations are immutable")
    path = _artifact_path(ctx, cid, sha)
    # Data first (temp file, fsync, rename), metadata last: a failure leaves nothing visible.
    await run_in_threadpool(atomic_write_bytes, path, blob)
    fields = {"artifact_version": CALIBRATION_VERSION, "bytes": len(blob), "file": path.name,
              "n_layers": calib.n_layers, "n_kv_heads": calib.n_kv_heads, "head_dim": calib.head_dim,
              "seed_k": calib.seed_k, "seed_v": calib.seed_v, "source": source,
              "meta": canonical_json(calib.meta)}
    args: list[Any] = [cid, sha, timestamp()]
    for k, v in fields.items():
        args += [k, v]
    try:
        created, info = await ctx.scripts.calibration_put(keys=[ix.k_calibration(cid), ix.K_CALIBRATIONS,
                                                                ix.K_CALIBRATION_SEQ], args=args)
    except Exception:
        if existing is None:  # our file is not referenced by any metadata
            path.unlink(missing_ok=True)
        raise
    if created == -1:  # a concurrent registration of other bytes won
        path.unlink(missing_ok=True)
        raise HTTPException(409, f"calibration {cid} is already registered with other bytes (sha256 "
                                 f"{str(info)[:16]}...); calibrations are immutable")
    meta = _meta(await ctx.redis.hgetall(ix.k_calibration(cid)), cid)
    return Response(meta.model_dump_json(), 201 if created == 1 else 200, media_type="application/json")


@router.put("/{calibration_id}", status_code=201, response_model=CalibrationMeta,
            responses={200: {"model": CalibrationMeta, "description": "already registered (same bytes)"},
                       **error_responses(400, 409, 413, 503)},
            openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": _BINARY},
                                           "description": "the artifact (Calibration.save / to_bytes)"}})
async def put_calibration(calibration_id: HexId, request: Request, ctx: Context) -> Response:
    """Upload an artifact (verified: it loads, and its id is the one in the path). Immutable:
    the same bytes again answer 200 (and repair a missing file), other bytes answer 409."""
    blob = await read_body(request, ctx.settings.control.max_calibration_bytes)
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
    return await _store_calibration(ctx, calib, blob, "upload")


@router.post("", status_code=201, response_model=CalibrationMeta,
             responses={200: {"model": CalibrationMeta, "description": "already registered (same bytes)"},
                        **error_responses(400, 409, 413, 503)})
async def compute_calibration(body: CalibrationCompute, ctx: Context) -> Response:
    """Compute a calibration from per-channel statistics or from K/V samples, store its artifact."""
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
    return await _store_calibration(ctx, calib, blob, "computed")


@router.get("", response_model=CalibrationList, responses=error_responses(503))
async def list_calibrations(ctx: Context) -> CalibrationList:
    ids = await ctx.redis.zrange(ix.K_CALIBRATIONS, 0, -1)
    out = []
    for cid in ids:
        h = await ctx.redis.hgetall(ix.k_calibration(cid))
        if h:
            out.append(_meta(h, cid))
    return CalibrationList(calibrations=out)


@router.get("/{calibration_id}", response_model=CalibrationMeta, responses=error_responses(404, 503))
async def get_calibration(calibration_id: HexId, ctx: Context) -> CalibrationMeta:
    h = await ctx.redis.hgetall(ix.k_calibration(calibration_id))
    if not h:
        raise HTTPException(404, f"calibration {calibration_id} is not registered")
    return _meta(h, calibration_id)


@router.get("/{calibration_id}/artifact", response_class=Response,
            responses={200: {"content": {"application/octet-stream": _BINARY}, "description": "the artifact"},
                       **error_responses(404, 500, 503)})
async def get_artifact(calibration_id: HexId, ctx: Context) -> Response:
    """The artifact bytes (sha256 verified on read); load with Calibration.from_bytes."""
    h = await ctx.redis.hgetall(ix.k_calibration(calibration_id))
    if not h:
        raise HTTPException(404, f"calibration {calibration_id} is not registered")
    path = _recorded_artifact(ctx, calibration_id, h["file"])
    try:
        blob = await run_in_threadpool(path.read_bytes)
    except OSError:
        blob = b""
    if hashlib.sha256(blob).hexdigest() != h["sha256"]:
        raise HTTPException(503, f"the artifact file of calibration {calibration_id} is missing or damaged; "
                                 "PUT the same artifact again to repair it")
    return Response(blob, media_type="application/octet-stream",
                    headers={"x-planekv-sha256": h["sha256"]})
