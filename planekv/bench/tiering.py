"""`planekv bench tiering`: hot planes on the GPU, refinement planes in host memory (docs/TIERING.md), measured.

Two parts, one harness:

- **Decode steps** (:func:`run_decode`, any device): consecutive decode steps of every layer of a
  :class:`~planekv.evaluation.decode_data.DecodeData` (SmolLM2's real K/V, or synthetic) through a
  :class:`~planekv.tiering.TieredCache` at hot depth h, with prefetch: per system, the share of the bits asked for
  that was capped, the prefetch hit rate (bits asked for past the hot planes that were resident), items fetched per
  step and their bytes, and the attention output's error against exact attention beside the all-GPU reader's (the
  same policy, every plane resident). The first ``warmup`` steps fill the promotion cache and are not counted.
  ``tier`` (:class:`TierSetup`) puts the refinement planes in host memory (the default), in spill files below a
  small host tier ("nvme") or at the store service below a small host tier ("remote"); each row then also reports
  the step time (wall, torch reference on the CPU), the bytes each tier holds at the end and the fetch bandwidth
  of the chosen tier (bytes fetched from it over the time spent fetching).
- **Step time** (:func:`run_timing`, CUDA; Triton's interpreter for a plumbing run with no meaningful times): on a
  benchmark shape, beside SDPA, FP8 and the all-GPU reader in the same run, the tiered read (FMA stages, its
  promotion cache as prefetch left it after ``warm`` steps of drifting queries), the H2D copy of one step's
  fetched bytes (on its own stream it overlaps the next step), and the whole-chunk offload baseline (every page's
  refinement planes copied to the GPU before an all-GPU read, as chunk stores do).

Both report GPU-resident bytes (:mod:`.tier_memory`) and the largest batch a GPU KV budget holds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..evaluation.common import VARIANT_OPTIONS, default_k_share
from ..evaluation.decode_data import DecodeData
from ..kernels import ReaderConfig, TritonReader
from ..kernels._dispatch import interpreting
from ..kvstore import ReadPolicy
from ..kvstore.reference import attention, readkv_decode, readkv_rows
from ..tiering import (
    HotPlanes,
    PlacementPolicy,
    Prefetcher,
    RemoteWriter,
    SpillTier,
    StepTally,
    TieredCache,
    tiered_decode_step,
)
from ..tiering.decode import step_deadline
from ..tiering.frame import HEADER_BYTES
from ..tiering.placement import DeepKeyChannels
from .attention import SHAPES, Shape, StepData, synthetic_step, time_system
from .output import column_table
from .tier_memory import GpuBytes, four_bit_bytes, gpu_bytes, workspace_bytes_per_sequence
from .timing import sync, time_graphs

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
FMA = ReaderConfig(assembly="fma", key_int8=False, value_int8=False)  # the stages that read tiered caches
POLICIES = ("flex-r4", "flex-r2", "flex-kr-r4", "flex-kr-r2")
HOTS = (4, 2)
TIERS = ("host", "nvme", "remote")


@dataclass(frozen=True)
class TierSetup:
    """Where the decode steps' refinement planes live. ``host``: host memory (16 GiB, the policy's 1 MiB blocks).
    ``nvme``: a small host tier that spills to files under ``spill_dir`` (None: a temporary directory, removed
    afterwards). ``remote``: a small host tier over the store service at ``store_url`` (``store_token``; the store
    must take the format: registered, or a store without ``require_registered_format``). For nvme and remote
    ``block_bytes`` (default: the 4 KiB header and 4 pages) and ``host_bytes`` (default: 2 blocks per stream, so
    the other blocks of a stream go below) size the host tier. ``deadline_ms``: the read policy's
    ``deadline_ms`` (remote fetches that miss it are capped)."""

    tier: str = "host"
    spill_dir: str | None = None
    store_url: str | None = None
    store_token: str | None = None
    block_bytes: int | None = None
    host_bytes: int | None = None
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if self.tier == "remote" and not self.store_url:
            raise ValueError("the remote tier needs a store service: give its URL (--store-url)")
        if self.block_bytes is not None and self.block_bytes <= HEADER_BYTES:
            raise ValueError(f"block_bytes must exceed the {HEADER_BYTES}-byte frame header, got {self.block_bytes}")


def policy_named(name: str, k_share: float | None = None) -> ReadPolicy:
    """flex-r4, flex-r2 (flexible reader, the frozen K share) and flex-kr-* (with Key refinement)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")
    rate = 4.0 if name.endswith("r4") else 2.0
    kw = VARIANT_OPTIONS["readkv-flexible-kr"] if "-kr-" in name else {}
    return ReadPolicy.flexible(rate, default_k_share(rate) if k_share is None else k_share, **kw)


