"""The two-pass Value allocation: lambda from a sampled histogram of the importances and one exact pass.

The default for steps of at least 2^19 (sequence, KV head, token) triples (``ReaderConfig.value_alloc``):

  _value_sample     grid (B*Hkv, spans)  1 in SAMPLE tokens' importances (runs of 8) counted in an 8192-bin
                                         histogram of their top 13 bits per head
  _v_bracket        grid (groups,)       the heads' histograms summed; by bisection the bracket (lo, hi]
                                         that holds lambda, widened for the sample's error
  _v_cand           grid (B*Hkv, NBLK)   every importance computed and stored; keys above hi counted, keys
                                         in (lo, hi] appended to the group's candidates and counted in
                                         CBINS bins over the bracket
  _v_exact(_split)  grid (groups[, n])   lambda's bin, then lambda and the ties still to take from that bin's
                                         candidates, written where the radix selection leaves them; a group
                                         whose candidates overflowed or whose bracket missed is flagged, and
                                         the radix passes (GATED) run for it alone

Downstream kernels read lambda as after the radix allocation; both rank the same float32 keys, so the
result is exact either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _block_prog, _load_scalar, next_pow2
from .plan import Step
from .radix import HSTRIDE, NPASS, SELBASE
from .value_alloc import CMETA, _importance, _steps_above, _v_count

# two-pass Value allocation (planekv.kernels.alloc2): per head an 8192-bin histogram of the
# importances' top 13 bits (exponent and 5 mantissa bits), per group their summed suffix sums; 8 words
# of state
IHSHIFT = tl.constexpr(18)


IHBINS = tl.constexpr(8192)


IH_BINS = 8192

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
               KS: tl.constexpr, KS_PAD: tl.constexpr, SAMPLE: tl.constexpr, SLACK, ZS, CBINS: tl.constexpr,
               cbins_ptr):
    """One program per group: (lo, hi] with #{keys > hi} < count <= #{keys > lo}, so that lambda lies in
    it; the candidate and above-hi counters start at zero. The histograms hold 1 in SAMPLE tokens
    (:func:`_value_sample`), so the counts are estimates, SAMPLE x the sample's, and the bracket is
    widened on each side by SLACK x count + ZS x sqrt(8 SAMPLE count) + 8 SAMPLE keys (ZS standard
    deviations of the estimate when runs of 8 tokens are sampled whole and each run holds at most 8 of
    the keys above: Var <= 8 SAMPLE count); it may still miss (the exact pass checks, :func:`_v_exact`).
    The candidates' histogram (:func:`_v_cand`) starts at zero, and cmeta word 6 holds its bins' width,
    2^shift keys, the smallest that spans (lo, hi] in CBINS bins."""
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
    # sample counts: hi where SAMPLE x B(x) < count - slack, lo where it reaches count + slack
    cf = count.to(tl.float32)
    slack = (cf * SLACK + ZS * tl.sqrt(8.0 * SAMPLE * cf)).to(tl.int32) + 8 * SAMPLE
    c_hi = tl.maximum(count - slack, 0) // SAMPLE  # 0: no x qualifies, hi = +inf (nothing above)
    c_lo = (count + slack + SAMPLE - 1) // SAMPLE
    # hi: the smallest x whose upper bound (a bin of margin below) is under count
    hi = _first_below(above_ptr, c_hi, r, kok, -1)
    # lo: the largest x whose lower bound (two bins of margin above) still reaches count; -1 when even
    # x = 0 leaves fewer than count above: every key (>= 0) is a candidate
    lo = _first_below(above_ptr, c_lo, r, kok, 2) - 1
    lo = tl.minimum(lo, hi)  # (already so unless SLACK < 0; an empty bracket misses, see _v_exact)
    shift = count * 0
    span1 = hi - lo - 1  # the bracket's keys are lo + 1 + [0, span1]
    for k in tl.static_range(31):  # the smallest shift with span1 >> shift < CBINS
        shift += ((span1 >> k) >= CBINS).to(tl.int32)
    zb = tl.arange(0, CBINS)
    tl.store(cbins_ptr + grp * CBINS + zb, tl.zeros([CBINS], tl.int32))
    cc = tl.arange(0, CMETA)
    vals = tl.where(cc == 0, lo, tl.where(cc == 1, hi, tl.where(cc == 6, shift, 0)))
    tl.store(cmeta_ptr + grp * CMETA + cc, vals)


@triton.jit
def _v_cand(vimp_ptr, len_ptr, r_ptr, cmeta_ptr, cand_ptr, TMAX, RATE, BK, BV_FIXED, CAP, USE_RATE: tl.constexpr,
            HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
            KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr, logit_ptr,
            mstat_ptr, sstat_ptr, hw_ptr, NSK, HQ: tl.constexpr, G: tl.constexpr, G2: tl.constexpr,
            NSK_PAD: tl.constexpr, HEAD_WEIGHT: tl.constexpr, CBINS: tl.constexpr, cbins_ptr):
    """Program (b*Hkv + h, block): the block's importances computed from the logits and stored (the
    sampled histogram pass did not write them), keys above hi counted, keys in (lo, hi] appended (up to
    CAP) and counted in the group's histogram of CBINS bins over (lo, hi] (for :func:`_v_exact`).

    A token's keys do not increase with the step (``_steps_above``), so its candidates are the
    steps n_hi .. n_lo - 1: everything is per token (KS products each, one prefix sum over the
    block), not per (step, token) pair."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    if blk * BLK < T:
        pos = blk * BLK + tl.arange(0, BLK)
        valid = pos < T
        bimp = _importance(logit_ptr, mstat_ptr, sstat_ptr, hw_ptr, pid_bh, pos, T, TMAX, NSK, HQ, HKV, G, G2,
                           NSK_PAD, HEAD_WEIGHT)
        tl.store(vimp_ptr + pid_bh * TMAX + pos, bimp, mask=valid)
        if count > 0:
            meta = cmeta_ptr + grp * CMETA
            lo = _load_scalar(meta)
            hi = _load_scalar(meta + 1)
            shift = _load_scalar(meta + 6)  # the candidates' bins are 2^shift keys wide
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
                        cb = (key - lo - 1) >> shift
                        tl.atomic_add(cbins_ptr + grp * CBINS + cb, tl.full(cb.shape, 1, tl.int32), mask=j < nc,
                                      sem="relaxed")


