"""The Value allocation (DESIGN section 1, steps 6-7): per token, how many V planes the step reads.

Token importance b_i = sum_g p_gi^2 (times the head's weight with ``value_head_weight``); a token's keys are
b_i x r_k for its KS step gains r_k, and lambda is the count-th largest key of the allocation group. The
radix allocation finds lambda with NPASS passes over all keys (``_value_hist`` computes the importances and
pass 1, ``_value_radix`` passes 2..NPASS, each selected by the group's last program); the two-pass
allocation (:mod:`.value_alloc_two_pass`) brackets lambda first and uses the radix passes only for groups
whose bracket overflowed or missed (GATED). ``_value_ties`` counts the keys at lambda per block, so that
ties are taken in the reference's (step, item) order. ``_value_order`` turns lambda into each token's depth
and lists a block's tokens of depth > 0 (in position order, or deepest first for the int8 Value stage) for
the compacting Value stages; the other Value stages compute depths themselves (:func:`_block_depths`,
:func:`_depths`).

Exactness: gains are ranked in float32 (the reference ranks float64), so depths can differ from the
reference only for gains within float32 rounding of lambda.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _block_prog, _load_scalar, _probs, _softmax_stats, next_pow2
from .plan import Step
from .radix import HSTRIDE, NBINS, NPASS, SELBASE, _arrive, _radix_digit

CMETA = tl.constexpr(16)


CMETA_WORDS = 16


@triton.jit
def _v_count(T, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
             HG: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr, KS: tl.constexpr):
    """Value steps to take for a group: min((B_V - m n) // p, K n), with B_V as ReadPolicy.budgets."""
    if USE_RATE:
        tf = T.to(tl.float64)
        bv = tl.floor((2.0 * tf * D * RATE - tf * BK) / D + 1e-9).to(tl.int32)
    else:
        bv = BV_FIXED + T * 0
    bv = tl.minimum(bv, T * W) * HG
    n = HG * T
    cnt = (bv - MIN_V * n) // PACKET
    cnt = tl.maximum(tl.minimum(cnt, KS * n), 0)
    return cnt


@triton.jit
def _importance(logit_ptr, mstat_ptr, sstat_ptr, hw_ptr, pid_bh, pos, T, TMAX, NSK, HQ: tl.constexpr,
                HKV: tl.constexpr, G: tl.constexpr, G2: tl.constexpr, NSK_PAD: tl.constexpr,
                HEAD_WEIGHT: tl.constexpr):
    """Value importance of the tokens ``pos`` of row b*HKV + h: the sum over the KV head's query heads
    of p^2 (0 at positions >= T), times the head's weight with HEAD_WEIGHT."""
    b = pid_bh // HKV
    h = pid_bh % HKV
    mg, z = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G2, NSK_PAD)
    p = _probs(logit_ptr, b, h, pos, T, mg, z, TMAX, HQ, G, G2)
    bimp = tl.sum(p * p, 0)
    if HEAD_WEIGHT:  # ReadPolicy.value_head_weight: times the head's sum of sigma_V^2
        bimp = bimp * _load_scalar(hw_ptr + h)
    return bimp


@triton.jit
def _steps_above(bimp, r_ptr, x, y, KS: tl.constexpr):
    """Per token: #{k : key_k > x} and #{k : key_k > y}, key_k = imp x r_k as float32 bits. The step
    gains r_k do not increase with k (``step_gains``) and float32 rounding is monotone, so a token's
    keys do not increase either and each count is a prefix of its steps: KS products per token, no
    [steps, tokens] tensor."""
    n_x = tl.zeros(bimp.shape, dtype=tl.int32)
    n_y = tl.zeros(bimp.shape, dtype=tl.int32)
    for k in tl.static_range(KS):
        key = (bimp * _load_scalar(r_ptr + k)).to(tl.int32, bitcast=True)
        n_x += (key > x).to(tl.int32)
        n_y += (key > y).to(tl.int32)
    return n_x, n_y