def placement(hot: int, format_id: str, deep: DeepKeyChannels | None = None) -> PlacementPolicy:
    """h_K = h_V = ``hot``; with ``deep`` (deep Key channels) h_K = hot - share x extra, so that the Key planes
    average ``hot`` (the same GPU bytes)."""
    hot_k = hot if deep is None else deep_hot_k(hot, deep)
    return PlacementPolicy(format_id=format_id, hot_planes=HotPlanes(k=hot_k, v=hot), block_bytes=MiB,
                           deep_key_channels=deep)


def deep_hot_k(hot: int, deep: DeepKeyChannels) -> int:
    """h_K that with ``deep`` averages ``hot`` Key planes; ValueError unless share x extra is a whole number of
    planes at most ``hot``."""
    pinned = deep.share * deep.extra
    if abs(pinned - round(pinned)) > 1e-9 or round(pinned) > hot:
        raise ValueError(f"deep Key channels {deep.share}:{deep.extra} add {pinned:g} planes on average: choose "
                         f"share x extra a whole number at most h = {hot}")
    return hot - round(pinned)


def parse_deep(text: str) -> DeepKeyChannels:
    """``SHARE:EXTRA`` (e.g. 0.25:4) -> DeepKeyChannels; ValueError with what is wrong."""
    share, sep, extra = text.partition(":")
    try:
        if not sep:
            raise ValueError("expected SHARE:EXTRA")
        return DeepKeyChannels(share=float(share), extra=int(extra))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"deep Key channels {text!r}: {exc}") from None


DEEP_RANKS = ("profile", "sigma", "oracle")


def key_channel_scores(data: DecodeData, enc: dict, policy: ReadPolicy, warmup: int, rank: str) -> torch.Tensor:
    """[layers, KV heads, d] scores ranking the Key channels for deep Key channels (higher = read deeper).
    ``profile``: the all-GPU reader's mean Key depth per channel over the first ``warmup`` decode steps (not
    counted), like a profile of the prefill's last queries; ``sigma``: the calibration's Key scale per channel (the
    static factor of the Key importance); ``oracle``: the mean Key depth over every decode step, counted ones
    included (not available to a real cache: an upper bound for the ranking). Layers without decode data keep
    ``sigma``."""
    if rank not in DEEP_RANKS:
        raise ValueError(f"rank must be one of {DEEP_RANKS}, got {rank!r}")
    scores = data.codec.calibration.sigma_k.clone()
    if rank == "sigma":
        return scores
    if warmup < 1 and rank == "profile":
        raise ValueError("a profile ranks the channels on the warm-up steps: use --warmup >= 1")
    for li in data.layers:
        kc, vc = enc[li.layer]
        m = warmup if rank == "profile" else li.q.shape[1]
        _, st = readkv_rows(li.q[:, :m].contiguous(), kc, vc, data.codec, li.layer, policy, li.lengths[:m],
                            scale=li.scale)
        scores[li.layer] = st.k_depths.double().mean(0).float() + 1e-3 * scores[li.layer] / scores[li.layer].max()
    return scores


@dataclass
class TierRow:
    source: str  # the K/V: a model and text, or a benchmark shape
    system: str  # sdpa, fp8, readkv-<policy> (all planes on the GPU), tiered-h<h>-<policy>, offload-h<h>-<policy>
    reader: str  # triton, reference or - (not a ReadKV read)
    step_ms: float | None = None
    x_sdpa: float | None = None
    x_all_gpu: float | None = None  # against readkv-<policy> with the same stages
    fetch_ms: float | None = None  # H2D copy of one step's fetched bytes (its own stream)
    prefetch_ms: float | None = None  # host wall time of one layer-step's prefetch (plan + promotions), not in step
    gpu_gib: float | None = None  # device bytes at the row's batch and length (a model of `layers` layers)
    x_four_bit: float | None = None  # gpu bytes / a 4-bit cache of the same tokens
    host_gib: float | None = None
    promoted_mib: float | None = None  # promotion cache in use at the end (not its capacity)
    max_batch: int | None = None  # sequences of this length in the GPU KV budget
    cap_rate: float | None = None  # share of the bits asked for that was capped
    hit_rate: float | None = None  # share of the bits asked for past the hot planes that was resident
    kr_hit_rate: float | None = None  # share of the tokens Key refinement chose that were read at depth W
    fetched_per_step: float | None = None  # Key channel-planes + Value pages + Key pages brought per step and layer
    fetched_mib_per_step: float | None = None
    used_share: float | None = None  # fetched items the next step read past the hot planes
    rel_err: float | None = None  # attention output vs exact attention
    rel_err_all_gpu: float | None = None  # the all-GPU reader's, same policy
    gpu_mib: float | None = None  # decode steps: hot pages in use + pinned deep Key planes + open pages + promotion
    tier: str | None = None  # decode steps: where the refinement planes lived (host, nvme, remote)
    host_mib: float | None = None  # decode steps, at the end: bytes in host memory, spill files, only at the store
    nvme_mib: float | None = None
    remote_mib: float | None = None
    fetch_mib_s: float | None = None  # bytes fetched from the row's tier / seconds spent fetching them
    extra: dict[str, Any] = field(default_factory=dict)


