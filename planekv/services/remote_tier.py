"""The store service as a cache's remote tier: :class:`StoreRemoteTier` implements
``planekv.tiering.RemoteTier`` over HTTP with :class:`~planekv.services.clients.StoreClient` (its timeouts and
retries). Hand it to a ``planekv.tiering.RemoteWriter`` and that to ``HostTier(remote=...)``
(docs/TIERING.md, "Below the spill tier: the remote tier").
"""

from __future__ import annotations

import time

import httpx

from ..tiering.frame import BlockKey
from .clients import ServiceError, StoreClient, _detail


class StoreRemoteTier(StoreClient):
    """``RemoteTier`` over the store service: PUT, GET and DELETE of ``/v1/blocks/{key}``. Errors are
    ``ServiceError`` (the writer retries and counts them; a read raises them to the caller)."""

    def put_frame(self, frame: bytes) -> None:
        self.put_block(frame)  # the same bytes again answer created=False: nothing to do

    def get_frame(self, key: BlockKey, timeout_s: float | None = None) -> bytes | None:
        """The frame of ``key`` or None. With ``timeout_s`` (the time left before a read's deadline) the whole GET
        is bounded by it: one HTTP timeout of that many seconds, tried again only while time is left (a refused
        connection), never the client's own retries; past it ``ServiceError`` (status 0)."""
        if timeout_s is None:
            return self.get_block(key)
        end = time.monotonic() + timeout_s
        path = f"/v1/blocks/{key}"
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise ServiceError(0, f"GET {path}: no answer within {timeout_s:.3f} s (the read's deadline)", self.url)
            try:
                r = self._http.get(path, timeout=httpx.Timeout(left))
            except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
                if end - time.monotonic() <= self.backoff_s:
                    raise ServiceError(0, f"GET {path}: {type(exc).__name__}: {exc}", self.url) from exc
                time.sleep(self.backoff_s)
                continue
            except httpx.TimeoutException as exc:
                raise ServiceError(0, f"GET {path}: no answer within {timeout_s:.3f} s (the read's deadline): "
                                      f"{type(exc).__name__}", self.url) from exc
            if r.status_code == 200:
                return r.content
            if r.status_code == 404:
                return None
            raise ServiceError(r.status_code, _detail(r), self.url)

    def delete(self, key: BlockKey) -> None:
        self.delete_block(key)  # absent: False, nothing to do
