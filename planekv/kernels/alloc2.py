"""Two-pass Value allocation: lambda from one histogram of the importances and one exact pass.

The Value keys of a group are ``imp_i x r_k`` (KS fixed step gains ``r_k`` per token), and lambda is
the count-th largest of them (``_v_count``). The radix select in ``decode`` finds it with 8 passes
of 4 bits. Here (docs/KERNEL_NOTES.md, runs 33-34):

  _value_hist (TWO_PASS)  grid (B*Hkv, NBLK)  importances, and an 8192-bin histogram of their top 13
                                             bits per head (one atomic add per token)
  _v_bracket              grid (groups,)     the heads' histograms summed, suffix sums; by bisection
                                             the bracket (lo, hi] that surely holds lambda: bounds
                                             on #{keys > x} at bin edges, a bin of margin below and
                                             two above for the rounding of the float32 product
  _v_cand                 grid (B*Hkv, NBLK) keys above hi counted, keys in (lo, hi] appended to the
                                             group's candidate buffer (CAP keys)
  _v_exact                grid (groups,)     lambda and the ties still to take, from the candidates,
                                             written where the radix select leaves them; a group
                                             whose candidates overflowed is flagged instead, and the
                                             radix passes (GATED) run for it alone; where every
                                             key at lambda is taken, lambda - 1 (none left to take),
                                             so that the tie counts (_value_ties, TIE_GATE) are
                                             needed only where some keys at lambda are not taken

Downstream kernels (ties, compaction, Value stage) read lambda as before. The result is the radix
select's: both rank the same float32 keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode import (
    CMETA,
    HSTRIDE,
    IHBINS,
    IHSHIFT,
    NPASS,
    SELBASE,
    _block_prog,
    _load_scalar,
    _steps_above,
    _v_count,
)


@triton.jit
def _first_below(above_ptr, count, r, kok, MARGIN: tl.constexpr):
    """The smallest bit pattern x in [0, +inf] with B(x) < count, B(x) = sum_k #{imp : bin(imp) >=
    bin(x / r_k) + MARGIN} (non-increasing in x: a bound on #{keys > x}); +inf when there is none.
    An 8-way search: 7 points of the interval per step, their bounds loaded at once (3 bits a step,
    ~11 steps for 31 bits instead of 31 dependent ones)."""
    ii = tl.arange(0, 8)
    a = count * 0
    z = a + 0x7F800000
    while a < z:
        mid = (a.to(tl.int64) + (z - a).to(tl.int64) * ii // 8).to(tl.int32)  # [8], mid[0] = a (unused)
        y = (mid.to(tl.float32, bitcast=True)[:, None] / r[None, :]).to(tl.int32, bitcast=True) >> IHSHIFT
        idx = y + MARGIN
        okk = kok[None, :] & (idx < IHBINS)
        bound = tl.sum(tl.load(above_ptr + tl.maximum(idx, 0), mask=okk, other=0), 1)  # [8]
        ok = (bound < count) & (ii > 0)
        first = tl.min(tl.where(ok, ii, 8), 0)
        last = tl.max(tl.where((ii > 0) & ~ok, ii, 0), 0)
        z = tl.where(first < 8, tl.sum(tl.where(ii == first, mid, 0), 0), z)
        a = tl.where(last > 0, tl.sum(tl.where(ii == last, mid, 0), 0) + 1, a)
    return z


@triton.jit
def _v_bracket(ihist_ptr, len_ptr, r_ptr, cmeta_ptr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, HKV: tl.constexpr,
               HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
               KS: tl.constexpr, KS_PAD: tl.constexpr):
    """One program per group: (lo, hi] with #{keys > hi} < count <= #{keys > lo} for sure, so lambda
    lies in it; the candidate and above-hi counters start at zero."""
    grp = tl.program_id(0)
    b = grp // (HKV // HG)
    T = _load_scalar(len_ptr + b)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    base = ihist_ptr + grp * (HG + 1) * IHBINS
    bb = tl.arange(0, IHBINS)
    h = tl.load(base + bb)
    for hl in tl.static_range(1, HG):  # the group's heads counted apart (less contention on the bins)
        h += tl.load(base + hl * IHBINS + bb)
    above_ptr = base + HG * IHBINS
    tl.store(above_ptr + bb, tl.sum(h, 0) - tl.cumsum(h, 0) + h)  # #{imp in bins >= b}
    tl.debug_barrier()
    kk = tl.arange(0, KS_PAD)
    kok = kk < KS
    r = tl.load(r_ptr + kk, mask=kok, other=1.0)
    # hi: the smallest x whose upper bound (a bin of margin below) is under count
    hi = _first_below(above_ptr, count, r, kok, -1)
    # lo: the largest x whose lower bound (two bins of margin above) still reaches count; -1 when even
    # x = 0 leaves fewer than count above: every key (>= 0) is a candidate
    lo = _first_below(above_ptr, count, r, kok, 2) - 1
    cc = tl.arange(0, CMETA)
    vals = tl.where(cc == 0, lo, tl.where(cc == 1, hi, 0))
    tl.store(cmeta_ptr + grp * CMETA + cc, vals)


@triton.jit
def _v_cand(vimp_ptr, len_ptr, r_ptr, cmeta_ptr, cand_ptr, TMAX, RATE, BK, BV_FIXED, CAP, USE_RATE: tl.constexpr,
            HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
            KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr):
    """Program (b*Hkv + h, block): keys above hi counted, keys in (lo, hi] appended (up to CAP).

    A token's keys do not increase with the step (``_steps_above``), so its candidates are the
    steps n_hi .. n_lo - 1: everything is per token (KS products each, one prefix sum over the
    block), not per (step, token) pair."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    if (blk * BLK < T) & (count > 0):
        meta = cmeta_ptr + grp * CMETA
        lo = _load_scalar(meta)
        hi = _load_scalar(meta + 1)
        pos = blk * BLK + tl.arange(0, BLK)
        valid = pos < T
        bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=valid, other=0.0)
        n_hi, n_lo = _steps_above(bimp, r_ptr, hi, lo, KS)
        n_hi = tl.where(valid, n_hi, 0)
        nc = tl.where(valid, n_lo, 0) - n_hi  # this token's candidates
        n_above = tl.sum(n_hi, 0)
        n = tl.sum(nc, 0)
        if n_above > 0:
            tl.atomic_add(meta + 3, n_above, sem="relaxed")
        if n > 0:
            off = tl.atomic_add(meta + 2, n, sem="relaxed")
            slot = off + tl.cumsum(nc, 0) - nc
            c_max = tl.max(nc, 0)
            for j in tl.static_range(KS):
                if j < c_max:
                    kj = tl.minimum(n_hi + j, KS - 1)
                    key = (bimp * tl.load(r_ptr + kj)).to(tl.int32, bitcast=True)
                    tl.store(cand_ptr + grp * CAP + slot + j, key, mask=(j < nc) & (slot + j < CAP))