# ---- decode steps: caps, hits, fetches, errors ----

def run_decode(data: DecodeData, policies: list[str], hots: list[int], promotion_mib: float = 64.0,
               warmup: int = 1, prefetch: bool = True, reader: str = "reference", k_share: float | None = None,
               progress: Callable[[str], None] | None = None, key_page_mib: float = 0.0,
               tier: TierSetup | None = None, deep: list[DeepKeyChannels] | None = None,
               deep_rank: str = "profile", k_margin: int = Prefetcher.k_margin,
               tier_aware: bool = False) -> list[TierRow]:
    """Every (policy, hot depth) over ``data``'s decode steps (one sequence; step s reads its own token and those
    before it). ``reader``: "reference" (the torch tiered read) or "triton" (the FMA stages). ``key_page_mib``:
    the tiered cache's Key page slots for Key refinement (MiB per model, beside the promotion cache). ``tier``:
    where the refinement planes live (:class:`TierSetup`; default host memory). ``deep``: after each hot depth's
    row, one row per deep Key channel option at the same average Key depth (h_K = h - share x extra, h_V = h),
    the channels ranked by ``deep_rank`` (:func:`key_channel_scores`). ``k_margin``: the prefetcher's Key planes
    past each channel's wanted depth (:class:`~planekv.tiering.prefetch.Prefetcher`). ``tier_aware``: the
    policies with ``ReadPolicy.tier_aware`` (allocations within the residency; the reference reader only; the
    all-GPU error beside them is the plain policy's)."""
    tier = tier or TierSetup()
    if tier_aware and reader != "reference":
        raise ValueError("tier-aware allocation runs in the reference reader only (the kernels cap); use "
                         "--reader reference")
    if k_margin < 0:
        raise ValueError(f"k_margin must be >= 0, got {k_margin}")
    codec = data.codec
    n_steps = data.layers[0].q.shape[1]
    if not 0 <= warmup < n_steps:
        raise ValueError(f"warmup must leave steps to count: 0 <= warmup < {n_steps}, got {warmup}")
    say = progress or log.info
    enc = {li.layer: (codec.encode_k(li.k, li.layer), codec.encode_v(li.v, li.layer)) for li in data.layers}
    rows = []
    tmp = tempfile.mkdtemp(prefix="planekv-bench-spill-") if tier.tier == "nvme" and not tier.spill_dir else None
    try:
        for name in policies:
            policy = policy_named(name, k_share)
            if tier.deadline_ms is not None:
                policy = dataclasses.replace(policy, deadline_ms=tier.deadline_ms)
            all_gpu = _all_gpu_error(data, enc, policy, warmup)
            if tier_aware:
                policy = dataclasses.replace(policy, tier_aware=True)
            scores = key_channel_scores(data, enc, policy, warmup, deep_rank) if deep else None
            for hot in hots:
                for option in [None, *(deep or [])]:
                    pf = Prefetcher(k_margin=k_margin) if prefetch else None
                    row = _decode_one(data, enc, name, policy, hot, promotion_mib, warmup, pf, reader,
                                      key_page_mib, dataclasses.replace(tier, spill_dir=tier.spill_dir or tmp),
                                      option, scores)
                    row.rel_err_all_gpu = all_gpu
                    rows.append(row)
                    bw = "" if row.fetch_mib_s is None else f", {row.fetch_mib_s:.1f} MiB/s from {tier.tier}"
                    say(f"{row.system} ({tier.tier}): caps {100 * (row.cap_rate or 0):.2f}% of the bits asked for, "
                        f"hit rate {100 * (row.hit_rate or 0):.1f}%, {row.fetched_per_step:.1f} items fetched a step "
                        f"and layer{bw}, error {row.rel_err:.4f} (all-GPU {all_gpu:.4f}), GPU {row.gpu_mib:.3f} MiB")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _all_gpu_error(data: DecodeData, enc: dict, policy: ReadPolicy, warmup: int) -> float:
    """The all-GPU reader's attention error over the counted steps (every plane resident)."""
    num = den = 0.0
    for li in data.layers:
        kc, vc = enc[li.layer]
        q, lengths = li.q[:, warmup:].contiguous(), li.lengths[warmup:]
        out, _ = readkv_rows(q, kc, vc, data.codec, li.layer, policy, lengths, scale=li.scale)
        exact = attention(q, li.k, li.v, lengths, scale=li.scale)
        num += float((out - exact).pow(2).sum())
        den += float(exact.pow(2).sum())
    return math.sqrt(num / den)


