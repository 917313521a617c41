"""PlacementPolicy (DESIGN section 5): where the planes of a cache live and how they move.

A versioned document served by the control plane; workers (and, later, the placement engine of
this package) read the active version. Validated here, so every consumer sees the same rules.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from ..kvstore import FormatSpec

TierName = Literal["gpu", "memory", "file", "store"]
# Fastest first: a policy's tier order must follow it (a tier may be left out).
TIER_SPEED_ORDER: tuple[str, ...] = ("gpu", "memory", "file", "store")
MiB = 1 << 20


class HotPlanes(BaseModel):
    """Planes ``[0, h)`` stay hot (GPU page pool); K and V may differ."""

    model_config = ConfigDict(extra="forbid")
    k: int = Field(ge=0, le=8, description="hot Key planes h_K")
    v: int = Field(ge=0, le=8, description="hot Value planes h_V")


class LayerOverride(BaseModel):
    """Hot planes for some layers (e.g. more hot planes for the first layers)."""

    model_config = ConfigDict(extra="forbid")
    layers: list[int] = Field(min_length=1, max_length=4096, description="layer indices (0-based)")
    hot_planes: HotPlanes

    @model_validator(mode="after")
    def _layers(self) -> LayerOverride:
        if any(layer < 0 or layer >= 65536 for layer in self.layers):
            raise ValueError("layer indices must be in [0, 65536)")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError("a layer is listed twice in one override")
        return self


class DeepKeyChannels(BaseModel):
    """Deep Key channels (issue 30): per layer and KV head, the ``share`` of Key channels that read deepest keep
    planes ``[h_K, h_K + extra)`` of every token on the device, pinned (prefetch and LRU never evict them), so the
    hot depth varies per Key channel at an average of ``h_K + share x extra`` planes.

    Which channels: those with the highest *scores* the cache is given (``TieredCache(key_channel_scores=...)``,
    [layers, KV heads, d], higher = read deeper); see ``TieredCache`` for the statistics that can rank them."""

    model_config = ConfigDict(extra="forbid")
    share: float = Field(gt=0.0, le=1.0, allow_inf_nan=False,
                         description="share of each KV head's Key channels that is deep, in (0, 1]")
    extra: int = Field(ge=1, le=8, description="planes past h_K pinned for the deep channels")

    def count(self, head_dim: int) -> int:
        """Deep channels per KV head: ``share x head_dim`` rounded to the nearest, at least 1."""
        return max(1, min(head_dim, int(self.share * head_dim + 0.5)))


class TierSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: TierName
    capacity_bytes: int = Field(ge=0, le=1 << 60, description="bytes this tier may hold for PlaneKV")


class PlacementPolicy(BaseModel):
    """Hot planes per layer and K/V, block size, tier capacities and order, eviction, prefetch,
    fetch deadline. ``format_id`` (optional) binds the policy to one FormatSpec, so its layers
    and width can be checked."""

    model_config = ConfigDict(extra="forbid")
    format_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    width: int = Field(default=8, ge=1, le=8, description="W: planes stored per scalar")
    hot_planes: HotPlanes = HotPlanes(k=4, v=2)
    layer_overrides: list[LayerOverride] = Field(default_factory=list, max_length=4096)
    block_bytes: int = Field(default=4 * MiB, ge=MiB, le=1 << 30,
                             description="cold-plane block size in bytes (>= 1 MiB, a multiple of 4 KiB)")
    tiers: list[TierSpec] = Field(
        default_factory=lambda: [TierSpec(name="gpu", capacity_bytes=8 << 30),
                                 TierSpec(name="memory", capacity_bytes=2 << 30),
                                 TierSpec(name="file", capacity_bytes=32 << 30)],
        min_length=1, max_length=4, description="fastest first")
    eviction: Literal["lru"] = "lru"
    prefetch_depth: int = Field(default=1, ge=0, le=64, description="blocks fetched ahead of the reader")
    fetch_deadline_ms: float = Field(default=5.0, gt=0, le=60_000, allow_inf_nan=False,
                                     description="a cold fetch later than this is read at its hot depth only")
    deep_key_channels: DeepKeyChannels | None = Field(
        default=None, description="pinned deeper planes for the Key channels that read deepest (default: none)")

    @model_validator(mode="after")
    def _consistent(self) -> PlacementPolicy:
        def check(h: HotPlanes, where: str) -> None:
            if h.k > self.width or h.v > self.width:
                raise ValueError(f"{where} hot planes (k={h.k}, v={h.v}) exceed the width W={self.width}")
            deep = self.deep_key_channels
            if deep is not None and h.k + deep.extra > self.width:
                raise ValueError(f"{where}: deep Key channels pin planes [{h.k}, {h.k + deep.extra}), past the width "
                                 f"W={self.width}: lower deep_key_channels.extra to at most {self.width - h.k}")

        check(self.hot_planes, "default")
        seen: set[int] = set()
        for o in self.layer_overrides:
            check(o.hot_planes, f"layers {o.layers}")
            if seen & set(o.layers):
                raise ValueError(f"layers {sorted(seen & set(o.layers))} appear in two overrides")
            seen |= set(o.layers)
        if self.block_bytes % 4096:
            raise ValueError(f"block_bytes must be a multiple of 4096 (frames are 4 KiB aligned), "
                             f"got {self.block_bytes}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must be distinct, got {names}")
        ranks = [TIER_SPEED_ORDER.index(n) for n in names]
        if ranks != sorted(ranks):
            raise ValueError(f"tiers must be listed fastest first ({' > '.join(TIER_SPEED_ORDER)}), got {names}")
        return self

    def hot(self, layer: int) -> HotPlanes:
        """Hot planes of ``layer`` (its override, else the default)."""
        for o in self.layer_overrides:
            if layer in o.layers:
                return o.hot_planes
        return self.hot_planes

    def capacity(self, tier: str) -> int | None:
        """``capacity_bytes`` of the tier named ``tier`` (e.g. "gpu"), or None if the policy has no such tier."""
        return next((t.capacity_bytes for t in self.tiers if t.name == tier), None)

    def check_format(self, n_layers: int, width: int) -> None:
        """Raise ValueError unless the policy fits a format of ``n_layers`` layers and width W."""
        if width != self.width:
            raise ValueError(f"policy width W={self.width} differs from the format's W={width}")
        bad = sorted(layer for o in self.layer_overrides for layer in o.layers if layer >= n_layers)
        if bad:
            raise ValueError(f"layer overrides name layers {bad}, but the format has {n_layers} layers")


def hot_page_bytes(policy: PlacementPolicy, spec: FormatSpec) -> int:
    """Bytes of the hot planes of one page (``spec.page_size`` tokens of one KV head) summed over every layer:
    per layer l, h_K(l) x d x P/8 (Key planes [h_K, d, P/8]) + h_V(l) x P x d/8 (Value planes [h_V, P, d/8]).
    The same number as ``TieredCache.hot_page_bytes``. Raises ValueError if the policy does not fit the format
    (``check_format``: width, layer overrides), as the cache's constructor does."""
    policy.check_format(spec.n_layers, spec.width)
    p, d = spec.page_size, spec.head_dim
    return sum(h.k * d * (p // 8) + h.v * p * (d // 8) for h in (policy.hot(layer) for layer in range(spec.n_layers)))


def pinned_page_bytes(policy: PlacementPolicy, spec: FormatSpec) -> int:
    """Bytes of one page's pinned deep-Key-channel planes (``deep_key_channels``) summed over every layer: per
    layer, ``count(d)`` channels x ``extra`` planes x P/8; 0 without deep channels. The same number per page as
    ``TierBytes.pinned`` of a ``TieredCache``."""
    dk = policy.deep_key_channels
    if dk is None:
        return 0
    return spec.n_layers * dk.count(spec.head_dim) * dk.extra * (spec.page_size // 8)


def hot_bytes(policy: PlacementPolicy, spec: FormatSpec, n_tokens: int) -> int:
    """GPU bytes of the hot planes of ``n_tokens`` tokens of one sequence in format ``spec`` under ``policy``:
    ceil(n_tokens / P) pages per KV head, times ``spec.n_kv_heads``, times :func:`hot_page_bytes` plus the pinned
    deep-Key-channel planes (:func:`pinned_page_bytes`). This is the hot pool (and pinned planes) a ``TieredCache``
    of that one sequence holds once its ``n_tokens`` tokens are appended (its hot pool is a whole number of pages).
    Raises ValueError if ``n_tokens`` < 0 or the policy does not fit the format."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    per_page = hot_page_bytes(policy, spec) + pinned_page_bytes(policy, spec)
    return math.ceil(n_tokens / spec.page_size) * spec.n_kv_heads * per_page
