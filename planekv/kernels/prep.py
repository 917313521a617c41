"""Stage 1 of a decode step, the Key allocation (DESIGN section 1, step 5): one program per allocation group.

``_prep`` computes the channel importances a = sum_g (q~ sigma_K)^2 of each KV head, the Key budget's lambda
(a bisection over 31 bits, or radix passes for small groups), every channel's depth, the list of channels of
depth > 0 that the FMA Key stage walks (kord, kcnt), the weights w = q~ sigma_K (float32 and fp16 hi / lo) and
base = q~ . mu_K, and zeroes the group's radix and importance histograms for the allocations that follow.
With fused transforms it first computes q~ = q M_K^T itself (one tf32x3 product per group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _rotate_rows, _split16, next_pow2
from .plan import Step
from .radix import CNTBASE, HSTRIDE, NBINS, NPASS, _kth_largest
from .value_alloc_two_pass import IHBINS

KSEG = tl.constexpr(16)  # words per KV head of the Key stage's channel-list segments (>= W + 1)


KSEG_WORDS = 16


@triton.jit
def _prep(qt_ptr, sig_ptr, mu_ptr, r_ptr, whi_ptr, wlo_ptr, wf_ptr, base_ptr, kdep_ptr, kord_ptr, kcnt_ptr, hist_ptr,
          count_k,
          rhist_ptr, ihist_ptr, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
          D: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_K: tl.constexpr, HG_PAD: tl.constexpr,
          RHW: tl.constexpr, TWO_PASS: tl.constexpr, KORDER: tl.constexpr, RADIX: tl.constexpr = False,
          QROWS: tl.constexpr = 0, q_ptr=None, sq_b=0, sq_h=0, sq_d=0, mkT_ptr=None, kmax_ptr=None):
    """One program per allocation group: HG KV heads of one sequence, N = HG * D channels. With Key
    refinement (RHW > 0 words of refinement histograms per group) those start at zero too. The Key
    allocation's lambda (the count-th largest key) by a bisection over its 31 bits, or with RADIX by
    the 8 radix passes of :func:`_kth_largest` (the same lambda: 8 dependent histograms instead of 32
    dependent counts). QROWS > 0: the group's HG * G transformed queries q~ = q M_K^T are computed here
    first (q of any float dtype at strides sq_*, M_K^T at mkT_ptr; rows padded to QROWS) and stored to
    qt_ptr for the Key stages that read them, instead of by a copy and a GEMM before the launch. ``kmax_ptr``
    (a tiered cache: int32 [B, Hkv, D], each channel's resident depth): ``kdep`` keeps the allocation's depths,
    the channel lists the Key stage walks are built at the depths capped there."""
    pid = tl.program_id(0)
    n_groups_b: tl.constexpr = HKV // HG
    b = pid // n_groups_b
    h0 = (pid % n_groups_b) * HG
    N: tl.constexpr = HG_PAD * D
    hh = tl.arange(0, HG_PAD)
    cc = tl.arange(0, D)
    hvalid = hh < HG
    if QROWS > 0:
        _rotate_rows(q_ptr + b * sq_b + h0 * G * sq_h, sq_h, sq_d, mkT_ptr, qt_ptr + (b * HQ + h0 * G) * D, HG * G,
                     QROWS, D)
        tl.debug_barrier()  # q~ stored by every lane before any loads it below
    # importance a[h, c] = sum_g (q~_{hG+g, c} sigma_{h, c})^2 ; also w = q~ sigma and base per query head
    sig = tl.load(sig_ptr + (h0 + hh[:, None]) * D + cc[None, :], mask=hvalid[:, None], other=0.0)
    mu = tl.load(mu_ptr + (h0 + hh[:, None]) * D + cc[None, :], mask=hvalid[:, None], other=0.0)
    a = tl.zeros([HG_PAD, D], dtype=tl.float32)
    for g in tl.static_range(G):
        qrow = (b * HQ + (h0 + hh) * G + g)[:, None] * D + cc[None, :]
        qt = tl.load(qt_ptr + qrow, mask=hvalid[:, None], other=0.0)
        w = qt * sig
        a += w * w
        w_hi, w_lo = _split16(w)
        tl.store(whi_ptr + qrow, w_hi, mask=hvalid[:, None])
        tl.store(wlo_ptr + qrow, w_lo, mask=hvalid[:, None])
        # float32, [B*Hkv, D, G]: a channel's G weights side by side for the FMA Key stage
        tl.store(wf_ptr + ((b * HKV + h0 + hh[:, None]) * D + cc[None, :]) * G + g, w, mask=hvalid[:, None])
        tl.store(base_ptr + b * HQ + (h0 + hh) * G + g, tl.sum(qt * mu, 1), mask=hvalid)
    af = tl.reshape(a, [N])
    valid = tl.reshape(hvalid[:, None] & (cc[None, :] >= 0), [N])
    kk = tl.arange(0, KS_PAD)
    r = tl.load(r_ptr + kk, mask=kk < KS, other=0.0)
    prio = af[None, :] * r[:, None]  # [KS_PAD, N], step-major
    ok = (kk[:, None] < KS) & valid[None, :]
    key = tl.where(ok, prio.to(tl.int32, bitcast=True), -1)
    # Smallest lambda (bit pattern) with #(key > lambda) < count: bisection over 31 bits. (An 8-way
    # search, 11 steps of 7 counts, measured slower for groups of 8 heads.)
    lo = tl.zeros([], dtype=tl.int32) - 1
    hi = tl.zeros([], dtype=tl.int32) + 0x7F800000
    keyf = tl.reshape(key, [KS_PAD * N])  # one reduction per step, not one per axis
    if RADIX:
        hi = _kth_largest(keyf, count_k)
    else:
        for _ in range(32):
            live = hi - lo > 1
            mid = lo + (hi - lo) // 2
            less = tl.sum((keyf > mid).to(tl.int32), 0) < count_k
            hi, lo = tl.where(live & less, mid, hi), tl.where(live & ~less, mid, lo)
    lam = tl.where(count_k > 0, hi, 0x7FFFFFFF)
    strict = key > lam
    need = count_k - tl.sum(tl.sum(strict.to(tl.int32), 1), 0)
    tie = (key == lam).to(tl.int32)
    order = tl.reshape(tl.cumsum(tl.reshape(tie, [KS_PAD * N]), 0), [KS_PAD, N])
    take = strict | ((tie > 0) & (order <= need))
    depth = MIN_K + tl.sum(take.to(tl.int32), 0)  # [N]
    dep2 = tl.reshape(depth, [HG_PAD, D])
    tl.store(kdep_ptr + ((b * HKV + h0 + hh[:, None]) * D + cc[None, :]), dep2, mask=hvalid[:, None])
    if kmax_ptr is not None:  # a tiered cache: what the Key stage reads is capped at the resident depth
        dep2 = tl.minimum(dep2, tl.load(kmax_ptr + ((b * HKV + h0 + hh[:, None]) * D + cc[None, :]),
                                        mask=hvalid[:, None], other=0))
    # each head's channels of depth > 0 as a list (depth << 8 | channel) and its length, for the
    # FMA Key stage, which walks that list only, one segment per depth (deepest first), so that each
    # segment's loop reads exactly t planes with no masks (KSEG words per head: [0] the list's
    # length, [t] how many channels have depth t)
    act = dep2 > 0
    slot = tl.cumsum(act.to(tl.int32), 1) - 1  # KORDER 1: channel order
    tt = tl.arange(0, KSEG)
    seg = tl.zeros([HG_PAD, KSEG], dtype=tl.int32)
    for t in tl.static_range(1, MIN_K + KS + 1):  # depths up to W = MIN_K + KS
        eq = dep2 == t
        if KORDER == 0:  # by depth, deepest first
            n_gt = tl.sum((dep2 > t).to(tl.int32), 1)
            slot = tl.where(eq, n_gt[:, None] + tl.cumsum(eq.to(tl.int32), 1) - 1, slot)
        seg = tl.where(tt[None, :] == t, tl.sum(eq.to(tl.int32), 1)[:, None], seg)
    seg = tl.where(tt[None, :] == 0, tl.sum(act.to(tl.int32), 1)[:, None], seg)
    tl.store(kord_ptr + (b * HKV + h0 + hh[:, None]) * D + slot, (dep2 << 8) | cc[None, :],
             mask=hvalid[:, None] & act)
    tl.store(kcnt_ptr + (b * HKV + h0 + hh[:, None]) * KSEG + tt[None, :], seg, mask=hvalid[:, None])
    # this group's radix histograms start at zero every step
    zi = tl.arange(0, NBINS * NPASS)
    tl.store(hist_ptr + pid * HSTRIDE + zi, tl.zeros([NBINS * NPASS], tl.int32))
    zc = tl.arange(0, NPASS)
    tl.store(hist_ptr + pid * HSTRIDE + CNTBASE + zc, tl.zeros([NPASS], tl.int32))
    if RHW > 0:
        zr = tl.arange(0, RHW)
        tl.store(rhist_ptr + pid * RHW + zr, tl.zeros([RHW], tl.int32))
    if TWO_PASS:  # the two-pass Value allocation's importance histogram
        zb = tl.arange(0, IHBINS)
        for hz in tl.static_range(HG):  # one histogram per head of the group (their sums: _v_bracket)
            tl.store(ihist_ptr + (pid * (HG + 1) + hz) * IHBINS + zb, tl.zeros([IHBINS], tl.int32))


PREP_WARPS = 8  # warps of _prep (one program per allocation group; 8 measured best)


def launch(st: Step, q: torch.Tensor, k_max: torch.Tensor | None = None) -> None:
    """q~ = q M_K^T (inside _prep with fused transforms, else a copy and a GEMM), then ``_prep``: the Key
    depths, channel lists, weights and base, and the group's histograms zeroed. q: [B, Hq, d], any float;
    k_max (a tiered cache's residency): int32 [B, Hkv, d]."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    if ch.fuse_transforms:  # q~ computed by _prep, one group's rows per program
        qrot = dict(QROWS=max(16, next_pow2(k.hg * k.g)), q_ptr=q, sq_b=q.stride(0), sq_h=q.stride(1),
                    sq_d=q.stride(2), mkT_ptr=c["mkT"])
    else:
        pl.qbuf.copy_(q)
        torch.mm(pl.qbuf.view(-1, k.d), c["mkT"], out=pl.qt.view(-1, k.d))
        qrot = {}
    _prep[(st.groups,)](pl.qt, c["sig_k"][st.layer], c["mu_k"][st.layer], c["rk"], pl.w_hi, pl.w_lo, pl.wf, pl.base,
                        pl.kdep, pl.kord, pl.kcnt, pl.hist, k.count_k, pl.rhist, pl.ihist, HQ=k.hq, HKV=k.hk, HG=k.hg,
                        G=k.g, D=k.d, KS=k.ks_k, KS_PAD=k.kspad_k, MIN_K=k.min_k, HG_PAD=next_pow2(k.hg),
                        RHW=k.rhw if k.refine else 0, TWO_PASS=ch.two_pass, KORDER=ch.key_walk, RADIX=ch.prep_radix,
                        **qrot, **({} if k_max is None else {"kmax_ptr": k_max}), num_warps=PREP_WARPS)