def _tiered_for(spec: Any, hot: int, t_last: int, dev: torch.device, promotion_mib: float, key_page_mib: float,
                tier: TierSetup, n_layers: int, deep: DeepKeyChannels | None = None,
                scores: torch.Tensor | None = None) -> tuple[TieredCache, SpillTier | None, RemoteWriter | None]:
    """The decode steps' cache with its refinement planes in ``tier`` (its spill tier and remote writer, to close);
    ``n_layers``: the layers the steps fill (the default host part holds 2 blocks of each of their streams)."""
    kw: dict[str, Any] = {}
    spill = writer = None
    block = None
    if tier.tier != "host":
        page = (spec.width - hot) * spec.page_size * spec.head_dim // 8  # a K or V page's refinement planes
        block = tier.block_bytes or HEADER_BYTES + 4 * max(page, 1)
        streams = n_layers * 2 * spec.n_kv_heads  # one sequence
        kw["host_bytes"] = tier.host_bytes if tier.host_bytes is not None else 2 * streams * block
    if tier.tier == "nvme":
        spill = SpillTier(tier.spill_dir or tempfile.gettempdir(), 64 * GiB, fsync=False)
        kw["spill"] = spill
    elif tier.tier == "remote":
        from ..services.remote_tier import StoreRemoteTier  # the services only for this tier

        writer = RemoteWriter(StoreRemoteTier(tier.store_url or "", tier.store_token, timeout_s=30.0),
                              submit_timeout_s=60.0)
        kw["remote"] = writer
    cache = TieredCache(spec, 1, placement(hot, spec.format_id, deep), max_tokens=t_last, device=dev,
                        promotion_bytes=int(promotion_mib * MiB), key_page_bytes=int(key_page_mib * MiB),
                        sequence_ids=[f"bench-{uuid.uuid4().hex[:12]}"],
                        key_channel_scores=scores if deep is not None else None, **kw)
    if block is not None:
        cache.host.block_bytes = block  # below the policy's 1 MiB minimum: blocks seal at this size
    return cache, spill, writer


def _decode_one(data: DecodeData, enc: dict, name: str, policy: ReadPolicy, hot: int, promotion_mib: float,
                warmup: int, pf: Prefetcher | None, reader: str, key_page_mib: float = 0.0,
                tier: TierSetup | None = None, deep: DeepKeyChannels | None = None,
                scores: torch.Tensor | None = None) -> TierRow:
    spec = data.codec.spec
    tier = tier or TierSetup()
    lengths = data.layers[0].lengths
    t_last = int(lengths.max())
    dev = torch.device("cuda" if reader == "triton" and torch.cuda.is_available() else "cpu")  # compiled kernels
    cache, spill, writer = _tiered_for(spec, hot, t_last, dev, promotion_mib, key_page_mib, tier, len(data.layers),
                                       deep, scores)
    try:
        row = _decode_steps(data, enc, name, policy, hot, promotion_mib, warmup, pf, reader, key_page_mib,
                            tier, cache, writer)
        tb = cache.bytes()
        hot_used = int((cache.page_table >= 0).sum()) * cache.hot_page_bytes  # hot pages in use, every layer
        row.gpu_mib = (hot_used + tb.pinned + tb.open + tb.promotion) / MiB
        row.extra |= {"gpu_bytes": {"hot_in_use": hot_used, "pinned": tb.pinned, "open": tb.open,
                                    "promotion": tb.promotion}, "hot_k": cache.hot_k[0], "hot_v": cache.hot_v[0]}
        if deep is not None:
            row.system = f"tiered-hk{cache.hot_k[0]}+{deep.share:g}x{deep.extra}-hv{hot}-{name}"
            row.extra["deep_key_channels"] = {"share": deep.share, "extra": deep.extra,
                                              "channels_per_head": deep.count(spec.head_dim)}
        return row
    finally:
        cache.free(0)  # the remote copies too
        if writer is not None:
            writer.close(30.0)
            writer.tier.close()  # type: ignore[attr-defined]
        cache.host.close()
        if spill is not None:
            spill.close()