@triton.jit
def _v_exact(hist_ptr, len_ptr, cmeta_ptr, cand_ptr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, HKV: tl.constexpr,
             HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
             KS: tl.constexpr, CAP: tl.constexpr):
    """One program per group: lambda = the largest x with #{keys >= x} >= count, found among the
    candidates (the keys above hi are all taken), and the keys at lambda still to take; stored where
    the radix select stores them. Overflowed candidates raise the group's fall-back flag instead."""
    grp = tl.program_id(0)
    b = grp // (HKV // HG)
    T = _load_scalar(len_ptr + b)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    meta = cmeta_ptr + grp * CMETA
    n_cand = _load_scalar(meta + 2)
    over = (n_cand > CAP) & (count > 0)
    tl.store(meta + 4, over.to(tl.int32))
    tl.store(meta + 5, over.to(tl.int32))  # the keys at lambda need ranks (_value_ties runs for the group)
    if (count > 0) & (n_cand <= CAP):
        need = count - _load_scalar(meta + 3)
        # the candidates in chunks of CH (L1-resident after the first step): work in proportion to
        # n_cand, not CAP, and as many steps as the bracket has bits (a while loop, not 32)
        CH: tl.constexpr = min(CAP, 4096)
        cc = tl.arange(0, CH)
        cbase = cand_ptr + grp * CAP
        a = _load_scalar(meta) + 1  # lambda in [lo + 1, hi]
        z = _load_scalar(meta + 1)
        while a < z:  # the largest x in [a, z] with #{candidates >= x} >= need
            mid = a + (z - a + 1) // 2
            n_ge = mid * 0
            for c0 in range(0, n_cand, CH):
                keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_cand, other=-1)
                n_ge += tl.sum((keys >= mid).to(tl.int32), 0)
            ok = n_ge >= need
            a = tl.where(ok, mid, a)
            z = tl.where(ok, z, mid - 1)
        lam = a
        n_gt = lam * 0
        n_eq = lam * 0
        for c0 in range(0, n_cand, CH):
            keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_cand, other=-1)
            n_gt += tl.sum((keys > lam).to(tl.int32), 0)
            n_eq += tl.sum((keys == lam).to(tl.int32), 0)
        left = need - n_gt
        rank = left < n_eq  # only some of the keys at lambda are taken: they need their ranks
        # every key at lambda taken: lambda - 1 with none left to take selects the same keys (keys >= 0;
        # none of those at lambda - 1 is taken), and no tie counts are needed
        lam = tl.where(rank, lam, lam - 1)
        left = tl.where(rank, left, 0)
        hb = hist_ptr + grp * HSTRIDE + SELBASE + 2 * (NPASS - 1)
        tl.store(hb, lam)
        tl.store(hb + 1, left)
        tl.store(meta + 5, rank.to(tl.int32))
