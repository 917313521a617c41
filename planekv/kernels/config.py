"""The Triton reader's settings: one frozen, validated :class:`ReaderConfig`, and the choices of one step shape.

Every field has a default and a one-line reason. A field left at ``"auto"`` is decided per step shape when a
plan is made, by :func:`resolve`, from rules measured on an H200 (docs/KERNELS.md gives the measurements);
the result is a :class:`StepChoices` that the plan carries. ``TritonReader.run`` reads only those choices:
nothing is chosen or checked mid-step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

AUTO = "auto"
ASSEMBLIES = ("fma", "transpose")
VALUE_ALLOCS = ("two-pass", "radix")
KEY_WALKS = ("by-depth", "by-channel")

# Constants of the step that no option changes (each measured best of its alternatives; docs/KERNELS.md)
FMA_MAX_GROUP = 8  # query heads per KV head the FMA stages hold accumulators for
INT8_KEY_PAGES = 4  # 64-token pages (warps) per program of the int8 Key stage
FMA_KEY_TOKENS = 1024  # tokens per FMA Key-stage program (128 in small steps)
BLOCK_TOKENS = 1024  # tokens per Value-pass program (256 in small steps)
HIST_SAMPLE = 16  # the two-pass allocation's histogram counts 1 in this many tokens
KEY_CHANNELS = 4  # channels the FMA Key stage decodes at a time in small steps (one in large ones)


@dataclass(frozen=True)
class ReaderConfig:
    """How the Triton reader runs a decode step. Frozen; checked when made. Options that change results are in
    ``ReadPolicy`` and ``FormatSpec``: every setting here gives the same depths and outputs."""

    # fma: CUDA cores, one accumulator per query head (<= 8 per KV head); transpose: fp16 MMAs of table
    # values over bit-transposed codes (any group). auto: fma where it fits (faster wherever both run)
    assembly: str = AUTO
    # the int8 bit-product Key stage for linear codebooks on CUDA: faster at every geometry measured
    key_int8: bool = True
    # the int8 bit-product Value stage for linear codebooks on CUDA; auto: head_dim >= 128 in large steps
    # (slower at d = 64 and in small steps)
    value_int8: bool | str = AUTO
    # the Value stage over a block's tokens of depth > 0 only; auto: always on the FMA stages, on the MMA
    # stages where most tokens are not read (mean Value depth <= 1 plane, or d >= 256, no minimum depth)
    compact_values: bool | str = AUTO
    # the query / output transforms inside _prep / _combine instead of a copy and two GEMMs; auto: head_dim
    # <= 128 (a [16, 256] x [256, 256] product per program is slower than the GEMM)
    fuse_transforms: bool | str = AUTO
    # lambda of the Value allocation: "two-pass" (a sampled bracket and one exact pass; the radix passes
    # only where it overflows or misses) or "radix" (8 passes); auto: two-pass from 2^19 (sequence, KV
    # head, token) triples (slower in launch-bound small steps)
    value_alloc: str = AUTO
    # lambda of the Key allocation by 8 radix passes (True) or a 32-step bisection (False); auto: radix for
    # groups of <= 2048 keys
    prep_radix: bool | str = AUTO
    # the FMA Key stage's channel walk: by-depth segments (hides latency) or by-channel (shares L1 lines);
    # auto: by-channel from 2^18 triples, by-depth below and for the Full Reader
    key_walk: str = AUTO
    # candidate keys kept per allocation group (a power of two >= 2); auto: 65536, fewer for smaller groups
    cand_cap: int | str = AUTO
    # candidates per program of the split exact pass (a power of two; 0: one program per group); auto:
    # 4096 where that makes at most 4 programs per SM (few groups with many candidates)
    exact_split: int | str = AUTO
    # keys the split exact pass keeps for its last program; above that it counts over every candidate
    exact_keep: int = 4096
    # the sampled bracket's widening per side: this share of the count, plus sample_z standard deviations
    # of the sample's estimate (a group whose bracket misses takes the radix passes: exact either way)
    sample_slack: float = 0.02
    sample_z: float = 2.0
    # programs per (sequence, KV head) of a gated radix pass: 1 is cheaper when no group falls back but
    # about 4x slower for a group that does
    gated_splits: int = 4
    # warps of the Key and Value stage programs (FMA and MMA), the tie counts and Key refinement
    num_warps: int = 4
    # warps of the per-block Value allocation kernels; auto: 8 below 2^22 triples, 4 from there (fewer
    # instructions per token in the block-wide sums)
    alloc_warps: int | str = AUTO
    # the step as this many batch parts, each on a CUDA stream of its own, so that one part's latency-bound
    # per-group kernels overlap the others' bandwidth-bound stages: not yet measured, so off
    batch_streams: int = 1
    # with batch parts, the earlier parts' streams rank higher (their small kernels are dispatched first)
    stream_priority: bool = True

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, want: str) -> None:
            if not ok:
                raise ValueError(f"ReaderConfig.{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def pow2(v: int) -> bool:
            return v > 0 and v & (v - 1) == 0

        check(self.assembly in (AUTO, *ASSEMBLIES), "assembly", f"'auto' or one of {ASSEMBLIES}")
        check(isinstance(self.key_int8, bool), "key_int8", "a bool")
        for name in ("value_int8", "compact_values", "fuse_transforms", "prep_radix"):
            check(getattr(self, name) == AUTO or isinstance(getattr(self, name), bool), name, "'auto' or a bool")
        check(self.value_alloc in (AUTO, *VALUE_ALLOCS), "value_alloc", f"'auto' or one of {VALUE_ALLOCS}")
        check(self.key_walk in (AUTO, *KEY_WALKS), "key_walk", f"'auto' or one of {KEY_WALKS}")
        check(self.cand_cap == AUTO or is_int(self.cand_cap) and self.cand_cap >= 2 and pow2(self.cand_cap),
              "cand_cap", "'auto' or a power of two >= 2")
        split = self.exact_split
        check(split == AUTO or is_int(split) and (split == 0 or pow2(split)), "exact_split",
              "'auto', 0 or a power of two")
        check(is_int(self.exact_keep) and self.exact_keep >= 1, "exact_keep", "an int >= 1")
        check(isinstance(self.sample_slack, (int, float)) and math.isfinite(self.sample_slack), "sample_slack",
              "a finite number")
        check(isinstance(self.sample_z, (int, float)) and math.isfinite(self.sample_z) and self.sample_z >= 0,
              "sample_z", "a finite number >= 0")
        check(is_int(self.gated_splits) and self.gated_splits >= 1, "gated_splits", "an int >= 1")
        check(self.num_warps in (1, 2, 4, 8, 16), "num_warps", "a power of two in 1..16")
        check(self.alloc_warps == AUTO or self.alloc_warps in (1, 2, 4, 8, 16), "alloc_warps",
              "'auto' or a power of two in 1..16")
        check(is_int(self.batch_streams) and self.batch_streams >= 1, "batch_streams", "an int >= 1")
        check(isinstance(self.stream_priority, bool), "stream_priority", "a bool")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Target:
    """The device a plan is made for, as the choices see it."""

    cuda: bool
    sms: int  # streaming multiprocessors (132 on an H200; the same figure off the GPU, so that Triton's
    #          interpreter plans what the GPU would)


def target_of(device: torch.device) -> Target:
    if device.type == "cuda":
        return Target(True, torch.cuda.get_device_properties(device).multi_processor_count)
    return Target(False, 132)


@dataclass(frozen=True)
class ReadShape:
    """What the choices depend on from the format and the read policy (fixed for a reader)."""

    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    width: int
    page_size: int
    linear: bool  # a codebook linear in the planes (the int8 stages can run)
    fixed_depth: int  # the Full Reader's depth (0: ReadKV's allocation)
    min_depth_v: int
    mean_value_depth: float  # planes per token the Value budget buys on average
    budget_heads: int  # KV heads whose budgets are pooled (the allocation group's heads)
    value_steps: int  # steps per token of the Value allocation (KS)
    key_keys: int  # keys per channel of the Key allocation, padded to a power of two (KS_PAD)

    @property
    def group_size(self) -> int:
        return self.n_q_heads // self.n_kv_heads


@dataclass(frozen=True)
class StepChoices:
    """Everything decided for one step shape: which kernel runs each stage and with what launch sizes."""

    small: bool  # fewer than two 1024-token programs per SM: smaller programs, latency-hiding forms
    key_stage: str  # "fma", "int8" or "transpose"
    value_stage: str  # "fma", "int8", "compact" (MMA, compacting) or "tile" (MMA, every position)
    pages_per_program: int  # pages per Key-stage program of the FMA / MMA stages
    key_pages: int  # pages per Key-stage split (the int8 stage's INT8_KEY_PAGES, else pages_per_program)
    block_tokens: int  # tokens per Value-pass program
    key_walk: int  # the FMA Key stage's walk: 0 by depth, 1 by channel
    key_channels: int  # channels the FMA Key stage decodes at a time
    prep_radix: bool
    fuse_transforms: bool
    compact: bool  # the Value stage walks only tokens of depth > 0 (listed by _value_order on the FMA / int8 stages)
    two_pass: bool
    alloc_warps: int
    sample: int  # the two-pass histogram counts 1 in this many tokens (1: no two-pass allocation)
    cand_cap: int
    exact_chunk: int  # candidates per program of the split exact pass (0: one program per group)
    key_int8_maxnreg: int | None  # register cap of the int8 Key stage
    key_int8_vector_store: bool  # its logits as two 16-byte stores per lane (rows of a multiple of 8)
    value_int8_pair: bool  # the int8 Value stage's planes two at a time
    value_int8_pipelined: bool  # its software-pipelined loop
    value_int8_maxnreg: int | None
    value_transposing: bool  # the MMA Value stages assemble codes by bit transposes (else bit-serially: d < 256)

    @property
    def value_order(self) -> bool:
        """Whether ``_value_order`` lists each block's tokens of depth > 0 before the Value stage."""
        return self.compact and self.value_stage in ("fma", "int8")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def resolve_assembly(cfg: ReaderConfig, shape: ReadShape) -> str:
    """The stages' assembly for a format (fixed for a reader); FMA refused for groups over FMA_MAX_GROUP."""
    if cfg.assembly == AUTO:
        return "fma" if shape.group_size <= FMA_MAX_GROUP else "transpose"
    if cfg.assembly == "fma" and shape.group_size > FMA_MAX_GROUP:
        raise ValueError(f"the FMA stages handle up to {FMA_MAX_GROUP} query heads per KV head, got "
                         f"{shape.group_size}; use assembly='transpose'")
    return cfg.assembly