def _decode_steps(data: DecodeData, enc: dict, name: str, policy: ReadPolicy, hot: int, promotion_mib: float,
                  warmup: int, pf: Prefetcher | None, reader: str, key_page_mib: float, tier: TierSetup,
                  cache: TieredCache, writer: RemoteWriter | None) -> TierRow:
    codec, spec = data.codec, data.codec.spec
    t_last = int(data.layers[0].lengths.max())
    dev = cache.device
    read_fn, used = _reader_for(codec, policy, reader)
    read_s = 0.0

    def read(q: torch.Tensor, c: TieredCache, layer: int, scale: float | None) -> tuple[torch.Tensor, Any]:
        nonlocal read_s
        t0 = time.perf_counter()
        if read_fn is None:
            out = readkv_decode(q, c, layer, codec, policy, scale=scale, residency=c.residency(layer))
        else:
            out = read_fn(q, c, layer, scale)
        read_s += time.perf_counter() - t0
        return out

    for li in data.layers:
        kc, vc = enc[li.layer]
        cache.append(li.layer, kc[:, : int(li.lengths[0]) - 1], vc[:, : int(li.lengths[0]) - 1], seq=0)
    if writer is not None:
        writer.flush(120.0)
    tally = StepTally()
    num = den = 0.0
    host = cache.host
    step_s, prefetch_s, base_bytes, base_s = 0.0, 0.0, dict(host.read_bytes), dict(host.read_s)
    for s in range(data.layers[0].q.shape[1]):
        if s == warmup:
            tally.restart()  # count from here (the promotion cache has been filled)
            step_s, prefetch_s, read_s, base_bytes, base_s = 0.0, 0.0, 0.0, dict(host.read_bytes), dict(host.read_s)
        for li in data.layers:
            kc, vc = enc[li.layer]
            t, have = int(li.lengths[s]), cache.length(li.layer, 0)
            if t < have:
                raise ValueError(f"decode step {s} of layer {li.layer} reads {t} tokens, fewer than before ({have})")
            cache.append(li.layer, kc[:, have:t], vc[:, have:t], seq=0)  # the step's own token (if new)
            q = li.q[:, s][None].float().to(dev)  # [1, Hq, d]
            t0 = time.perf_counter()
            out, took = _step_then_prefetch(q, cache, li.layer, codec, policy, pf, tally, li.scale, read)
            step_s += time.perf_counter() - t0
            prefetch_s += took
            if s >= warmup:
                exact = attention(li.q[:, s: s + 1], li.k[:, :t], li.v[:, :t], torch.tensor([t]), scale=li.scale)
                num += float((out[0].cpu() - exact[:, 0]).pow(2).sum())
                den += float(exact.pow(2).sum())
    sm = tally.summary()
    page_v = (spec.width - hot) * spec.page_size * spec.head_dim / 8
    vec_k = math.ceil(t_last / spec.page_size) * spec.page_size / 8
    page_k = (spec.width - hot) * spec.page_size * spec.head_dim / 8
    fetched_bytes = sm["fetched_k"] * vec_k + sm["fetched_v"] * page_v + sm["fetched_kp"] * page_k
    layers_steps = max(1, sm["steps"])
    got = {k: host.read_bytes[k] - base_bytes[k] for k in host.read_bytes}
    took = {k: host.read_s[k] - base_s[k] for k in host.read_s}
    # memory pages are views: their fetch time is the prefetch's less the lower tiers'
    took["host"] = max(0.0, prefetch_s - took["nvme"] - took["remote"])
    tb = cache.bytes()
    return TierRow(
        source=data.source, system=f"tiered-h{hot}-{name}{'-ta' if policy.tier_aware else ''}", reader=used,
        cap_rate=sm["cap_rate"], tier=tier.tier, step_ms=1e3 * step_s / layers_steps,
        prefetch_ms=1e3 * prefetch_s / layers_steps, host_mib=tb.host / MiB, nvme_mib=tb.nvme / MiB,
        remote_mib=tb.remote / MiB,
        fetch_mib_s=got[tier.tier] / MiB / took[tier.tier] if got[tier.tier] and took[tier.tier] > 0 else None,
        hit_rate=sm["hit_rate"], kr_hit_rate=sm["kr_hit_rate"] if policy.key_refine else None,
        fetched_per_step=sm["fetched"] / layers_steps,
        fetched_mib_per_step=fetched_bytes / layers_steps / MiB,
        used_share=sm["fetched_used"] / sm["fetched"] if sm["fetched"] else None,
        rel_err=math.sqrt(num / den) if den else None, host_gib=cache.bytes().host / GiB,
        promoted_mib=cache.promoted_bytes() / MiB,
        extra={"steps_counted": sm["steps"], "warmup": warmup, "prefetch": pf is not None,
               "k_margin": None if pf is None else pf.k_margin,
               "promotion_mib": promotion_mib, "key_page_mib": key_page_mib, "tally": sm, "tier": tier.tier,
               "step_ms_note": "wall time of one decode step of one layer (read + prefetch) on this device",
               "read_ms": 1e3 * read_s / layers_steps, "fetched_bytes": got, "fetch_s": took,
               "block_bytes": cache.host.block_bytes, "host_capacity_bytes": cache.host.capacity_bytes,
               "deadline_ms": policy.deadline_ms, "deadline_missed": sm["missed"],
               "remote_deadline_misses": cache.host.remote_deadline_misses,
               "remote_writes": None if writer is None else dataclasses.asdict(writer.stats)})