@triton.jit
def _bisect_chunks(cbase, n_scan, a, z, need_s, CH: tl.constexpr):
    """lambda = the largest x in [a, z] with #{keys >= x} >= need_s among cbase[0, n_scan), counting
    chunks of CH keys for each step (L1-resident after the first); and #{keys > lambda}, #{keys ==
    lambda}."""
    cc = tl.arange(0, CH)
    while a < z:
        mid = a + (z - a + 1) // 2
        n_ge = mid * 0
        for c0 in range(0, n_scan, CH):
            keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_scan, other=-1)
            n_ge += tl.sum((keys >= mid).to(tl.int32), 0)
        ok = n_ge >= need_s
        a = tl.where(ok, mid, a)
        z = tl.where(ok, z, mid - 1)
    n_gt = a * 0
    n_eq = a * 0
    for c0 in range(0, n_scan, CH):
        keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_scan, other=-1)
        n_gt += tl.sum((keys > a).to(tl.int32), 0)
        n_eq += tl.sum((keys == a).to(tl.int32), 0)
    return a, n_gt, n_eq


@triton.jit
def _bisect_regs(cbase, n_scan, a, z, need_s, SM: tl.constexpr, VOLATILE: tl.constexpr = False):
    """:func:`_bisect_chunks` for n_scan <= SM keys, held in registers: one load (VOLATILE: past L1, for
    keys other programs of the launch stored), then a reduction per step."""
    sm = tl.arange(0, SM)
    keys = tl.load(cbase + sm, mask=sm < n_scan, other=-1, volatile=VOLATILE)
    while a < z:
        mid = a + (z - a + 1) // 2
        ok = tl.sum((keys >= mid).to(tl.int32), 0) >= need_s
        a = tl.where(ok, mid, a)
        z = tl.where(ok, z, mid - 1)
    return a, tl.sum((keys > a).to(tl.int32), 0), tl.sum((keys == a).to(tl.int32), 0)


@triton.jit
def _exact_start(grp, len_ptr, cmeta_ptr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, HKV: tl.constexpr,
                 HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
                 KS: tl.constexpr, CAP: tl.constexpr, flag):
    """An exact pass's group: its cmeta words, count, candidates, keys to take among them (above hi: all
    taken), and whether the bracket held lambda without overflowing; where ``flag``, the fall-back flags
    stored (cmeta words 4 and 5: the radix passes and the tie counts run for a group that did not hold)."""
    b = grp // (HKV // HG)
    T = _load_scalar(len_ptr + b)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    meta = cmeta_ptr + grp * CMETA
    n_cand = _load_scalar(meta + 2)
    need = count - _load_scalar(meta + 3)
    held = (n_cand <= CAP) & (need > 0) & (need <= n_cand)
    if flag:
        over = ((count > 0) & ~held).to(tl.int32)
        tl.store(meta + 4, over)
        tl.store(meta + 5, over)
    return meta, count, n_cand, need, held