@triton.jit
def _keys(bimp, r_ptr, KS: tl.constexpr, KS_PAD: tl.constexpr):
    kk = tl.arange(0, KS_PAD)
    r = tl.load(r_ptr + kk, mask=kk < KS, other=0.0)
    return (bimp[None, :] * r[:, None]).to(tl.int32, bitcast=True), kk < KS  # [KS_PAD, BLOCK]


@triton.jit
def _value_hist(logit_ptr, mstat_ptr, sstat_ptr, len_ptr, r_ptr, vimp_ptr, hist_ptr, hw_ptr, TMAX, NSK,
                HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr, G2: tl.constexpr,
                NSK_PAD: tl.constexpr, BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr,
                HEAD_WEIGHT: tl.constexpr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, D: tl.constexpr,
                W: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr):
    """Program (b*Hkv + h, block of BLK tokens) of the radix allocation: the tokens' Value importances
    (stored to ``vimp``) and radix pass 1 over their keys; the group's last program selects pass 1's digit
    (:func:`_arrive`; RATE .. PACKET as :func:`_v_count` takes them)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if blk * BLK < T:
        pos = blk * BLK + tl.arange(0, BLK)
        bimp = _importance(logit_ptr, mstat_ptr, sstat_ptr, hw_ptr, pid_bh, pos, T, TMAX, NSK, HQ, HKV, G, G2,
                           NSK_PAD, HEAD_WEIGHT)
        tl.store(vimp_ptr + pid_bh * TMAX + pos, bimp, mask=pos < T)
        # radix pass 1: every key matches the empty prefix
        _pass_hist(bimp, pos < T, 0, r_ptr, hist_ptr + grp * HSTRIDE, 1, KS, KS_PAD)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    _arrive(hist_ptr + grp * HSTRIDE, count, HG * tl.num_programs(1), 1)


@triton.jit
def _value_radix(vimp_ptr, len_ptr, r_ptr, hist_ptr, cmeta_ptr, TMAX, RATE, BK, BV_FIXED, NBLK,
                 USE_RATE: tl.constexpr, PASS: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr,
                 W: tl.constexpr, BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                 PACKET: tl.constexpr, GATED: tl.constexpr):
    """Radix pass PASS (2..NPASS; 1 as well when GATED) over the keys that match the digits chosen
    so far. GATED (the two-pass allocation's fall back): only in groups whose candidates overflowed,
    on a grid of (B*Hkv, a few) programs that stride over the NBLK blocks, so that a pass with
    nothing to do costs a few programs reading one flag instead of a full grid. The group's last
    program to finish selects the pass's digit (:func:`_arrive`)."""
    pid_bh, blk0, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if GATED:  # only in groups whose candidates overflowed
        go = _load_scalar(cmeta_ptr + grp * CMETA + 4) != 0
    else:
        go = True
    if go:
        if GATED:
            for blk in range(blk0, NBLK, tl.num_programs(1)):
                _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk, T, TMAX, RATE, BK, BV_FIXED, USE_RATE,
                             PASS, HG, D, W, BLK, KS, KS_PAD, MIN_V, PACKET)
        else:
            _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk0, T, TMAX, RATE, BK, BV_FIXED, USE_RATE, PASS,
                         HG, D, W, BLK, KS, KS_PAD, MIN_V, PACKET)
        _arrive(hist_ptr + grp * HSTRIDE, _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS),
                HG * tl.num_programs(1), PASS)


@triton.jit
def _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk, T, TMAX, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr,
                 PASS: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
                 KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr):
    """One block's share of radix pass PASS."""
    if blk * BLK < T:
        count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
        hbase = hist_ptr + grp * HSTRIDE
        if PASS == 1:
            prefix = count * 0
        else:
            prefix = _load_scalar(hbase + SELBASE + 2 * (PASS - 2))  # digits of passes 1..PASS-1
        pos = blk * BLK + tl.arange(0, BLK)
        bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=pos < T, other=0.0)
        _pass_hist(bimp, (pos < T) & (count > 0), prefix, r_ptr, hbase + (PASS - 1) * NBINS, PASS, KS, KS_PAD)