def _reader_for(codec: Any, policy: ReadPolicy, reader: str) -> tuple[Any, str]:
    """The read function for ``tiered_decode_step`` and the reader's name."""
    if reader == "reference":
        return None, "reference"
    if reader != "triton":
        raise ValueError(f"reader must be 'reference' or 'triton', got {reader!r}")
    tr = TritonReader(codec, policy, config=FMA)
    return (lambda q, cache, layer, scale: tr.decode_tiered(q, cache, layer, scale)), "triton"


# ---- step time on a benchmark shape ----

def run_timing(shape: str | Shape, policies: list[str], hots: list[int], reps: int = 30, warm: int = 4,
               promotion_mib: float = 256.0, layers: int = 32, budget_gib: float = 40.0, seed: int = 0,
               k_share: float | None = None, progress: Callable[[str], None] | None = None,
               key_page_mib: float = 0.0, k_margin: int = Prefetcher.k_margin) -> list[TierRow]:
    """SDPA, FP8, the all-GPU reader (default stages and FMA stages) and the tiered read at each hot depth, timed in
    one run on ``shape``; GPU bytes for a model of ``layers`` such layers and the largest batch ``budget_gib``
    holds. ``key_page_mib``: the tiered cache's Key page slots (per layer, as ``promotion_mib``), given to the
    policies with Key refinement only (the others never read them). ``k_margin``: the prefetcher's."""
    if not torch.cuda.is_available() and not interpreting():
        raise RuntimeError("step times need a CUDA device (or TRITON_INTERPRET=1 for a plumbing run on CPU)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shp = SHAPES[shape] if isinstance(shape, str) else shape
    say = progress or log.info
    s = synthetic_step(shp, dev, seed)
    codec = s.codec
    model = dataclasses.replace(codec.spec, n_layers=layers)
    b, t = shp.batch, shp.tokens
    scalars, bytes_fp16 = 2.0 * b * shp.n_kv_heads * t * shp.head_dim, 4.0 * b * shp.n_kv_heads * t * shp.head_dim
    four = four_bit_bytes(model, t)
    budget = budget_gib * GiB
    rows: list[TierRow] = []

    def add(row: TierRow, mem: GpuBytes) -> None:
        row.gpu_gib = mem.total(b) / GiB
        row.x_four_bit = mem.total(b) / (b * four)
        row.max_batch = mem.max_batch(budget)
        rows.append(row)
        say(f"{shp.name} / {row.system}: {row.step_ms:.4f} ms" if row.step_ms is not None else row.system)

    base = {name: time_system(name, shp, [s], codec, reps, False, k_share, scalars, bytes_fp16, ReaderConfig())
            for name in ("sdpa", "fp8")}
    sdpa_ms = base["sdpa"].median_ms
    for name, r in base.items():
        add(TierRow(shp.name, name, "-", r.median_ms, r.median_ms / sdpa_ms),
            gpu_bytes(name, model, t))
    for pname in policies:
        policy = policy_named(pname, k_share)
        ws = workspace_bytes_per_sequence(codec, policy, t)
        kp_mib = key_page_mib if policy.key_refine else 0.0
        all_ms = {}
        for label, cfg in (("", ReaderConfig()), ("-fma", FMA)):
            system = f"readkv-{pname}{label}"
            r = _time_reader(TritonReader(codec, policy, config=cfg), s, reps)
            all_ms[label] = r
            add(TierRow(shp.name, system, "triton", r, r / sdpa_ms), gpu_bytes("readkv", model, t,
                                                                             workspace_per_sequence=ws))
        for hot in hots:
            mem = gpu_bytes("tiered", model, t, (hot, hot), int(promotion_mib * MiB * layers),
                            workspace_per_sequence=ws, key_page_bytes=int(kp_mib * MiB * layers))
            row = _time_tiered(shp.name, s, codec, policy, hot, pname, promotion_mib, warm, reps, seed, kp_mib,
                               k_margin)
            row.x_sdpa, row.x_all_gpu = row.step_ms / sdpa_ms, row.step_ms / all_ms["-fma"]
            add(row, mem)
            off = _time_offload(s, codec, policy, hot, reps)
            # the hot pools of every layer (no promotion cache) and one layer's refinement planes staged
            w = codec.spec.width
            staged = (w - hot) / w * gpu_bytes("readkv", dataclasses.replace(model, n_layers=1), t).per_sequence
            off_mem = GpuBytes(gpu_bytes("tiered", model, t, (hot, hot), 0, workspace_per_sequence=ws).per_sequence
                               + staged, 0.0)
            add(TierRow(shp.name, f"offload-h{hot}-{pname}", "triton", off, off / sdpa_ms, off / all_ms[""],
                        extra={"note": "every page's refinement planes of one layer copied from pinned host memory "
                               "before the all-GPU read (default stages)"}), off_mem)
    del s
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _time_reader(reader: TritonReader, s: StepData, reps: int) -> float:
    plan = reader.plan(s.q.shape[0], int(s.lengths.max()), s.q.device)
    step = lambda: reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)  # noqa: E731
    ms, _ = time_graphs([step], reps)
    return ms


