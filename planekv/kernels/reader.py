"""TritonReader: the two-stage decode read as a plan/run pair (FlashInfer's split).

``plan(batch, max_tokens)`` sizes every buffer once for a step shape; ``run(...)`` is a fixed
launch sequence that allocates nothing, reads lengths and page tables from device tensors, and can
be captured in a CUDA graph (decode appends only change device data).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from ..kvstore import Codec, PlaneKVCache, ReadPolicy, ReadStats, UniformLinearTree
from ..kvstore.accounting import two_stage_workspace_bytes
from ..kvstore.allocate import step_gains
from ..kvstore.format import FormatSpec
from ..kvstore.planes import v_page_shape
from ._dispatch import check_device
from .alloc2 import _v_bracket, _v_cand, _v_exact, _v_exact_split, _value_sample
from .decode import (
    CMETA_WORDS,
    HIST_STRIDE,
    IH_BINS,
    KSEG_WORDS,
    NPASS,
    _combine,
    _key_stage,
    _key_stage_f,
    _key_stage_t8,
    _prep,
    _radix_select,
    _value_hist,
    _value_order,
    _value_radix,
    _value_stage,
    _value_stage_c,
    _value_stage_f,
    _value_ties,
    next_pow2,
)
from .linear import (
    MMA_BITS,
    _key_stage_imma,
    _key_stage_mma,
    _lin_prep,
    _lin_prep_i8,
    _value_stage_imma,
    _value_stage_mma,
    linear_tables,
    value_scale,
)
from .refine import (
    HIST_STRIDE_R,
    RSEL_STRIDE,
    _key_refine_f,
    _key_restat,
    _refine_order,
    _refine_radix,
    _refine_score,
    _refine_select,
    _refine_ties,
)

GATED_SPLITS = 4  # programs per (sequence, KV head) of a gated radix pass (they stride over the blocks)


def spread_table() -> torch.Tensor:
    """SPREAD[b] (int64): bit k of the byte b moved to bit 8k."""
    b = torch.arange(256, dtype=torch.int64)
    out = torch.zeros(256, dtype=torch.int64)
    for k in range(8):
        out |= ((b >> k) & 1) << (8 * k)
    return out


def packed_table(codec: Codec) -> torch.Tensor:
    """Reconstruction table [(W + 1) * 2**W] as int32 words: fp16(L) in the low half, fp16(L - fp16(L))
    in the high half, so z = hi + lo is L to about 2^-22."""
    t = codec.tree.table().reshape(-1).double()
    hi = t.half()
    lo = (t - hi.double()).half()
    return (hi.view(torch.int16).to(torch.int32) & 0xFFFF) | (lo.view(torch.int16).to(torch.int32) << 16)


def reversed_table(codec: Codec) -> torch.Tensor:
    """:func:`packed_table` indexed by bit-reversed codes: entry [t, c'] is entry [t, rev_W(c')].
    The transposing Key stage assembles codes with plane j at bit j (the stored code has it at bit
    W - 1 - j)."""
    w = codec.width
    return packed_table(codec).reshape(w + 1, 1 << w)[:, _bit_reversal(w)].reshape(-1).contiguous()


def _bit_reversal(w: int) -> torch.Tensor:
    """rev_W(c) for every W-bit code c."""
    c = torch.arange(1 << w)
    rev = torch.zeros_like(c)
    for j in range(w):
        rev |= ((c >> j) & 1) << (w - 1 - j)
    return rev


def reversed_table_f32(codec: Codec) -> torch.Tensor:
    """The reconstruction table in float32, indexed by bit-reversed codes (entry [t, c'] is the
    tree's value for depth t and code rev_W(c')): the FMA Key stage's table."""
    w = codec.width
    return codec.tree.table().float().reshape(w + 1, 1 << w)[:, _bit_reversal(w)].reshape(-1).contiguous()


# How lambda of the Value allocation is found: "two-pass" (an importance histogram brackets it, one
# exact pass over the keys in the bracket; the radix passes only for groups whose bracket overflows)
# or "radix" (8 radix passes of 4 bits); None picks by the step's size. docs/KERNEL_NOTES.md runs 33-34.
VALUE_ALLOC = ("two-pass", "radix")

# How the Key and Value stages decode planes: "fma" (on the CUDA cores, float32 table and FMAs, one row
# of 8 tokens or one token's 8 channels per thread), "transpose" (word-level bit transposition feeding
# MMAs), "serial" (bit-serial assembly feeding MMAs).
ASSEMBLY = ("transpose", "serial", "fma")

# warps (64-token pages) per program of the bit-product Key stage (KERNEL_NOTES run 46: 8 with a
# two-step prefetch measured fastest)
MMA_WARPS = 8
# the int8 Value stage's register cap per form (vimma_prefetch 0, 1, 2) under value_maxnreg="auto" (None: none)
VALUE_MAXNREG = (128, None, 200)
KEY_BITS = ("shifted", "in-place", "int8")  # TritonReader.key_bits
VALUE_BITS = (*MMA_BITS, "int8")  # TritonReader.value_bits


@dataclass
class Plan:
    """Buffers and launch constants of one step shape (all on one device)."""

    batch: int
    max_tokens: int
    n_splits: int  # Key-stage programs per (sequence, KV head): PPK pages each
    n_blocks: int  # Value-stage programs per (sequence, KV head): BLK tokens each
    device: torch.device
    qbuf: torch.Tensor  # [B, Hq, d] f32: queries copied in
    qt: torch.Tensor  # [B, Hq, d] f32: q~
    w_hi: torch.Tensor  # [B, Hq, d] f16: q~ * sigma_K, high half
    w_lo: torch.Tensor  # [B, Hq, d] f16: low half
    wf: torch.Tensor  # [B, Hkv, d, G] f32: q~ * sigma_K, a channel's G query heads side by side
    base: torch.Tensor  # [B, Hq] f32: q~ . mu_K
    kdep: torch.Tensor  # [B, Hkv, d] i32: Key channel depths
    kord: torch.Tensor  # [B, Hkv, d] i32: channels of depth > 0 (depth << 8 | channel); order: key_loop
    kcnt: torch.Tensor  # [B * Hkv, KSEG_WORDS] i32: [0] how many, [t] how many of depth t
    logits: torch.Tensor  # [B, Hq, T] f32 (scaled)
    mstat: torch.Tensor  # [B, Hq, S] f32
    sstat: torch.Tensor  # [B, Hq, S] f32
    vimp: torch.Tensor  # [B, Hkv, T] f32: Value importance
    vdep: torch.Tensor  # [B, Hkv, T] i8: Value token depths
    vord: torch.Tensor  # [B, Hkv, T] i16: per block, its tokens of depth > 0 in position order (compaction)
    vcnt: torch.Tensor  # [B, Hkv, NBLK] i32: how many (the FMA Value stage)
    hist: torch.Tensor  # [groups, HIST_STRIDE] i32: radix histograms
    ties: torch.Tensor  # [groups, HG * NBLK, KS_PAD] i32
    part: torch.Tensor  # [B, Hq, NBLK, d] f32: per-block weighted sums
    out_t: torch.Tensor  # [B, Hq, d] f32: output in the V-transformed domain
    out: torch.Tensor  # [B, Hq, d] f32
    # Key refinement (one-element placeholders without it); its keys live in vimp, which the Value
    # allocation writes only after the refinement is done
    rhist: torch.Tensor  # [groups, HG_PAD * NPASS * NBINS] i32: per-head radix histograms
    rsel: torch.Tensor  # [groups, RSEL_STRIDE] i64: prefix and bits left after each pass
    rtie: torch.Tensor  # [groups, HG * NBLK] i32: keys at lambda per block
    rcnt: torch.Tensor  # [B, Hkv, NBLK] i32: chosen tokens per block
    rord: torch.Tensor  # [B, Hkv, T] i16: per block, the chosen tokens' positions in it (the first rcnt)
    rcost: torch.Tensor  # [B * Hkv] i32: bits to refine one token of the head
    # two-pass Value allocation (one-element placeholders without it)
    two_pass: bool
    ihist: torch.Tensor  # [groups, (HG + 1) IH_BINS] i32: importance histogram per head, suffix sums
    # [groups, CMETA_WORDS] i32: lo, hi, candidates, keys above hi, fall back (overflow or miss), keys at
    # lambda ranked, the candidates' histogram's bin shift, the split exact pass's kept keys and arrivals
    cmeta: torch.Tensor
    cand: torch.Tensor  # [groups, cap] i32: candidate keys
    cbins: torch.Tensor  # [groups, exact_bins] i32: the candidates' histogram over the bracket
    key_loop: int = 0  # the FMA Key stage's channel walk (TritonReader._key_loop)
    key_ch: int = 1  # channels a Key-stage program decodes at a time (4 for small steps, segment walk)
    # the bit-product Key stage (linear codebooks on the GPU, TritonReader.key_mma; one-element
    # placeholders without it): per (sequence, KV head) its steps of 16 pairs in fragment order
    key_mma: bool = False
    lin_off: torch.Tensor | None = None  # [B*Hkv, SMAX, 16] i32: byte offsets
    lin_v: torch.Tensor | None = None  # [B*Hkv, SMAX, 128] f16: 2^7 V hi / lo
    lin_steps: torch.Tensor | None = None  # [B*Hkv] i32
    lin_base: torch.Tensor | None = None  # [B, Hq] f32: base'
    lin_scale: torch.Tensor | None = None  # [B, Hq] f32: the int8 digits' scale (key_bits="int8")
    key_int8: bool = False  # the bit-product Key stage on int8 tensor cores (key_bits="int8" when planned)
    mma_pages: int = 0  # pages per bit-product Key-stage program (the splits are that many pages)
    # the bit-product Value stage (linear codebooks on the GPU, TritonReader.value_mma): vord lists each
    # block's tokens deepest first
    value_mma: bool = False
    vsort: bool = False  # _value_order lists deepest first (set with value_mma)
    ckeep: torch.Tensor | None = None  # [groups, keep] i32: lambda's bin's candidates (the split exact pass)
    exact_chunk: int = 0  # candidates per program of the split exact pass (0: one program per group)
    pages_per_program: int = 1  # pages per Key-stage program (FMA and transposing Key stages)
    block_tokens: int = 1024  # tokens per Value-pass program
    # TritonReader.batch_streams > 1: the step as batch parts (plans over views of these buffers, rows
    # part_starts[i]...), each on a stream of its own between a fork and a join event (CUDA only; off the
    # GPU the parts run one after the other)
    parts: tuple[Plan, ...] = ()
    part_starts: tuple[int, ...] = ()
    streams: tuple[torch.cuda.Stream, ...] = ()
    events: tuple[torch.cuda.Event, ...] = ()

    @property
    def split_pages(self) -> int:
        """Pages per Key-stage split (program): the bit-product stage's ``mma_pages``, else ``pages_per_program``."""
        return self.mma_pages if self.key_mma else self.pages_per_program

    def batch_part(self, b0: int, b1: int) -> Plan:
        """The plan of sequences b0..b1-1 over views of this plan's buffers: every buffer is batch-major
        (its first dimension B, B*Hkv or the B*Hkv/HG groups, a group never spanning two sequences), so
        rows b0*f..b1*f of one with f rows per sequence; one-element placeholders are shared."""
        if not 0 <= b0 < b1 <= self.batch:
            raise ValueError(f"batch part [{b0}, {b1}) outside the plan's batch {self.batch}")
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.shape[0] >= self.batch and v.shape[0] % self.batch == 0:
                per = v.shape[0] // self.batch
                v = v[b0 * per: b1 * per]
            kw[f.name] = v
        kw.update(batch=b1 - b0, parts=(), part_starts=(), streams=(), events=())
        return Plan(**kw)

    def workspace_bytes(self) -> int:
        """Bytes of every temporary buffer (not the output)."""
        bufs = (self.qbuf, self.qt, self.w_hi, self.w_lo, self.wf, self.base, self.kdep, self.kord, self.kcnt,
                self.logits, self.mstat, self.sstat,
                self.vimp, self.vdep, self.vord, self.vcnt, self.hist, self.ties, self.part, self.out_t,
                self.rhist, self.rsel, self.rtie, self.rcnt, self.rord, self.rcost, self.ihist, self.cmeta, self.cand,
                self.cbins, self.ckeep,
                self.lin_off, self.lin_v, self.lin_steps, self.lin_base, self.lin_scale)
        return sum(t.numel() * t.element_size() for t in bufs if t is not None)


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200; also the figure off the GPU, so
    that the interpreter plans what the GPU would)."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).multi_processor_count
    return 132