@triton.jit
def _exact_bin(meta, bins, need, CBINS: tl.constexpr):
    """Lambda's bin of the candidates' histogram ``bins``: its key range [a, z] and the keys to take in it
    (the bins above are all taken)."""
    bb = tl.arange(0, CBINS)
    hc = tl.load(bins + bb)
    suf = tl.sum(hc, 0) - tl.cumsum(hc, 0) + hc  # candidates in bins >= b
    jb = tl.max(tl.where(suf >= need, bb, -1), 0)  # (need <= the candidates: jb >= 0)
    need_s = need - tl.sum(tl.where(bb > jb, hc, 0), 0)
    shift = _load_scalar(meta + 6)
    a = _load_scalar(meta) + 1 + (jb << shift)
    return a, tl.minimum(_load_scalar(meta + 1), a + ((1 << shift) - 1)), need_s


@triton.jit
def _store_lambda(hbase, meta, lam, left, n_eq):
    """lambda and the keys at it still to take (``left`` of the ``n_eq``), where the radix select leaves
    them, and whether those keys need ranks (cmeta word 5)."""
    rank = left < n_eq  # only some of the keys at lambda are taken: they need their ranks
    # every key at lambda taken: lambda - 1 with none left to take selects the same keys (keys >= 0;
    # none of those at lambda - 1 is taken), and no tie counts are needed
    hb = hbase + SELBASE + 2 * (NPASS - 1)
    tl.store(hb, tl.where(rank, lam, lam - 1))
    tl.store(hb + 1, tl.where(rank, left, 0))
    tl.store(meta + 5, rank.to(tl.int32))


@triton.jit
def _v_exact(hist_ptr, len_ptr, cmeta_ptr, cand_ptr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, HKV: tl.constexpr,
             HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
             KS: tl.constexpr, CAP: tl.constexpr, CBINS: tl.constexpr, cbins_ptr, SMALL: tl.constexpr = 4096):
    """One program per group: lambda = the largest x with #{keys >= x} >= count, found among the
    candidates (the keys above hi are all taken), and the keys at lambda still to take; stored where
    the radix selection stores them. Overflowed candidates, or a bracket that missed lambda
    (#{keys > hi} >= count or #{keys > lo} < count), raise the group's fall-back flag instead.
    Lambda's bin first, from the candidates' histogram (:func:`_v_cand`); that bin's candidates moved to
    the front of the buffer in one pass; the bisection then runs over them and the bin's range only (a
    few dependent counts over a few keys, instead of one count over every candidate for each of the
    bracket's bits), with the keys in registers when they are at most SMALL."""
    grp = tl.program_id(0)
    meta, count, n_cand, need, held = _exact_start(grp, len_ptr, cmeta_ptr, RATE, BK, BV_FIXED, USE_RATE, HKV, HG, D,
                                                   W, MIN_V, PACKET, KS, CAP, True)
    if (count > 0) & held:
        # the candidates in chunks of CH (L1-resident after the first step): work in proportion to
        # n_cand, not CAP, and as many steps as the bracket has bits (a while loop, not 32)
        CH: tl.constexpr = min(CAP, 4096)
        cc = tl.arange(0, CH)
        cbase = cand_ptr + grp * CAP
        # lambda in [lo + 1, hi]: its bin's range [a, z]; the bisection counts cbase[0, n_scan) and takes need_s of them
        a, z, need_s = _exact_bin(meta, cbins_ptr + grp * CBINS, need, CBINS)
        # the bin's candidates to the front, in place: a chunk's keys are all loaded (its prefix sum
        # waits for every lane) before any lane stores, and only below the chunk's end
        n_scan = n_cand * 0
        for c0 in range(0, n_cand, CH):
            keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_cand, other=-1)
            inb = ((keys >= a) & (keys <= z)).to(tl.int32)  # (a >= 0: the masked -1 is out)
            tl.store(cbase + n_scan + tl.cumsum(inb, 0) - inb, keys, mask=inb > 0)
            n_scan += tl.sum(inb, 0)
        tl.debug_barrier()  # the moved keys visible to every lane
        if n_scan <= SMALL:  # the bin's keys in registers, loaded once
            lam, n_gt, n_eq = _bisect_regs(cbase, n_scan, a, z, need_s, SMALL)
        else:
            lam, n_gt, n_eq = _bisect_chunks(cbase, n_scan, a, z, need_s, CH)
        _store_lambda(hist_ptr + grp * HSTRIDE, meta, lam, need_s - n_gt, n_eq)


