"""Two-pass Value allocation: lambda from one histogram of the importances and one exact pass.

The Value keys of a group are ``imp_i x r_k`` (KS fixed step gains ``r_k`` per token), and lambda is
the count-th largest of them (``_v_count``). The radix select in ``decode`` finds it with 8 passes
of 4 bits. Here (docs/KERNEL_NOTES.md, runs 33-34):

  _value_hist (TWO_PASS)  grid (B*Hkv, NBLK)  importances, and a 2048-bin histogram of their top 11
                                             bits per group (one atomic add per token)
  _v_bracket              grid (groups,)     suffix sums; by bisection the bracket (lo, hi] that
                                             surely holds lambda: bounds on #{keys > x} at bin edges,
                                             a bin of margin below and two above for the rounding of
                                             the float32 product
  _v_cand                 grid (B*Hkv, NBLK) keys above hi counted, keys in (lo, hi] appended to the
                                             group's candidate buffer (CAP keys)
  _v_exact                grid (groups,)     lambda and the ties still to take, from the candidates,
                                             written where the radix select leaves them; a group
                                             whose candidates overflowed is flagged instead, and the
                                             radix passes (GATED) run for it alone

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
    IHSTRIDE,
    NPASS,
    SELBASE,
    _block_prog,
    _keys,
    _load_scalar,
    _v_count,
)


@triton.jit
def _bound(above_ptr, x, r, kok, MARGIN: tl.constexpr):
    """sum_k #{imp : bin(imp) >= bin(x / r_k) + MARGIN}: a bound on #{keys > x} (x a bit pattern)."""
    y = (x.to(tl.float32, bitcast=True) / r).to(tl.int32, bitcast=True) >> IHSHIFT
    idx = y + MARGIN
    ok = kok & (idx < IHBINS)
    return tl.sum(tl.load(above_ptr + tl.maximum(idx, 0), mask=ok, other=0), 0)


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
    base = ihist_ptr + grp * IHSTRIDE
    bb = tl.arange(0, IHBINS)
    h = tl.load(base + bb)
    tl.store(base + IHBINS + bb, tl.sum(h, 0) - tl.cumsum(h, 0) + h)  # #{imp in bins >= b}
    tl.debug_barrier()
    above_ptr = base + IHBINS
    kk = tl.arange(0, KS_PAD)
    kok = kk < KS
    r = tl.load(r_ptr + kk, mask=kok, other=1.0)
    # hi: the smallest x whose upper bound (a bin of margin below) is under count
    a = count * 0
    z = a + 0x7F800000
    for _ in range(32):
        live = a < z
        mid = a + (z - a) // 2
        ok = _bound(above_ptr, mid, r, kok, -1) < count
        z = tl.where(live & ok, mid, z)
        a = tl.where(live & ~ok, mid + 1, a)
    hi = z
    # lo: the largest x whose lower bound (two bins of margin above) still reaches count
    a = count * 0
    z = a + 0x7F800000
    for _ in range(32):
        live = a < z
        mid = a + (z - a) // 2
        ok = _bound(above_ptr, mid, r, kok, 2) < count
        z = tl.where(live & ok, mid, z)
        a = tl.where(live & ~ok, mid + 1, a)
    lo = z - 1  # -1 when even x = 0 leaves fewer than count above: every key (>= 0) is a candidate
    cc = tl.arange(0, CMETA)
    vals = tl.where(cc == 0, lo, tl.where(cc == 1, hi, 0))
    tl.store(cmeta_ptr + grp * CMETA + cc, vals)


@triton.jit
def _v_cand(vimp_ptr, len_ptr, r_ptr, cmeta_ptr, cand_ptr, TMAX, RATE, BK, BV_FIXED, CAP, USE_RATE: tl.constexpr,
            HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
            KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr):
    """Program (b*Hkv + h, block): keys above hi counted, keys in (lo, hi] appended (up to CAP)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    if (blk * BLK < T) & (count > 0):
        meta = cmeta_ptr + grp * CMETA
        lo = _load_scalar(meta)
        hi = _load_scalar(meta + 1)
        pos = blk * BLK + tl.arange(0, BLK)
        bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=pos < T, other=0.0)
        key, kok = _keys(bimp, r_ptr, KS, KS_PAD)
        valid = kok[:, None] & (pos[None, :] < T)
        n_above = tl.sum(tl.sum((valid & (key > hi)).to(tl.int32), 1), 0)
        cand = tl.reshape(valid & (key > lo) & (key <= hi), [KS_PAD * BLK])
        n = tl.sum(cand.to(tl.int32), 0)
        if n_above > 0:
            tl.atomic_add(meta + 3, n_above)
        if n > 0:
            off = tl.atomic_add(meta + 2, n)
            slot = off + tl.cumsum(cand.to(tl.int32), 0) - 1
            tl.store(cand_ptr + grp * CAP + slot, tl.reshape(key, [KS_PAD * BLK]), mask=cand & (slot < CAP))


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
    if (count > 0) & (n_cand <= CAP):
        need = count - _load_scalar(meta + 3)
        cc = tl.arange(0, CAP)
        keys = tl.load(cand_ptr + grp * CAP + cc, mask=cc < n_cand, other=-1)
        a = _load_scalar(meta) + 1  # lambda in [lo + 1, hi]
        z = _load_scalar(meta + 1)
        for _ in range(32):  # the largest x in [a, z] with #{candidates >= x} >= need
            live = a < z
            mid = a + (z - a + 1) // 2
            ok = tl.sum((keys >= mid).to(tl.int32), 0) >= need
            a = tl.where(live & ok, mid, a)
            z = tl.where(live & ~ok, mid - 1, z)
        lam = a
        left = need - tl.sum((keys > lam).to(tl.int32), 0)
        hb = hist_ptr + grp * HSTRIDE + SELBASE + 2 * (NPASS - 1)
        tl.store(hb, lam)
        tl.store(hb + 1, left)
