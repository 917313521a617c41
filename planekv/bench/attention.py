"""The decode-attention benchmark: every system in one harness, timed beside torch SDPA in the same run.

For each shape: synthetic K/V (Gaussian with large-offset outlier channels in K, queries built from a few keys,
logits scaled to a standard deviation of 2.5) are encoded on the device with the Triton encode kernel; each
system's step is captured in a CUDA graph and replayed, rotating over several input sets when one set would fit
in L2. Reported per system: median step time, the ratio to SDPA, logical bits (what the read requested),
physical bytes counted from the layout (:mod:`.traffic`), achieved bandwidth. With ``check=True`` the Triton
reader is first compared with the reference reader at full size (same depths, output error).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..evaluation.common import VARIANT_OPTIONS, default_k_share
from ..kernels import Encoder, FP8Decode, Plan, ReaderConfig, TritonReader, quantize_fp8
from ..kernels._dispatch import interpreting
from ..kvstore import Codec, FormatSpec, PlaneKVCache, ReadPolicy, calibrate
from ..kvstore.reference import attention, readkv_rows
from .timing import sync, time_graphs, timeline_or_error
from .traffic import readkv_physical

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


def parse_settings(spec: str) -> dict[str, int | float | str | bool]:
    """``"name=value[,name=value]"`` (reader settings on the command line) as a dict; a value is an int or a
    float where it parses as one, a bool for true / false, else the string."""
    out: dict[str, int | float | str | bool] = {}
    for item in filter(None, spec.split(",")):
        if "=" not in item:
            raise ValueError(f"a setting is name=value, got {item!r}")
        k, v = item.split("=", 1)
        if v.lower() in ("true", "false"):
            out[k] = v.lower() == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def config_with(settings: dict[str, Any], base: ReaderConfig | None = None) -> ReaderConfig:
    """``base`` (default: the defaults) with ``settings`` replaced; an unknown name or a bad value is refused
    by ReaderConfig with what it accepts."""
    unknown = set(settings) - set(ReaderConfig.field_names())
    if unknown:
        known = ", ".join(ReaderConfig.field_names())
        raise ValueError(f"ReaderConfig has no field {sorted(unknown)}; its fields: {known}")
    return dataclasses.replace(base or ReaderConfig(), **settings)


def policy_of(system: str, k_share: float | None = None) -> ReadPolicy | None:
    """The policy of a ReadKV system; the flexible reader's K share is ``k_share``, or when None the
    share frozen by the split search for that rate (the configuration the kernels run by default)."""
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
class StepData:
    spec: FormatSpec
    codec: Codec
    q: torch.Tensor  # [B, Hq, d] fp16
    k: torch.Tensor  # [B, Hkv, T, d] fp16
    v: torch.Tensor
    cache: PlaneKVCache
    page_table: torch.Tensor  # [B, Hkv, slots] int32 (device)
    lengths: torch.Tensor  # [B] int32 (device)


def synthetic_step(shape: Shape, dev: torch.device, seed: int, calib: tuple[FormatSpec, Codec] | None = None,
                   codebook: str = "gaussian-lloyd-tree", v_run: int = 1) -> StepData:
    """One step's inputs: synthetic K/V of ``shape`` encoded into a paged cache on ``dev`` (calibrated on its
    first 4096 tokens, or with ``calib``'s format and codec), queries, page table and lengths."""
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
    return StepData(spec, codec, q, k, v, cache, pt, lengths)


def run_bench(shapes: list[str | Shape], systems: list[str] | None = None, reps: int = 30, check: bool = True,
              k_share: float | None = None, seed: int = 0, config: ReaderConfig | None = None,
              pages_per_program: int | None = None, progress: Callable[[str], None] | None = None,
              timeline: bool = False, codebook: str = "gaussian-lloyd-tree", v_run: int = 1) -> list[Row]:
    """Every system of ``systems`` (default: all) on every shape, SDPA first; the Triton readers with ``config``.
    One system's failure is logged and reported, and the others still run."""
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
        # rotate input sets when one fits in L2 (on the GPU; off it a step runs once, on the host clock)
        n_sets = max(1, min(4, math.ceil(3 * 60e6 / bytes_fp16))) if dev.type == "cuda" else 1
        sets = [synthetic_step(shape, dev, seed, None, codebook=codebook, v_run=v_run)]
        for i in range(1, n_sets):
            sets.append(synthetic_step(shape, dev, seed + i, (sets[0].spec, sets[0].codec)))
        say(f"{name}: data ready in {time.perf_counter() - t0:.1f} s ({n_sets} input sets)")
        codec = sets[0].codec
        scalars = 2.0 * b * hk * t * d
        sdpa_ms = None
        for system in systems:
            try:
                row = time_system(system, shape, sets, codec, reps, check, k_share, scalars, bytes_fp16,
                           config or ReaderConfig(), pages_per_program, timeline)
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


def time_system(system: str, shape: Shape, sets: list[StepData], codec: Codec, reps: int, check: bool,
                k_share: float | None, scalars: float, bytes_fp16: float, config: ReaderConfig,
                pages_per_program: int | None = None, timeline: bool = False) -> Row:
    """One system's row on ``shape``: its step timed over ``sets`` (CUDA graphs), its logical and physical read."""
    b, t, hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    dev = sets[0].q.device
    info: dict[str, Any] = {}
    if system == "sdpa":
        qs = [s.q[:, :, None, :] for s in sets]
        steps = [lambda s=s, q=q: torch.nn.functional.scaled_dot_product_attention(q, s.k, s.v, enable_gqa=True)
                 for s, q in zip(sets, qs, strict=False)]
        ms, graphs = time_graphs(steps, reps)
        if timeline and graphs:
            info["timeline"] = timeline_or_error(graphs[0])
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
        ms, _ = time_graphs(steps, reps)
        phys = bytes_fp16 / 2 + 4.0 * b * hq * plan["S"] * (d + 2) * 2
        return Row(shape.name, system, ms, None, 8.0, bytes_fp16 / 2, phys, phys / (bytes_fp16 / 2),
                   phys / ms / 1e9, info)
    if system == "full4":
        reader = TritonReader(codec, fixed_depth=4, config=config)
    else:
        pol = policy_of(system, k_share)
        if pol is None:
            raise ValueError(f"unknown system {system}")
        reader = TritonReader(codec, pol, config=config)
    plan = reader.plan(b, t, dev, pages_per_program=pages_per_program)
    s0 = sets[0]
    if check:
        info.update(check_against_reference(reader, plan, s0, codec))
    steps = [lambda s=s: reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)
             for s in sets]
    ms, graphs = time_graphs(steps, reps)
    if timeline and graphs:
        info["timeline"] = timeline_or_error(graphs[0])
    reader.run(plan, s0.q, s0.cache.k_pool[0], s0.cache.v_pool[0], s0.page_table, s0.lengths, 0)
    sync(dev)
    st = reader.stats(plan, s0.lengths)
    logical_bits = float(st.total_bits.sum())
    phys = readkv_physical(plan, reader, s0.lengths, s0.spec)
    return Row(shape.name, system, ms, None, logical_bits / scalars, logical_bits / 8, phys,
               phys / (logical_bits / 8), phys / ms / 1e9, info)


def check_against_reference(reader: TritonReader, plan: Plan, s: StepData, codec: Codec,
                            n_seq: int = 2) -> dict[str, Any]:
    """Triton reader vs the reference reader (torch, same device) on the first sequences."""
    out = reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0).clone()
    sync(out.device)
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