@triton.jit
def _v_exact_split(hist_ptr, len_ptr, cmeta_ptr, cand_ptr, cbins_ptr, keep_ptr, RATE, BK, BV_FIXED,
                   USE_RATE: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                   MIN_V: tl.constexpr, PACKET: tl.constexpr, KS: tl.constexpr, CAP: tl.constexpr,
                   CBINS: tl.constexpr, CH: tl.constexpr, KEEP: tl.constexpr):
    """:func:`_v_exact`'s binned pass over CAP / CH programs per group (program (group, chunk)): each
    finds lambda's bin from the candidates' histogram, appends its chunk's candidates in that bin to the
    group's ``keep`` list (KEEP keys; one atomic per program for the slots, cmeta word 7), and arrives
    (cmeta word 8); the last of the group's programs to arrive bisects among the kept keys (volatile
    loads: written by other programs of this launch), or, where more than KEEP keys fell in the bin, over
    every candidate within the bin's range, and stores lambda and the keys at it still to take as
    :func:`_v_exact` does. The same results; the scan over the candidates no longer runs in one
    program. The fall-back flags as in :func:`_v_exact` (program 0 stores them)."""
    tl.static_assert((CH <= CAP) & (CAP % CH == 0), "programs of CH candidates over a buffer of CAP")
    grp = tl.program_id(0)
    ch = tl.program_id(1)
    NCH: tl.constexpr = CAP // CH
    meta, count, n_cand, need, held = _exact_start(grp, len_ptr, cmeta_ptr, RATE, BK, BV_FIXED, USE_RATE, HKV, HG, D,
                                                   W, MIN_V, PACKET, KS, CAP, ch == 0)
    if (count > 0) & held:
        cbase = cand_ptr + grp * CAP
        kbase = keep_ptr + grp * KEEP
        cc = tl.arange(0, CH)
        c0 = ch * CH
        # (every program reads the bins, also one past the candidates: measured faster than reading them
        # only where needed, the last program's read then following its arrival)
        a, z, need_s = _exact_bin(meta, cbins_ptr + grp * CBINS, need, CBINS)
        if c0 < n_cand:
            keys = tl.load(cbase + c0 + cc, mask=c0 + cc < n_cand, other=-1)
            inb = ((keys >= a) & (keys <= z)).to(tl.int32)  # (a >= 0: the masked -1 is out)
            k = tl.sum(inb, 0)
            if k > 0:
                slot = tl.atomic_add(meta + 7, k, sem="relaxed") + tl.cumsum(inb, 0) - inb
                tl.store(kbase + slot, keys, mask=(inb > 0) & (slot < KEEP))
        tl.debug_barrier()  # every lane's stores before thread 0's acq_rel arrival
        if tl.atomic_add(meta + 8, 1, sem="acq_rel") == NCH - 1:
            n_scan = tl.atomic_add(meta + 7, 0, sem="acquire")
            if n_scan <= KEEP:
                lam, n_gt, n_eq = _bisect_regs(kbase, n_scan, a, z, need_s, KEEP, True)
            else:  # more keys in the bin than the list holds: count over every candidate, within the bin
                lam, n_gt, n_eq = _bisect_chunks(cbase, n_cand, a, z, need, CH)
                need_s = need  # (counted over every candidate: the bins above are in n_gt)
            _store_lambda(hist_ptr + grp * HSTRIDE, meta, lam, need_s - n_gt, n_eq)


