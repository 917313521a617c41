"""The remote tier's interface (docs/TIERING.md, "Below the spill tier: the remote tier"): where sealed blocks'
frames go below host memory and the spill tier, e.g. the store service.

``planekv.tiering`` does not know the services (the import layers), so it names what it needs here and the
services implement it (``planekv.services.remote_tier.StoreRemoteTier``, over HTTP). Frames are whole
(``planekv.tiering.frame``: header, payload, padding); a reader verifies what it gets against the key it asked
for, so an implementation need not be trusted to return the right bytes.

A tier whose ``get_frame`` takes a ``timeout_s`` keyword (``StoreRemoteTier``: its HTTP timeout) is handed the time
left before a read's deadline (:func:`get_frame_within`); the host tier never waits past the deadline either way
(``HostTier.fetch_within``), the timeout only ends the abandoned request early.
"""

from __future__ import annotations

import inspect
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


def takes_timeout(tier: RemoteTier) -> bool:
    """Whether ``tier.get_frame`` takes a ``timeout_s`` keyword (seconds the fetch may take)."""
    try:
        return "timeout_s" in inspect.signature(tier.get_frame).parameters
    except (TypeError, ValueError):
        return False


def get_frame_within(tier: RemoteTier, key: BlockKey, timeout_s: float) -> bytes | None:
    """``tier.get_frame(key)``, with ``timeout_s`` as its timeout where the tier takes one."""
    if takes_timeout(tier):
        return tier.get_frame(key, timeout_s=timeout_s)  # type: ignore[call-arg]
    return tier.get_frame(key)
