"""Typed errors of the block frame, the block store and the placement policy; services map them to HTTP
status codes.

A reader that is handed a frame of the wrong *format* raises :class:`planekv.kvstore.FormatMismatch`
(the core library's error); everything else about a bad frame is a :class:`BlockError` below.
"""

from __future__ import annotations

from ..kvstore.errors import PlaneKVError


class BlockError(PlaneKVError):
    """Base class of the block frame and block store errors."""


class BadBlockKey(BlockError, ValueError):
    """A block key (or its string form) is ill-formed: unknown kind, bad range, bad sequence id."""


class BlockCorrupt(BlockError):
    """The bytes are not an intact frame (bad magic, malformed header, trailing bytes)."""


class BadMagic(BlockCorrupt):
    """The bytes do not start with the PlaneKV block magic."""


class FrameTruncated(BlockCorrupt):
    """Fewer bytes than the header promises (a torn write or a cut transfer)."""


class ChecksumMismatch(BlockCorrupt):
    """The xxh3-64 checksum over header and payload does not match the stored one."""


class UnknownFrameVersion(BlockError):
    """The frame was written by a frame version this build does not read."""


class BlockKeyMismatch(BlockError):
    """An intact frame holds another block than the one asked for."""


class BlockExists(BlockError):
    """Blocks are immutable: a different block is already stored under this key."""


class BlockBusy(BlockError):
    """Another PUT of the same key is in flight."""


class BlockTooLarge(BlockError):
    """The block is larger than the store accepts (max block size or tier capacity)."""


class StoreFull(BlockError):
    """No room can be made: every evictable block is leased, or the tiers are too small."""


class StoreIOError(BlockError):
    """Writing to or reading from the file tier failed (disk full, I/O error)."""


class BlockUndeletable(BlockError):
    """The block's file could not be deleted (read-only tier, permission error): the block is kept,
    still stored and listed."""


class IndexPublishError(BlockError):
    """The block's metadata could not be published (e.g. Redis unreachable); the write was undone."""


class TierFull(BlockError):
    """A bounded tier has no room for more data (raise its capacity, or free sequences)."""


class PolicyDoesNotFit(PlaneKVError):
    """A placement policy's hot planes, over the caches registered under it, need more bytes than its GPU tier
    holds (``planekv.tiering.placement.hot_bytes``); the message names both numbers and what to change."""


class RemoteQueueFull(BlockError):
    """The remote tier's write queue stayed full (its byte or block bound) past the submit timeout: the remote
    tier is slower than blocks are sealed. The block is kept locally; nothing is lost."""


class RemoteBlockMissing(BlockError):
    """A block held only by the remote tier is not there any more (deleted or lost by the store)."""
