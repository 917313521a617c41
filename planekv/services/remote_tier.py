"""The store service as a cache's remote tier: :class:`StoreRemoteTier` implements
``planekv.tiering.RemoteTier`` over HTTP with :class:`~planekv.services.clients.StoreClient` (its timeouts and
retries). Hand it to a ``planekv.tiering.RemoteWriter`` and that to ``HostTier(remote=...)``
(docs/TIERING.md, "Below the spill tier: the remote tier").
"""

from __future__ import annotations

from ..tiering.frame import BlockKey
from .clients import StoreClient


class StoreRemoteTier(StoreClient):
    """``RemoteTier`` over the store service: PUT, GET and DELETE of ``/v1/blocks/{key}``. Errors are
    ``ServiceError`` (the writer retries and counts them; a read raises them to the caller)."""

    def put_frame(self, frame: bytes) -> None:
        self.put_block(frame)  # the same bytes again answer created=False: nothing to do

    def get_frame(self, key: BlockKey) -> bytes | None:
        return self.get_block(key)

    def delete(self, key: BlockKey) -> None:
        self.delete_block(key)  # absent: False, nothing to do
