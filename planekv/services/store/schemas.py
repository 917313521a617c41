"""The store service's request and response bodies (pydantic)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ...tiering import BlockInfo
from ..request_body import RequestBody

MAX_BATCH_KEYS = 256


class BlockMeta(BaseModel):
    key: str
    size: int = Field(description="frame bytes (4 KiB header + payload padded to 4 KiB)")
    checksum: str = Field(description="xxh3-64 of the frame, hex")
    tiers: list[str]


class PutAnswer(BlockMeta):
    created: bool


class BlockList(BaseModel):
    blocks: list[BlockMeta]
    truncated: bool


class BatchGet(RequestBody):
    keys: list[str] = Field(min_length=1, max_length=MAX_BATCH_KEYS)


class TierUsage(BaseModel):
    capacity_bytes: int
    used_bytes: int
    blocks: int


class StoreStatsBody(BaseModel):
    store_id: str
    blocks: int
    leases: int
    memory: TierUsage
    file: TierUsage
    counters: dict[str, int]


class Health(BaseModel):
    status: str
    store_id: str
    blocks: int


def block_meta(info: BlockInfo) -> dict[str, Any]:
    """The fields of :class:`BlockMeta` for a stored block."""
    return {"key": str(info.key), "size": info.size, "checksum": f"{info.checksum:016x}", "tiers": list(info.tiers)}


class ReconcileAnswer(BaseModel):
    missing_files: int = Field(description="blocks dropped because their file vanished from the file tier")
    index_removed: int = Field(description="index entries removed: blocks this store does not hold")
    republished: int = Field(description="held blocks (re)written to the index")
    at: float = Field(description="unix time the reconciliation finished")