def resolve_compact(cfg: ReaderConfig, shape: ReadShape, assembly: str) -> bool:
    """Whether the Value stage compacts (never for the Full Reader, whose tokens all have one depth)."""
    if shape.fixed_depth:
        return False
    if cfg.compact_values != AUTO:
        return bool(cfg.compact_values)
    return assembly == "fma" or (shape.min_depth_v == 0 and (shape.mean_value_depth <= 1.0 or shape.head_dim >= 256))


def resolve(cfg: ReaderConfig, shape: ReadShape, batch: int, max_tokens: int, target: Target,
            pages_per_program: int | None = None, block_tokens: int | None = None) -> StepChoices:
    """The choices of a step of ``batch`` sequences of at most ``max_tokens`` tokens on ``target``.
    ``pages_per_program`` / ``block_tokens`` override the Key- and Value-program sizes."""
    hk, d, w, p, g = shape.n_kv_heads, shape.head_dim, shape.width, shape.page_size, shape.group_size
    triples = batch * hk * max_tokens  # (sequence, KV head, token)
    assembly = resolve_assembly(cfg, shape)
    compact = resolve_compact(cfg, shape, assembly)
    small = batch * hk * math.ceil(max_tokens / FMA_KEY_TOKENS) < 2 * target.sms
    if pages_per_program is None:
        pages_per_program = max(1, (128 if small else FMA_KEY_TOKENS) // p) if assembly == "fma" else 4
    if block_tokens is None:
        block_tokens = max(p, 256) if small else BLOCK_TOKENS
    if pages_per_program < 1 or pages_per_program & (pages_per_program - 1):
        raise ValueError(f"pages_per_program must be a power of two >= 1, got {pages_per_program}")
    if block_tokens < p or block_tokens % p:
        raise ValueError(f"block_tokens must be a positive multiple of the page size {p}, got {block_tokens}")
    if compact and block_tokens > 2048:
        raise ValueError(f"block_tokens must be <= 2048 with compacted Values (11-bit positions), got {block_tokens}")

    gpu_linear = target.cuda and shape.linear and assembly == "fma" and not shape.fixed_depth
    key_int8 = (cfg.key_int8 and gpu_linear and p == 64 and g <= 4 and d * w % 32 == 0)
    value_int8 = (cfg.value_int8 is not False and gpu_linear and compact and g <= 4 and d % 64 == 0 and w <= 8
                  and (cfg.value_int8 is True or d >= 128 and not small))
    if assembly == "transpose":
        rows = pages_per_program * p // 8  # the transposing Key stage's tile: the MMA's minimum, the registers' limit
        if not 16 <= rows <= 64 or rows & (rows - 1):
            raise ValueError(f"the transposing Key stage needs pages_per_program x page_size / 8 to be 16, 32 or 64 "
                             f"rows, got {pages_per_program} x {p} / 8 = {rows}")
    key_stage = "int8" if key_int8 else assembly
    value_stage = "int8" if value_int8 else "fma" if assembly == "fma" else "compact" if compact else "tile"
    key_pages = INT8_KEY_PAGES if key_int8 else pages_per_program

    if cfg.key_walk != AUTO:
        key_walk = KEY_WALKS.index(cfg.key_walk)
    else:
        key_walk = 0 if shape.fixed_depth or triples < 1 << 18 else 1
    key_channels = 1  # up to KEY_CHANNELS at a time, as many as fill KEY_CHANNELS warps with token rows
    if small and key_walk == 0 and assembly == "fma":
        key_channels = max(1, min(KEY_CHANNELS, 32 * KEY_CHANNELS // (pages_per_program * p // 8)))

    if cfg.prep_radix != AUTO:
        prep_radix = bool(cfg.prep_radix)
    else:
        prep_radix = shape.key_keys * _next_pow2(shape.budget_heads) * d <= 2048
    fuse = d <= 128 if cfg.fuse_transforms == AUTO else bool(cfg.fuse_transforms)
    if shape.fixed_depth:
        two_pass = False
    elif cfg.value_alloc == AUTO:
        two_pass = triples >= 1 << 19
    else:
        two_pass = cfg.value_alloc == "two-pass"
    alloc_warps = (4 if triples >= 1 << 22 else 8) if cfg.alloc_warps == AUTO else int(cfg.alloc_warps)
    # 1 in HIST_SAMPLE tokens, at most one run of 8 per block
    sample = min(HIST_SAMPLE, block_tokens // 8) if two_pass else 1
    if cfg.cand_cap != AUTO:
        cand_cap = int(cfg.cand_cap)
    else:
        cand_cap = max(16, min(65536, _next_pow2(shape.value_steps * shape.budget_heads * max_tokens)))
    groups = batch * hk // shape.budget_heads
    if not two_pass:
        exact_chunk = 0
    elif cfg.exact_split == AUTO:
        exact_chunk = min(4096, cand_cap) if groups * max(1, cand_cap // 4096) <= 4 * target.sms else 0
    else:
        exact_chunk = min(int(cfg.exact_split), cand_cap)

    n_splits = math.ceil(math.ceil(max_tokens / p) / key_pages)
    n_programs = batch * hk * n_splits
    # a 64-register cap (8 programs per SM instead of 7) where the grid is between one and eight such waves
    key_maxnreg = 64 if key_int8 and target.cuda and target.sms * 7 < n_programs <= target.sms * 8 * 8 else None
    pipelined = w % 4 == 0 and w <= 12
    return StepChoices(
        small=small, key_stage=key_stage, value_stage=value_stage, pages_per_program=pages_per_program,
        key_pages=key_pages, block_tokens=block_tokens, key_walk=key_walk, key_channels=key_channels,
        prep_radix=prep_radix, fuse_transforms=fuse, compact=compact, two_pass=two_pass, alloc_warps=alloc_warps,
        sample=sample, cand_cap=cand_cap, exact_chunk=exact_chunk, key_int8_maxnreg=key_maxnreg,
        key_int8_vector_store=max_tokens % 8 == 0, value_int8_pair=d >= 256 and w % 2 == 0 and not pipelined,
        value_int8_pipelined=pipelined, value_int8_maxnreg=200 if pipelined else 128,
        value_transposing=d >= 256,
    )