def _tiered_from(s: StepData, codec: Any, hot: int, promotion_mib: float, key_page_mib: float = 0.0) -> TieredCache:
    b, t = s.q.shape[0], int(s.lengths.max())
    cache = TieredCache(codec.spec, b, placement(hot, codec.spec.format_id), max_tokens=t, device=s.q.device,
                        promotion_bytes=int(promotion_mib * MiB), host_bytes=64 * GiB,
                        key_page_bytes=int(key_page_mib * MiB))
    for i in range(b):
        cache.append(0, s.cache.read_k(0, i, codec.spec.width), s.cache.read_v(0, i, codec.spec.width), seq=i)
    return cache


def _time_tiered(source: str, s: StepData, codec: Any, policy: ReadPolicy, hot: int, pname: str,
                 promotion_mib: float, warm: int, reps: int, seed: int, key_page_mib: float = 0.0,
                 k_margin: int = Prefetcher.k_margin) -> TierRow:
    cache = _tiered_from(s, codec, hot, promotion_mib, key_page_mib)
    reader = TritonReader(codec, policy, config=FMA)
    b, t = s.q.shape[0], int(s.lengths.max())
    plan = reader.plan(b, t, s.q.device)
    gen = torch.Generator(device=s.q.device).manual_seed(seed + 17)
    pf, tally = Prefetcher(k_margin=k_margin), StepTally()
    prefetch_s = []  # host wall time of each step's prefetch (plan and promotion copies, synchronized)
    for i in range(warm + 1):  # drifting queries fill the promotion cache; the last step is the one counted
        if i == warm:
            tally.restart()
        q = s.q.float() + 0.1 * s.q.float().std() * torch.randn(s.q.shape, device=s.q.device, generator=gen)
        _, took = _step_then_prefetch(q, cache, 0, codec, policy, pf, tally, None,
                                      lambda qq, c, layer, scale: reader.decode_tiered(qq, c, layer, scale, plan))
        prefetch_s.append(took)
    pools = cache.pools(0)
    pt = cache.page_table.to(device=s.q.device, dtype=torch.int32).contiguous()
    lengths = cache.lengths[0].to(device=s.q.device, dtype=torch.int32)
    step = lambda: reader.run(plan, s.q, pools.k_hot, pools.v_hot, pt, lengths, 0, tiers=pools)  # noqa: E731
    ms, _ = time_graphs([step], reps)
    sm = tally.summary()
    spec = codec.spec
    fetched = sm["fetched_k"] * math.ceil(t / spec.page_size) * spec.page_size / 8 \
        + (sm["fetched_v"] + sm["fetched_kp"]) * (spec.width - hot) * spec.page_size * spec.head_dim / 8
    return TierRow(source, f"tiered-h{hot}-{pname}", "triton", ms, cap_rate=sm["cap_rate"],
                   hit_rate=sm["hit_rate"], fetched_per_step=float(sm["fetched"]),
                   fetched_mib_per_step=fetched / MiB, fetch_ms=_time_h2d(int(fetched), s.q.device, reps),
                   prefetch_ms=1e3 * statistics.median(prefetch_s[1:] or prefetch_s),
                   host_gib=cache.bytes().host / GiB, promoted_mib=cache.promoted_bytes() / MiB,
                   extra={"warm_steps": warm, "tally": sm, "k_margin": k_margin, "key_page_mib": key_page_mib,
                          "prefetch_ms_note": "host wall time of one layer-step's prefetch after the first warm "
                                              "step (median; not in step_ms)"})