@triton.jit
def _pass_hist(bimp, ok, prefix, r_ptr, dst, PASS: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr):
    """Adds to ``dst`` (NBINS words) the histogram of radix pass PASS's digit over the keys
    imp x r_k of the tokens ``ok`` (importances ``bimp``) whose digits of the earlier passes are
    ``prefix``.

    The histogram of a [KS_PAD * BLK] reshape of [KS_PAD, BLK] keys with a mask reshaped alike
    paired values and mask differently on the GPU (KS_PAD = 4, BLK = 256: a quarter of the counted keys
    were padding rows), which the interpreter cannot show. So no mask travels beside the reshape: one
    histogram of 2 NBINS bins whose upper half receives the masked keys and is not added. After the first
    digits most blocks hold no key under the chosen prefix: from pass 2 they skip the histogram
    (O(keys x bins) as Triton lowers it)."""
    key, kok = _keys(bimp, r_ptr, KS, KS_PAD)
    above, digit = _radix_digit(key, PASS)
    mk = kok[:, None] & ok[None, :] & (above == prefix)
    if PASS > 1:  # (in pass 1 every key matches)
        go = tl.sum(tl.sum(mk.to(tl.int32), 1), 0) > 0
    else:
        go = True
    if go:
        hist2 = tl.histogram(tl.reshape(tl.where(mk, digit, NBINS), [KS_PAD * bimp.shape[0]]), 2 * NBINS)
        bins2 = tl.arange(0, 2 * NBINS)
        tl.atomic_add(dst + bins2, hist2, mask=(bins2 < NBINS) & (hist2 > 0), sem="relaxed")


