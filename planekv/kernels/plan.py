"""A plan and a step: FlashInfer's plan/run split.

:class:`Plan` holds every buffer and the :class:`~.config.StepChoices` of one step shape (batch, longest
sequence), sized once by ``TritonReader.plan``. :class:`Step` is what one ``run`` hands each stage's launcher:
the plan, the format's and policy's constants, this layer's calibration rows and the reader's constant tables.
Neither allocates during a run, so a run can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .config import StepChoices
from .tables import linear_tables


@dataclass
class Plan:
    """Buffers and choices of one step shape (all on one device). Shapes: B sequences, Hq query / Hkv KV heads,
    d head dim, T = max_tokens, S = n_splits Key-stage programs and NBLK = n_blocks Value programs per
    (sequence, KV head), G = Hq / Hkv, groups = B Hkv / HG allocation groups of HG KV heads."""

    batch: int
    max_tokens: int
    n_splits: int  # Key-stage programs per (sequence, KV head): choices.key_pages pages each
    n_blocks: int  # Value-stage programs per (sequence, KV head): choices.block_tokens tokens each
    device: torch.device
    choices: StepChoices
    qbuf: torch.Tensor  # [B, Hq, d] f32: queries copied in (unfused transforms)
    qt: torch.Tensor  # [B, Hq, d] f32: q~
    w_hi: torch.Tensor  # [B, Hq, d] f16: q~ * sigma_K, high half
    w_lo: torch.Tensor  # [B, Hq, d] f16: low half
    wf: torch.Tensor  # [B, Hkv, d, G] f32: q~ * sigma_K, a channel's G query heads side by side
    base: torch.Tensor  # [B, Hq] f32: q~ . mu_K
    kdep: torch.Tensor  # [B, Hkv, d] i32: Key channel depths
    kord: torch.Tensor  # [B, Hkv, d] i32: channels of depth > 0 (depth << 8 | channel), in the FMA Key walk's order
    kcnt: torch.Tensor  # [B * Hkv, KSEG_WORDS] i32: [0] how many, [t] how many of depth t
    logits: torch.Tensor  # [B, Hq, T] f32 (scaled)
    mstat: torch.Tensor  # [B, Hq, S] f32: each split's softmax maximum
    sstat: torch.Tensor  # [B, Hq, S] f32: and sum
    vimp: torch.Tensor  # [B, Hkv, T] f32: Value importance (Key refinement's keys before the allocation)
    vdep: torch.Tensor  # [B, Hkv, T] i8: Value token depths
    vord: torch.Tensor  # [B, Hkv, T] i16: per block, its tokens of depth > 0 ((W - depth) << 11 | position)
    vcnt: torch.Tensor  # [B, Hkv, NBLK] i32: how many
    hist: torch.Tensor  # [groups, HIST_STRIDE] i32: radix histograms and selections
    ties: torch.Tensor  # [groups, HG * NBLK, KS_PAD] i32: keys at lambda per block and step
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
    ihist: torch.Tensor  # [groups, (HG + 1) IH_BINS] i32: sampled importance histogram per head, suffix sums
    # [groups, CMETA_WORDS] i32: lo, hi, candidates, keys above hi, fall back (overflow or miss), keys at
    # lambda ranked, the candidates' histogram's bin shift, the split exact pass's kept keys and arrivals
    cmeta: torch.Tensor
    cand: torch.Tensor  # [groups, cand_cap] i32: candidate keys
    cbins: torch.Tensor  # [groups, EXACT_BINS] i32: the candidates' histogram over the bracket
    ckeep: torch.Tensor  # [groups, exact_keep] i32: lambda's bin's candidates (the split exact pass)
    # the int8 Key stage's operands (one-element placeholders without it): per (sequence, KV head) its steps of
    # 32 pairs in fragment order
    lin_off: torch.Tensor  # [B*Hkv, 2 SMAX, 16] i32: byte offsets
    lin_v: torch.Tensor  # [B*Hkv, 2 SMAX, 128] f16 storage of the int8 V digits
    lin_steps: torch.Tensor  # [B*Hkv] i32
    lin_base: torch.Tensor  # [B, Hq] f32: base'
    lin_scale: torch.Tensor  # [B, Hq] f32: the int8 digits' scale
    # ReaderConfig.batch_streams > 1: the step as batch parts (plans over views of these buffers, rows
    # part_starts[i]...), each on a stream of its own between a fork and a join event (CUDA only; off the
    # GPU the parts run one after the other)
    parts: tuple[Plan, ...] = ()
    part_starts: tuple[int, ...] = ()
    streams: tuple[torch.cuda.Stream, ...] = ()
    events: tuple[torch.cuda.Event, ...] = ()

    @property
    def two_pass(self) -> bool:
        return self.choices.two_pass

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
        return sum(v.numel() * v.element_size() for f in fields(self)
                   if f.name != "out" and isinstance(v := getattr(self, f.name), torch.Tensor))


@dataclass(frozen=True)
class ReadConsts:
    """The format's geometry and the read policy's budgets as the launches take them (fixed for a reader)."""

    hq: int
    hk: int
    g: int  # query heads per KV head
    d: int
    w: int  # planes stored (W)
    p: int  # tokens per page
    vg: int  # V planes per run (FormatSpec.v_run)
    hg: int  # KV heads per allocation group (all of a sequence's when the budget is pooled)
    ks_k: int  # steps per channel of the Key allocation
    kspad_k: int
    ks_v: int  # steps per token of the Value allocation
    kspad_v: int
    min_k: int
    min_v: int
    packet: int  # Value depths in packets of this many planes
    use_rate: bool  # budgets from a rate (else fixed B_V)
    rate: float
    bv_fixed: int
    bk: int  # Key budget B_K (channel-plane increments per KV head)
    bk_stage: int  # the channel stage's share of it (all of it without Key refinement)
    count_k: int  # Key-allocation steps to take per group
    head_weight: bool  # ReadPolicy.value_head_weight
    refine: bool  # Key refinement on
    rhw: int  # int32 words of refinement histograms per group
    fixed_depth: int  # the Full Reader's depth (0: ReadKV's allocation)
    wmax: float  # max |w_tj| of a linear codebook (the int8 Value stage's digit scale), else 1

    @staticmethod
    def wmax_of(tree) -> float:
        return float(linear_tables(tree)[1].abs().max())


@dataclass(frozen=True)
class Step:
    """What the launches of one ``run`` share."""

    plan: Plan
    k: ReadConsts
    c: dict[str, torch.Tensor]  # the reader's constant tables on the plan's device
    layer: int
    scale: float
    slots: int  # page-table slots per (sequence, KV head)
    num_warps: int  # ReaderConfig.num_warps
    gated_splits: int  # ReaderConfig.gated_splits
    sample_slack: float
    sample_z: float

    @property
    def ch(self) -> StepChoices:
        return self.plan.choices

    @property
    def groups(self) -> int:
        return self.plan.batch * self.k.hk // self.k.hg

    @property
    def gpad(self) -> int:  # query heads padded for the MMA stages' tiles (>= 16)
        return max(16, _pow2(self.k.g))

    @property
    def g2(self) -> int:
        return _pow2(self.k.g)

    @property
    def nsk_pad(self) -> int:
        return _pow2(self.plan.n_splits)

    def value_consts(self) -> dict[str, int]:
        """The Value-allocation constants most Value kernels take."""
        k = self.k
        return dict(D=k.d, W=k.w, BLK=self.ch.block_tokens, KS=k.ks_v, KS_PAD=k.kspad_v, MIN_V=k.min_v,
                    PACKET=k.packet)

    def budget_args(self) -> tuple[float, int, int]:
        """RATE, BK, BV_FIXED as the allocation kernels take them."""
        return self.k.rate, self.k.bk, self.k.bv_fixed


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())