def _step_then_prefetch(q: torch.Tensor, cache: TieredCache, layer: int, codec: Any, policy: ReadPolicy,
                        pf: Prefetcher | None, tally: StepTally, scale: float | None,
                        read: Callable[..., Any] | None) -> tuple[torch.Tensor, float]:
    """``tiered_decode_step`` with its prefetch timed apart: (out, seconds of host wall time the prefetch took,
    synchronized before and after; 0 without a prefetcher)."""
    deadline = step_deadline(policy)
    residency = cache.residency(layer)
    out, stats = tiered_decode_step(q, cache, layer, codec, policy, None, tally, scale, read, residency=residency)
    sync(cache.device)
    if pf is None:
        return out, 0.0
    t0 = time.perf_counter()
    tally.fetched_for_next(layer, pf.run(cache, layer, stats, residency, deadline=deadline))
    sync(cache.device)
    return out, time.perf_counter() - t0


def _time_h2d(nbytes: int, dev: torch.device, reps: int) -> float | None:
    """Median ms of copying ``nbytes`` from pinned host memory to the device (None off CUDA or for 0 bytes)."""
    if dev.type != "cuda" or nbytes <= 0:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ms, _ = time_graphs([lambda: dst.copy_(src, non_blocking=True)], reps)
    return ms


def _time_offload(s: StepData, codec: Any, policy: ReadPolicy, hot: int, reps: int) -> float:
    """Whole-chunk offload: every page's refinement planes (W - h of W, K and V) copied from pinned host memory, then
    the all-GPU read (default stages) over the full pool."""
    spec = codec.spec
    kv_bytes = s.cache.k_pool[0].numel() + s.cache.v_pool[0].numel()
    cold = int(kv_bytes * (spec.width - hot) / spec.width)
    reader = TritonReader(codec, policy)
    plan = reader.plan(s.q.shape[0], int(s.lengths.max()), s.q.device)
    pinned = s.q.device.type == "cuda"
    src = torch.empty(cold, dtype=torch.uint8)
    src = src.pin_memory() if pinned else src
    dst = torch.empty(cold, dtype=torch.uint8, device=s.q.device)

    def step() -> None:
        dst.copy_(src, non_blocking=True)
        reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)

    ms, _ = time_graphs([step], reps)
    sync(s.q.device)
    return ms


# ---- output ----

COLUMNS = ("source", "system", "reader", "tier", "step_ms", "x_sdpa", "x_all_gpu", "fetch_ms", "prefetch_ms", "gpu_gib",
           "gpu_mib", "x_four_bit",
           "promoted_mib", "max_batch", "cap_rate", "hit_rate", "kr_hit_rate", "fetched_per_step",
           "fetched_mib_per_step",
           "used_share", "rel_err", "rel_err_all_gpu", "host_mib", "nvme_mib", "remote_mib", "fetch_mib_s")


def format_table(rows: list[TierRow]) -> str:
    def cell(v: Any, col: str) -> str:
        if col in ("cap_rate", "hit_rate", "kr_hit_rate", "used_share"):
            return f"{100 * v:.2f}%"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    return column_table(rows, COLUMNS, cell)
