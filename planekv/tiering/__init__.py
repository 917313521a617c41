"""planekv.tiering: block frame, tiers (GPU pool, host, NVMe via kvikio or POSIX, remote store),
placement policy engine, fetch with deadlines, promotion and prefetch. Builds on kvstore.

Today: the block frame (:mod:`.frame`), the memory and POSIX file tiers (:mod:`.tiers`) and the
block store over them (:mod:`.blockstore`), which the store service serves over HTTP; the
PlacementPolicy document (:mod:`.placement`) that the control plane versions; the tiered cache
(:mod:`.tiered_cache`: hot planes on the device, sealed pages' refinement planes in the bounded host
tier of :mod:`.host_tier`, a promotion cache between; below it the spill tier of :mod:`.spill_tier` and the
remote tier of :mod:`.remote_tier`, written by :mod:`.remote_writer`), prefetch (:mod:`.prefetch`) and the tiered
decode step of the torch reference (:mod:`.decode`), prefix reuse over chained page keys (:mod:`.prefix`).
docs/TIERING.md is the design.
"""

from .blockstore import BlockInfo, BlockListener, BlockStore, Lease, PutResult, StoreStats
from .decode import tiered_decode_step
from .errors import (
    BadBlockKey,
    BadMagic,
    BlockBusy,
    BlockCorrupt,
    BlockError,
    BlockExists,
    BlockKeyMismatch,
    BlockTooLarge,
    BlockUndeletable,
    ChecksumMismatch,
    FrameTruncated,
    IndexPublishError,
    PolicyDoesNotFit,
    RemoteBlockMissing,
    RemoteQueueFull,
    StoreFull,
    StoreIOError,
    TierFull,
    UnknownFrameVersion,
)
from .frame import (
    FRAME_VERSION,
    HEADER_BYTES,
    BlockKey,
    FrameHeader,
    decode_frame,
    decode_header,
    encode_frame,
    iter_frames,
    verify_frame,
)
from .host_tier import HostTier
from .placement import (
    DeepKeyChannels,
    HotPlanes,
    LayerOverride,
    PlacementPolicy,
    TierSpec,
    hot_bytes,
    hot_page_bytes,
    pinned_page_bytes,
)
from .prefetch import Prefetcher, PrefetchPlan, StepTally
from .prefix import (
    PrefixIndex,
    PrefixPage,
    PrefixStats,
    load_pages,
    page_codes,
    page_keys,
    prefix_root,
    publish_pages,
    remote_block_key,
    sealed_pages,
)
from .remote_tier import RemoteTier
from .remote_writer import RemoteWriter, RemoteWriterStats
from .spill_tier import SpillTier
from .tiered_cache import TierBytes, TieredCache
from .tiers import FILE, MEMORY, FileTier, MemoryTier, PosixFileTier

__all__ = [
    "FILE", "FRAME_VERSION", "HEADER_BYTES", "MEMORY", "BadBlockKey", "BadMagic", "BlockBusy", "BlockCorrupt",
    "BlockError", "BlockExists", "HostTier", "PrefetchPlan", "Prefetcher", "StepTally", "TierBytes", "TierFull",
    "TieredCache", "tiered_decode_step", "BlockInfo", "BlockKey", "BlockKeyMismatch", "BlockListener", "BlockStore",
    "BlockTooLarge", "BlockUndeletable", "ChecksumMismatch", "FileTier", "FrameHeader", "FrameTruncated", "HotPlanes",
    "IndexPublishError", "LayerOverride", "Lease", "MemoryTier", "PlacementPolicy", "PolicyDoesNotFit",
    "PosixFileTier",
    "PutResult", "RemoteBlockMissing", "RemoteQueueFull", "RemoteTier", "RemoteWriter", "RemoteWriterStats",
    "SpillTier", "StoreFull", "StoreIOError", "StoreStats", "TierSpec", "UnknownFrameVersion",
    "DeepKeyChannels", "decode_frame", "decode_header", "encode_frame", "hot_bytes", "hot_page_bytes",
    "pinned_page_bytes", "iter_frames", "verify_frame",
    "PrefixIndex", "PrefixPage", "PrefixStats", "load_pages", "page_codes", "page_keys", "prefix_root",
    "publish_pages", "remote_block_key", "sealed_pages",
]