@triton.jit
def _value_sample(logit_ptr, mstat_ptr, sstat_ptr, len_ptr, hw_ptr, ihist_ptr, TMAX, NSK, HQ: tl.constexpr,
                  HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr, G2: tl.constexpr, NSK_PAD: tl.constexpr,
                  TOK: tl.constexpr, SAMPLE: tl.constexpr, HEAD_WEIGHT: tl.constexpr):
    """Program (b*Hkv + h, span of TOK tokens): the importance histogram of 1 in SAMPLE of the span's
    tokens, runs of 8 consecutive ones (a 32-byte sector of each query head's logits) every 8 SAMPLE
    positions, one atomic add each; the bracket (:func:`_v_bracket` with SAMPLE) scales the counts.
    Spans of several blocks share the softmax statistics' loads (NSK splits per query head)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if blk * TOK < T:
        ii = tl.arange(0, TOK // SAMPLE)
        pos = blk * TOK + (ii // 8) * (8 * SAMPLE) + ii % 8
        bimp = _importance(logit_ptr, mstat_ptr, sstat_ptr, hw_ptr, pid_bh, pos, T, TMAX, NSK, HQ, HKV, G, G2,
                           NSK_PAD, HEAD_WEIGHT)
        dig = bimp.to(tl.int32, bitcast=True) >> IHSHIFT
        tl.atomic_add(ihist_ptr + (grp * (HG + 1) + hl) * IHBINS + dig, tl.full(dig.shape, 1, tl.int32),
                      mask=pos < T, sem="relaxed")


EXACT_BINS = 4096  # bins of the candidates' histogram over the bracket (the exact pass bisects in one bin)
BRACKET_WARPS = (4, 8)  # warps of _v_bracket: one KV head per group, several (their histograms summed)
EXACT_WARPS = 8  # warps of _v_exact (one program per group)
EXACT_SPLIT_WARPS = 4  # warps of _v_exact_split
SAMPLE_WARPS = 4  # warps of _value_sample
SAMPLE_SPAN = 8  # Value blocks per _value_sample program (they share the softmax statistics' loads)


def launch(st: Step, lengths: torch.Tensor) -> None:
    """The sampled histogram, the bracket, the candidates (and every importance) and the exact pass: lambda
    and the ties to take stored for each group whose bracket held, the fall-back flag set for the others."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    b, nblk, blk, nsk = pl.batch, pl.n_blocks, ch.block_tokens, pl.n_splits
    imp = dict(HQ=k.hq, G=k.g, G2=st.g2, NSK_PAD=st.nsk_pad, HEAD_WEIGHT=k.head_weight)
    span = min(SAMPLE_SPAN, next_pow2(nblk))
    _value_sample[(b * k.hk, -(-nblk // span))](pl.logits, pl.mstat, pl.sstat, lengths, c["hw"][st.layer], pl.ihist,
                                                pl.max_tokens, nsk, HKV=k.hk, HG=k.hg, TOK=span * blk,
                                                SAMPLE=ch.sample, **imp, num_warps=SAMPLE_WARPS)
    sel = dict(USE_RATE=k.use_rate, HKV=k.hk, HG=k.hg, D=k.d, W=k.w, MIN_V=k.min_v, PACKET=k.packet, KS=k.ks_v)
    cap, nb = pl.cand.shape[1], pl.cbins.shape[1]
    rate, bk, bv_fixed = st.budget_args()
    _v_bracket[(st.groups,)](pl.ihist, lengths, c["rv"], pl.cmeta, rate, bk, bv_fixed, KS_PAD=k.kspad_v,
                             SAMPLE=ch.sample, SLACK=float(st.sample_slack), ZS=float(st.sample_z), CBINS=nb,
                             cbins_ptr=pl.cbins, **sel, num_warps=BRACKET_WARPS[k.hg > 1])
    _v_cand[(b * k.hk, nblk)](pl.vimp, lengths, c["rv"], pl.cmeta, pl.cand, pl.max_tokens, rate, bk, bv_fixed, cap,
                              BLK=blk, KS_PAD=k.kspad_v, **sel, logit_ptr=pl.logits, mstat_ptr=pl.mstat,
                              sstat_ptr=pl.sstat, hw_ptr=c["hw"][st.layer], NSK=nsk, **imp, CBINS=nb,
                              cbins_ptr=pl.cbins, num_warps=ch.alloc_warps)
    if ch.exact_chunk:  # the scan over the candidates split over programs
        _v_exact_split[(st.groups, cap // ch.exact_chunk)](pl.hist, lengths, pl.cmeta, pl.cand, pl.cbins, pl.ckeep,
                                                          rate, bk, bv_fixed, CAP=cap, CBINS=nb, CH=ch.exact_chunk,
                                                          KEEP=pl.ckeep.shape[1], **sel,
                                                          num_warps=EXACT_SPLIT_WARPS)
    else:
        _v_exact[(st.groups,)](pl.hist, lengths, pl.cmeta, pl.cand, rate, bk, bv_fixed, CAP=cap, **sel, CBINS=nb,
                               cbins_ptr=pl.cbins, num_warps=EXACT_WARPS)
