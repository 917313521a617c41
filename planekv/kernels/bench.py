"""Decode-attention benchmark: every system in one harness, timed beside torch SDPA in the same run.

For each shape: synthetic K/V (Gaussian with large-offset outlier channels in K, queries built from a
few keys, logits scaled to a standard deviation of 2.5) are encoded on the device with the Triton
encode kernel; each system's step is captured in a CUDA graph and replayed, rotating over several
input sets when one set would fit in L2. Reported per system: median step time, the ratio to SDPA,
logical bits (what the read requested), physical bytes counted from the layout (32-byte sectors
touched, workspace written and read back, output), achieved bandwidth. With ``check=True`` the
Triton reader is first compared with the reference reader at full size (same depths, output error).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kvstore import Codec, FormatSpec, PlaneKVCache, ReadPolicy, calibrate
from ..kvstore.reference import readkv_rows
from .decode import NPASS
from .encode import Encoder
from .fp8 import FP8Decode, quantize_fp8
from .reader import Plan, TritonReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    tokens: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int


SHAPES = {
    "b32-t32k": Shape("b32-t32k", 32, 32768, 32, 8, 128),
    "b1-t8k": Shape("b1-t8k", 1, 8192, 32, 8, 128),
    "smollm2-b32-t8k": Shape("smollm2-b32-t8k", 32, 8192, 9, 3, 64),
    "d256-b32-t32k": Shape("d256-b32-t32k", 32, 32768, 4, 1, 256),
}

SYSTEMS = ("sdpa", "fp8", "full4", "readkv-flex-r4", "readkv-flex-r2", "readkv-flex-kr-r4", "readkv-flex-kr-r2",
           "readkv-cons-r4", "readkv-cons-r2")


@dataclass
class Row:
    shape: str
    system: str
    median_ms: float
    ratio_to_sdpa: float | None
    logical_bits_per_scalar: float
    logical_bytes: float
    physical_bytes: float
    physical_over_logical: float
    bandwidth_tbs: float
    check: dict[str, Any] = field(default_factory=dict)


def parse_settings(spec: str) -> dict[str, int | float | str]:
    """``"name=value[,name=value]"`` (the tools' reader settings) as a dict; a value is an int or a
    float where it parses as one, else the string."""
    out: dict[str, int | float | str] = {}
    for item in filter(None, spec.split(",")):
        k, v = item.split("=", 1)
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def apply_settings(reader: TritonReader, settings: dict[str, int | float | str]) -> None:
    """Set TritonReader tuning attributes by name (before planning); an unknown name is an error."""
    for k, v in settings.items():
        if not hasattr(reader, k):
            raise ValueError(f"TritonReader has no attribute {k!r}")
        setattr(reader, k, v)


def _policy(system: str, k_share: float | None) -> ReadPolicy | None:
    """The policy of a ReadKV system; the flexible reader's K share is ``k_share``, or when None the
    share frozen by the split search for that rate (the configuration the kernels run by default)."""
    from ..evaluation.common import VARIANT_OPTIONS, default_k_share

    def ks(rate: float) -> float:
        return default_k_share(rate) if k_share is None else k_share

    kr = VARIANT_OPTIONS["readkv-flexible-kr"]  # the third read stage, Key refinement (EVALUATION.md)
    return {
        "readkv-flex-r4": ReadPolicy.flexible(4.0, ks(4.0)),
        "readkv-flex-r2": ReadPolicy.flexible(2.0, ks(2.0)),
        "readkv-flex-kr-r4": ReadPolicy.flexible(4.0, ks(4.0), **kr),
        "readkv-flex-kr-r2": ReadPolicy.flexible(2.0, ks(2.0), **kr),
        "readkv-cons-r4": ReadPolicy.constrained(4.0),
        "readkv-cons-r2": ReadPolicy.constrained(2.0),
    }.get(system)


@dataclass
class _Data:
    spec: FormatSpec
    codec: Codec
    q: torch.Tensor  # [B, Hq, d] fp16
    k: torch.Tensor  # [B, Hkv, T, d] fp16
    v: torch.Tensor
    cache: PlaneKVCache
    page_table: torch.Tensor  # [B, Hkv, slots] int32 (device)
    lengths: torch.Tensor  # [B] int32 (device)


def _gen(shape: Shape, dev: torch.device, seed: int, calib: tuple[FormatSpec, Codec] | None,
         codebook: str = "gaussian-lloyd-tree", v_run: int = 1) -> _Data:
    g = torch.Generator(device=dev).manual_seed(seed)
    b, t, hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    gen0 = torch.Generator().manual_seed(1000 + d + hk)  # distribution parameters: fixed per geometry
    k_scale = torch.ones(hk, 1, d)
    k_off = 0.5 * torch.randn(hk, 1, d, generator=gen0)
    idx = torch.randperm(d, generator=gen0)[:4]
    k_scale[..., idx] = 2.0
    k_off[..., idx] = 8.0 * torch.sign(torch.randn(hk, 1, 4, generator=gen0))
    v_scale = 1 + 0.5 * torch.rand(hk, 1, d, generator=gen0)
    k_scale, k_off, v_scale = k_scale.to(dev), k_off.to(dev), v_scale.to(dev)
    k = (torch.randn(b, hk, t, d, device=dev, generator=g) * k_scale + k_off).half()
    v = (torch.randn(b, hk, t, d, device=dev, generator=g) * v_scale).half()
    if calib is None:
        n_cal = min(t, 4096)
        spec0 = FormatSpec(model_id=f"bench-{shape.name}", n_layers=1, n_q_heads=hq, n_kv_heads=hk, head_dim=d,
                           calibration_id="-", codebook=codebook, v_run=v_run)
        cal = calibrate(k[:1, :, :n_cal].float().cpu().transpose(0, 1).reshape(1, hk, n_cal, d),
                        v[:1, :, :n_cal].float().cpu().transpose(0, 1).reshape(1, hk, n_cal, d),
                        spec0.seed_k, spec0.seed_v)
        spec = dataclasses.replace(spec0, calibration_id=cal.calibration_id)
        codec = Codec(spec, cal)
    else:
        spec, codec = calib
    # Queries: a noisy mix of three keys of the group, logits scaled to a std of 2.5.
    gq = hq // hk
    pick = torch.randint(0, t, (b, hk, gq, 3), device=dev, generator=g)
    kk = torch.gather(k.float(), 2, pick.reshape(b, hk, -1, 1).expand(-1, -1, -1, d)).reshape(b, hk, gq, 3, d)
    q = kk.mean(3) + 0.5 * torch.randn(b, hk, gq, d, device=dev, generator=g)
    lg = (q @ k.float().transpose(2, 3)) / math.sqrt(d)
    q = (q * (2.5 / lg.std(-1, keepdim=True))).reshape(b, hq, d).half()
    n_pages = math.ceil(t / spec.page_size)
    cache = PlaneKVCache(spec, b, device=dev, initial_pages=b * hk * n_pages)
    Encoder(codec).append(cache, 0, k, v)
    pt = cache.page_table.to(device=dev, dtype=torch.int32).contiguous()
    lengths = torch.full((b,), t, dtype=torch.int32, device=dev)
    return _Data(spec, codec, q, k, v, cache, pt, lengths)


def _time_graphs(steps: list[Callable[[], Any]], reps: int) -> tuple[float, list[torch.cuda.CUDAGraph]]:
    """Capture each step in a CUDA graph; replay round-robin; median ms of single replays, and the
    graphs (for :func:`_timeline`).

    Off the GPU (Triton's interpreter, for plumbing checks) each step runs once on the host clock."""
    if not torch.cuda.is_available():
        times = []
        for f in steps:
            t0 = time.perf_counter()
            f()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), []
    graphs = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in steps:
            for _ in range(2):
                f()  # warm up: compile, autotune, allocate
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for f in steps:
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            f()
        graphs.append(gr)
    for gr in graphs:
        gr.replay()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        gr = graphs[i % len(graphs)]
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        gr.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times), graphs


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _sector_bytes_k(kdep: torch.Tensor, lengths: torch.Tensor, page: int, granule: int = 32) -> float:
    """K words touched: per page and plane j, every 32-byte sector (32*8/page channels; or granule of
    ``granule`` bytes) holding a channel with depth > j. kdep [B, Hkv, d]."""
    row = page // 8
    per_sector = max(1, granule // row)
    b, hk, d = kdep.shape
    grp = kdep.reshape(b, hk, d // per_sector, per_sector).amax(-1)  # [B, Hkv, sectors]
    pages = torch.ceil(lengths.double() / page)  # [B]
    return float((grp.sum((1, 2)).double() * pages).sum()) * max(granule, row)


def _sector_bytes_v(vdep: torch.Tensor, lengths: torch.Tensor, d: int, granule: int = 32, v_run: int = 1,
                    width: int = 8, page: int = 64) -> float:
    """V rows touched: every 32-byte sector (or granule of ``granule`` bytes) holding a row that a token's
    depth reaches, in the format's layout: per plane, rows of consecutive tokens (``v_run`` = 1); with
    ``v_run`` = g, per run of g planes, each token's g rows together (``width`` planes, ``page`` tokens
    a page: a run of a page is P g rows)."""
    row = d // 8
    per_sector = max(1, granule // row)
    b, hk, t = vdep.shape
    mask = torch.arange(t, device=vdep.device)[None, None, :] < lengths.to(vdep.device)[:, None, None]
    dep = vdep.long() * mask
    if v_run == 1:
        pad = -t % per_sector
        if pad:
            dep = torch.nn.functional.pad(dep, (0, pad))
        dep = dep.reshape(b, hk, -1, per_sector).amax(-1)
        return float(dep.sum()) * max(granule, row)
    dep = torch.nn.functional.pad(dep, (0, -t % page)).reshape(b, hk, -1, page, 1)
    total = 0
    for r in range(width // v_run):  # run r: rows (token, i) in order, row i of a token read where depth > r g + i
        read = dep > (r * v_run + torch.arange(v_run, device=dep.device))  # [b, hk, pages, P, g]
        total += int(read.reshape(b, hk, -1, per_sector).any(-1).sum())
    return float(total) * max(granule, row)


def _readkv_physical(plan: Plan, reader: TritonReader, lengths: torch.Tensor, spec: FormatSpec) -> float:
    b, hq, hk, d = plan.batch, spec.n_q_heads, spec.n_kv_heads, spec.head_dim
    kdep = plan.kdep
    vdep = plan.vdep if not reader.fixed_depth else torch.full_like(plan.vdep, reader.fixed_depth)
    data = _sector_bytes_k(kdep, lengths, spec.page_size) + _sector_bytes_v(vdep, lengths, d, v_run=spec.v_run,
                                                                             width=spec.width, page=spec.page_size)
    n = float(lengths.double().sum())  # tokens over the batch
    logits = 4.0 * hq * n
    if reader.fixed_depth:
        ws = logits * 2  # written by the Key stage, read by the Value stage
    else:
        # logits: written, read by the importance pass and the Value stage; importance: written, read
        # by radix passes 2..NPASS, the tie count and the Value stage (compaction); Value depths written
        vimp_reads = NPASS.value - 1 + 2
        if plan.two_pass:
            # two-pass: the candidates pass, the ties and the compaction read it; the gated radix
            # passes (all NPASS) only in the groups whose candidates overflowed; one histogram
            # read-modify-write (8 bytes) per token; the candidates written and read once
            over = float(plan.cmeta[:, 4].double().mean())
            vimp_reads = 3 + NPASS.value * over
            ws_alloc = 8.0 * hk * n + 8.0 * float(plan.cmeta[:, 2].clamp(max=plan.cand.shape[1]).double().sum())
        else:
            ws_alloc = 0.0
        ws = logits * 2 + 4.0 * hk * n * (1 + vimp_reads) + 1.0 * hk * n + ws_alloc
        if reader.compact_values:
            # the Value stage reads the logits of depth > 0 tokens only: every 32-byte sector (8
            # tokens) of a query head's row holding one; and writes and reads a 2-byte key per token
            tok = torch.arange(vdep.shape[2], device=vdep.device)
            mask = tok[None, None, :] < lengths.to(vdep.device)[:, None, None]
            live = (vdep.long() * mask) > 0
            pad = -live.shape[2] % 8
            sectors = torch.nn.functional.pad(live, (0, pad)).reshape(b, hk, -1, 8).any(-1).sum()
            ws += float(sectors) * 32 * (hq // hk) + 4.0 * float(live.sum())
        else:
            ws += logits
    if plan.key_mma:  # the bit-product Key stage's operands: written by _lin_prep, read back (per step of
        # 16 pairs: 16 int32 offsets and 64 int32 V words), and base'
        ws += 2.0 * (float(plan.lin_steps.double().sum()) * (16 + 64) * 4 + 4.0 * b * hq)
    out = 4.0 * b * hq * d * 2 + 4.0 * b * hq * plan.n_blocks * d * 2
    if reader.refine:
        data += _refine_sector_bytes(reader.refined(plan).to(kdep.device), kdep, lengths, spec)
        n_ref = float(plan.rcnt.sum())
        # logits read by the keys pass and the stats pass; keys written, read by passes 2..NPASS, the
        # ties and the order; chosen positions written and read; chosen logits rewritten (a 32-byte
        # sector per query head)
        ws += logits * 2 + 4.0 * hk * n * (1 + NPASS.value - 1 + 2) + 2.0 * 2 * n_ref + 32.0 * (hq // hk) * n_ref
    return data + ws + out


def _refine_sector_bytes(refined: torch.Tensor, kdep: torch.Tensor, lengths: torch.Tensor, spec: FormatSpec) -> float:
    """K sectors the refinement touches: per page holding a refined token, per plane j, every 32-byte
    sector (32*8/page channels) holding a channel of depth <= j (the planes the channel stage left)."""
    p, w = spec.page_size, spec.width
    row = p // 8
    per_sector = max(1, 32 // row)
    b, hk, d = kdep.shape
    tmax = refined.shape[2]
    pad = torch.nn.functional.pad(refined, (0, -tmax % p))
    pages = pad.view(b, hk, -1, p).any(-1).sum(-1).double()  # [B, Hkv]
    left = (w - kdep.long().reshape(b, hk, d // per_sector, per_sector).amin(-1)).sum(-1).double()  # [B, Hkv]
    return float((pages * left).sum()) * max(32, row)


def run_bench(shapes: list[str | Shape], systems: list[str] | None = None, reps: int = 30, check: bool = True,
              k_share: float | None = None, seed: int = 0, num_warps: int = 4, assembly: str | None = None,
              compact_values: bool | None = None, pages_per_program: int | None = None,
              progress: Callable[[str], None] | None = None, value_alloc: str | None = None,
              timeline: bool = False, alloc_warps: int | None = None,
              codebook: str = "gaussian-lloyd-tree", v_run: int = 1, batch_streams: int = 1) -> list[Row]:
    from ._dispatch import interpreting

    if not torch.cuda.is_available() and not interpreting():
        raise RuntimeError("the attention benchmark times CUDA graphs: it needs a CUDA device "
                           "(or TRITON_INTERPRET=1 for a plumbing run on CPU, with no meaningful times)")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    systems = list(systems or SYSTEMS)
    say = progress or (lambda s: log.info(s))
    rows: list[Row] = []
    for name in shapes:
        shape = SHAPES[name] if isinstance(name, str) else name
        t0 = time.perf_counter()
        b, t, _hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
        bytes_fp16 = 2.0 * b * hk * t * d * 2
        n_sets = max(1, min(4, math.ceil(3 * 60e6 / bytes_fp16)))  # rotate when one set fits in L2
        sets = [_gen(shape, dev, seed, None, codebook=codebook, v_run=v_run)]
        for i in range(1, n_sets):
            sets.append(_gen(shape, dev, seed + i, (sets[0].spec, sets[0].codec)))
        say(f"{name}: data ready in {time.perf_counter() - t0:.1f} s ({n_sets} input sets)")
        codec = sets[0].codec
        scalars = 2.0 * b * hk * t * d
        sdpa_ms = None
        for system in systems:
            try:
                row = _one(system, shape, sets, codec, reps, check, k_share, scalars, bytes_fp16, num_warps, assembly,
                           compact_values, pages_per_program, value_alloc, timeline, alloc_warps, batch_streams)
            except Exception as exc:  # keep going: one call should report every system
                log.exception("%s / %s failed", name, system)
                say(f"{name} / {system}: FAILED {type(exc).__name__}: {exc}")
                continue
            if system == "sdpa":
                sdpa_ms = row.median_ms
            row.ratio_to_sdpa = None if sdpa_ms is None else row.median_ms / sdpa_ms
            rows.append(row)
            say(f"{name} / {system}: {row.median_ms:.4f} ms, x{row.ratio_to_sdpa or float('nan'):.3f} SDPA, "
                f"{row.logical_bits_per_scalar:.2f} bits, phys/logical {row.physical_over_logical:.2f}, "
                f"{row.bandwidth_tbs:.2f} TB/s {_plain_check(row)}")
        del sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _one(system: str, shape: Shape, sets: list[_Data], codec: Codec, reps: int, check: bool, k_share: float | None,
         scalars: float, bytes_fp16: float, num_warps: int = 4, assembly: str | None = None,
         compact_values: bool | None = None, pages_per_program: int | None = None,
         value_alloc: str | None = None, timeline: bool = False, alloc_warps: int | None = None,
         batch_streams: int = 1) -> Row:
    b, t, hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    dev = sets[0].q.device
    info: dict[str, Any] = {}
    if system == "sdpa":
        qs = [s.q[:, :, None, :] for s in sets]
        steps = [lambda s=s, q=q: torch.nn.functional.scaled_dot_product_attention(q, s.k, s.v, enable_gqa=True)
                 for s, q in zip(sets, qs, strict=False)]
        ms, graphs = _time_graphs(steps, reps)
        if timeline and graphs:
            info["timeline"] = _timeline_or_error(graphs[0])
        return Row(shape.name, system, ms, None, 16.0, bytes_fp16, bytes_fp16 + 2.0 * b * hq * d * 2, 1.0,
                   (bytes_fp16 + 4.0 * b * hq * d) / ms / 1e9, info)
    if system == "fp8":
        f = FP8Decode(hq, hk, d)
        plan = f.plan(b, t, dev)
        qd = [(s, *quantize_fp8(s.k), *quantize_fp8(s.v)) for s in sets]
        if check:
            out = f.run(plan, sets[0].q, qd[0][1], qd[0][3], qd[0][2], qd[0][4], sets[0].lengths).clone()
            kk = qd[0][1].float() * qd[0][2][None, :, None, None]
            vv = qd[0][3].float() * qd[0][4][None, :, None, None]
            ref = torch.nn.functional.scaled_dot_product_attention(sets[0].q.float()[:, :, None], kk, vv,
                                                                  enable_gqa=True)[:, :, 0]
            info["rel_err_vs_fp32_sdpa_on_dequant"] = float((out - ref).norm() / ref.norm())
        steps = [lambda x=x: f.run(plan, x[0].q, x[1], x[3], x[2], x[4], x[0].lengths) for x in qd]
        ms, _ = _time_graphs(steps, reps)
        phys = bytes_fp16 / 2 + 4.0 * b * hq * plan["S"] * (d + 2) * 2
        return Row(shape.name, system, ms, None, 8.0, bytes_fp16 / 2, phys, phys / (bytes_fp16 / 2),
                   phys / ms / 1e9, info)
    if system == "full4":
        reader = TritonReader(codec, fixed_depth=4, num_warps=num_warps, assembly=assembly)
    else:
        pol = _policy(system, k_share)
        if pol is None:
            raise ValueError(f"unknown system {system}")
        reader = TritonReader(codec, pol, num_warps=num_warps, assembly=assembly, compact_values=compact_values,
                              value_alloc=value_alloc, alloc_warps=alloc_warps)
    reader.batch_streams = batch_streams
    plan = reader.plan(b, t, dev, pages_per_program=pages_per_program)
    s0 = sets[0]
    if check:
        info.update(_check(reader, plan, s0, codec))
    steps = [lambda s=s: reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)
             for s in sets]
    ms, graphs = _time_graphs(steps, reps)
    if timeline and graphs:
        info["timeline"] = _timeline_or_error(graphs[0])
    reader.run(plan, s0.q, s0.cache.k_pool[0], s0.cache.v_pool[0], s0.page_table, s0.lengths, 0)
    _sync(dev)
    st = reader.stats(plan, s0.lengths)
    logical_bits = float(st.total_bits.sum())
    phys = _readkv_physical(plan, reader, s0.lengths, s0.spec)
    return Row(shape.name, system, ms, None, logical_bits / scalars, logical_bits / 8, phys,
               phys / (logical_bits / 8), phys / ms / 1e9, info)


def _timeline_or_error(graph: torch.cuda.CUDAGraph) -> dict[str, Any]:
    try:
        return _timeline(graph)
    except Exception as exc:  # the profiler is a diagnostic: its failure must not lose the row
        log.exception("timeline failed")
        return {"error": f"{type(exc).__name__}: {exc}", "kernels_us": {}, "kernel_sum_us": 0.0, "graph_us": 0.0}


def _timeline(gr: torch.cuda.CUDAGraph, reps: int = 20) -> dict[str, Any]:
    """Per-kernel GPU time of one step's captured graph (from :func:`_time_graphs`), from the
    profiler's kernel records over ``reps`` replays: {kernel: [launches per step, microseconds per
    step]}, their sum, and the graph's wall time per replay (the difference is launch gaps and tails
    between dependent kernels)."""
    from torch.profiler import ProfilerActivity, profile

    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        e0.record()
        for _ in range(reps):
            gr.replay()
        e1.record()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            name = ev.name.split("(")[0]
            per.setdefault(name, []).append(ev.device_time_total)
    kernels = {k: [round(len(v) / reps, 2), round(sum(v) / reps, 2)] for k, v in
               sorted(per.items(), key=lambda kv: -sum(kv[1]))}
    return {"kernels_us": kernels, "kernel_sum_us": round(sum(v[1] for v in kernels.values()), 1),
            "graph_us": round(1e3 * e0.elapsed_time(e1) / reps, 1)}


def _check(reader: TritonReader, plan: Plan, s: _Data, codec: Codec, n_seq: int = 2) -> dict[str, Any]:
    """Triton reader vs the reference reader (torch, same device) on the first sequences."""
    out = reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0).clone()
    _sync(out.device)
    errs, kmis, vmis, rmis = [], 0, 0, 0
    pol = reader.policy
    refined = reader.refined(plan) if reader.refine else None
    for bi in range(min(n_seq, s.q.shape[0])):
        t = int(s.lengths[bi])
        kc = s.cache.read_k(0, bi, 8)
        vc = s.cache.read_v(0, bi, 8)
        if reader.fixed_depth:
            kk = codec.decode(kc, reader.fixed_depth, 0, "k")
            vv = codec.decode(vc, reader.fixed_depth, 0, "v")
            from ..kvstore.reference import attention

            ref = attention(s.q[bi].float()[:, None], kk, vv, torch.tensor([t]))[:, 0]
        else:
            ref, st = readkv_rows(s.q[bi].float()[:, None], kc, vc, codec, 0, pol, torch.tensor([t]))
            ref = ref[:, 0]
            kmis += int((st.k_depths[0].to(plan.kdep.device) != plan.kdep[bi]).sum())
            vmis += int((st.v_depths[0].to(plan.vdep.device) != plan.vdep[bi, :, :t].long()).sum())
            if refined is not None:
                rmis += int((st.extra["k_refined"][:, 0, :t] != refined[bi, :, :t]).sum())
        errs.append(float((out[bi] - ref).norm() / ref.norm()))
    res = {"rel_err": max(errs), "k_depth_mismatch": kmis, "v_depth_mismatch": vmis, "checked_seqs": len(errs)}
    if refined is not None:
        res["refined_mismatch"] = rmis
        res["refined_fraction"] = float(refined.sum()) / float(s.lengths.sum() * plan.rcnt.shape[1])
    return res


def rows_to_json(rows: list[Row], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=2)


def _plain_check(row: Row) -> dict[str, Any]:
    """A row's check values without the timeline (reported apart by :func:`format_timeline`)."""
    return {k: v for k, v in row.check.items() if k != "timeline"}


def format_table(rows: list[Row]) -> str:
    head = ("| shape | system | median ms | x SDPA | logical bits/scalar | physical / logical | TB/s | check |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        chk = ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in _plain_check(r).items())
        ratio = "" if r.ratio_to_sdpa is None else f"{r.ratio_to_sdpa:.3f}"
        lines.append(f"| {r.shape} | {r.system} | {r.median_ms:.4f} | {ratio} | {r.logical_bits_per_scalar:.2f} | "
                     f"{r.physical_over_logical:.2f} | {r.bandwidth_tbs:.2f} | {chk} |")
    return head + "\n".join(lines)


def format_timeline(rows: list[Row]) -> str:
    """Per-kernel GPU time of each profiled row (``--timeline``), largest first."""
    out = []
    for r in rows:
        tl = r.check.get("timeline")
        if not tl:
            continue
        out.append(f"{r.shape} / {r.system}: graph {tl['graph_us']} us per step, kernels {tl['kernel_sum_us']} us")
        out.extend(f"    {us:9.2f} us  x{n:<5g} {name}" for name, (n, us) in tl["kernels_us"].items())
    return "\n".join(out)
