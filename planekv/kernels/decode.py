"""Triton kernels of the two-stage decode read (DESIGN section 1, steps 5-8), layout version 1.

One decode step of one layer is a fixed launch sequence (see reader.TritonReader.run):

  q~ = q M_K^T (torch)               transform the queries
  _prep          grid (groups,)      Key importance, channel depths (threshold search in registers),
                                     w = q~ sigma_K split into fp16 hi/lo, base = q~ . mu_K;
                                     zeroes this group's radix histograms
  _key_stage     grid (B*Hkv, NSK)   PPK pages each: Key planes at the channel depths -> logits, a
                                     softmax max/sum per program; the whole GQA group per program
  _value_hist    grid (B*Hkv, NBLK)  BLK tokens each: global softmax stats, Value importance
                                     b_i = sum_g p_gi^2, radix pass 1 (top 4 bits of every gain)
  _value_radix   (7 times)           radix passes 2-8 (4 bits each) -> exact lambda
  _value_ties                        ties at lambda counted per block and step
  _value_stage   grid (B*Hkv, NBLK)  token depths from lambda (ties in (step, item) order), Value
                                     planes at those depths, p-weighted sums per block
  _combine       grid (B*Hkv,)       sum over blocks, mu_V + sigma_V * acc
  out = out~ M_V (torch)             inverse transform

A group is the set of items whose budget is pooled: a sequence (flexible reader: all its KV heads)
or a (sequence, KV head) pair (per-head budgets).

Decoding: a plane's bits of 8 consecutive elements are one byte; SPREAD[byte] (an int64 table)
moves bit k to bit 8k, so a plane adds 8 code bits with one table read, a shift and an OR. The
reconstruction table holds L_t[code] as fp16 hi and lo halves in one int32, and every dot is three
fp16 MMAs (hi*hi + hi*lo + lo*hi), float32-accurate.

Exactness: the allocation follows planekv.kvstore.allocate's total order (gain, then step, then
item) with gains in float32 (the reference uses float64), so depths can differ from the reference
only for gains within float32 rounding of lambda.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Radix select over the 31 magnitude bits of a non-negative float32, RBITS bits per pass (the last
# pass takes what is left). tl.histogram costs O(keys x bins), so small digits and more passes win.
RBITS = tl.constexpr(4)
NBINS = tl.constexpr(16)
NPASS = tl.constexpr(8)
# int32 words per group: 8 histograms of 16 bins, then per pass the digits chosen so far and the keys
# still to take among those that match them (written by the selection after each pass), then per
# pass a count of the programs that have added to its histogram (the last one selects: _arrive)
HSTRIDE = tl.constexpr(16 * 8 + 2 * 8 + 8)
SELBASE = tl.constexpr(16 * 8)
CNTBASE = tl.constexpr(16 * 8 + 2 * 8)
HIST_STRIDE = 16 * 8 + 2 * 8 + 8
# two-pass Value allocation (planekv.kernels.alloc2): per head an 8192-bin histogram of the
# importances' top 13 bits (exponent and 5 mantissa bits), per group their summed suffix sums; 8 words
# of state
IHSHIFT = tl.constexpr(18)
IHBINS = tl.constexpr(8192)
IH_BINS = 8192
KSEG = tl.constexpr(16)  # words per KV head of the Key stage's channel-list segments (>= W + 1)
KSEG_WORDS = 16
CMETA = tl.constexpr(16)
CMETA_WORDS = 16


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _load_scalar(ptr):
    """A scalar load that is 0-d in both the compiler and the interpreter (which returns [1])."""
    return tl.sum(tl.load(ptr + tl.arange(0, 1)), 0)


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
def _select_digit(hist_ptr, NB: tl.constexpr, need, VOLATILE: tl.constexpr = False):
    """Digit D of the need-th largest key given a histogram of that digit (keys that matched the
    prefix so far), and how many keys of digit D are still to be taken. VOLATILE: the histogram is
    read past the L1 (other programs of the same launch added to it: :func:`_arrive`)."""
    idx = tl.arange(0, NB)
    h = tl.load(hist_ptr + idx, volatile=VOLATILE)
    total = tl.sum(h, 0)
    ge = total - tl.cumsum(h, 0) + h  # keys with digit >= idx
    dsel = tl.max(tl.where(ge >= need, idx, -1), 0)
    above = tl.sum(tl.where(idx > dsel, h, 0), 0)
    return dsel, need - above


@triton.jit
def _radix_select(hist_ptr, len_ptr, cmeta_ptr, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr, PASS: tl.constexpr,
                  HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, MIN_V: tl.constexpr,
                  PACKET: tl.constexpr, KS: tl.constexpr, GATED: tl.constexpr):
    """One program per allocation group, after radix pass PASS: the digit of the count-th largest
    key in that pass's histogram, appended to the digits of earlier passes, and the keys still to
    take among those matching them, stored once (SELBASE + 2 (PASS - 1)) so that the next pass and the
    Value stage read two words instead of every program re-deriving them from the histograms (a chain
    of dependent loads per program, which dominated the passes)."""
    grp = tl.program_id(0)
    go = grp >= 0
    if GATED:  # the two-pass allocation found lambda itself unless its candidates overflowed
        go = _load_scalar(cmeta_ptr + grp * CMETA + 4) != 0
    if go:
        b = grp // (HKV // HG)
        T = _load_scalar(len_ptr + b)
        count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
        _select_pass(hist_ptr + grp * HSTRIDE, count, PASS, False)


@triton.jit
def _select_pass(hbase, count, PASS: tl.constexpr, VOLATILE: tl.constexpr):
    """The selection after radix pass PASS for the group whose words start at ``hbase``."""
    if PASS == 1:
        pref = count * 0
        rem = tl.maximum(count, 1)
    else:
        pref = _load_scalar(hbase + SELBASE + 2 * (PASS - 2))
        rem = _load_scalar(hbase + SELBASE + 2 * (PASS - 2) + 1)
    dsel, rem = _select_digit(hbase + (PASS - 1) * NBINS, NBINS, rem, VOLATILE)
    pref = (pref << min(RBITS, 31 - RBITS * (PASS - 1))) | dsel
    tl.store(hbase + SELBASE + 2 * (PASS - 1), pref)
    tl.store(hbase + SELBASE + 2 * (PASS - 1) + 1, rem)


@triton.jit
def _arrive(hbase, count, n_prog, PASS: tl.constexpr):
    """A program's arrival after its share of radix pass PASS, in place of a :func:`_radix_select`
    launch: the last of the group's ``n_prog`` programs to arrive runs the selection. The barrier
    orders every thread's histogram adds before thread 0's acq_rel increment (the pattern of a
    grid-wide reduction's last block); the last program reads the histogram with volatile loads.
    ``_prep`` zeroes the counters every step."""
    tl.debug_barrier()
    if tl.atomic_add(hbase + CNTBASE + (PASS - 1), 1, sem="acq_rel") == n_prog - 1:
        _select_pass(hbase, count, PASS, True)


@triton.jit
def _group_of(pid_bh, HKV: tl.constexpr, HG: tl.constexpr):
    """(group index, head index inside the group) of program row b*HKV + h."""
    b = pid_bh // HKV
    h = pid_bh % HKV
    return b * (HKV // HG) + h // HG, h % HG


@triton.jit
def _block_prog(len_ptr, HKV: tl.constexpr, HG: tl.constexpr):
    """Program (b*Hkv + h, block): (b*Hkv + h, block, sequence b, allocation group, head index in the
    group, the sequence's length)."""
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid_bh // HKV
    grp, hl = _group_of(pid_bh, HKV, HG)
    return pid_bh, blk, b, grp, hl, _load_scalar(len_ptr + b)


@triton.jit
def _radix_digit(key, PASS: tl.constexpr):
    """Radix pass PASS reads bits [SH, SH + width) of a 31-bit key (4 bits, the last pass what is
    left): (the bits above them, where the prefix chosen by earlier passes sits; the digit)."""
    SH: tl.constexpr = max(31 - RBITS * PASS, 0)
    SH_PREV: tl.constexpr = 31 - RBITS * (PASS - 1)
    WIDTH: tl.constexpr = min(RBITS, 31 - RBITS * (PASS - 1))
    MASK: tl.constexpr = (NBINS - 1) >> (RBITS - WIDTH)
    return key >> SH_PREV, (key >> SH) & MASK


# ----------------------------------------------------------------------------- decoding helpers


@triton.jit
def _codes_from_bytes(c64, byte, spread_ptr, msk, j: tl.constexpr, W: tl.constexpr):
    """Add plane j to 8 codes packed per int64: ``byte`` holds the plane's bits of 8 consecutive
    elements; SPREAD[byte] moves bit k to bit 8k, so one table read places 8 bits at once."""
    sp = tl.load(spread_ptr + byte, mask=msk, other=0)
    return c64 | (sp << (W - 1 - j))


@triton.jit
def _hi_lo(zz):
    """int32 words holding (fp16 hi | fp16 lo << 16) -> two fp16 tensors."""
    hi = (zz & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    lo = ((zz >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    return hi, lo


@triton.jit
def _split16(x):
    """float32 -> (hi, lo) fp16 with hi + lo = x to about 2^-22 relative."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


# ----------------------------------------------------------------------------- Key allocation


@triton.jit
def _rotate_rows(x_ptr, sx_r, sx_c, m_ptr, y_ptr, n_rows, ROWS: tl.constexpr, D: tl.constexpr):
    """y[r, :] = x[r, :] @ m for the first n_rows of ROWS (>= 16) rows: x at x_ptr with row / column
    strides sx_r / sx_c (any float dtype, taken as float32), m a contiguous float32 [D, D], y contiguous
    float32 rows of D. One program; K in chunks of 32, each a tf32x3 product (three TF32 MMAs: the operands
    split in high and low TF32 parts, the low x low term dropped; float32 sums, ~2^-22 relative; the FMA
    form, input_precision="ieee", measured slower: KERNEL_NOTES run 102)."""
    rr = tl.arange(0, ROWS)
    cc = tl.arange(0, D)
    rok = rr < n_rows
    KC: tl.constexpr = min(D, 32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for j0 in tl.static_range(0, D, KC):
        kc = j0 + tl.arange(0, KC)
        xa = tl.load(x_ptr + rr[:, None] * sx_r + kc[None, :] * sx_c, mask=rok[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(xa, tl.load(m_ptr + kc[:, None] * D + cc[None, :]), input_precision="tf32x3")
    tl.store(y_ptr + rr[:, None] * D + cc[None, :], acc, mask=rok[:, None])


@triton.jit
def _kth_largest(keys, count):
    """The count-th largest of the keys >= 0 (31-bit patterns; negative ones are padding), 1 <= count <=
    their number: NPASS radix passes of RBITS bits, each a histogram of the keys that match the digits
    chosen so far (the masked keys counted in an upper half of bins that is never read: no mask beside
    the values, see :func:`_pass_hist`) and the digit that holds the count-th key."""
    ok = keys >= 0
    pref = count * 0
    rem = tl.maximum(count, 1)
    idx = tl.arange(0, 2 * NBINS)
    for pas in tl.static_range(1, NPASS + 1):
        above, digit = _radix_digit(keys, pas)
        h = tl.histogram(tl.where(ok & (above == pref), digit, NBINS), 2 * NBINS)
        h = tl.where(idx < NBINS, h, 0)
        ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # keys of this digit or a larger one
        dsel = tl.max(tl.where(ge >= rem, idx, -1), 0)
        rem -= tl.sum(tl.where(idx > dsel, h, 0), 0)
        pref = (pref << min(RBITS, 31 - RBITS * (pas - 1))) | dsel
    return pref


@triton.jit
def _prep(qt_ptr, sig_ptr, mu_ptr, r_ptr, whi_ptr, wlo_ptr, wf_ptr, base_ptr, kdep_ptr, kord_ptr, kcnt_ptr, hist_ptr,
          count_k,
          rhist_ptr, ihist_ptr, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
          D: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_K: tl.constexpr, HG_PAD: tl.constexpr,
          RHW: tl.constexpr, TWO_PASS: tl.constexpr, KORDER: tl.constexpr, RADIX: tl.constexpr = False,
          QROWS: tl.constexpr = 0, q_ptr=None, sq_b=0, sq_h=0, sq_d=0, mkT_ptr=None):
    """One program per allocation group: HG KV heads of one sequence, N = HG * D channels. With Key
    refinement (RHW > 0 words of refinement histograms per group) those start at zero too. The Key
    allocation's lambda (the count-th largest key) by a bisection over its 31 bits, or with RADIX by
    the 8 radix passes of :func:`_kth_largest` (the same lambda: 8 dependent histograms instead of 32
    dependent counts). QROWS > 0: the group's HG * G transformed queries q~ = q M_K^T are computed here
    first (q of any float dtype at strides sq_*, M_K^T at mkT_ptr; rows padded to QROWS) and stored to
    qt_ptr for the Key stages that read them, instead of by a copy and a GEMM before the launch."""
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
    # search, 11 steps of 7 counts, measured slower for groups of 8 heads: 32 -> 36 us at B=32, run 38.)
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


# ----------------------------------------------------------------------------- Key stage


@triton.jit
def _key_stage(kw_ptr, pt_ptr, len_ptr, kdep_ptr, whi_ptr, wlo_ptr, base_ptr, tab_ptr, spread_ptr, logit_ptr,
               mstat_ptr, sstat_ptr, scale, SLOTS, TMAX,
               HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
               D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, PPK: tl.constexpr):
    """Program (b*Hkv + h, split): PPK pages of one (sequence, KV head). Per 32-token word: for every
    plane below a channel's depth, one word load per channel and one SPREAD read per 8 tokens build
    the codes; one packed-table read per element gives z = L_t[code] as fp16 hi/lo; three fp16 MMAs
    (hi*hi + hi*lo + lo*hi) give float32-accurate logits for the whole GQA group."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = _load_scalar(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    p0 = split * PPK
    p1 = tl.minimum(p0 + PPK, n_pages)
    NW: tl.constexpr = P // 32
    NCODE: tl.constexpr = 1 << W
    NSPLIT = tl.num_programs(1)
    cc = tl.arange(0, D)
    gg = tl.arange(0, G_PAD)
    tok = tl.arange(0, 32)
    gvalid = gg < G
    tdep = tl.load(kdep_ptr + pid_bh * D + cc)  # [D]
    t_max = tl.max(tdep, 0)
    wrow = (b * HQ + h * G + gg[None, :]) * D + cc[:, None]  # [D, G_PAD]
    w_hi = tl.load(whi_ptr + wrow, mask=gvalid[None, :], other=0.0)
    w_lo = tl.load(wlo_ptr + wrow, mask=gvalid[None, :], other=0.0)
    base = tl.load(base_ptr + b * HQ + h * G + gg, mask=gvalid, other=0.0)
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    for pg in range(p0, p1):
        page = tl.load(pt_ptr + pid_bh * SLOTS + pg).to(tl.int64)
        for half in tl.static_range(NW):
            codes = tl.zeros([32, D], dtype=tl.int32)
            for j in tl.static_range(W):
                if j < t_max:  # uniform branch: planes no channel of this head reads cost nothing
                    wv = tl.load(kw_ptr + ((page * W + j) * D + cc) * NW + half, mask=tdep > j, other=0)  # [D]
                    codes = codes | (((wv[None, :] >> tok[:, None]) & 1) << (W - 1 - j))
            z_hi, z_lo = _hi_lo(tl.load(tab_ptr + tdep[None, :] * NCODE + codes))  # [32, D]
            lg = tl.dot(z_hi, w_hi)
            lg = tl.dot(z_hi, w_lo, lg)
            lg = tl.dot(z_lo, w_hi, lg)  # [32, G_PAD]
            lg = tl.trans(lg)  # [G_PAD, 32]
            pos = pg * P + half * 32 + tok
            lg = (lg + base[:, None]) * scale
            lg = tl.where(pos[None, :] < T, lg, float("-inf"))
            tl.store(logit_ptr + (b * HQ + h * G + gg[:, None]) * TMAX + pos[None, :], lg,
                     mask=gvalid[:, None] & (pos[None, :] < T))
            m_new = tl.maximum(m_run, tl.max(lg, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), 1)
            m_run = m_new
    sidx = (b * HQ + h * G + gg) * NSPLIT + split
    tl.store(mstat_ptr + sidx, m_run, mask=gvalid)
    tl.store(sstat_ptr + sidx, s_run, mask=gvalid)


@triton.jit
def _transpose8(x):
    """8x8 bit transpose of each int64: bit 8j + k <-> bit 8k + j (three delta swaps, ~30 SASS for 64
    bits). With byte j holding plane j of 8 consecutive elements, byte k afterwards holds element k's
    code with plane j at bit j. (Arithmetic right shifts are harmless: every mask stops below the
    bits they fill.)"""
    t = (x ^ (x >> 7)) & 0x00AA00AA00AA00AA
    x = x ^ t ^ (t << 7)
    t = (x ^ (x >> 14)) & 0x0000CCCC0000CCCC
    x = x ^ t ^ (t << 14)
    t = (x ^ (x >> 28)) & 0x00000000F0F0F0F0
    return x ^ t ^ (t << 28)


@triton.jit
def _key_stage_t8(kb_ptr, pt_ptr, len_ptr, kdep_ptr, whi_ptr, wlo_ptr, base_ptr, tabr_ptr, logit_ptr,
                  mstat_ptr, sstat_ptr, scale, SLOTS, TMAX,
                  HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, PPK: tl.constexpr):
    """The Key stage with word-level bit transposition. Program (b*Hkv + h, split) covers PPK pages
    as one tile of M = PPK*P/8 rows (one row per page and byte of a plane row, i.e. 8 tokens) by D
    channels: each plane below a channel's depth is one byte load per 8 tokens, OR-ed into byte j of
    an int64; one 8x8 bit transpose per int64 then yields the 8 tokens' codes (plane j at bit j, so
    the table ``tabr`` is indexed by the bit-reversed code). For each k < 8 the codes of tokens
    8*row + k go through the table and three fp16 MMAs (hi*hi + hi*lo + lo*hi) into logits."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = _load_scalar(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    NB: tl.constexpr = P // 8
    M: tl.constexpr = PPK * NB
    NCODE: tl.constexpr = 1 << W
    NSPLIT = tl.num_programs(1)
    cc = tl.arange(0, D)
    gg = tl.arange(0, G_PAD)
    mm = tl.arange(0, M)
    gvalid = gg < G
    pg = split * PPK + mm // NB  # page slot of each row
    byte = mm % NB
    pvalid = pg < n_pages
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg, mask=pvalid, other=0).to(tl.int64)  # [M]
    tdep = tl.load(kdep_ptr + pid_bh * D + cc)  # [D]
    t_max = tl.max(tdep, 0)
    wrow = (b * HQ + h * G + gg[None, :]) * D + cc[:, None]  # [D, G_PAD]
    w_hi = tl.load(whi_ptr + wrow, mask=gvalid[None, :], other=0.0)
    w_lo = tl.load(wlo_ptr + wrow, mask=gvalid[None, :], other=0.0)
    base = tl.load(base_ptr + b * HQ + h * G + gg, mask=gvalid, other=0.0)
    x = tl.zeros([M, D], dtype=tl.int64)
    for j in tl.static_range(W):
        if j < t_max:  # uniform branch: planes no channel of this head reads cost nothing
            addr = kb_ptr + ((page[:, None] * W + j) * D + cc[None, :]) * NB + byte[:, None]
            bj = tl.load(addr, mask=pvalid[:, None] & (tdep[None, :] > j), other=0)  # [M, D] uint8
            x = x | (bj.to(tl.int64) << (8 * j))
    x = _transpose8(x)
    tbase = tdep[None, :] * NCODE
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    for k in range(8):  # a loop, not unrolled: eight unrolled slices exhaust the registers
        code = ((x >> (8 * k)) & 0xFF).to(tl.int32)
        z_hi, z_lo = _hi_lo(tl.load(tabr_ptr + tbase + code))  # [M, D]
        lg = tl.dot(z_hi, w_hi)
        lg = tl.dot(z_hi, w_lo, lg)
        lg = tl.dot(z_lo, w_hi, lg)  # [M, G_PAD]
        lg = tl.trans(lg)  # [G_PAD, M]
        pos = pg * P + byte * 8 + k  # [M]
        lg = (lg + base[:, None]) * scale
        lg = tl.where(pos[None, :] < T, lg, float("-inf"))
        tl.store(logit_ptr + (b * HQ + h * G + gg[:, None]) * TMAX + pos[None, :], lg,
                 mask=gvalid[:, None] & (pos[None, :] < T))
        m_new = tl.maximum(m_run, tl.max(lg, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), 1)
        m_run = m_new
    sidx = (b * HQ + h * G + gg) * NSPLIT + split
    tl.store(mstat_ptr + sidx, m_run, mask=gvalid)
    tl.store(sstat_ptr + sidx, s_run, mask=gvalid)


@triton.jit
def _bytes8(lo, hi):
    """Two uint32 words [M] (an int64's low and high halves) -> int32 [M, 8]: the 8 bytes, byte k
    at column k. Built with ``tl.join`` (each join adds an in-thread dimension), so the 8 columns of a
    row stay in one thread: no data movement."""
    b0, b1, b2, b3 = lo & 0xFF, (lo >> 8) & 0xFF, (lo >> 16) & 0xFF, lo >> 24
    b4, b5, b6, b7 = hi & 0xFF, (hi >> 8) & 0xFF, (hi >> 16) & 0xFF, hi >> 24
    # the last join is the minor dimension: [M, A, B, C] holds byte 4A + 2B + C
    y = tl.join(tl.join(tl.join(b0, b4), tl.join(b2, b6)), tl.join(tl.join(b1, b5), tl.join(b3, b7)))
    return tl.reshape(y, (lo.shape[0], 8)).to(tl.int32)


@triton.jit
def _transpose8_32(lo, hi):
    """:func:`_transpose8` on the two uint32 halves of the int64 (the first two delta swaps stay
    inside a half; the third moves nibbles between them): 20 32-bit operations, no 64-bit shifts."""
    t = (lo ^ (lo >> 7)) & 0x00AA00AA
    lo = lo ^ t ^ (t << 7)
    t = (hi ^ (hi >> 7)) & 0x00AA00AA
    hi = hi ^ t ^ (t << 7)
    t = (lo ^ (lo >> 14)) & 0x0000CCCC
    lo = lo ^ t ^ (t << 14)
    t = (hi ^ (hi >> 14)) & 0x0000CCCC
    hi = hi ^ t ^ (t << 14)
    t = (lo ^ (hi << 4)) & 0xF0F0F0F0
    return lo ^ t, hi ^ (t >> 4)


@triton.jit
def _transpose4_32(lo):
    """:func:`_transpose8_32` of (lo, 0): four planes (bytes of lo) of 8 tokens -> the 8 tokens'
    4-bit codes, in the same byte positions as the 8-plane transpose leaves them (13 operations)."""
    t = (lo ^ (lo >> 7)) & 0x00AA00AA
    lo = lo ^ t ^ (t << 7)
    t = (lo ^ (lo >> 14)) & 0x0000CCCC
    lo = lo ^ t ^ (t << 14)
    t = lo & 0xF0F0F0F0
    return lo ^ t, t >> 4


@triton.jit
def _w_times(z, wp, live, PER_ROW: tl.constexpr):
    """z * w for one query head: one weight for the whole tile (a channel's), or PER_ROW one per row
    (``wp``: [R] pointers; rows not ``live``: 0)."""
    if PER_ROW:
        w = tl.where(live, tl.load(wp), 0.0)[:, None]
    else:
        w = _load_scalar(wp)
    return z * w


@triton.jit
def _fma_channel(z, wp, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G: tl.constexpr, live=0,
                 PER_ROW: tl.constexpr = False):
    """acc_g += z * w_g for the G query heads of a KV head; ``wp`` points at the channel's G weights
    w = q~ sigma_K (contiguous, written by ``_prep``); PER_ROW: a channel per row (:func:`_w_times`)."""
    acc0 += _w_times(z, wp, live, PER_ROW)
    if G > 1:
        acc1 += _w_times(z, wp + 1, live, PER_ROW)
    if G > 2:
        acc2 += _w_times(z, wp + 2, live, PER_ROW)
    if G > 3:
        acc3 += _w_times(z, wp + 3, live, PER_ROW)
    if G > 4:
        acc4 += _w_times(z, wp + 4, live, PER_ROW)
    if G > 5:
        acc5 += _w_times(z, wp + 5, live, PER_ROW)
    if G > 6:
        acc6 += _w_times(z, wp + 6, live, PER_ROW)
    if G > 7:
        acc7 += _w_times(z, wp + 7, live, PER_ROW)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _key_fma_out(acc, base_ptr, qrow, logit_ptr, mstat_ptr, sstat_ptr, sidx, pos, T, TMAX, scale):
    """Epilogue of one query head of the FMA Key stage: logits of the tile [M, 8] and its split's
    softmax statistics."""
    lg = (acc + _load_scalar(base_ptr + qrow)) * scale
    ok = pos < T
    lg = tl.where(ok, lg, float("-inf"))
    tl.store(logit_ptr + qrow * TMAX + pos, lg, mask=ok)
    m = tl.max(tl.max(lg, 1), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    tl.store(mstat_ptr + sidx, m)
    tl.store(sstat_ptr + sidx, tl.sum(tl.sum(tl.exp(lg - m_safe), 1), 0))


@triton.jit
def _vj(j, PLANE: tl.constexpr, VG: tl.constexpr, ROW: tl.constexpr):
    """Offset of a token's plane j (a constexpr or an int32 tensor) from its plane 0 in a V page (PLANE = a
    plane's P rows, ROW = one row, in the same unit): ``j * PLANE`` (plane-major, VG = 1), or with the
    format's ``v_run`` = VG > 1 run j // VG of VG * PLANE plus row j % VG of the token's run."""
    if VG == 1:
        return j * PLANE
    return (j // VG) * (VG * PLANE) + (j % VG) * ROW


@triton.jit
def _pack_planes(p0, STRIDE: tl.constexpr, NPL: tl.constexpr, depth, MASKED: tl.constexpr, VG: tl.constexpr = 1,
                 ROW: tl.constexpr = 0):
    """Planes 0..NPL-1 at ``p0 + j * STRIDE`` (V pages in runs of VG planes: ``p0 + _vj(j, STRIDE, VG, ROW)``,
    ROW the bytes of a row) as two uint32 words (plane j in byte j of lo for j < 4,
    byte j - 4 of hi otherwise). MASKED: plane j only where ``depth > j`` (the loads masked, not
    branched, so all are in flight at once); otherwise every load runs (the Key stage's segments and
    depth branches, where every channel has depth NPL; rows past the sequence read page 0 and are
    dropped at the logits' store)."""
    lo = tl.zeros(p0.shape, dtype=tl.uint32)
    hi = tl.zeros(p0.shape, dtype=tl.uint32)
    for j in tl.static_range(NPL):
        if MASKED:
            bj = tl.load(p0 + _vj(j, STRIDE, VG, ROW), mask=depth > j, other=0).to(tl.uint32)
        else:
            bj = tl.load(p0 + _vj(j, STRIDE, VG, ROW)).to(tl.uint32)
        if j < 4:
            lo = lo | (bj << (8 * j))
        else:
            hi = hi | (bj << (8 * (j - 4)))
    return lo, hi


@triton.jit
def _codes(lo, hi, NPL: tl.constexpr):
    """The 8 codes (plane j at bit j) of packed plane words, [M, 8]: the 8x8 bit transpose, or the
    4x8 one when at most 4 planes were packed."""
    if NPL > 4:
        lo, hi = _transpose8_32(lo, hi)
    else:
        lo, hi = _transpose4_32(lo)
    return _bytes8(lo, hi)


@triton.jit
def _key_channel(lo, hi, trow, wp, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G: tl.constexpr,
                 T: tl.constexpr):
    """One channel of depth T in the FMA Key stage: its codes, their values in the table row ``trow``
    and acc_g += value * w_g (``wp``: the channel's G weights)."""
    z = tl.load(trow + _codes(lo, hi, T))  # [M, 8] float32
    return _fma_channel(z, wp, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G)


@triton.jit
def _key_segment(kb_ptr, rbase, lrow, wrow, tabf_ptr, start, end, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, T: tl.constexpr):
    """The channels kord[start:end] of one depth T: per channel T plane loads per row (the next
    channel's requested before this one's math; the last re-requests itself, an L1 hit), the bit
    transpose (8x8, or 4x8 for T <= 4), 8 lookups in row T of ``tabf`` and 8 x G FMAs."""
    trow = tabf_ptr + T * (1 << W)
    c = _load_scalar(lrow + start) & 0xFF
    lo, hi = _pack_planes(kb_ptr + rbase + c * NB, D * NB, T, 0, False)
    for i in range(start, end):
        c_n = _load_scalar(lrow + tl.minimum(i + 1, end - 1)) & 0xFF
        lo_n, hi_n = _pack_planes(kb_ptr + rbase + c_n * NB, D * NB, T, 0, False)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _key_channel(
            lo, hi, trow, wrow + c * G, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G, T)
        lo = lo_n
        hi = hi_n
        c = c_n
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _key_segment_ch(kb_ptr, rbase, slot, lrow, wrow, tabf_ptr, start, end, acc0, acc1, acc2, acc3, acc4, acc5,
                    acc6, acc7, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NB: tl.constexpr,
                    T: tl.constexpr, CH: tl.constexpr):
    """:func:`_key_segment` CH channels at a time: row r of the program's CH x M rows decodes channel
    kord[i + r // M] for the token row r % M (``slot`` = r // M), so that a program of few token
    rows (small steps: B = 1) keeps CH channels' loads in flight instead of one. Past the segment's
    end a slot re-reads its last channel with weight 0."""
    trow = tabf_ptr + T * (1 << W)
    for i in range(start, end, CH):
        ci = i + slot
        live = ci < end
        c = tl.load(lrow + tl.minimum(ci, end - 1)) & 0xFF
        lo, hi = _pack_planes(kb_ptr + rbase + c * NB, D * NB, T, 0, False)
        z = tl.load(trow + _codes(lo, hi, T))  # [R, 8]
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _fma_channel(
            z, wrow + c * G, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G, live, True)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _slot_sum(acc, CH: tl.constexpr, M: tl.constexpr):
    """[CH x M, 8] partial sums of the channel slots -> [M, 8]."""
    return tl.sum(tl.reshape(acc, (CH, M, 8)), 0)


@triton.jit
def _key_stage_f(kb_ptr, pt_ptr, len_ptr, kord_ptr, kcnt_ptr, wf_ptr, base_ptr, tabf_ptr, logit_ptr,
                 mstat_ptr, sstat_ptr, scale, SLOTS, TMAX,
                 HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                 P: tl.constexpr, PPK: tl.constexpr, KLOOP: tl.constexpr, CH: tl.constexpr = 1):
    """The Key stage on the CUDA cores, tokens across threads and channels in a loop. Program
    (b*Hkv + h, split) covers PPK pages as M = PPK*P/8 rows of 8 tokens, one row per thread. It walks
    the list of the head's channels of depth t > 0 that ``_prep`` writes (kord; kcnt: KSEG words per
    head, [0] the list's length, [t] how many have depth t), so depth-0 channels (their
    reconstruction, the mean, is in ``base``) cost nothing. KLOOP 0: the list in segments of one
    depth, deepest first, one loop per segment; KLOOP 1: the list in channel order, a branch per
    channel to its depth's body. Either way the body is specialized to the depth: per channel and row
    exactly t byte loads with no masks (plane j into byte j of an int64), one bit transpose (8x8; 4x8
    for t <= 4) giving the 8 tokens' codes (plane j at bit j), 8 lookups in row t of the
    bit-reversed float32 table (``tabf``) and 8 x G float32 FMAs with w = q~ sigma_K (``wf``, G
    contiguous weights per channel). No MMA, no operand shuffles, no
    hi/lo split; float32 throughout, like the reference reader. CH > 1 (KLOOP 0, small steps): CH
    channels of a segment at a time (:func:`_key_segment_ch`), the slots' sums added at the end."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = _load_scalar(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    NB: tl.constexpr = P // 8
    M: tl.constexpr = PPK * NB
    R: tl.constexpr = CH * M  # rows: channel slot r // M, token row r % M
    NSPLIT = tl.num_programs(1)
    rr = tl.arange(0, R)
    mm = rr % M
    pg = split * PPK + mm // NB
    byte = mm % NB
    pvalid = pg < n_pages
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg, mask=pvalid, other=0).to(tl.int64)
    rbase = page * (W * D * NB) + byte  # [R]: plane 0, channel 0 of each row
    q0 = b * HQ + h * G
    acc0 = tl.zeros([R, 8], dtype=tl.float32)
    acc1 = tl.zeros([R, 8], dtype=tl.float32)
    acc2 = tl.zeros([R, 8], dtype=tl.float32)
    acc3 = tl.zeros([R, 8], dtype=tl.float32)
    acc4 = tl.zeros([R, 8], dtype=tl.float32)
    acc5 = tl.zeros([R, 8], dtype=tl.float32)
    acc6 = tl.zeros([R, 8], dtype=tl.float32)
    acc7 = tl.zeros([R, 8], dtype=tl.float32)
    lrow = kord_ptr + pid_bh * D
    wrow = wf_ptr + pid_bh * D * G
    segs = kcnt_ptr + pid_bh * KSEG
    if KLOOP == 0:  # one loop per depth segment (kord by depth, deepest first)
        start = _load_scalar(segs) * 0
        for tt in tl.static_range(W):
            n_t = _load_scalar(segs + W - tt)
            if n_t > 0:
                if CH > 1:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _key_segment_ch(
                        kb_ptr, rbase, rr // M, lrow, wrow, tabf_ptr, start, start + n_t, acc0, acc1, acc2, acc3,
                        acc4, acc5, acc6, acc7, G, D, W, NB, W - tt, CH)
                else:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _key_segment(
                        kb_ptr, rbase, lrow, wrow, tabf_ptr, start, start + n_t, acc0, acc1, acc2, acc3, acc4,
                        acc5, acc6, acc7, G, D, W, NB, W - tt)
            start += n_t
    else:  # kord in channel order (neighbouring channels share L1 lines); a branch per depth
        tl.static_assert(CH == 1, "the channel-order walk takes one channel at a time")
        for i in range(_load_scalar(segs)):
            ent = _load_scalar(lrow + i)
            c = ent & 0xFF
            t = ent >> 8
            for tt in tl.static_range(1, W + 1):
                if t == tt:
                    lo, hi = _pack_planes(kb_ptr + rbase + c * NB, D * NB, tt, 0, False)
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _key_channel(
                        lo, hi, tabf_ptr + tt * (1 << W), wrow + c * G, acc0, acc1, acc2, acc3, acc4, acc5,
                        acc6, acc7, G, tt)
    if CH > 1:  # the channel slots' partial sums; positions of the M token rows
        acc0 = _slot_sum(acc0, CH, M)
        acc1 = _slot_sum(acc1, CH, M)
        acc2 = _slot_sum(acc2, CH, M)
        acc3 = _slot_sum(acc3, CH, M)
        acc4 = _slot_sum(acc4, CH, M)
        acc5 = _slot_sum(acc5, CH, M)
        acc6 = _slot_sum(acc6, CH, M)
        acc7 = _slot_sum(acc7, CH, M)
        m1 = tl.arange(0, M)
        pg = split * PPK + m1 // NB
        byte = m1 % NB
    kk = _bytes8(tl.full([M], 0x03020100, tl.uint32), tl.full([M], 0x07060504, tl.uint32))  # [M, 8]: column index
    pos = (pg * P + byte * 8)[:, None] + kk
    sidx = q0 * NSPLIT + split
    _key_fma_out(acc0, base_ptr, q0, logit_ptr, mstat_ptr, sstat_ptr, sidx, pos, T, TMAX, scale)
    if G > 1:
        _key_fma_out(acc1, base_ptr, q0 + 1, logit_ptr, mstat_ptr, sstat_ptr, sidx + NSPLIT, pos, T, TMAX, scale)
    if G > 2:
        _key_fma_out(acc2, base_ptr, q0 + 2, logit_ptr, mstat_ptr, sstat_ptr, sidx + 2 * NSPLIT, pos, T, TMAX, scale)
    if G > 3:
        _key_fma_out(acc3, base_ptr, q0 + 3, logit_ptr, mstat_ptr, sstat_ptr, sidx + 3 * NSPLIT, pos, T, TMAX, scale)
    if G > 4:
        _key_fma_out(acc4, base_ptr, q0 + 4, logit_ptr, mstat_ptr, sstat_ptr, sidx + 4 * NSPLIT, pos, T, TMAX, scale)
    if G > 5:
        _key_fma_out(acc5, base_ptr, q0 + 5, logit_ptr, mstat_ptr, sstat_ptr, sidx + 5 * NSPLIT, pos, T, TMAX, scale)
    if G > 6:
        _key_fma_out(acc6, base_ptr, q0 + 6, logit_ptr, mstat_ptr, sstat_ptr, sidx + 6 * NSPLIT, pos, T, TMAX, scale)
    if G > 7:
        _key_fma_out(acc7, base_ptr, q0 + 7, logit_ptr, mstat_ptr, sstat_ptr, sidx + 7 * NSPLIT, pos, T, TMAX, scale)


# ----------------------------------------------------------------------------- Value allocation


@triton.jit
def _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ: tl.constexpr, G: tl.constexpr, G2: tl.constexpr,
                   NSK_PAD: tl.constexpr):
    gg = tl.arange(0, G2)
    ss = tl.arange(0, NSK_PAD)
    msk = (gg[:, None] < G) & (ss[None, :] < NSK)
    idx = (b * HQ + h * G + gg[:, None]) * NSK + ss[None, :]
    m = tl.load(mstat_ptr + idx, mask=msk, other=float("-inf"))
    s = tl.load(sstat_ptr + idx, mask=msk, other=0.0)
    mg = tl.max(m, 1)
    mg = tl.where(mg == float("-inf"), 0.0, mg)
    z = tl.sum(s * tl.exp(m - mg[:, None]), 1)
    z = tl.where(z > 0, z, 1.0)
    return mg, z


@triton.jit
def _probs(logit_ptr, b, h, pos, T, mg, z, TMAX, HQ: tl.constexpr, G: tl.constexpr, G2: tl.constexpr):
    gg = tl.arange(0, G2)
    msk = (gg[:, None] < G) & (pos[None, :] < T)
    lg = tl.load(logit_ptr + (b * HQ + h * G + gg[:, None]) * TMAX + pos[None, :], mask=msk,
                 other=float("-inf"))
    p = tl.exp(lg - mg[:, None]) / z[:, None]
    return tl.where(msk, p, 0.0)


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
def _value_hist(logit_ptr, mstat_ptr, sstat_ptr, len_ptr, r_ptr, vimp_ptr, hist_ptr, hw_ptr, ihist_ptr, TMAX, NSK,
                HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr, G2: tl.constexpr,
                NSK_PAD: tl.constexpr, BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr,
                HEAD_WEIGHT: tl.constexpr, TWO_PASS: tl.constexpr, RATE=0.0, BK=0, BV_FIXED=0,
                USE_RATE: tl.constexpr = False, D: tl.constexpr = 0, W: tl.constexpr = 0, MIN_V: tl.constexpr = 0,
                PACKET: tl.constexpr = 1, FUSED: tl.constexpr = False, HWIN: tl.constexpr = 0,
                RHIST: tl.constexpr = 0):
    """Program (b*Hkv + h, block of BLK tokens): Value importance and radix pass 1 (TWO_PASS: instead,
    the head's 8192-bin histogram of the importances' top 13 bits, one atomic add per token). FUSED
    (radix pass 1 only): the group's last program selects pass 1's digit (:func:`_arrive`; RATE ..
    PACKET as :func:`_v_count` takes them). HWIN > 0 (TWO_PASS): the block's tokens in a window of HWIN
    bins around their mean bin are counted in the block first (tl.histogram) and added with one
    atomic per non-empty bin; the others with one atomic each (KERNEL_NOTES run 39)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if blk * BLK < T:
        pos = blk * BLK + tl.arange(0, BLK)
        bimp = _importance(logit_ptr, mstat_ptr, sstat_ptr, hw_ptr, pid_bh, pos, T, TMAX, NSK, HQ, HKV, G, G2,
                           NSK_PAD, HEAD_WEIGHT)
        tl.store(vimp_ptr + pid_bh * TMAX + pos, bimp, mask=pos < T)
        if TWO_PASS:
            dig = bimp.to(tl.int32, bitcast=True) >> IHSHIFT
            ok = pos < T
            hrow = ihist_ptr + (grp * (HG + 1) + hl) * IHBINS
            if HWIN > 0:
                center = tl.sum(tl.where(ok, dig, 0), 0) // tl.maximum(tl.sum(ok.to(tl.int32), 0), 1)
                lo = tl.minimum(tl.maximum(center - HWIN // 2, 0), IHBINS - HWIN)
                inwin = ok & (dig >= lo) & (dig < lo + HWIN)
                wh = tl.histogram(tl.where(inwin, dig - lo, 0), HWIN, mask=inwin)
                tl.atomic_add(hrow + lo + tl.arange(0, HWIN), wh, mask=wh > 0, sem="relaxed")
                ok = ok & ~inwin
            tl.atomic_add(hrow + dig, tl.full([BLK], 1, tl.int32), mask=ok, sem="relaxed")
        else:  # radix pass 1: every key matches the empty prefix
            _pass_hist(bimp, pos < T, 0, r_ptr, hist_ptr + grp * HSTRIDE, 1, KS, KS_PAD, RHIST)
    if FUSED and not TWO_PASS:
        count = _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS)
        _arrive(hist_ptr + grp * HSTRIDE, count, HG * tl.num_programs(1), 1)


@triton.jit
def _value_radix(vimp_ptr, len_ptr, r_ptr, hist_ptr, cmeta_ptr, TMAX, RATE, BK, BV_FIXED, NBLK,
                 USE_RATE: tl.constexpr, PASS: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, D: tl.constexpr,
                 W: tl.constexpr, BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                 PACKET: tl.constexpr, GATED: tl.constexpr, FUSED: tl.constexpr = False, RHIST: tl.constexpr = 0):
    """Radix pass PASS (2..NPASS; 1 as well when GATED) over the keys that match the digits chosen
    so far. GATED (the two-pass allocation's fall back): only in groups whose candidates overflowed,
    on a grid of (B*Hkv, a few) programs that stride over the NBLK blocks, so that a pass with
    nothing to do costs a few programs reading one flag instead of a full grid. FUSED: the group's
    last program to finish selects the pass's digit (:func:`_arrive`), no :func:`_radix_select`."""
    pid_bh, blk0, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    if GATED:  # only in groups whose candidates overflowed
        go = _load_scalar(cmeta_ptr + grp * CMETA + 4) != 0
    else:
        go = True
    if go:
        if GATED:
            for blk in range(blk0, NBLK, tl.num_programs(1)):
                _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk, T, TMAX, RATE, BK, BV_FIXED, USE_RATE,
                             PASS, HG, D, W, BLK, KS, KS_PAD, MIN_V, PACKET, RHIST)
        else:
            _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk0, T, TMAX, RATE, BK, BV_FIXED, USE_RATE, PASS,
                         HG, D, W, BLK, KS, KS_PAD, MIN_V, PACKET, RHIST)
        if FUSED:
            _arrive(hist_ptr + grp * HSTRIDE, _v_count(T, RATE, BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS),
                    HG * tl.num_programs(1), PASS)


@triton.jit
def _radix_block(vimp_ptr, r_ptr, hist_ptr, pid_bh, grp, blk, T, TMAX, RATE, BK, BV_FIXED, USE_RATE: tl.constexpr,
                 PASS: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLK: tl.constexpr,
                 KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr, PACKET: tl.constexpr,
                 RHIST: tl.constexpr):
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
        _pass_hist(bimp, (pos < T) & (count > 0), prefix, r_ptr, hbase + (PASS - 1) * NBINS, PASS, KS, KS_PAD,
                   RHIST)


@triton.jit
def _pass_hist(bimp, ok, prefix, r_ptr, dst, PASS: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr,
               RHIST: tl.constexpr):
    """Adds to ``dst`` (NBINS words) the histogram of radix pass PASS's digit over the keys
    imp x r_k of the tokens ``ok`` (importances ``bimp``) whose digits of the earlier passes are
    ``prefix``.

    The histogram of a [KS_PAD * BLK] reshape of [KS_PAD, BLK] keys with a mask reshaped alike
    paired values and mask differently on the GPU for KS_PAD = 4, BLK = 256 (the constrained reader
    at B = 1: a quarter of the counted keys were padding rows; KERNEL_NOTES run 39), which the
    interpreter cannot show. So no mask travels beside a reshape: RHIST 1 takes one histogram of
    2 NBINS bins whose upper half receives the masked keys and is not added; RHIST 0 one step's keys
    at a time as 1-D tensors. After the first digits most blocks hold no key under the chosen
    prefix: from pass 2 they skip the histogram (O(keys x bins) as Triton lowers it)."""
    if RHIST == 1:
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
    else:
        hist = tl.zeros([NBINS], dtype=tl.int32)
        for k in tl.static_range(KS):
            key = (bimp * _load_scalar(r_ptr + k)).to(tl.int32, bitcast=True)
            above, digit = _radix_digit(key, PASS)
            mk = ok & (above == prefix)
            if PASS > 1:
                go = tl.sum(mk.to(tl.int32), 0) > 0
            else:
                go = True
            if go:
                hist += tl.histogram(tl.where(mk, digit, 0), NBINS, mask=mk)
        bins = tl.arange(0, NBINS)
        tl.atomic_add(dst + bins, hist, mask=hist > 0, sem="relaxed")


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


# ----------------------------------------------------------------------------- Value stage


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
def _v_tile_serial(vb_ptr, rows, st, s_max, tab_ptr, p_hi, p_lo, acc, D: tl.constexpr, W: tl.constexpr,
                   P: tl.constexpr, VG: tl.constexpr = 1):
    """One 32-token Value tile, bit-serial: ``rows`` [32] is each token's row in plane 0 (page * W * P
    + offset x VG), ``st`` its depth; one byte load per element and plane."""
    cc = tl.arange(0, D)
    NB8: tl.constexpr = D // 8
    codes = tl.zeros([32, D], dtype=tl.int32)
    for j in tl.static_range(W):
        if j < s_max:
            byte = tl.load(vb_ptr + (rows[:, None] + _vj(j, P, VG, 1)) * NB8 + (cc[None, :] // 8),
                           mask=(st > j)[:, None], other=0).to(tl.int32)  # [32, D]
            codes = codes | (((byte >> (cc[None, :] % 8)) & 1) << (W - 1 - j))
    z_hi, z_lo = _hi_lo(tl.load(tab_ptr + st[:, None] * (1 << W) + codes))  # [32, D]
    acc = tl.dot(p_hi, z_hi, acc)
    acc = tl.dot(p_hi, z_lo, acc)
    return tl.dot(p_lo, z_hi, acc)


@triton.jit
def _v_tile_t8(vb_ptr, rows, st, s_max, tabr_ptr, p_hi, p_lo, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
               D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NB8P: tl.constexpr, VG: tl.constexpr = 1):
    """One 32-token Value tile, bit-transposed: each plane byte (8 channels) loaded once into byte j
    of an int64; after the transpose byte k holds channel 8b + k, one accumulator per k."""
    NB8: tl.constexpr = D // 8
    bb = tl.arange(0, NB8P)
    x = tl.zeros([32, NB8P], dtype=tl.int64)
    for j in tl.static_range(W):
        if j < s_max:
            bj = tl.load(vb_ptr + (rows[:, None] + _vj(j, P, VG, 1)) * NB8 + bb[None, :],
                         mask=(st > j)[:, None] & (bb[None, :] < NB8), other=0)  # [32, NB8P]
            x = x | (bj.to(tl.int64) << (8 * j))
    x = _transpose8(x)
    sb = st[:, None] * (1 << W)
    acc0 = _v_slice(x, 0, sb, tabr_ptr, p_hi, p_lo, acc0)
    acc1 = _v_slice(x, 1, sb, tabr_ptr, p_hi, p_lo, acc1)
    acc2 = _v_slice(x, 2, sb, tabr_ptr, p_hi, p_lo, acc2)
    acc3 = _v_slice(x, 3, sb, tabr_ptr, p_hi, p_lo, acc3)
    acc4 = _v_slice(x, 4, sb, tabr_ptr, p_hi, p_lo, acc4)
    acc5 = _v_slice(x, 5, sb, tabr_ptr, p_hi, p_lo, acc5)
    acc6 = _v_slice(x, 6, sb, tabr_ptr, p_hi, p_lo, acc6)
    acc7 = _v_slice(x, 7, sb, tabr_ptr, p_hi, p_lo, acc7)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_part(part_ptr, prow, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, NB8P: tl.constexpr,
                T8: tl.constexpr, acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7):
    """A block's partial sums [G, D]: ``acc``, or with T8 the eight accumulators of channels 8b + k."""
    gg = tl.arange(0, G_PAD)
    if T8:
        bb = tl.arange(0, NB8P)
        msk = (gg[:, None] < G) & (bb[None, :] < D // 8)
        col = part_ptr + prow + bb[None, :] * 8
        tl.store(col + 0, acc0, mask=msk)
        tl.store(col + 1, acc1, mask=msk)
        tl.store(col + 2, acc2, mask=msk)
        tl.store(col + 3, acc3, mask=msk)
        tl.store(col + 4, acc4, mask=msk)
        tl.store(col + 5, acc5, mask=msk)
        tl.store(col + 6, acc6, mask=msk)
        tl.store(col + 7, acc7, mask=msk)
    else:
        tl.store(part_ptr + prow + tl.arange(0, D)[None, :], acc, mask=gg[:, None] < G)


@triton.jit
def _value_stage(vb_ptr, pt_ptr, len_ptr, logit_ptr, mstat_ptr, sstat_ptr, vimp_ptr, r_ptr, hist_ptr, tie_ptr,
                 tab_ptr, tabr_ptr, vdep_ptr, part_ptr, SLOTS, TMAX, NSK, RATE, BK, BV_FIXED,
                 USE_RATE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
                 G_PAD: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                 BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                 PACKET: tl.constexpr, NT_PAD: tl.constexpr, FIXED_V: tl.constexpr, T8: tl.constexpr,
                 VG: tl.constexpr = 1):
    """Program (b*Hkv + h, block of BLK tokens): token depths from lambda (ties in (step, item)
    order; FIXED_V > 0 gives every token that depth: the Full Reader), then per 32-token tile the
    planes each token needs, z = L_s[code] as fp16 hi/lo, and the p-weighted sum with three fp16
    MMAs into a float32 partial per block. Code assembly: T8 (set by the reader for D >= 256) loads
    each plane byte once (8 channels) into byte j of an int64 and bit-transposes it, giving the
    codes of channels 8b + k for k < 8 (one MMA accumulator per k); otherwise bit-serial, one byte
    load per element."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    h = pid_bh % HKV
    if FIXED_V == 0:
        lam, need, run = _lambda_and_run(hist_ptr, tie_ptr, grp, hl, blk, NBLK, T, RATE, BK, BV_FIXED, USE_RATE,
                                         D, W, HG, MIN_V, PACKET, KS, KS_PAD, NT_PAD)
    mg, z = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G_PAD, NSK_PAD)
    tok = tl.arange(0, 32)
    NB8P: tl.constexpr = max(D // 8, 16)
    acc = tl.zeros([G_PAD, D], tl.float32)
    acc0 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc1 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc2 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc3 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc4 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc5 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc6 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc7 = tl.zeros([G_PAD, NB8P], tl.float32)
    # 32-token tiles (half a 64-token page) keep the decode tile small in registers
    TPP: tl.constexpr = P // 32
    n_tiles = tl.cdiv(T, 32)
    TPB: tl.constexpr = BLK // 32
    t0 = blk * TPB
    for ti in range(t0, tl.minimum(t0 + TPB, n_tiles)):
        pos = ti * 32 + tok
        valid = pos < T
        if FIXED_V == 0:
            bimp = tl.load(vimp_ptr + pid_bh * TMAX + pos, mask=valid, other=0.0)
            s, run = _depths(bimp, valid, r_ptr, lam, need, run, KS, KS_PAD, MIN_V, PACKET)
            tl.store(vdep_ptr + pid_bh * TMAX + pos, s.to(tl.int8), mask=valid)
        else:
            s = tl.where(valid, FIXED_V, 0)
        if tl.max(s, 0) > 0:
            page = tl.load(pt_ptr + pid_bh * SLOTS + ti // TPP).to(tl.int64)
            rows = page * W * P + ((ti % TPP) * 32 + tok) * VG
            s_max = tl.max(s, 0)
            p_hi, p_lo = _split16(_probs(logit_ptr, b, h, pos, T, mg, z, TMAX, HQ, G, G_PAD))  # [G_PAD, 32]
            if T8:
                acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _v_tile_t8(
                    vb_ptr, rows, s, s_max, tabr_ptr, p_hi, p_lo, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                    D, W, P, NB8P, VG)
            else:
                acc = _v_tile_serial(vb_ptr, rows, s, s_max, tab_ptr, p_hi, p_lo, acc, D, W, P, VG)
    prow = ((b * HQ + h * G + tl.arange(0, G_PAD)[:, None]) * NBLK + blk) * D
    _store_part(part_ptr, prow, G, G_PAD, D, NB8P, T8, acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)


@triton.jit
def _value_stage_c(vb_ptr, pt_ptr, len_ptr, logit_ptr, mstat_ptr, sstat_ptr, vimp_ptr, r_ptr, hist_ptr, tie_ptr,
                   tab_ptr, tabr_ptr, vdep_ptr, vord_ptr, part_ptr, SLOTS, TMAX, NSK, RATE, BK, BV_FIXED,
                   USE_RATE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                   BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                   PACKET: tl.constexpr, NT_PAD: tl.constexpr, T8: tl.constexpr, VG: tl.constexpr = 1):
    """The Value stage with token compaction. Program (b*Hkv + h, block of BLK tokens): the depths of
    the whole block at once (as in :func:`_value_stage`), then the tokens with depth > 0 sorted by
    depth, deepest first (one int16 key per token: (W - depth) << 11 | position in the block,
    written to ``vord`` and read back in 32-token tiles). A depth-0 token reconstructs to the
    channel mean, which the combine step adds once for all, so it costs nothing here; and sorted
    tiles hold tokens of (nearly) one depth, so a tile reads the planes its tokens need rather than
    those of its deepest token. Decoding per tile as in :func:`_value_stage`, with a page per
    token. The reader uses it where it measured faster (``TritonReader.compact_values``)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    h = pid_bh % HKV
    lp, s = _block_depths(vimp_ptr, r_ptr, hist_ptr, tie_ptr, vdep_ptr, pid_bh, grp, hl, blk, NBLK, T, TMAX, RATE,
                          BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS, KS_PAD, NT_PAD, BLK)
    # compaction: deepest first, depth-0 and padding tokens last (key 0x7FFF)
    srt = tl.sort(tl.where(s > 0, ((W - s) << 11) | lp, 0x7FFF))
    nz = tl.sum((s > 0).to(tl.int32), 0)
    obase = vord_ptr + pid_bh * TMAX + blk * BLK
    tl.store(obase + lp, srt.to(tl.int16), mask=lp < nz)
    tl.debug_barrier()  # the tiles below read keys other threads wrote

    mg, z = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G_PAD, NSK_PAD)
    tok = tl.arange(0, 32)
    NB8P: tl.constexpr = max(D // 8, 16)
    acc = tl.zeros([G_PAD, D], tl.float32)
    acc0 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc1 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc2 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc3 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc4 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc5 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc6 = tl.zeros([G_PAD, NB8P], tl.float32)
    acc7 = tl.zeros([G_PAD, NB8P], tl.float32)
    for ti in range(0, tl.cdiv(nz, 32)):
        e = ti * 32 + tok
        em = e < nz
        kv = tl.load(obase + e, mask=em, other=0x7FFF).to(tl.int32)
        st = tl.where(em, W - (kv >> 11), 0)
        tp = tl.where(em, blk * BLK + (kv & 2047), T)  # token position (T: padding, p = 0)
        page = tl.load(pt_ptr + pid_bh * SLOTS + tp // P, mask=em, other=0).to(tl.int64)
        rows = page * W * P + (tp % P) * VG
        s_max = tl.max(st, 0)
        p_hi, p_lo = _split16(_probs(logit_ptr, b, h, tp, T, mg, z, TMAX, HQ, G, G_PAD))  # [G_PAD, 32]
        if T8:
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _v_tile_t8(
                vb_ptr, rows, st, s_max, tabr_ptr, p_hi, p_lo, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                D, W, P, NB8P, VG)
        else:
            acc = _v_tile_serial(vb_ptr, rows, st, s_max, tab_ptr, p_hi, p_lo, acc, D, W, P, VG)
    prow = ((b * HQ + h * G + tl.arange(0, G_PAD)[:, None]) * NBLK + blk) * D
    _store_part(part_ptr, prow, G, G_PAD, D, NB8P, T8, acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7)


@triton.jit
def _v_fma(acc, z, lrow_ptr, tp, em, m, inv_z):
    """acc [F, 8] += p * z for one query head: p = exp(logit - m) / z of each thread's token
    (tp, em: [F]; the reciprocal of z is taken once per program)."""
    lg = tl.load(lrow_ptr + tp, mask=em, other=float("-inf"))
    p = tl.where(em, tl.exp(lg - m) * inv_z, 0.0)
    return acc + z * p[:, None]


@triton.jit
def _v_fma_store(acc, part_ptr, prow, cidx):
    tl.store(part_ptr + prow + tl.max(cidx, 0), tl.sum(acc, 0))


@triton.jit
def _pick(v, gg, g: tl.constexpr):
    return tl.sum(tl.where(gg == g, v, 0.0), 0)


@triton.jit
def _depth_sorted_slots(s, W: tl.constexpr):
    """Each depth > 0 token's slot in a counting sort of the block by depth, deepest first, stable:
    the tokens of depth > s, then its rank among the tokens of depth s. The running counts of the
    depths are two prefix sums of int64 words holding four 16-bit counters each (depths 1-4, 5-8;
    a block holds at most 2048 tokens)."""
    tl.static_assert(W <= 8, "two words of four 16-bit depth counters")
    act = s > 0
    sh = (16 * ((s - 1) & 3)).to(tl.int64)
    one = tl.where(act, tl.full(s.shape, 1, tl.int64) << sh, 0)
    lo_w = tl.where(s <= 4, one, 0)
    hi_w = tl.where(s > 4, one, 0)
    c_lo = tl.cumsum(lo_w, 0)
    c_hi = tl.cumsum(hi_w, 0)
    t_lo = tl.sum(lo_w, 0)
    t_hi = tl.sum(hi_w, 0)
    rank = ((tl.where(s <= 4, c_lo, c_hi) >> sh) & 0xFFFF).to(tl.int32) - 1
    above = tl.zeros(s.shape, tl.int32)
    for dd in tl.static_range(1, W + 1):
        if dd <= 4:
            n_dd = ((t_lo >> (16 * (dd - 1))) & 0xFFFF).to(tl.int32)
        else:
            n_dd = ((t_hi >> (16 * (dd - 5))) & 0xFFFF).to(tl.int32)
        above += tl.where(s < dd, n_dd, 0)
    return above + rank


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
    """:func:`_depth_sorted_slots` (the same slots) from ONE prefix sum per token instead of two block-wide
    ones: the block as [BLK / CH, CH] chunks, each chunk's running counts of depths 1..8 as the eight
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
                 PACKET: tl.constexpr, NT_PAD: tl.constexpr, SORT: tl.constexpr = False,
                 CHUNKED: tl.constexpr = True):
    """Token depths of a block (as in :func:`_value_stage_c`) and the list of its depth > 0 tokens
    (``vord``: (W - depth) << 11 | position in the block; ``vcnt``: how many), for the compacting
    Value stages: in position order, or with SORT deepest first (position order within a depth; the
    bit-product Value stage, whose steps of 16 tokens loop over their deepest token's planes; CHUNKED:
    the slots from one prefix sum along 128-token chunks, else two block-wide ones, the same slots). A
    kernel of its own: the depths' tie ranks over the whole block need many registers, which would
    otherwise cap the occupancy of the Value stage's loop."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    lp, s = _block_depths(vimp_ptr, r_ptr, hist_ptr, tie_ptr, vdep_ptr, pid_bh, grp, hl, blk, NBLK, T, TMAX, RATE,
                          BK, BV_FIXED, USE_RATE, D, W, HG, MIN_V, PACKET, KS, KS_PAD, NT_PAD, BLK)
    act = s > 0
    if SORT and CHUNKED:
        slot = _depth_sorted_slots_chunked(s, W, BLK)
    elif SORT:
        slot = _depth_sorted_slots(s, W)
    else:
        # stream compaction in position order (a prefix sum, no sort: in the FMA stage each thread
        # decodes its own token, so tokens of mixed depths in one tile cost nothing extra)
        slot = tl.cumsum(act.to(tl.int32), 0) - 1
    tl.store(vord_ptr + pid_bh * TMAX + blk * BLK + slot, (((W - s) << 11) | lp).to(tl.int16), mask=act)
    tl.store(vcnt_ptr + pid_bh * NBLK + blk, tl.sum(act.to(tl.int32), 0))


@triton.jit
def _v_tile_f(vb_ptr, pt_ptr, tabf_ptr, lrow, pid_bh, SLOTS, TMAX, tp, st, em, bcol, mg, izs, gg, acc0, acc1, acc2,
              acc3, acc4, acc5, acc6, acc7, G: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NB8: tl.constexpr,
              NPL: tl.constexpr, VG: tl.constexpr = 1):
    """One tile of the FMA Value stage: each thread's token ``tp`` (depth ``st``, live ``em``) and byte
    column: its planes below its depth (at most NPL loads; NPL <= 4: one word, a 4x8 transpose), the 8
    codes, 8 table lookups and 8 x G FMAs with the token's probabilities."""
    NCODE: tl.constexpr = 1 << W
    tp = tl.where(em, tp, 0)
    page = tl.load(pt_ptr + pid_bh * SLOTS + tp // P, mask=em, other=0).to(tl.int64)
    p0 = vb_ptr + (page * W * P + (tp % P) * VG) * NB8 + bcol  # plane 0
    lo, hi = _pack_planes(p0, P * NB8, NPL, st, True, VG, NB8)
    z = tl.load(tabf_ptr + (st * NCODE)[:, None] + _codes(lo, hi, NPL))  # [F, 8]
    acc0 = _v_fma(acc0, z, lrow, tp, em, _pick(mg, gg, 0), _pick(izs, gg, 0))
    if G > 1:
        acc1 = _v_fma(acc1, z, lrow + TMAX, tp, em, _pick(mg, gg, 1), _pick(izs, gg, 1))
    if G > 2:
        acc2 = _v_fma(acc2, z, lrow + 2 * TMAX, tp, em, _pick(mg, gg, 2), _pick(izs, gg, 2))
    if G > 3:
        acc3 = _v_fma(acc3, z, lrow + 3 * TMAX, tp, em, _pick(mg, gg, 3), _pick(izs, gg, 3))
    if G > 4:
        acc4 = _v_fma(acc4, z, lrow + 4 * TMAX, tp, em, _pick(mg, gg, 4), _pick(izs, gg, 4))
    if G > 5:
        acc5 = _v_fma(acc5, z, lrow + 5 * TMAX, tp, em, _pick(mg, gg, 5), _pick(izs, gg, 5))
    if G > 6:
        acc6 = _v_fma(acc6, z, lrow + 6 * TMAX, tp, em, _pick(mg, gg, 6), _pick(izs, gg, 6))
    if G > 7:
        acc7 = _v_fma(acc7, z, lrow + 7 * TMAX, tp, em, _pick(mg, gg, 7), _pick(izs, gg, 7))
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _value_stage_f(vb_ptr, pt_ptr, len_ptr, logit_ptr, mstat_ptr, sstat_ptr, vimp_ptr, r_ptr, hist_ptr, tie_ptr,
                   tabf_ptr, vdep_ptr, vord_ptr, vcnt_ptr, part_ptr, SLOTS, TMAX, NSK, RATE, BK, BV_FIXED,
                   USE_RATE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
                   G_PAD: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                   BLK: tl.constexpr, KS: tl.constexpr, KS_PAD: tl.constexpr, MIN_V: tl.constexpr,
                   PACKET: tl.constexpr, NT_PAD: tl.constexpr, FIXED_V: tl.constexpr, COMPACT: tl.constexpr,
                   TS: tl.constexpr, VG: tl.constexpr = 1):
    """The Value stage on the CUDA cores. Program (b*Hkv + h, block of BLK tokens): token depths as in
    :func:`_value_stage` (FIXED_V > 0: every token at that depth, the Full Reader), then tiles of TS
    tokens x D/8 plane-byte columns, one (token, byte column) per thread: the token's planes below
    its depth (masked byte loads), an 8x8 bit transpose (the codes of its 8 channels), 8 lookups in
    the float32 table and 8 x G FMAs with the token's probabilities into per-thread accumulators,
    reduced over the tile's tokens once per program. With COMPACT the tiles walk only the block's
    depth > 0 tokens, as :func:`_value_order` listed them, so depth-0 tokens cost nothing;
    otherwise positions in order (depth-0 tokens' loads are masked off)."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    h = pid_bh % HKV
    NB8: tl.constexpr = D // 8
    obase = vord_ptr + pid_bh * TMAX + blk * BLK
    if FIXED_V == 0:
        if COMPACT:  # the block's depth > 0 tokens, deepest first, from _value_order
            n_items = _load_scalar(vcnt_ptr + pid_bh * NBLK + blk)
        else:
            lam, need, run = _lambda_and_run(hist_ptr, tie_ptr, grp, hl, blk, NBLK, T, RATE, BK, BV_FIXED, USE_RATE,
                                             D, W, HG, MIN_V, PACKET, KS, KS_PAD, NT_PAD)
            n_items = tl.maximum(tl.minimum(T - blk * BLK, BLK), 0)
    else:
        n_items = tl.maximum(tl.minimum(T - blk * BLK, BLK), 0)
    mg, zs = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G_PAD, NSK_PAD)
    izs = 1.0 / zs
    gg = tl.arange(0, G_PAD)
    # the thread grid is flat, F = TS * NB8 threads: f -> (token slot f // NB8, byte column f % NB8);
    # every per-token quantity is computed by each of its NB8 threads alike, so that no tensor
    # changes layout inside the loop (a 2D grid made Triton shuffle through shared memory)
    F: tl.constexpr = TS * NB8
    ff = tl.arange(0, F)
    slot = ff // NB8
    bcol = ff % NB8
    zero = _bytes8(tl.zeros([F], tl.uint32), tl.zeros([F], tl.uint32)).to(tl.float32)  # [F, 8]
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    acc4 = zero
    acc5 = zero
    acc6 = zero
    acc7 = zero
    lrow = logit_ptr + (b * HQ + h * G) * TMAX
    # one loop over tiles of tokens of mixed depths (a split into deep and shallow tiles, each with its
    # own loop, cost more registers than the 4x8 transpose saved: run 35); only the Full Reader at
    # <= 4 planes, where every token is shallow, reads with 4 loads and the 4x8 transpose
    NPL: tl.constexpr = W if FIXED_V == 0 or FIXED_V > 4 else min(W, 4)
    for ti in range(0, tl.cdiv(n_items, TS)):
        e = ti * TS + slot
        em = e < n_items
        if FIXED_V == 0:
            if COMPACT:
                kv = tl.load(obase + e, mask=em, other=0x7FFF).to(tl.int32)
                st = tl.where(em, W - (kv >> 11), 0)
                tp = blk * BLK + (kv & 2047)
            else:
                e1 = ti * TS + tl.arange(0, TS)
                em1 = e1 < n_items
                bimp = tl.load(vimp_ptr + pid_bh * TMAX + blk * BLK + e1, mask=em1, other=0.0)
                st1, run = _depths(bimp, em1, r_ptr, lam, need, run, KS, KS_PAD, MIN_V, PACKET)
                tl.store(vdep_ptr + pid_bh * TMAX + blk * BLK + e1, st1.to(tl.int8), mask=em1)
                tp = blk * BLK + e
                # the depths just stored, read back in the thread grid (each thread its own token)
                tl.debug_barrier()
                st = tl.load(vdep_ptr + pid_bh * TMAX + tp, mask=em, other=0).to(tl.int32)
        else:
            tp = blk * BLK + e
            st = tl.where(em, FIXED_V, 0)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _v_tile_f(
            vb_ptr, pt_ptr, tabf_ptr, lrow, pid_bh, SLOTS, TMAX, tp, st, em, bcol, mg, izs, gg, acc0, acc1, acc2,
            acc3, acc4, acc5, acc6, acc7, G, W, P, NB8, NPL, VG)
    # channel 8 * column + k of each accumulator element, in the accumulators' layout
    kk = _bytes8(tl.full([F], 0x03020100, tl.uint32), tl.full([F], 0x07060504, tl.uint32))
    cidx = tl.reshape(bcol[:, None] * 8 + kk, (TS, NB8, 8))
    prow = ((b * HQ + h * G) * NBLK + blk) * D
    _v_fma_store(tl.reshape(acc0, (TS, NB8, 8)), part_ptr, prow, cidx)
    if G > 1:
        _v_fma_store(tl.reshape(acc1, (TS, NB8, 8)), part_ptr, prow + NBLK * D, cidx)
    if G > 2:
        _v_fma_store(tl.reshape(acc2, (TS, NB8, 8)), part_ptr, prow + 2 * NBLK * D, cidx)
    if G > 3:
        _v_fma_store(tl.reshape(acc3, (TS, NB8, 8)), part_ptr, prow + 3 * NBLK * D, cidx)
    if G > 4:
        _v_fma_store(tl.reshape(acc4, (TS, NB8, 8)), part_ptr, prow + 4 * NBLK * D, cidx)
    if G > 5:
        _v_fma_store(tl.reshape(acc5, (TS, NB8, 8)), part_ptr, prow + 5 * NBLK * D, cidx)
    if G > 6:
        _v_fma_store(tl.reshape(acc6, (TS, NB8, 8)), part_ptr, prow + 6 * NBLK * D, cidx)
    if G > 7:
        _v_fma_store(tl.reshape(acc7, (TS, NB8, 8)), part_ptr, prow + 7 * NBLK * D, cidx)


@triton.jit
def _v_slice(x, K: tl.constexpr, sb, tabr_ptr, p_hi, p_lo, acc):
    """Channels 8b + K of a bit-transposed Value tile: codes, table (bit-reversed index), 3 MMAs."""
    code = ((x >> (8 * K)) & 0xFF).to(tl.int32)
    z_hi, z_lo = _hi_lo(tl.load(tabr_ptr + sb + code))  # [32, NB8]
    acc = tl.dot(p_hi, z_hi, acc)
    acc = tl.dot(p_hi, z_lo, acc)
    return tl.dot(p_lo, z_hi, acc)


@triton.jit
def _combine(part_ptr, mu_ptr, sig_ptr, out_ptr, NBLK, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
             G_PAD: tl.constexpr, D: tl.constexpr, INV: tl.constexpr = False, mv_ptr=None, fin_ptr=None):
    """Program b*Hkv + h: the blocks' partial outputs summed and the V transform's affine part undone
    (mu + sigma x sum), stored to out_ptr in the V-transformed domain; INV: then also rotated back
    (times M_V, at mv_ptr) into fin_ptr, instead of by a GEMM after the launch."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    h = pid_bh % HKV
    gg = tl.arange(0, G_PAD)
    cc = tl.arange(0, D)
    msk = gg[:, None] < G
    acc = tl.zeros([G_PAD, D], tl.float32)
    for s in range(NBLK):
        acc += tl.load(part_ptr + (((b * HQ + h * G + gg[:, None]) * NBLK + s) * D + cc[None, :]), mask=msk,
                       other=0.0)
    mu = tl.load(mu_ptr + h * D + cc)
    sig = tl.load(sig_ptr + h * D + cc)
    out = mu[None, :] + sig[None, :] * acc
    row0 = (b * HQ + h * G) * D
    tl.store(out_ptr + row0 + gg[:, None] * D + cc[None, :], out, mask=msk)
    if INV:
        tl.debug_barrier()  # the rows stored by every lane before the product reads them back in chunks
        _rotate_rows(out_ptr + row0, D, 1, mv_ptr, fin_ptr + row0, G, G_PAD, D)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


__all__ = ["HIST_STRIDE", "NBINS", "NPASS", "RBITS", "next_pow2", "triton"]
