"""The remote tier's interface (docs/TIERING.md, "Below the spill tier: the remote tier"): where sealed blocks'
frames go below host memory and the spill tier, e.g. the store service.

``planekv.tiering`` does not know the services (the import layers), so it names what it needs here and the
services implement it (``planekv.services.remote_tier.StoreRemoteTier``, over HTTP). Frames are whole
(``planekv.tiering.frame``: header, payload, padding); a reader verifies what it gets against the key it asked
for, so an implementation need not be trusted to return the right bytes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .frame import BlockKey


@runtime_checkable
class RemoteTier(Protocol):
    """Framed blocks by key, somewhere else. Methods may block (network) and raise on failure."""

    def put_frame(self, frame: bytes) -> None:
        """Store ``frame`` under the key in its header (the same bytes again: nothing to do)."""
        ...

    def get_frame(self, key: BlockKey) -> bytes | None:
        """The frame stored under ``key``, or None if there is none."""
        ...

    def delete(self, key: BlockKey) -> None:
        """Remove the frame stored under ``key`` (absent: nothing to do)."""
        ...