@triton.jit
def _value_ties(vimp_ptr, len_ptr, r_ptr, hist_ptr, tie_ptr, TMAX, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr,
                HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
                KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
                TIE_GATE: tl.constexpr = False, cmeta_ptr=None):
    """Keys equal to lambda in this block, per step: tie[group, hl * NBLK + blk, k]. TIE_GATE (the
    two-pass allocation): only in groups whose keys at lambda need ranks (``cmeta`` word 5, set by
    ``_v_exact``); elsewhere nobody reads the counts."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if TIE_GATE:
        if _load_scalar(cmeta_ptr + grp * CMETA + 5) == 0:
            return
    NBLK = tl.num_programs(1)
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    lam = _load_scalar(hist_ptr + grp * HSTRIDE + SELBASE + 2 * (NPASS - 1))
    lam = tl.where(count > 0, lam, 0x7FFFFFFF)
    pos = blk * BLK + tl.arange(0, BLK)
    bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=pos < T, other=0.0)
    key, kok = _keys(bimp, r_ptr, KS, KS_PAD)
    eq = (key == lam) & kok[:, None] & (pos[None, :] < T)
    kk = tl.arange(0, KS_PAD)
    tl.store(tie_ptr + ((grp * HG + hl) * NBLK + blk) * KS_PAD + kk, tl.sum(eq.to(tl.int32), 1))


@triton.jit
def _lambda_need(hist_ptr, grp, T, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                 HG: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr, KS: tl.constexpr):
    """Lambda and the ties at lambda still to take (where the selection left them)."""
    count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    lam = _load_scalar(hist_ptr + grp * HSTRIDE + SELBASE + 2 * (NPASS - 1))
    need = _load_scalar(hist_ptr + grp * HSTRIDE + SELBASE + 2 * (NPASS - 1) + 1)
    return tl.where(count > 0, lam, 0x7FFFFFFF), tl.where(count > 0, need, 0)


@triton.jit
def _tie_run(tie_ptr, grp, hl, blk, NBLK, HG: tl.constexpr, KS_PAD: tl.constexpr, NT_PAD: tl.constexpr):
    """This block's rank base of the ties at lambda for each step: all ties of earlier steps, plus
    ties of the same step in blocks that come earlier in item order (head, then block)."""
    kk = tl.arange(0, KS_PAD)
    NT = HG * NBLK
    me = hl * NBLK + blk
    TR: tl.constexpr = min(NT_PAD, 32)  # rows of tie counts per load (few registers)
    per_k = tl.zeros([KS_PAD], dtype=tl.int32)
    before = tl.zeros([KS_PAD], dtype=tl.int32)
    for t0 in range(0, NT, TR):
        tt = t0 + tl.arange(0, TR)
        tie = tl.load(tie_ptr + (grp * NT + tt[:, None]) * KS_PAD + kk[None, :], mask=tt[:, None] < NT, other=0)
        per_k += tl.sum(tie, 0)
        before += tl.sum(tl.where(tt[:, None] < me, tie, 0), 0)
    return tl.cumsum(per_k, 0) - per_k + before


@triton.jit
def _lambda_and_run(hist_ptr, tie_ptr, grp, hl, blk, NBLK, T, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr,
                    D: tl.constexpr, W: tl.constexpr, HG: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
                    KS: tl.constexpr, KS_PAD: tl.constexpr, NT_PAD: tl.constexpr):
    """Lambda, the ties at lambda still to take, and this block's rank base of those ties."""
    lam, need = _lambda_need(hist_ptr, grp, T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    return lam, need, _tie_run(tie_ptr, grp, hl, blk, NBLK, HG, KS_PAD, NT_PAD)


@triton.jit
def _depths(bimp, valid, r_ptr, lam, need, run, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
            PACKET: tl.constexpr):
    """Value depths of consecutive tokens (importance ``bimp``) given lambda and the ties' rank base
    ``run``; returns the depths and the rank base after these tokens."""
    key, kok = _keys(bimp, r_ptr, KS, KS_PAD)
    ok = kok[:, None] & valid[None, :]
    strict = tl.sum(((key > lam) & ok).to(tl.int32), 0)
    eq = ((key == lam) & ok).to(tl.int32)  # [KS_PAD, n]
    rank = run[:, None] + tl.cumsum(eq, 1) - eq
    taken = tl.sum(((eq > 0) & (rank < need)).to(tl.int32), 0)
    return tl.where(valid, MIN_V + PACKET * (strict + taken), 0), run + tl.sum(eq, 1)


@triton.jit
def _block_depths(vimp_ptr, r_ptr, hist_ptr, tie_ptr, vdep_ptr, pid_bh, grp, hl, blk, NBLK, T, TMAX, RATE, BK,
                  BV_FIXED, USE_RATE: tl.constexpr, D: tl.constexpr, W: tl.constexpr, HG: tl.constexpr,
                  MIN_V: tl.constexpr, PACKET: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr,
                  NT_PAD: tl.constexpr, BLK: tl.constexpr):
    """Value depths of a whole block of BLK tokens at once (ties at lambda in (step, item) order),
    stored to ``vdep``; returns (position in the block, depth) for the compaction that follows.

    A token's strict count is KS compares of its own keys (``_steps_above``); the ties' ranks (the
    tie counts of every earlier block and a prefix sum over (step, token)) are computed only in a
    block that holds a key equal to lambda."""
    lam, need = _lambda_need(hist_ptr, grp, T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
    lp = tl.arange(0, BLK)
    pos = blk * BLK + lp
    valid = pos < T
    bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=valid, other=0.0)
    strict, n_ge = _steps_above(bimp, r_ptr, lam, lam - 1, KS)
    n_eq = n_ge - strict
    s = tl.where(valid, MIN_V + PACKET * strict, 0)
    vrow = vdep_ptr + pid_bh * TMAX
    if tl.sum(tl.where(valid, n_eq, 0), 0) > 0:  # rare: keys at lambda, ranked in (step, item) order
        # in chunks of TCH tokens through vdep, so that the ranks' [KS, tokens] prefix sums do not
        # set the register count (and the occupancy) of the common path
        TCH: tl.constexpr = min(BLK, 128)
        run = _tie_run(tie_ptr, grp, hl, blk, NBLK, HG, KS_PAD, NT_PAD)
        for c0 in range(0, BLK, TCH):
            pc = blk * BLK + c0 + tl.arange(0, TCH)
            vc = pc < T
            sc, run = _depths(tl.load(vimp_ptr + pid_bh * TMAX + pc, mask=vc, other=0.0), vc, r_ptr, lam, need, run,
                              KS, KS_PAD, MIN_V, PACKET)
            tl.store(vrow + pc, sc.to(tl.int8), mask=vc)
        tl.debug_barrier()
        s = tl.load(vrow + pos, mask=valid, other=0).to(tl.int32)
    else:
        tl.store(vrow + pos, s.to(tl.int8), mask=valid)
    return lp, s


@triton.jit
def _spread16(x):
    """The four bytes of an int64 ``x`` (< 2^32) moved to 16-bit fields: byte k to bits 16k..16k+7."""
    return (x & 0xFF) | ((x & 0xFF00) << 8) | ((x & 0xFF0000) << 16) | ((x & 0xFF000000) << 24)


@triton.jit
def _suffix16(x):
    """For four 16-bit fields f1..f4 of ``x`` (f1 lowest): field s holds f_{s+1} + .. + f4."""
    return (x >> 16) + (x >> 32) + (x >> 48)


@triton.jit
def _depth_sorted_slots_chunked(s, W: tl.constexpr, BLK: tl.constexpr):
    """Each depth > 0 token's slot in a stable counting sort of the block by depth, deepest first (the
    tokens of greater depth, then its rank among the tokens of its depth), from one prefix sum per token:
    the block as [BLK / CH, CH] chunks, each chunk's running counts of depths 1..8 as the eight
    bytes of one int64 (a chunk holds <= 128 tokens, so a byte never carries) scanned along the chunk,
    then per chunk a base = (tokens of greater depth in the block) + (tokens of equal depth in earlier
    chunks), kept as two int64 of four 16-bit fields (depths 1-4, 5-8; a block holds <= 2048 tokens)
    and picked per token by two selects and a shift. The chunk axis is small ([BLK / CH] values)."""
    tl.static_assert(W <= 8, "eight byte counters in one int64")
    CH: tl.constexpr = min(BLK, 128)
    R: tl.constexpr = BLK // CH
    s2 = tl.reshape(s, [R, CH])
    act = s2 > 0
    sh8 = (8 * ((s2 - 1) & 7)).to(tl.int64)
    one = tl.where(act, tl.full([R, CH], 1, tl.int64) << sh8, 0)
    rank = ((tl.cumsum(one, 1) >> sh8) & 0xFF).to(tl.int32) - 1  # among the chunk's tokens of its depth
    tot = tl.sum(one, 1)  # [R]: the chunk's counts of depths 1..8, one byte each
    tot_lo = _spread16(tot & 0xFFFFFFFF)  # depths 1-4 as 16-bit fields
    tot_hi = _spread16((tot >> 32) & 0xFFFFFFFF)  # depths 5-8
    pre_lo = tl.cumsum(tot_lo, 0) - tot_lo  # equal depths in earlier chunks
    pre_hi = tl.cumsum(tot_hi, 0) - tot_hi
    all_lo = tl.sum(tot_lo, 0)
    all_hi = tl.sum(tot_hi, 0)
    n_hi = ((all_hi * 0x0001000100010001) >> 48) & 0xFFFF  # tokens of depths 5-8
    base_lo = pre_lo + _suffix16(all_lo) + n_hi * 0x0001000100010001
    base_hi = pre_hi + _suffix16(all_hi)
    word = tl.where(s2 <= 4, base_lo[:, None], base_hi[:, None])
    base = ((word >> (16 * ((s2 - 1) & 3)).to(tl.int64)) & 0xFFFF).to(tl.int32)
    return tl.reshape(base + rank, [BLK])


@triton.jit
def _value_order(len_ptr, vimp_ptr, r_ptr, hist_ptr, tie_ptr, vdep_ptr, vord_ptr, vcnt_ptr, TMAX, RATE, BK, BV_FIXED,
                 USE_RATE: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                 BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                 PACKET: tl.constexpr, NT_PAD: tl.constexpr, SORT: tl.constexpr = False):
    """Token depths of a block (:func:`_block_depths`) and the list of its depth > 0 tokens (``vord``:
    (W - depth) << 11 | position in the block; ``vcnt``: how many), for the compacting Value stages: in
    position order, or with SORT deepest first (position order within a depth; the int8 Value stage,
    whose steps of 16 tokens loop over their deepest token's planes). A kernel of its own: the depths'
    tie ranks over the whole block need many registers, which would otherwise cap the occupancy of the
    Value stage's loop."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    lp, s = _block_depths(vimp_ptr, r_ptr, hist_ptr, tie_ptr, vdep_ptr, pid_bh, grp, hl, blk, NBLK, T, TMAX, RATE,
                          BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS, KS_PAD, NT_PAD, BLK)
    act = s > 0
    if SORT:
        slot = _depth_sorted_slots_chunked(s, W, BLK)
    else:
        # stream compaction in position order (a prefix sum, no sort: in the FMA stage each thread
        # decodes its own token, so tokens of mixed depths in one tile cost nothing extra)
        slot = tl.cumsum(act.to(tl.int32), 0) - 1
    tl.store(vord_ptr + pid_bh * TMAX + blk * BLK + slot, (((W - s) << 11) | lp).to(tl.int16), mask=act)
    tl.store(vcnt_ptr + pid_bh * NBLK + blk, tl.sum(act.to(tl.int32), 0))


def launch(st: Step, lengths: torch.Tensor) -> None:
    """After the Key stage (and after the two-pass bracket where the plan has one): lambda by the radix passes
    (only for the groups the two-pass allocation flagged), the ties at lambda per block, and with compacting
    FMA / int8 Value stages each block's depths and list of tokens of depth > 0."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    b, nblk, tmax = pl.batch, pl.n_blocks, pl.max_tokens
    grid = (b * k.hk, nblk)
    rate, bk, bv_fixed = st.budget_args()
    vconst = st.value_consts()
    tp = ch.two_pass
    if not tp:  # importances and radix pass 1
        _value_hist[grid](pl.logits, pl.mstat, pl.sstat, lengths, c["rv"], pl.vimp, pl.hist, c["hw"][st.layer], tmax,
                          pl.n_splits, HQ=k.hq, HKV=k.hk, HG=k.hg, G=k.g, G2=st.g2, NSK_PAD=st.nsk_pad,
                          BLK=ch.block_tokens, KS=k.ks_v, KS_PAD=k.kspad_v, HEAD_WEIGHT=k.head_weight, RATE=rate,
                          BK=bk, BV_FIXED=bv_fixed, USE_RATE=k.use_rate, D=k.d, W=k.w, MIN_V=k.min_v,
                          PACKET=k.packet, num_warps=ch.alloc_warps)
    # gated (two-pass): a few programs per (sequence, KV head) striding over the blocks, work only where flagged
    rgrid = (b * k.hk, min(nblk, st.gated_splits)) if tp else grid
    for pas in range(1 if tp else 2, NPASS.value + 1):
        _value_radix[rgrid](pl.vimp, lengths, c["rv"], pl.hist, pl.cmeta, tmax, rate, bk, bv_fixed, nblk,
                            USE_RATE=k.use_rate, PASS=pas, HKV=k.hk, HG=k.hg, GATED=tp, **vconst,
                            num_warps=ch.alloc_warps)
    _value_ties[grid](pl.vimp, lengths, c["rv"], pl.hist, pl.ties, tmax, rate, bk, bv_fixed, USE_RATE=k.use_rate,
                      HKV=k.hk, HG=k.hg, **vconst, TIE_GATE=tp, cmeta_ptr=pl.cmeta if tp else None,
                      num_warps=st.num_warps)
    if ch.value_order:
        _value_order[grid](lengths, pl.vimp, c["rv"], pl.hist, pl.ties, pl.vdep, pl.vord, pl.vcnt, tmax, rate, bk,
                           bv_fixed, USE_RATE=k.use_rate, HKV=k.hk, HG=k.hg, NT_PAD=next_pow2(k.hg * nblk),
                           SORT=ch.value_stage == "int8", **vconst, num_warps=ch.alloc_warps)