def check_v_pool(v_pool: torch.Tensor, spec: FormatSpec) -> None:
    """Refuse a V pool whose page shape is not the format's: [pages, W, P, d/8], or [pages, W/g, P, g, d/8]
    with ``spec.v_run`` = g > 1."""
    want = v_page_shape(spec)
    if tuple(v_pool.shape[1:]) != want:
        raise ValueError(f"v_pool must be [pages, {', '.join(map(str, want))}] for this format (v_run = {spec.v_run}), "
                         f"got {tuple(v_pool.shape)}")


class TritonReader:
    """Two-stage ReadKV decode on the GPU (or Triton's interpreter on CPU tensors).

    Both readers: the flexible one (pooled budgets, depth 0, tuned split; the default) and the
    constrained one (per-head budgets, minimum depth 1, Value packets); either with the third stage,
    Key refinement (``ReadPolicy.key_refine`` at token granularity, FMA stages only).
    """

    def __init__(self, codec: Codec, policy: ReadPolicy | None = None, num_warps: int = 4,
                 fixed_depth: int = 0, assembly: str | None = None, compact_values: bool | None = None,
                 value_alloc: str | None = None, cand_cap: int | None = None, alloc_warps: int | None = None,
                 key_loop: int | None = None) -> None:
        if assembly is None:  # the FMA stages, which hold one accumulator per query head of a group (<= 8)
            assembly = "fma" if codec.spec.group_size <= 8 else "transpose"
        if assembly not in ASSEMBLY:
            raise ValueError(f"assembly must be one of {ASSEMBLY}, got {assembly!r}")
        if assembly == "fma" and codec.spec.group_size > 8:
            raise ValueError(f"the FMA Key stage handles up to 8 query heads per KV head, got {codec.spec.group_size}")
        if value_alloc is not None and value_alloc not in VALUE_ALLOC:
            raise ValueError(f"value_alloc must be one of {VALUE_ALLOC}, got {value_alloc!r}")
        if cand_cap is not None and (cand_cap < 2 or cand_cap & (cand_cap - 1)):
            raise ValueError(f"cand_cap must be a power of two >= 2, got {cand_cap}")
        self.codec = codec
        self.assembly = assembly
        self.value_alloc = value_alloc
        self._cand_cap = cand_cap
        self.fixed_depth = fixed_depth
        if fixed_depth:
            # Full Reader: every K channel and V token at one depth, read fully; no allocation.
            policy = ReadPolicy(width=codec.width, rate=float(fixed_depth), min_depth_k=fixed_depth,
                                min_depth_v=fixed_depth, pool_heads=False, reader="constrained")
        self.policy = policy or ReadPolicy.flexible(4.0)
        spec = codec.spec
        if self.policy.width != spec.width:
            raise ValueError(f"policy width {self.policy.width} != stored width {spec.width}")
        if spec.head_dim % 32 or spec.head_dim & (spec.head_dim - 1):
            raise ValueError(f"Triton reader needs a power-of-two head dim >= 32, got {spec.head_dim}")
        if spec.page_size % 32:
            raise ValueError("page size must be a multiple of 32")
        self.num_warps = num_warps
        if alloc_warps not in (None, 1, 2, 4, 8, 16):
            raise ValueError(f"alloc_warps must be None or a power of two in 1..16, got {alloc_warps}")
        # warps of the per-block Value allocation kernels (importance, candidates, radix passes,
        # compaction) over 1024-token blocks; None: by step size (_alloc_warps)
        self.alloc_warps = alloc_warps
        # the query and output transforms inside _prep and _combine (one group's / head's rows per program, a
        # tf32x3 product: three TF32 MMAs, float32-accurate to ~2^-22) instead of a copy and two GEMMs around
        # the step (three to five launches: cuBLAS adds a split-K reduction to each at small batches). "auto":
        # where head_dim <= 128, the sizes where it measured faster (KERNEL_NOTES run 103: SmolLM2's d=64
        # kernel sum 135 -> 123 us, d=128 B=32 747 -> 743 and B=1 101 -> 98; d=256, a [16, 256] x [256, 256]
        # product per program, 213 -> 240); True, False: always, never
        self.fuse_transforms: bool | str = "auto"
        # the step as this many batch parts, each on a CUDA stream of its own, so that one part's latency-bound
        # per-group kernels (one program per allocation group: ~110 us on 32 SMs at B=32 T=32768) overlap the
        # other parts' bandwidth-bound stages; the same kernels and results per sequence. stream_priority: the
        # earlier parts' streams rank higher (Plan.parts)
        self.batch_streams = 1
        self.stream_priority = True
        self.prep_warps = 8  # warps of _prep (one program per allocation group; 8 measured best, run 36)
        # the Key allocation's lambda in _prep: 1 by 8 radix passes (histograms), 0 by a 32-step bisection,
        # None by the group's key count (_prep_radix)
        self.prep_radix: int | None = None
        # each radix pass's selection run by the group's last program of the pass (no _radix_select
        # launches: 8 fewer per step; KERNEL_NOTES run 39)
        self.fused_select = True
        # small steps (plan: fewer than two 1024-token programs per SM) decode 4 Key channels at a time
        self.key_channels = True
        self.key_ch_max = 4  # at most this many channels at a time (8 measured no faster, run 42)
        # two-pass importance histogram: the bins of a window around each block's mean bin counted in
        # the block first, one atomic add per non-empty bin (0: one atomic add per token). 256 measured
        # best of 0 / 128 / 256 (KERNEL_NOTES run 39: B=32 T=32768 134 -> 101 us)
        self.hist_window = 256
        # the two-pass allocation's bracket from a sample: S > 1 counts 1 in S tokens' importances
        # (_value_sample, runs of 8 every 8 S positions) and _v_cand computes every importance itself (no
        # per-token atomics); the bracket is widened per side by sample_slack x count + sample_z standard
        # deviations of the sample's estimate (_v_bracket), and a group whose bracket misses lambda runs the
        # radix passes (exact either way; run 96: two d=256 groups that missed took them from 8 to 150 us).
        # None: 16 (KERNEL_NOTES run 97, with exact_bins: B=32 T=32768 flexible kernel sum 785 -> 752 us at
        # R=2, 1240 -> 1202 at R=4; run 96: constrained R=2 906 -> 855, d=256 and SmolLM2's geometry 1-15 us
        # less; 1 in 16 at z=2 fell back in none of the 288 distinct group-steps measured, at z=1 with slack 0.01
        # in 8); 0: every token's importance counted (_value_hist)
        self.hist_sample: int | None = None
        self.sample_slack = 0.02
        self.sample_z = 2.0
        # the exact pass's lambda: N > 0 (a power of two >= 16) first finds its bin in a histogram of N bins
        # over the bracket that the candidates pass counts, then bisects among that bin's candidates only, in
        # registers when they are at most 4096 (run 95, full histogram: B=32 T=32768 exact pass 12.8 ->
        # 6.8 us at R=2, 32.5 -> 11.8 at R=4, the candidates pass 5-6 us slower for the counts; run 97:
        # 1024 in registers measured as 4096); 0: a bisection over every candidate for each of the bracket's bits
        self.exact_bins = 4096
        # with exact_bins, the exact pass's scan over the candidates split over programs of this many
        # candidates each (the last of a group's programs to arrive bisects among the kept keys: up to
        # _exact_keep of them, else over every candidate in the bin's range); 0: one program per group;
        # "auto": 4096 where that makes at most 4 programs per SM (few groups, many candidates each), else 0
        # (KERNEL_NOTES run 105: B=32 T=32768 flexible exact pass 24.6 -> 14.3 us at R=2, 48.1 -> 18.4 at R=4;
        # the constrained reader's 256 groups of ~7k candidates 16.1 -> 54.9; 2048 per program slower)
        self.exact_split: int | str = "auto"
        self._exact_keep = 4096
        # warps of the two-pass allocation's per-group kernels (one program per group): _v_bracket 8 where
        # a group pools several KV heads' histograms, else 4 (None; KERNEL_NOTES run 78: B=32 T=32768
        # 17.0 -> 14.3 us, SmolLM2 10.8 -> 10.3; one head (d=256) 8.8 -> 9.3), _v_exact 8 (4 and 16 slower)
        self.bracket_warps: int | None = None
        self.exact_warps = 8
        # warps of _v_exact_split and of _value_sample (KERNEL_NOTES run 113: the split exact pass 14.3 -> 14.0 us
        # at B=32 T=32768, 12.8 -> 11.3 in SmolLM2's geometry and at d=256 with 4 instead of 8, 16 slower; the
        # sample kernel fastest at 4, 2 and 8 slower)
        self.exact_split_warps = 4
        self.sample_warps = 4
        # warps of _combine (one program per (sequence, KV head)): 8 measured faster than 4 everywhere (KERNEL_NOTES
        # run 112: d=256, the output rotated by the GEMM after it, 11.9 -> 4.6 us; B=1 7.2 -> 6.1; B=32 d=128
        # with the rotation inside 12.5 -> 11.9); 2 slower
        self.combine_warps = 8
        # radix-pass histograms: 1 one of 2 x NBINS bins over all steps' keys (masked keys in the upper
        # half, not added), 0 one per step of 1-D keys; both exact on the GPU, 1 faster (KERNEL_NOTES
        # run 41: B=1 T=8192 passes 29.7 -> 25.1 us, pass 1 8.3 -> 5.6 us)
        self.radix_hist = 1
        # the depth-sorted Value list's slots (_value_order SORT): 1 one int64 prefix sum of byte counters
        # along 128-token chunks, 0 two block-wide prefix sums of 16-bit counters; the same slots
        self.order_chunked = 1
        # the two-pass allocation's tie counts only in groups where some keys at lambda are not taken
        # (elsewhere _v_exact moves lambda to lambda - 1 with none left to take: the same depths)
        self.tie_gate = 1
        # programs per (sequence, KV head) of a gated radix pass (they stride over the blocks). 1 makes the eight
        # passes that find nothing to do cheaper (KERNEL_NOTES runs 111-112: B=32 T=32768 15.1 -> 8.5 us, SmolLM2's
        # geometry 11.3 -> 8.5) but a step where a group falls back ~4x slower in them; kept at 4
        self.gated_splits = GATED_SPLITS
        # the Key stage as a product of plane bits for codebooks linear in the planes (planekv.kernels.
        # linear; KERNEL_NOTES run 46): on CUDA devices (inline PTX) with the FMA stages, 64-token pages,
        # up to 4 query heads per KV head; "auto" where it measured faster, True
        # wherever it can run, False never
        self.key_mma: bool | str = "auto"
        # the Value stage as the mirror product (planekv.kernels.linear._value_stage_mma; KERNEL_NOTES
        # run 50): the same conditions as key_mma and the compacting FMA Value stage; "auto", True, False
        self.value_mma: bool | str = "auto"
        # how the bit-product stages turn a plane bit into an MMA operand: an fp16 one (planekv.kernels.
        # linear.MMA_BITS; the Key stage takes 0/1 bits only), or for the Key stage "int8" (the default):
        # bits in place as an unsigned int8 operand against V in three int8 digits, exact int32 sums
        # (_key_stage_imma; KERNEL_NOTES runs 55-56: fewer instructions, B=32 T=32768 Key stage 534 -> 481
        # us at R=2, 808 -> 655 at R=4)
        self.key_bits = "int8"
        # pages (warps) per program of the int8 Key stage: 4 measured faster than 8 (KERNEL_NOTES run 56: B=32
        # T=32768 R=2 493 -> 481 us, R=4 682 -> 655, d=256 126 -> 112 / 188 -> 167)
        self.imma_warps = 4
        # how the int8 Key stage runs ahead of its plane rows: 1 one step, 3 two steps with the loop over pairs
        # of steps (KERNEL_NOTES run 86: B=32 T=32768 Key stage 376 -> 315 us at R=2, 568 -> 466 at R=4; run 85's
        # form 2, two steps by a register rotation, measured as 1 and was removed)
        self.imma_prefetch = 3
        # a register cap for it: "auto" caps at 64 registers (8 programs per SM instead of 7; a few bytes
        # spilled) where the grid is between one and eight such waves, so that the last wave's share counts
        # (run 86: d=256 82 -> 72 us at R=2, 150 -> 114 at R=4, SmolLM2 24.5 -> 23.1 / 34.0 -> 31.6; the
        # B=32 d=128 grid of 32 waves 315 -> 318 / 466 -> 479 with it, B=1 under one wave 7.2 -> 7.5);
        # None: the compiler's choice (72), an int: that cap
        self.imma_maxnreg: int | str | None = "auto"
        # its logits as two 16-byte stores per lane (rows of a multiple of 8 entries; KERNEL_NOTES run 61:
        # B=32 T=32768 R=2 482 -> 410 us); False: eight 4-byte stores
        self.imma_vstore = True
        # the Value stage's operands: "int8" (the default), bits in place against the three bytes of an
        # int32 Y = rint(p w / S), exact int32 sums (_value_stage_imma; KERNEL_NOTES runs 69-71: B=32
        # T=32768 Value stage 270 -> 198 us at R=2, 746 -> 562 at R=4), or fp16 bits ("signed": +1 / -1,
        # "shifted": 0 / 1, "in-place") against p w in fp16 halves (_value_stage_mma)
        self.value_bits = "int8"
        # the int8 Value stage's planes two at a time: "auto" where it measured faster (head_dim >= 256:
        # d=256 R=2 58 -> 52 us, R=4 163 -> 142; head_dim 128 slower: 198 -> 239 us, KERNEL_NOTES run 71)
        self.imma_pair: bool | str = "auto"
        # the int8 Value stage software-pipelined: 1 loads the list entries two steps and the pages and logits one
        # step ahead (the next step's depths carried in one register) and the plane rows four planes at a time; 2
        # (the default) also the next step's first four plane rows a step ahead (own entries three steps and pages
        # two steps ahead); 0: one step's entry -> page / logit -> row chain at a time, a row per plane. B=32
        # T=32768 Value stage, form 0 -> 1 (KERNEL_NOTES run 89): 186 -> 171 us at R=2, 512 -> 457 at R=4; form
        # 1 -> 2 (run 92): 166 -> 153, 442 -> 415; d=256 (run 92) 41 -> 36, 104 -> 85
        self.vimma_prefetch = 2
        # a register cap for the int8 Value stage: "auto" is 128 for form 0 (16 warps per SM; the compiler takes
        # 153: 12; measured faster with the transposed row loads, run 82: R=4 560 -> 493 us), none for form 1 (181
        # registers, 11 warps; capped at 168 / 152 slower, run 89) and 200 for form 2 (10 warps; uncapped 205 and
        # 184 slower, run 92); None: no cap, an int: that cap
        self.value_maxnreg: int | str | None = "auto"
        self._vscale = value_scale(codec.tree) if isinstance(codec.tree, UniformLinearTree) else 1.0
        # max |w_tj|: the int8 Value stage's Y = rint(p w / S) stays within 2^22 with S = p_max wmax / 2^22
        self._wmax = (float(linear_tables(codec.tree)[1].abs().max()) if isinstance(codec.tree, UniformLinearTree)
                      else 1.0)
        if key_loop not in (None, 0, 1):
            raise ValueError(f"key_loop must be None, 0 or 1, got {key_loop!r}")
        # the FMA Key stage's channel walk (None: by step size, see _key_loop)
        self.key_loop: int | None = key_loop
        pol = self.policy
        ref_only = pol.reference_only_options()
        if ref_only:
            raise ValueError(f"the Triton reader does not implement {ref_only} (reference reader only)")
        self.refine = pol.key_refine > 0
        if self.refine and assembly != "fma":
            raise ValueError("Key refinement runs on the FMA stages only (assembly='fma', <= 8 query heads "
                             f"per KV head), got assembly={assembly!r}")
        d, w = spec.head_dim, spec.width
        self.hg = spec.n_kv_heads if pol.pool_heads else 1
        self.bk = pol.key_budget(d)
        # the channel stage's share of B_K (all of it without refinement), as the reference computes it
        self.bk_stage = max(math.floor(self.bk * (1.0 - pol.key_refine)), pol.min_depth_k * d) if self.refine \
            else self.bk
        # Value stage over the tokens of depth > 0 only, sorted by depth (never for the Full Reader,
        # whose tokens all have one depth). None = measured choice (runs 18-19, docs/KERNEL_NOTES.md):
        # gathering pays where most tokens are not read (mean Value depth <= 1 plane, no minimum
        # depth) and at d >= 256, whose 32-byte token rows keep the gathers sector-efficient.
        # (explicit budgets: the mean depth depends on T, so the tile path)
        # The FMA Value stage decodes one token per thread: compaction costs one prefix sum per block
        # and paid for every policy measured (run 25, docs/KERNEL_NOTES.md), so it always compacts.
        mean_v = (2 * d * pol.rate - self.bk) / d if pol.rate is not None else float(w)
        auto = assembly == "fma" or (pol.min_depth_v == 0 and (mean_v <= 1.0 or d >= 256))
        self.compact_values = (auto if compact_values is None else compact_values) and not fixed_depth
        if self.bk < pol.min_depth_k * d:
            raise ValueError(f"Key budget {self.bk} below the minimum depth {pol.min_depth_k} x {d}")
        n_items = self.hg * d
        ks_k = w - pol.min_depth_k
        self.count_k = max(0, min(self.bk_stage * self.hg - pol.min_depth_k * n_items, ks_k * n_items))
        dist = codec.tree.distortion
        rk = step_gains(dist, w, pol.min_depth_k, 1)
        rv = step_gains(dist, w, pol.min_depth_v, pol.v_packet)
        self.ks_k, self.ks_v = len(rk), len(rv)
        self.kspad_k, self.kspad_v = next_pow2(max(1, len(rk))), next_pow2(max(1, len(rv)))
        self._rk = torch.zeros(self.kspad_k, dtype=torch.float32)
        self._rk[: len(rk)] = torch.tensor(rk, dtype=torch.float32)
        self._rv = torch.zeros(self.kspad_v, dtype=torch.float32)
        self._rv[: len(rv)] = torch.tensor(rv, dtype=torch.float32)
        c = codec.calibration
        self._consts_cpu = {
            "mu_k": c.mu_k, "sig_k": c.sigma_k, "mu_v": c.mu_v, "sig_v": c.sigma_v,
            "mkT": codec.rot_k.matrix.T.float().contiguous(), "mv": codec.rot_v.matrix.float().contiguous(),
            "tab2": packed_table(codec), "tabr": reversed_table(codec), "spread": spread_table(),
            "tabf": reversed_table_f32(codec), **self._linear_consts(codec),
            "tabw": codec.tree.table().float()[codec.width].contiguous(),  # depth W, stored code order
            "dist": torch.tensor(codec.tree.distortion, dtype=torch.float32),
            "rk": self._rk, "rv": self._rv,
            "hw": (c.sigma_v * c.sigma_v).sum(-1).contiguous(),  # [L, Hkv] for value_head_weight
        }
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}
        self._plan_cache: dict[tuple[int, torch.device], Plan] = {}

    @staticmethod
    def _linear_consts(codec: Codec) -> dict[str, torch.Tensor]:
        """A linear codebook's a_t and w_tj for ``_lin_prep`` (none for other codebooks)."""
        if not isinstance(codec.tree, UniformLinearTree):
            return {}
        a, wt = linear_tables(codec.tree)
        # and the signed form's: a_t + sum_j w_tj b_j = c_t + sum_j (-w_tj / 2) (1 - 2 b_j)
        return {"lin_a": a, "lin_w": wt.reshape(-1).contiguous(), "lin_c": a + 0.5 * wt.sum(1),
                "lin_wm": (-0.5 * wt).reshape(-1).contiguous()}

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        if device not in self._consts:
            self._consts[device] = {k: v.to(device).contiguous() for k, v in self._consts_cpu.items()}
        return self._consts[device]

    # ---- plan ----

    def plan(self, batch: int, max_tokens: int, device: torch.device | str, pages_per_program: int | None = None,
             block_tokens: int | None = None) -> Plan:
        """Buffers for steps of ``batch`` sequences of at most ``max_tokens`` tokens. The Key stage
        runs one program per ``pages_per_program`` pages of a (sequence, KV head) (default: 1024
        tokens with the FMA Key stage, one thread per 8 tokens; 4 pages with the MMA ones); the Value
        passes one per ``block_tokens`` tokens (a multiple of the page size; default 1024). Where a
        1024-token split leaves fewer than two programs per SM (B = 1: 64 programs), the Key stage
        runs 128-token programs decoding 4 channels at a time and the Value passes 256-token blocks
        (KERNEL_NOTES runs 39 and 42: B=1 T=8192 R=2 0.163 -> 0.124 ms)."""
        spec = self.codec.spec
        dev = torch.device(device)
        small = batch * spec.n_kv_heads * math.ceil(max_tokens / 1024) < 2 * _sm_count(dev)
        if pages_per_program is None:
            if self.assembly == "fma":
                pages_per_program = max(1, (128 if small else 1024) // spec.page_size)
            else:
                pages_per_program = 4
        if block_tokens is None:
            block_tokens = max(spec.page_size, 256) if small else 1024
        if pages_per_program < 1 or pages_per_program & (pages_per_program - 1):
            raise ValueError(f"pages_per_program must be a power of two >= 1, got {pages_per_program}")
        hq, hk, d, p = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.page_size
        if block_tokens % p:
            raise ValueError(f"block_tokens must be a multiple of the page size {p}")
        if self.compact_values and block_tokens > 2048:
            raise ValueError("block_tokens must be <= 2048 with compact_values (11-bit positions)")
        n_pages = math.ceil(max_tokens / p)
        mma = self._key_mma(dev, small)
        vmma = self._value_mma(dev, small)
        n_splits = math.ceil(n_pages / (self._mma_pages if mma else pages_per_program))
        n_blocks = math.ceil(max_tokens / block_tokens)
        groups = batch * hk // self.hg
        f32 = dict(dtype=torch.float32, device=dev)
        f16 = dict(dtype=torch.float16, device=dev)
        i32 = dict(dtype=torch.int32, device=dev)
        self._on(dev)
        r = self.refine
        tp = self._two_pass(batch * hk * max_tokens)
        key_loop = self._key_loop(batch * hk * max_tokens)
        key_ch = 1  # up to key_ch_max channels at a time, as many as fill key_ch_max warps with token rows
        if small and key_loop == 0 and self.key_channels and self.assembly == "fma":
            key_ch = max(1, min(self.key_ch_max, 32 * self.key_ch_max // (pages_per_program * p // 8)))
        exact_chunk = self._exact_chunk(max_tokens, groups, dev) if tp and self._exact_bins() > 0 else 0

        def opt(on: bool, *shape: int, **kw) -> torch.Tensor:
            """A stage's buffer, or a one-element placeholder when the stage is off."""
            return torch.zeros(*(shape if on else (1,) * len(shape)), **kw)

        pl = Plan(
            batch=batch, max_tokens=max_tokens, n_splits=n_splits, n_blocks=n_blocks, device=dev,
            pages_per_program=pages_per_program, block_tokens=block_tokens,
            qbuf=torch.empty(batch, hq, d, **f32), qt=torch.empty(batch, hq, d, **f32),
            w_hi=torch.empty(batch, hq, d, **f16), w_lo=torch.empty(batch, hq, d, **f16),
            wf=torch.empty(batch, hk, d, hq // hk, dtype=torch.float32, device=dev),
            base=torch.empty(batch, hq, **f32),
            kdep=torch.empty(batch, hk, d, dtype=torch.int32, device=dev),
            kord=torch.zeros(batch, hk, d, dtype=torch.int32, device=dev),
            kcnt=torch.zeros(batch * hk, KSEG_WORDS, dtype=torch.int32, device=dev),
            logits=torch.empty(batch, hq, max_tokens, **f32),
            mstat=torch.empty(batch, hq, n_splits, **f32), sstat=torch.empty(batch, hq, n_splits, **f32),
            vimp=torch.empty(batch, hk, max_tokens, **f32),
            vdep=torch.zeros(batch, hk, max_tokens, dtype=torch.int8, device=dev),
            vord=torch.zeros(batch, hk, max_tokens if self.compact_values else 1, dtype=torch.int16, device=dev),
            vcnt=torch.zeros(batch, hk, n_blocks if self.compact_values else 1, dtype=torch.int32, device=dev),
            hist=torch.zeros(groups, HIST_STRIDE, dtype=torch.int32, device=dev),
            ties=torch.zeros(groups, self.hg * n_blocks, self.kspad_v, dtype=torch.int32, device=dev),
            part=torch.empty(batch, hq, n_blocks, d, **f32), out_t=torch.empty(batch, hq, d, **f32),
            out=torch.empty(batch, hq, d, **f32),
            rhist=opt(r, groups, self._rhw, **i32),
            rsel=opt(r, groups, RSEL_STRIDE, dtype=torch.int64, device=dev),
            rtie=opt(r, groups, self.hg * n_blocks, **i32),
            rcnt=opt(r, batch, hk, n_blocks, **i32),
            rord=opt(r, batch, hk, max_tokens, dtype=torch.int16, device=dev),
            rcost=opt(r, batch * hk, **i32),
            two_pass=tp, ihist=opt(tp, groups, (self.hg + 1) * IH_BINS, **i32),
            cmeta=opt(tp, groups, CMETA_WORDS, **i32),
            cand=opt(tp, groups, self._cap(max_tokens), **i32),
            cbins=opt(tp and self._exact_bins() > 0, groups, max(1, self.exact_bins), **i32),
            ckeep=opt(exact_chunk > 0, groups, self._exact_keep, **i32), exact_chunk=exact_chunk,
            key_loop=key_loop, key_ch=key_ch, key_mma=mma,
            lin_off=opt(mma, batch * hk, self._lin_smax, 16, **i32),
            lin_v=opt(mma, batch * hk, self._lin_smax, 128, dtype=torch.float16, device=dev),
            lin_steps=opt(mma, batch * hk, **i32), lin_base=opt(mma, batch, hq, **f32),
            lin_scale=opt(mma, batch, hq, **f32), key_int8=mma and self._bits("key_bits") < 0,
            mma_pages=self._mma_pages if mma else 0, value_mma=vmma, vsort=vmma,
        )
        return self._with_parts(pl)

    def _with_parts(self, pl: Plan) -> Plan:
        """``pl`` split into ``batch_streams`` batch parts of near-equal size (none where that is 1 or the
        batch is 1), each with a stream of its own on a CUDA device; with ``stream_priority`` the earlier
        parts' streams rank higher, so that a part's small per-group kernels are dispatched ahead of the
        other parts' pending programs."""
        n = self.batch_streams
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"batch_streams must be an int >= 1, got {n!r}")
        n = min(n, pl.batch)
        if n == 1:
            return pl
        starts = tuple(round(i * pl.batch / n) for i in range(n + 1))
        parts = tuple(pl.batch_part(starts[i], starts[i + 1]) for i in range(n))
        streams: tuple[torch.cuda.Stream, ...] = ()
        events: tuple[torch.cuda.Event, ...] = ()
        if pl.device.type == "cuda":
            _, top = torch.cuda.Stream.priority_range()  # (lowest, highest): lower numbers rank higher
            prio = [max(top, -(n - 1 - i)) if self.stream_priority else 0 for i in range(n)]
            streams = tuple(torch.cuda.Stream(device=pl.device, priority=pr) for pr in prio)
            events = tuple(torch.cuda.Event() for _ in range(n + 1))  # the fork, then each part's join
        pl.parts, pl.part_starts, pl.streams, pl.events = parts, starts[:-1], streams, events
        return pl

    def _key_mma(self, dev: torch.device, small: bool = False) -> bool:
        """Whether plans on ``dev`` run the bit-product Key stage (``key_mma``): a linear codebook, the
        FMA stages, a CUDA device (the kernel's MMAs are inline PTX, which Triton's interpreter does
        not run), 64-token pages, at most 4 query heads per KV head; and where it measured faster: the
        int8 form (``key_bits="int8"``, the default) everywhere it runs (KERNEL_NOTES run 62: also
        SmolLM2's d=64 and B=1 steps), the fp16 forms for head_dim >= 128 and steps that are not small
        (run 47: B=32 T=32768 R=2 1.507 -> 1.273 ms; slower for d=64 and at B=1). ``key_mma=True``
        forces it wherever it can run (``"auto"``, the default, chooses)."""
        spec = self.codec.spec
        can = (bool(self.key_mma) and isinstance(self.codec.tree, UniformLinearTree) and self.assembly == "fma"
               and dev.type == "cuda" and spec.page_size == 64 and spec.group_size <= 4 and not self.fixed_depth
               and spec.head_dim * spec.width % 32 == 0)
        if self.key_mma == "auto":  # the int8 stage measured faster everywhere it runs (KERNEL_NOTES run 62)
            return can and (self.key_bits == "int8" or (spec.head_dim >= 128 and not small))
        return can

    def _value_mma(self, dev: torch.device, small: bool = False) -> bool:
        """Whether plans on ``dev`` run the bit-product Value stage (``value_mma``): a linear codebook,
        the FMA stages with compaction, a CUDA device, at most 4 query heads per KV head, head_dim a
        multiple of 64, at most 8 planes; ``"auto"`` (the default) where it measured faster (KERNEL_NOTES
        run 50): head_dim >= 128 and steps that are not small, as for ``key_mma``."""
        spec = self.codec.spec
        can = (bool(self.value_mma) and isinstance(self.codec.tree, UniformLinearTree) and self.assembly == "fma"
               and self.compact_values and dev.type == "cuda" and spec.group_size <= 4 and spec.head_dim % 64 == 0
               and spec.width <= 8 and not self.fixed_depth)
        if self.value_mma == "auto":
            return can and spec.head_dim >= 128 and not small
        return can

    def _bits(self, attr: str) -> int:
        """``key_bits`` / ``value_bits`` as the kernels' BITS constexpr (an index into MMA_BITS; "int8"
        as -1: the int8 kernel)."""
        v = getattr(self, attr)
        ok = KEY_BITS if attr == "key_bits" else VALUE_BITS
        if v not in ok:
            raise ValueError(f"{attr} must be one of {ok}, got {v!r}")
        return -1 if v == "int8" else MMA_BITS.index(v)

    def _imma_maxnreg(self, n_programs: int, dev: torch.device) -> int | None:
        """The int8 Key stage's register cap (``imma_maxnreg``) for a grid of ``n_programs``."""
        cap = self.imma_maxnreg
        if cap != "auto":
            if cap is not None and (not isinstance(cap, int) or cap < 24):
                raise ValueError(f"imma_maxnreg must be 'auto', None or an int >= 24, got {cap!r}")
            return cap
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        return 64 if sms * 7 < n_programs <= sms * 8 * 8 else None

    def _value_maxnreg(self, form: int) -> int | None:
        """The int8 Value stage's register cap for its form (``vimma_prefetch`` 0, 1, 2) from
        ``value_maxnreg``; "auto": 128, none, 200."""
        cap = self.value_maxnreg
        if cap == "auto":
            return VALUE_MAXNREG[form]
        if cap is not None and (not isinstance(cap, int) or cap < 0):
            raise ValueError(f"value_maxnreg must be 'auto', None or a register count, got {cap!r}")
        return cap or None

    @property
    def _mma_pages(self) -> int:
        """Pages (warps) per program of the bit-product Key stage."""
        return self.imma_warps if self.key_bits == "int8" else MMA_WARPS

    @property
    def _lin_smax(self) -> int:
        """Steps of 16 pairs a head can need: every channel at full depth."""
        spec = self.codec.spec
        return spec.head_dim * spec.width // 16

    def _key_loop(self, tokens: int) -> int:
        """How the FMA Key stage walks a head's channels of depth > 0 (``key_loop``; None = measured
        choice, KERNEL_NOTES run 36). 1: in channel order (neighbouring channels share L1 lines), a
        branch per channel to a body specialized to its depth (t unmasked loads, a 4x8 transpose for
        t <= 4); at B=32 T=32768 flexible R=2 1.62 -> 1.54 ms, R=4 2.41 -> 2.11 ms. 0: one loop per
        depth segment, the next channel's planes requested before this one's math; better where
        latency shows (B=1 T=8192: 0.164 vs 0.171 ms) and for the Full Reader (one depth: the
        segment is the channel order)."""
        if self.key_loop is not None:
            return self.key_loop
        return 0 if self.fixed_depth or tokens < 1 << 18 else 1

    def _fuse_transforms(self, head_dim: int) -> bool:
        """Whether _prep and _combine apply the query and output transforms (``fuse_transforms``)."""
        v = self.fuse_transforms
        if v == "auto":
            return head_dim <= 128
        if v not in (True, False, 0, 1):
            raise ValueError(f"fuse_transforms must be 'auto', True or False, got {v!r}")
        return bool(v)

    def _prep_radix(self) -> bool:
        """Whether ``_prep`` finds the Key allocation's lambda by radix passes (``prep_radix``; None =
        measured choice, KERNEL_NOTES run 73): 8 histograms cost more than 32 bisection steps over the
        8192 keys of a group of 8 KV heads at d=128 (B=32 T=32768: 24 -> 48 us; B=1: 23 -> 31) and less
        over groups of <= 2048 keys (d=256 with one KV head 12.1 -> 10.1 us; SmolLM2's 3 KV heads at d=64
        13.0 -> 10.7)."""
        if self.prep_radix is not None:
            return bool(self.prep_radix)
        return self.kspad_k * next_pow2(self.hg) * self.codec.spec.head_dim <= 2048

    def _alloc_warps(self, tokens: int) -> int:
        """Warps of the per-block Value allocation kernels for a plan of ``tokens`` (sequence, KV head,
        position) triples (``alloc_warps``; None = measured choice): 8 (4 tokens per thread) below 2^22
        triples, 4 (8 tokens per thread: fewer instructions per token in the block-wide sums and prefix
        sums) from there; KERNEL_NOTES run 72: B=32 T=32768 importance 110 -> 96 us, depth-sorted order
        71 -> 60, candidates 50 -> 48, gated passes 18 -> 15; B=1 T=8192 (65k) and d=256 (1M) no clear
        change."""
        if self.alloc_warps is not None:
            return self.alloc_warps
        return 4 if tokens >= 1 << 22 else 8

    def _hist_sample(self) -> int:
        """1 in how many tokens the two-pass allocation's importance histogram counts (``hist_sample``;
        None: 16, measured faster on every two-pass benchmark shape, KERNEL_NOTES run 96); 0 or 1: all."""
        hs = 16 if self.hist_sample is None else self.hist_sample
        if not isinstance(hs, int) or hs < 0 or (hs > 1 and hs & (hs - 1)):
            raise ValueError(f"hist_sample must be None, 0, 1 or a power of two, got {self.hist_sample!r}")
        return hs

    def _exact_bins(self) -> int:
        """The binned exact pass's bins (``exact_bins``, 0: off), checked."""
        v = self.exact_bins
        if not isinstance(v, int) or v != 0 and (v < 16 or v & (v - 1)):
            raise ValueError(f"exact_bins must be 0 or a power of two >= 16, got {v!r}")
        return v

    def _exact_chunk(self, max_tokens: int, groups: int, dev: torch.device | str) -> int:
        """Candidates per program of the split exact pass (``exact_split``; 0: the one-program pass), at
        most the candidate buffer; a power of two."""
        v = self.exact_split
        cap = self._cap(max_tokens)
        if v == "auto":
            return min(4096, cap) if groups * max(1, cap // 4096) <= 4 * _sm_count(torch.device(dev)) else 0
        if not isinstance(v, int) or v < 0 or (v and v & (v - 1)):
            raise ValueError(f"exact_split must be 'auto', 0 or a power of two, got {v!r}")
        return min(v, cap)

    def _two_pass(self, tokens: int) -> bool:
        """Whether a plan for ``tokens`` (sequence, KV head, position) triples uses the two-pass
        Value allocation. None = measured choice (docs/KERNEL_NOTES.md runs 34-36): faster at B=32
        T=32768 (8.4M triples), B=32 T=8192 with SmolLM2's 3 KV heads (786k: flexible R=2 0.253 ->
        0.230 ms) and d=256 with one KV head (1M: 0.547 -> 0.497 ms); slower at B=1 T=8192 (65k:
        0.163 -> 0.195 ms, where the bracket's and the exact pass's bisections are chains of
        dependent steps in a launch-bound step). So it is chosen from 2^19 (524k) triples."""
        if self.fixed_depth:
            return False
        if self.value_alloc is None:
            return tokens >= 1 << 19
        return self.value_alloc == "two-pass"

    def _cap(self, max_tokens: int) -> int:
        """Candidate keys kept per group (a power of two): measured brackets held 0.6% of the keys
        with 2048-bin histograms (run 33; 8192 bins since run 36 narrow them further), so 32768
        covers a group of ~5M keys; fewer when the group has fewer keys."""
        if self._cand_cap is not None:
            return self._cand_cap
        top = 65536 if self._hist_sample() > 1 else 32768  # a sampled bracket is wider
        return max(16, min(top, next_pow2(self.ks_v * self.hg * max_tokens)))

    @property
    def _rhw(self) -> int:
        """int32 words of refinement histograms per group: one NPASS x NBINS set per KV head."""
        return next_pow2(self.hg) * HIST_STRIDE_R

    def _run_parts(self, plan: Plan, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                   page_table: torch.Tensor, lengths: torch.Tensor, layer: int, scale: float | None) -> None:
        """A step of ``plan.parts``: each part's sequences on its own stream after a fork event recorded on
        the current stream, which then waits for every part's join event (events and streams made by
        :meth:`plan`: nothing allocated; a CUDA graph captures the fork and join as dependencies). Off the
        GPU, the parts one after the other."""
        cuda = plan.device.type == "cuda"
        if cuda:
            cur = torch.cuda.current_stream(plan.device)
            plan.events[0].record(cur)
        for i, (part, b0) in enumerate(zip(plan.parts, plan.part_starts, strict=True)):
            rows = slice(b0, b0 + part.batch)
            args = (part, q[rows], k_pool, v_pool, page_table[rows], lengths[rows], layer, scale)
            if not cuda:
                self.run(*args)
                continue
            st = plan.streams[i]
            st.wait_event(plan.events[0])
            with torch.cuda.stream(st):
                self.run(*args)
            plan.events[i + 1].record(st)
        if cuda:
            for ev in plan.events[1:]:
                cur.wait_event(ev)

    def _transposing(self, pages_per_program: int, page_size: int) -> bool:
        """The transposing Key stage needs a tile of M = PPK * P / 8 rows, a power of two >= 16
        (the MMA's minimum) and <= 64 (registers); otherwise the bit-serial one runs."""
        m = pages_per_program * page_size // 8
        return self.assembly == "transpose" and 16 <= m <= 64 and m & (m - 1) == 0

    def _value_transposing(self, head_dim: int) -> bool:
        """The transposing Value stage splits a tile into 8 MMAs of D/8 columns: measured on the H200
        (run 16) 1.8x faster than bit-serial at d = 256 but 1.5x slower at d = 128 (sixteen-column
        MMAs and their layout conversions cost more than the byte loads they save), so d >= 256."""
        return self.assembly in ("transpose", "fma") and head_dim >= 256

    # ---- run ----

    def run(self, plan: Plan, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
            page_table: torch.Tensor, lengths: torch.Tensor, layer: int, scale: float | None = None,
            marks: list[tuple[str, torch.cuda.Event]] | None = None) -> torch.Tensor:
        """One decode step: q [B, Hq, d]; k_pool [pages, W, d, P/8] and v_pool [pages, W, P, d/8] (uint8,
        this layer's pools; [pages, W/g, P, g, d/8] with the format's ``v_run`` = g > 1); page_table [B, Hkv,
        slots] (int32); lengths [B] (int32, <= plan.max_tokens). Returns plan.out [B, Hq, d] (float32).
        Allocates nothing. ``marks`` (profiling only) receives a recorded CUDA event after each stage."""

        def mark(name: str) -> None:
            if marks is not None:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((name, ev))

        spec, pol = self.codec.spec, self.policy
        check_device(q, k_pool, v_pool, page_table, lengths, plan.out)
        if q.dim() != 3 or q.shape[1:] != (spec.n_q_heads, spec.head_dim) or not q.is_floating_point():
            raise ValueError(f"q must be a float tensor [B, {spec.n_q_heads}, {spec.head_dim}], got "
                             f"{q.dtype} {tuple(q.shape)}")
        b, hq, d = q.shape
        hk, g, w, p = spec.n_kv_heads, spec.group_size, spec.width, spec.page_size
        check_v_pool(v_pool, spec)
        vg = spec.v_run
        if b != plan.batch:
            raise ValueError(f"batch {b} != planned batch {plan.batch}")
        if plan.parts:
            mark("start")
            self._run_parts(plan, q, k_pool, v_pool, page_table, lengths, layer, scale)
            mark("parts")
            return plan.out
        c = self._consts[plan.device]
        nsk, nblk = plan.n_splits, plan.n_blocks
        ppk, blk = plan.pages_per_program, plan.block_tokens  # this plan's program sizes
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        slots = page_table.shape[2]
        tmax = plan.max_tokens
        gpad = max(16, next_pow2(g))
        g2 = next_pow2(g)
        nsk_pad = next_pow2(nsk)
        groups = b * hk // self.hg
        use_rate = pol.rate is not None
        rate = float(pol.rate) if use_rate else 0.0
        bv_fixed = 0 if use_rate else int(pol.budget_v)  # type: ignore[arg-type]
        vconst = dict(D=d, W=w, BLK=blk, KS=self.ks_v, KS_PAD=self.kspad_v, MIN_V=pol.min_depth_v,
                      PACKET=pol.v_packet)
        mu_k, sig_k = c["mu_k"][layer], c["sig_k"][layer]
        mu_v, sig_v = c["mu_v"][layer], c["sig_v"][layer]
        nw, aw = self.num_warps, self._alloc_warps(b * hk * tmax)

        mark("start")
        fuse = self._fuse_transforms(d)
        if fuse:  # q~ = q M_K^T computed by _prep, one group's rows per program
            qrot = dict(QROWS=max(16, next_pow2(self.hg * g)), q_ptr=q, sq_b=q.stride(0), sq_h=q.stride(1),
                        sq_d=q.stride(2), mkT_ptr=c["mkT"])
        else:
            plan.qbuf.copy_(q)
            torch.mm(plan.qbuf.view(-1, d), c["mkT"], out=plan.qt.view(-1, d))
            qrot = {}
        mark("q_transform")
        _prep[(groups,)](plan.qt, sig_k, mu_k, c["rk"], plan.w_hi, plan.w_lo, plan.wf, plan.base, plan.kdep, plan.kord,
                         plan.kcnt, plan.hist, self.count_k, plan.rhist, plan.ihist, HQ=hq, HKV=hk, HG=self.hg, G=g,
                         D=d, KS=self.ks_k, KS_PAD=self.kspad_k, MIN_K=pol.min_depth_k, HG_PAD=next_pow2(self.hg),
                         RHW=self._rhw if self.refine else 0, TWO_PASS=plan.two_pass,
                         KORDER=plan.key_loop, RADIX=self._prep_radix(), **qrot, num_warps=self.prep_warps)
        mark("prep")
        if plan.key_mma and plan.key_int8 != (self._bits("key_bits") < 0):
            raise ValueError(f"the plan was made for another key_bits than {self.key_bits!r}; plan again")
        if plan.key_int8:  # the bit product on int8 tensor cores
            smax = plan.lin_off.shape[1] // 2  # steps of 32 pairs in the buffers of the 16-pair steps
            _lin_prep_i8[(b * hk, w)](plan.kdep, plan.wf, plan.base, c["lin_a"], c["lin_w"], plan.lin_off,
                                    plan.lin_v.view(torch.int8), plan.lin_steps, plan.lin_base, plan.lin_scale, smax,
                                    HQ=hq, HKV=hk, G=g, D=d, W=w, P=p, num_warps=4)
            if self.imma_prefetch not in (1, 3):
                raise ValueError(f"imma_prefetch must be 1 or 3, got {self.imma_prefetch!r}")
            cap = self._imma_maxnreg(b * hk * nsk, q.device)
            _key_stage_imma[(b * hk, nsk)](k_pool, page_table, lengths, plan.lin_off, plan.lin_v.view(torch.int32),
                                           plan.lin_steps, plan.lin_base, plan.lin_scale, plan.logits, plan.mstat,
                                           plan.sstat, scale, slots, tmax, smax, HQ=hq, HKV=hk, G=g, D=d, W=w, P=p,
                                           NWARP=plan.mma_pages, VST=self.imma_vstore and tmax % 8 == 0,
                                           PF=self.imma_prefetch, num_warps=plan.mma_pages,
                                           **({"maxnreg": cap} if cap else {}))
        elif plan.key_mma:  # the bit product (linear codebook): operands from _prep's depths and weights
            _lin_prep[(b * hk,)](plan.kdep, plan.wf, plan.base, c["lin_a"], c["lin_w"], plan.lin_off, plan.lin_v,
                                 plan.lin_steps, plan.lin_base, plan.lin_off.shape[1], HQ=hq, HKV=hk, G=g, D=d, W=w,
                                 P=p, num_warps=4)
            _key_stage_mma[(b * hk, nsk)](k_pool, page_table, lengths, plan.lin_off, plan.lin_v.view(torch.int32),
                                          plan.lin_steps, plan.lin_base, plan.logits, plan.mstat, plan.sstat, scale,
                                          slots, tmax, plan.lin_off.shape[1], HQ=hq, HKV=hk, G=g, D=d, W=w, P=p,
                                          NWARP=plan.mma_pages, PREFETCH=2, BITS=self._bits("key_bits"),
                                          num_warps=plan.mma_pages)
        elif self.assembly == "fma":
            _key_stage_f[(b * hk, nsk)](k_pool, page_table, lengths, plan.kord, plan.kcnt, plan.wf, plan.base,
                                        c["tabf"], plan.logits, plan.mstat, plan.sstat, scale, slots, tmax, HQ=hq,
                                        HKV=hk, G=g, D=d, W=w, P=p, PPK=ppk, KLOOP=plan.key_loop,
                                        CH=plan.key_ch, num_warps=max(1, min(nw, plan.key_ch * ppk * p // 256)))
        elif self._transposing(ppk, p):
            _key_stage_t8[(b * hk, nsk)](k_pool, page_table, lengths, plan.kdep, plan.w_hi, plan.w_lo, plan.base,
                                         c["tabr"], plan.logits, plan.mstat, plan.sstat, scale, slots, tmax, HQ=hq,
                                         HKV=hk, G=g, G_PAD=gpad, D=d, W=w, P=p, PPK=ppk, num_warps=nw)
        else:
            _key_stage[(b * hk, nsk)](k_pool.view(torch.int32), page_table, lengths, plan.kdep, plan.w_hi,
                                      plan.w_lo, plan.base, c["tab2"], c["spread"], plan.logits, plan.mstat,
                                      plan.sstat, scale, slots, tmax, HQ=hq, HKV=hk, G=g, G_PAD=gpad, D=d, W=w, P=p,
                                      PPK=ppk, num_warps=nw)
        mark("key_stage")
        grid = (b * hk, nblk)
        if self.refine:
            self._refine(plan, k_pool, page_table, lengths, sig_k, scale, slots, g, g2, nsk_pad, groups, mark)
        if not self.fixed_depth:
            tp, fused = plan.two_pass, self.fused_select
            if tp and plan.cbins.shape[1] != max(1, self._exact_bins()):
                raise ValueError(f"the plan was made for another exact_bins than {self.exact_bins!r}; plan again")
            hs = self._hist_sample()
            # 1 in `sample` tokens, at most one in 8 of a block (one run of 8)
            sample = min(hs, blk // 8) if tp and hs > 1 else 1
            imp_args = dict(HQ=hq, G=g, G2=g2, NSK_PAD=nsk_pad, HEAD_WEIGHT=pol.value_head_weight)
            if sample > 1:  # spans of up to 8 blocks per program (1, 2, 4 measured alike, KERNEL_NOTES run 100)
                span = min(8, next_pow2(nblk))
                _value_sample[(b * hk, -(-nblk // span))](plan.logits, plan.mstat, plan.sstat, lengths,
                                                                 c["hw"][layer], plan.ihist, tmax, nsk, HKV=hk,
                                                                 HG=self.hg, TOK=span * blk, SAMPLE=sample,
                                                                 **imp_args, num_warps=self.sample_warps)
            else:
                _value_hist[grid](plan.logits, plan.mstat, plan.sstat, lengths, c["rv"], plan.vimp, plan.hist,
                                  c["hw"][layer], plan.ihist, tmax, nsk, HQ=hq, HKV=hk, HG=self.hg, G=g, G2=g2,
                                  NSK_PAD=nsk_pad, BLK=blk, KS=self.ks_v, KS_PAD=self.kspad_v,
                                  HEAD_WEIGHT=pol.value_head_weight, TWO_PASS=tp, RATE=rate, BK=self.bk,
                                  BV_FIXED=bv_fixed, USE_RATE=use_rate, D=d, W=w, MIN_V=pol.min_depth_v,
                                  PACKET=pol.v_packet, FUSED=fused, HWIN=self.hist_window if tp else 0,
                                  RHIST=self.radix_hist, num_warps=aw)
            mark("value_hist")
            gsel = dict(USE_RATE=use_rate, HKV=hk, HG=self.hg, D=d, W=w, MIN_V=pol.min_depth_v, PACKET=pol.v_packet,
                        KS=self.ks_v)
            if tp:  # lambda from the bracket and its candidates; radix passes only where they overflow
                cap = plan.cand.shape[1]
                nb = plan.cbins.shape[1] if self.exact_bins else 0
                cb = dict(CBINS=nb, cbins_ptr=plan.cbins) if nb else {}
                _v_bracket[(groups,)](plan.ihist, lengths, c["rv"], plan.cmeta, rate, self.bk, bv_fixed,
                                      KS_PAD=self.kspad_v, SAMPLE=sample, SLACK=float(self.sample_slack),
                                      ZS=float(self.sample_z), **cb, **gsel,
                                      num_warps=self.bracket_warps or (8 if self.hg > 1 else 4))
                fl = dict(FROM_LOGITS=True, logit_ptr=plan.logits, mstat_ptr=plan.mstat, sstat_ptr=plan.sstat,
                          hw_ptr=c["hw"][layer], NSK=nsk, **imp_args) if sample > 1 else {}
                _v_cand[grid](plan.vimp, lengths, c["rv"], plan.cmeta, plan.cand, tmax, rate, self.bk, bv_fixed, cap,
                              BLK=blk, KS_PAD=self.kspad_v, **gsel, **fl, **cb, num_warps=aw)
                ch = plan.exact_chunk if nb else 0
                if ch:  # the scan split over programs
                    _v_exact_split[(groups, cap // ch)](plan.hist, lengths, plan.cmeta, plan.cand, plan.cbins,
                                                        plan.ckeep, rate, self.bk, bv_fixed, CAP=cap, CBINS=nb, CH=ch,
                                                        KEEP=plan.ckeep.shape[1], **gsel,
                                                        num_warps=self.exact_split_warps)
                else:
                    _v_exact[(groups,)](plan.hist, lengths, plan.cmeta, plan.cand, rate, self.bk, bv_fixed, CAP=cap,
                                        **gsel, **cb, num_warps=self.exact_warps)
                mark("value_two_pass")
            if not tp and not fused:
                _radix_select[(groups,)](plan.hist, lengths, plan.cmeta, rate, self.bk, bv_fixed, PASS=1, GATED=False,
                                         **gsel, num_warps=1)
            if tp and (not isinstance(self.gated_splits, int) or self.gated_splits < 1):
                raise ValueError(f"gated_splits must be an int >= 1, got {self.gated_splits!r}")
            rgrid = (b * hk, min(nblk, self.gated_splits)) if tp else grid
            for pas in range(1 if tp else 2, NPASS.value + 1):
                _value_radix[rgrid](plan.vimp, lengths, c["rv"], plan.hist, plan.cmeta, tmax, rate, self.bk,
                                    bv_fixed, nblk, USE_RATE=use_rate, PASS=pas, HKV=hk, HG=self.hg, GATED=tp,
                                    FUSED=fused, RHIST=self.radix_hist, **vconst, num_warps=aw)
                if not fused:
                    _radix_select[(groups,)](plan.hist, lengths, plan.cmeta, rate, self.bk, bv_fixed, PASS=pas,
                                             GATED=tp, **gsel, num_warps=1)
                mark(f"value_radix{pas}")
            gate = tp and bool(self.tie_gate)
            _value_ties[grid](plan.vimp, lengths, c["rv"], plan.hist, plan.ties, tmax, rate, self.bk, bv_fixed,
                              USE_RATE=use_rate, HKV=hk, HG=self.hg, **vconst, TIE_GATE=gate,
                              cmeta_ptr=plan.cmeta if gate else None, num_warps=nw)
            mark("value_ties")
        if self.assembly == "fma":
            if self.compact_values:
                _value_order[grid](lengths, plan.vimp, c["rv"], plan.hist, plan.ties, plan.vdep, plan.vord, plan.vcnt,
                                   tmax, rate, self.bk, bv_fixed, USE_RATE=use_rate, HKV=hk, HG=self.hg,
                                   NT_PAD=next_pow2(self.hg * nblk), SORT=plan.vsort, CHUNKED=bool(self.order_chunked),
                                   **vconst, num_warps=aw)
                mark("value_order")
        if plan.value_mma and self._bits("value_bits") < 0:
            ts = plan.split_pages * p  # tokens per Key-stage split
            pair = d >= 256 if self.imma_pair == "auto" else bool(self.imma_pair)
            if self.vimma_prefetch not in (0, 1, 2):
                raise ValueError(f"vimma_prefetch must be 0, 1 or 2, got {self.vimma_prefetch!r}")
            vpf = int(self.vimma_prefetch) if w % 4 == 0 and w <= 12 else 0
            vcap = self._value_maxnreg(vpf)
            _value_stage_imma[grid](v_pool, page_table, lengths, plan.logits, plan.mstat, plan.sstat, plan.vord,
                                    plan.vcnt, c["lin_a"], c["lin_w"], plan.part, self._wmax, slots, tmax, nsk, HQ=hq,
                                    HKV=hk, G=g, G2=g2, NSK_PAD=nsk_pad, D=d, W=w, P=p, BLK=blk, TS=ts,
                                    PAIR=pair and w % 2 == 0 and not vpf, VPF=vpf, VG=vg,
                                    **({"maxnreg": vcap} if vcap else {}),
                                    num_warps=max(1, d // 128))
        elif plan.value_mma:
            vb = self._bits("value_bits")
            signed = MMA_BITS[vb] == "signed"  # value = c_t + sum_j (-w_tj / 2) s_j, s_j = 1 - 2 b_j
            _value_stage_mma[grid](v_pool, page_table, lengths, plan.logits, plan.mstat, plan.sstat, plan.vord,
                                   plan.vcnt, c["lin_c" if signed else "lin_a"], c["lin_wm" if signed else "lin_w"],
                                   plan.part, self._vscale, slots, tmax, nsk, HQ=hq, HKV=hk, G=g, G2=g2,
                                   NSK_PAD=nsk_pad, D=d, W=w, P=p, BLK=blk, BITS=vb, VG=vg,
                                   num_warps=max(1, d // 128))
        elif self.assembly == "fma":
            _value_stage_f[grid](v_pool, page_table, lengths, plan.logits, plan.mstat, plan.sstat, plan.vimp, c["rv"],
                                 plan.hist, plan.ties, c["tabf"], plan.vdep, plan.vord, plan.vcnt, plan.part, slots,
                                 tmax, nsk,
                                 rate, self.bk, bv_fixed, USE_RATE=use_rate, HQ=hq, HKV=hk, HG=self.hg, G=g,
                                 G_PAD=gpad, NSK_PAD=nsk_pad, P=p, NT_PAD=next_pow2(self.hg * nblk),
                                 FIXED_V=self.fixed_depth, COMPACT=self.compact_values, TS=32 * nw // (d // 8),
                                 VG=vg, **vconst, num_warps=nw)
        elif self.compact_values:
            _value_stage_c[grid](v_pool, page_table, lengths, plan.logits, plan.mstat, plan.sstat, plan.vimp, c["rv"],
                                 plan.hist, plan.ties, c["tab2"], c["tabr"], plan.vdep, plan.vord, plan.part, slots,
                                 tmax, nsk, rate, self.bk, bv_fixed, USE_RATE=use_rate, HQ=hq, HKV=hk, HG=self.hg,
                                 G=g, G_PAD=gpad, NSK_PAD=nsk_pad, P=p, NT_PAD=next_pow2(self.hg * nblk),
                                 T8=self._value_transposing(d), VG=vg, **vconst, num_warps=nw)
        else:
            _value_stage[grid](v_pool, page_table, lengths, plan.logits, plan.mstat, plan.sstat, plan.vimp, c["rv"],
                               plan.hist, plan.ties, c["tab2"], c["tabr"], plan.vdep, plan.part, slots, tmax, nsk,
                               rate, self.bk, bv_fixed, USE_RATE=use_rate, HQ=hq, HKV=hk, HG=self.hg, G=g,
                               G_PAD=gpad, NSK_PAD=nsk_pad, P=p, NT_PAD=next_pow2(self.hg * nblk),
                               FIXED_V=self.fixed_depth, T8=self._value_transposing(d), VG=vg, **vconst,
                               num_warps=nw)
        mark("value_stage")
        inv = dict(INV=True, mv_ptr=c["mv"], fin_ptr=plan.out) if fuse else {}
        _combine[(b * hk,)](plan.part, mu_v, sig_v, plan.out_t, nblk, HQ=hq, HKV=hk, G=g, G_PAD=gpad, D=d, **inv,
                            num_warps=self.combine_warps)
        if not fuse:
            torch.mm(plan.out_t.view(-1, d), c["mv"], out=plan.out.view(-1, d))
        mark("combine_inverse")
        return plan.out

    def _refine(self, plan: Plan, k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                sig_k: torch.Tensor, scale: float, slots: int, g: int, g2: int, nsk_pad: int, groups: int,
                mark: Callable[[str], None]) -> None:
        """The Key-refinement launches (planekv.kernels.refine): keys and radix pass 1, passes 2..8
        with a selection after each, ties, the chosen tokens, their Keys at depth W, the split stats."""
        spec = self.codec.spec
        c = self._consts[plan.device]
        hq, hk, d, w, p = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.width, spec.page_size
        b, tmax, nblk = plan.batch, plan.max_tokens, plan.n_blocks
        blk = plan.block_tokens
        grid = (b * hk, nblk)
        hgp = next_pow2(self.hg)
        nw = self.num_warps
        rkey = plan.vimp.view(torch.int32)  # free until the Value allocation writes importances
        rord = plan.rord
        bkr = self.bk - self.bk_stage
        _refine_score[grid](plan.logits, plan.mstat, plan.sstat, lengths, plan.qt, sig_k, plan.kdep, c["dist"], rkey,
                            plan.rcost, plan.rhist, scale, tmax, plan.n_splits, HQ=hq, HKV=hk, HG=self.hg, HG_PAD=hgp,
                            G=g, G2=g2, NSK_PAD=nsk_pad, D=d, W=w, BLK=blk, num_warps=nw)
        mark("refine_keys")
        sel = dict(HKV=hk, HG=self.hg, HG_PAD=hgp, num_warps=1)
        _refine_select[(groups,)](plan.rhist, plan.rsel, plan.rcost, lengths, bkr, PASS=1, **sel)
        for pas in range(2, NPASS.value + 1):
            _refine_radix[grid](rkey, lengths, plan.rsel, plan.rhist, tmax, PASS=pas, HKV=hk, HG=self.hg, HG_PAD=hgp,
                                BLK=blk, num_warps=nw)
            _refine_select[(groups,)](plan.rhist, plan.rsel, plan.rcost, lengths, bkr, PASS=pas, **sel)
        mark("refine_radix")
        _refine_ties[grid](rkey, lengths, plan.rsel, plan.rtie, tmax, HKV=hk, HG=self.hg, BLK=blk, num_warps=nw)
        _refine_order[grid](rkey, lengths, plan.rsel, plan.rtie, plan.rcost, rord, plan.rcnt, tmax, HKV=hk,
                            HG=self.hg, HG_PAD=hgp, BLK=blk, NT_PAD=next_pow2(self.hg * nblk), num_warps=nw)
        mark("refine_order")
        _key_refine_f[grid](k_pool, page_table, lengths, rord, plan.rcnt, plan.qt, sig_k, plan.base, c["tabw"],
                            plan.logits, scale, slots, tmax, HQ=hq, HKV=hk, G=g, D=d, W=w, P=p, BLK=blk,
                            TS=max(1, 1024 // d), num_warps=nw)
        mark("refine_decode")
        ntok = plan.split_pages * p  # tokens per Key-stage split
        _key_restat[(b * hk, plan.n_splits)](plan.logits, lengths, plan.mstat, plan.sstat, tmax, HQ=hq, HKV=hk, G=g,
                                             G2=g2, NTOK=ntok, num_warps=nw)
        mark("refine_stats")

    # ---- convenience ----

    def decode(self, q: torch.Tensor, cache: PlaneKVCache, layer: int, scale: float | None = None,
               plan: Plan | None = None) -> tuple[torch.Tensor, ReadStats]:
        """The same contract as planekv.kvstore.reference.readkv_decode, over a PlaneKVCache."""
        cache.check_format(self.codec.format_id)
        b = q.shape[0]
        lengths = cache.lengths[layer].to(torch.int32)
        t_max = int(lengths.max())
        if plan is None:
            plan = self._plan_cache.get((b, q.device))
            if plan is None or plan.max_tokens < t_max:
                # grow in steps of 4096 tokens on the GPU so decode steps re-plan rarely; of 256 in Triton's
                # interpreter (CPU tensors), whose time grows with the planned tokens, not the stored ones
                step = 4096 if q.device.type == "cuda" else 256
                plan = self.plan(b, -(-t_max // step) * step, q.device)
                self._plan_cache[(b, q.device)] = plan
        elif plan.max_tokens < t_max or plan.batch != b:
            raise ValueError(f"plan for {plan.batch} x {plan.max_tokens} tokens cannot serve {b} x {t_max}")
        pt = cache.page_table.to(device=q.device, dtype=torch.int32).contiguous()
        if pt.shape[2] == 0:
            raise ValueError("the cache holds no pages")
        out = self.run(plan, q, cache.k_pool[layer], cache.v_pool[layer], pt, lengths.to(q.device), layer, scale)
        return out.clone(), self.stats(plan, lengths)

    def stats(self, plan: Plan, lengths: torch.Tensor) -> ReadStats:
        """Logical read of the last run, counted from its depth buffers."""
        spec = self.codec.spec
        lengths = lengths.to(torch.int64).cpu()
        kdep = plan.kdep.cpu().to(torch.int64)
        vdep = plan.vdep.cpu().to(torch.int64)
        if self.fixed_depth:
            vdep = torch.full_like(vdep, self.fixed_depth)
        tok = torch.arange(plan.max_tokens)
        vmask = tok[None, None, :] < lengths[:, None, None]
        vdep = vdep * vmask
        k_bits = (lengths * kdep.sum((1, 2))).double()
        refined = self.refined(plan) if self.refine else None
        if refined is not None:  # chosen tokens x the bits to refine one token of their head
            n_ref = refined.sum(2).to(torch.int64)  # [B, Hkv]
            k_bits = k_bits + (n_ref * plan.rcost.cpu().to(torch.int64).view(plan.batch, -1)).sum(1).double()
        v_bits = (spec.head_dim * vdep.sum((1, 2))).double()
        return ReadStats(
            k_bits=k_bits, v_bits=v_bits, tokens=lengths.double(), n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim,
            workspace_bytes=two_stage_workspace_bytes(spec.n_q_heads, spec.n_kv_heads, int(lengths.max()),
                                                      spec.head_dim, plan.batch),
            k_depths=kdep, v_depths=vdep,
            extra={} if refined is None else {"k_refined": refined},
        )

    def refined(self, plan: Plan) -> torch.Tensor:
        """The tokens whose Keys the last run's refinement read at depth W: [B, Hkv, T] bool (CPU)."""
        if not self.refine:
            raise ValueError("this reader's policy has no Key refinement")
        b, hk, tmax = plan.rord.shape
        blk = plan.block_tokens
        nblk = plan.n_blocks
        lp = torch.nn.functional.pad(plan.rord.cpu().to(torch.int64), (0, nblk * blk - tmax)).view(b, hk, nblk, blk)
        take = torch.arange(blk)[None, None, None, :] < plan.rcnt.cpu().to(torch.int64)[..., None]
        pos = torch.where(take, lp + (torch.arange(nblk) * blk)[None, None, :, None], nblk * blk)
        out = torch.zeros(b, hk, nblk * blk + 1, dtype=torch.bool)
        out.scatter_(2, pos.view(b, hk, -1), True)
        return out[:, :, :tmax]


_READERS: dict[tuple[str, ReadPolicy], TritonReader] = {}


def readkv_decode(q: torch.Tensor, cache: PlaneKVCache, layer: int, codec: Codec, policy: ReadPolicy,
                  scale: float | None = None) -> tuple[torch.Tensor, ReadStats]:
    """Drop-in for planekv.kvstore.reference.readkv_decode through the Triton kernels (one reader
    and its plans kept per format and policy)."""
    key = (codec.format_id, policy)
    reader = _READERS.get(key)
    if reader is None:
        reader = _READERS[key] = TritonReader(codec, policy)
    return reader.decode(q, cache, layer, scale)
