"""Typed Python clients of the two services: ``StoreClient`` (blocks) and ``ControlClient`` (formats,
calibrations, placement policies, caches).

Each call returns the service's own response model (``planekv.services.store.schemas``,
``planekv.services.control.schemas``) or raises :class:`ServiceError` with the status and the service's
``detail``. Every request has a timeout. A request that could not reach the service (connection refused or
reset, a connect timeout) is tried again with exponential backoff, ``retries`` times; a request that reached it
is retried only when it is idempotent (GET, HEAD, PUT, DELETE) and its answer was lost (a read timeout, a
dropped connection). Tokens go in the ``Authorization: Bearer`` header.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ..tiering.frame import BlockKey, decode_header
from ..tiering.placement import PlacementPolicy
from .control.schemas import CacheDetail, CalibrationMeta, FormatEntry, PolicySummary, PolicyVersion
from .store.schemas import BlockList, PutAnswer, StoreStatsBody

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
IDEMPOTENT = ("GET", "HEAD", "PUT", "DELETE")
FRAME_MEDIA = "application/octet-stream"  # the store's frame media type


class ServiceError(Exception):
    """A service answered an error (``status``, its ``detail``), or could not be reached (``status`` 0)."""

    def __init__(self, status: int, detail: str, url: str) -> None:
        super().__init__(f"{url}: {status or 'unreachable'}: {detail}")
        self.status, self.detail, self.url = status, detail, url


class _Client:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0, retries: int = 3,
                 backoff_s: float = 0.1, transport: httpx.BaseTransport | None = None) -> None:
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"timeout_s must be > 0, retries and backoff_s >= 0; got {timeout_s}, {retries}, "
                             f"{backoff_s}")
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self: Any) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, ok: tuple[int, ...] = (200, 201, 204), **kw: Any) -> httpx.Response:
        """The answer to ``method path`` when its status is in ``ok``, else ServiceError; retried as the module
        docstring says."""
        for attempt in range(self.retries + 1):
            try:
                r = self._http.request(method, path, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the service
                err: Exception = exc
            except (httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if method not in IDEMPOTENT:
                    raise ServiceError(0, f"{method} {path}: the answer was lost ({type(exc).__name__}); not "
                                          "retried (not idempotent)", self.url) from exc
                err = exc
            else:
                if r.status_code in ok:
                    return r
                raise ServiceError(r.status_code, _detail(r), self.url)
            if attempt < self.retries:
                delay = self.backoff_s * (2 ** attempt)
                log.info("%s %s%s: %s; trying again in %.2f s", method, self.url, path, type(err).__name__, delay)
                time.sleep(delay)
        raise ServiceError(0, f"{method} {path}: {type(err).__name__}: {err} (after {self.retries + 1} tries)",
                           self.url) from err

    def _model(self, model: type[M], method: str, path: str, **kw: Any) -> M:
        return model.model_validate_json(self.request(method, path, **kw).content)

    def healthz(self) -> dict[str, Any]:
        return self.request("GET", "/healthz").json()

    def readyz(self) -> dict[str, Any]:
        """The readiness checks (200 or 503 both answer them)."""
        return self.request("GET", "/readyz", ok=(200, 503)).json()


class StoreClient(_Client):
    """The store service: framed blocks by key (``planekv.tiering.frame``)."""

    def put_block(self, frame: bytes) -> PutAnswer:
        """Store a frame under the key in its header; the same bytes again answer ``created=False``."""
        key = decode_header(frame).key
        return self._model(PutAnswer, "PUT", f"/v1/blocks/{key}", content=frame,
                           headers={"content-type": FRAME_MEDIA})

    def get_block(self, key: BlockKey) -> bytes | None:
        """The frame of ``key`` (verified by the store on this read), or None if it is not stored."""
        r = self.request("GET", f"/v1/blocks/{key}", ok=(200, 404))
        return r.content if r.status_code == 200 else None

    def has_block(self, key: BlockKey) -> bool:
        return self.request("HEAD", f"/v1/blocks/{key}", ok=(200, 404)).status_code == 200

    def delete_block(self, key: BlockKey) -> bool:
        """True once the block is gone from every tier of the store, False if it was not stored."""
        return self.request("DELETE", f"/v1/blocks/{key}", ok=(204, 404)).status_code == 204

    def list_blocks(self, sequence_id: str | None = None, format_id: str | None = None,
                    limit: int = 1000) -> BlockList:
        params: dict[str, Any] = {"limit": limit}
        params.update({k: v for k, v in (("sequence_id", sequence_id), ("format_id", format_id)) if v})
        return self._model(BlockList, "GET", "/v1/blocks", params=params)

    def stats(self) -> StoreStatsBody:
        return self._model(StoreStatsBody, "GET", "/v1/stats")


class ControlClient(_Client):
    """The control plane: formats, calibrations, placement policies and caches."""

    def register_format(self, spec: dict[str, Any]) -> FormatEntry:
        """Register a FormatSpec (its dict, ``FormatSpec.to_dict()``); idempotent."""
        return self._model(FormatEntry, "POST", "/v1/formats", json=spec, ok=(200, 201))

    def get_format(self, format_id: str) -> FormatEntry | None:
        r = self.request("GET", f"/v1/formats/{format_id}", ok=(200, 404))
        return FormatEntry.model_validate_json(r.content) if r.status_code == 200 else None

    def register_calibration(self, calibration_id: str, artifact: bytes) -> CalibrationMeta:
        """Register a calibration artifact's bytes under its id; the same bytes again answer 200."""
        return self._model(CalibrationMeta, "PUT", f"/v1/calibrations/{calibration_id}", content=artifact,
                           headers={"content-type": "application/octet-stream"})

    def get_calibration(self, calibration_id: str) -> CalibrationMeta | None:
        r = self.request("GET", f"/v1/calibrations/{calibration_id}", ok=(200, 404))
        return CalibrationMeta.model_validate_json(r.content) if r.status_code == 200 else None

    def calibration_artifact(self, calibration_id: str) -> bytes:
        return self.request("GET", f"/v1/calibrations/{calibration_id}/artifact").content

    def create_policy(self, name: str, policy: PlacementPolicy, comment: str = "") -> PolicySummary:
        return self._model(PolicySummary, "POST", "/v1/policies",
                           json={"name": name, "policy": policy.model_dump(mode="json"), "comment": comment})

    def update_policy(self, name: str, policy: PlacementPolicy, comment: str = "",
                      activate: bool = False) -> PolicyVersion:
        """Add a version (the same document as the latest adds none); ``activate`` also activates it."""
        return self._model(PolicyVersion, "PUT", f"/v1/policies/{name}",
                           json={"policy": policy.model_dump(mode="json"), "comment": comment,
                                 "activate": activate})

    def active_policy(self, name: str) -> PolicyVersion | None:
        """The active version of policy ``name``, or None if there is no such policy."""
        r = self.request("GET", f"/v1/policies/{name}/active", ok=(200, 404))
        return PolicyVersion.model_validate_json(r.content) if r.status_code == 200 else None

    def activate_policy(self, name: str, version: int) -> PolicySummary:
        return self._model(PolicySummary, "POST", f"/v1/policies/{name}/activate", json={"version": version})

    def register_cache(self, sequence_id: str, format_id: str, n_tokens: int | None = None,
                       policy: str | None = None) -> CacheDetail:
        body: dict[str, Any] = {"format_id": format_id}
        body.update({k: v for k, v in (("n_tokens", n_tokens), ("policy", policy)) if v is not None})
        return self._model(CacheDetail, "PUT", f"/v1/caches/{sequence_id}", json=body, ok=(200, 201))

    def get_cache(self, sequence_id: str) -> CacheDetail | None:
        r = self.request("GET", f"/v1/caches/{sequence_id}", ok=(200, 404))
        return CacheDetail.model_validate_json(r.content) if r.status_code == 200 else None

    def delete_cache(self, sequence_id: str) -> bool:
        """True once unregistered, False if it was not registered; ServiceError 409 while stores hold blocks."""
        return self.request("DELETE", f"/v1/caches/{sequence_id}", ok=(204, 404)).status_code == 204


def _detail(r: httpx.Response) -> str:
    try:
        d = r.json().get("detail", r.text)
    except ValueError:
        return r.text[:500]
    return d if isinstance(d, str) else str(d)[:500]
