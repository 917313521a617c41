"""The Key stage on the CUDA cores (the default for up to 8 query heads per KV head).

Program (b*Hkv + h, split) covers PPK pages as rows of 8 tokens, one row per thread, and walks the head's
channels of depth > 0 (``_prep``'s list): per channel and row t byte loads (plane j into byte j of a word),
one bit transpose (8x8, or 4x8 for t <= 4) giving 8 tokens' codes, 8 lookups in row t of the float32 table
and 8 x G FMAs. It writes the logits and each split's softmax maximum and sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kvstore.tiered_pools import TieredPools
from .common import _bytes8, _codes, _load_scalar, _pack_k_tiered, _pack_planes
from .plan import Step
from .prep import KSEG


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
def _key_channel(lo, hi, trow, wp, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G: tl.constexpr,
                 T: tl.constexpr):
    """One channel of depth T in the FMA Key stage: its codes, their values in the table row ``trow``
    and acc_g += value * w_g (``wp``: the channel's G weights)."""
    z = tl.load(trow + _codes(lo, hi, T))  # [M, 8] float32
    return _fma_channel(z, wp, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, G)


@triton.jit
def _pack_k(kb_ptr, rbase, c, tier, D: tl.constexpr, NB: tl.constexpr, T: tl.constexpr, TIERED: tl.constexpr,
            HOT: tl.constexpr, NCOLD: tl.constexpr, MAXSLOTS: tl.constexpr):
    """Planes 0..T-1 of channel ``c`` for the rows at ``rbase``: from the page pool, or (TIERED, T > HOT) the
    hot pool and the promotion cache (``tier`` = (promotion vectors, the head's slot row, page slot x NB +
    byte per row, Key page slots, Key page slot x NCOLD*D*NB + byte per row); :func:`_pack_k_tiered`)."""
    if TIERED and T > HOT:
        kp_ptr, ks_row, vbase, pp_ptr, pbase = tier
        return _pack_k_tiered(kb_ptr, rbase, c, kp_ptr, ks_row, vbase, pp_ptr, pbase, D * NB, T, HOT, NCOLD, NB,
                              MAXSLOTS)
    return _pack_planes(kb_ptr + rbase + c * NB, D * NB, T, 0, False)


@triton.jit
def _key_segment(kb_ptr, rbase, lrow, wrow, tabf_ptr, start, end, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                 G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, NB: tl.constexpr, T: tl.constexpr, tier=None,
                 TIERED: tl.constexpr = False, HOT: tl.constexpr = 0, NCOLD: tl.constexpr = 0,
                 MAXSLOTS: tl.constexpr = 0):
    """The channels kord[start:end] of one depth T: per channel T plane loads per row (the next
    channel's requested before this one's math; the last re-requests itself, an L1 hit), the bit
    transpose (8x8, or 4x8 for T <= 4), 8 lookups in row T of ``tabf`` and 8 x G FMAs."""
    trow = tabf_ptr + T * (1 << W)
    c = _load_scalar(lrow + start) & 0xFF
    if TIERED:
        lo, hi = _pack_k(kb_ptr, rbase, c, tier, D, NB, T, TIERED, HOT, NCOLD, MAXSLOTS)
    else:
        lo, hi = _pack_planes(kb_ptr + rbase + c * NB, D * NB, T, 0, False)
    for i in range(start, end):
        c_n = _load_scalar(lrow + tl.minimum(i + 1, end - 1)) & 0xFF
        if TIERED:
            lo_n, hi_n = _pack_k(kb_ptr, rbase, c_n, tier, D, NB, T, TIERED, HOT, NCOLD, MAXSLOTS)
        else:
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
                    T: tl.constexpr, CH: tl.constexpr, tier=None, TIERED: tl.constexpr = False,
                    HOT: tl.constexpr = 0, NCOLD: tl.constexpr = 0, MAXSLOTS: tl.constexpr = 0):
    """:func:`_key_segment` CH channels at a time: row r of the program's CH x M rows decodes channel
    kord[i + r // M] for the token row r % M (``slot`` = r // M), so that a program of few token
    rows (small steps: B = 1) keeps CH channels' loads in flight instead of one. Past the segment's
    end a slot re-reads its last channel with weight 0."""
    trow = tabf_ptr + T * (1 << W)
    for i in range(start, end, CH):
        ci = i + slot
        live = ci < end
        c = tl.load(lrow + tl.minimum(ci, end - 1)) & 0xFF
        lo, hi = _pack_k(kb_ptr, rbase, c, tier, D, NB, T, TIERED, HOT, NCOLD, MAXSLOTS)
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
                 P: tl.constexpr, PPK: tl.constexpr, KLOOP: tl.constexpr, CH: tl.constexpr = 1, kp_ptr=None,
                 ks_ptr=None, TIERED: tl.constexpr = False, HOT: tl.constexpr = 0, MAXSLOTS: tl.constexpr = 0,
                 pp_ptr=None, ps_ptr=None):
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
    channels of a segment at a time (:func:`_key_segment_ch`), the slots' sums added at the end. TIERED (a
    tiered cache): ``kb_ptr`` is the hot pool of HOT planes a page and planes >= HOT come from the promotion
    cache's channel-plane vectors ``kp_ptr`` [slots, MAXSLOTS, NB] at the slots ``ks_ptr`` [B*Hkv, D, W - HOT],
    or, for a plane not promoted there, from the page's Key page slot (``pp_ptr`` [slots, W - HOT, D, NB] at
    ``ps_ptr`` [pages]) (``_prep`` built the channel lists at the resident depths)."""
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
    NCOLD: tl.constexpr = W - HOT
    if TIERED:  # the hot pool: HOT planes a page; the rows' places in a promoted channel-plane vector
        rbase = page * (HOT * D * NB) + byte
        ps = tl.load(ps_ptr + page, mask=pvalid, other=-1).to(tl.int64)  # [R]: each row's Key page slot
        pbase = tl.where(ps >= 0, ps * (NCOLD * D * NB) + byte, -1)
        tier = (kp_ptr, ks_ptr + pid_bh * (D * NCOLD), tl.where(pvalid, pg, 0).to(tl.int64) * NB + byte, pp_ptr,
                pbase)
    else:
        rbase = page * (W * D * NB) + byte  # [R]: plane 0, channel 0 of each row
        tier = None
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
                        acc4, acc5, acc6, acc7, G, D, W, NB, W - tt, CH, tier, TIERED, HOT, NCOLD, MAXSLOTS)
                else:
                    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _key_segment(
                        kb_ptr, rbase, lrow, wrow, tabf_ptr, start, start + n_t, acc0, acc1, acc2, acc3, acc4,
                        acc5, acc6, acc7, G, D, W, NB, W - tt, tier, TIERED, HOT, NCOLD, MAXSLOTS)
            start += n_t
    else:  # kord in channel order (neighbouring channels share L1 lines); a branch per depth
        tl.static_assert(CH == 1, "the channel-order walk takes one channel at a time")
        for i in range(_load_scalar(segs)):
            ent = _load_scalar(lrow + i)
            c = ent & 0xFF
            t = ent >> 8
            for tt in tl.static_range(1, W + 1):
                if t == tt:
                    lo, hi = _pack_k(kb_ptr, rbase, c, tier, D, NB, tt, TIERED, HOT, NCOLD, MAXSLOTS)
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


def launch(st: Step, k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
           tiers: TieredPools | None = None) -> None:
    """Grid (B*Hkv, n_splits): logits [B, Hq, T] and each split's softmax maximum and sum. Warps: as many as
    the program's rows of 8 tokens fill (one row per thread), at most ``num_warps``. ``tiers``: a tiered cache's
    promotion cache (``k_pool`` is then its hot pool)."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    ppk = ch.pages_per_program
    tier = {} if tiers is None else dict(kp_ptr=tiers.k_promo, ks_ptr=tiers.k_slot, TIERED=True, HOT=tiers.hot_k,
                                         MAXSLOTS=tiers.k_promo.shape[1], pp_ptr=tiers.kp_promo, ps_ptr=tiers.kp_slot)
    _key_stage_f[(pl.batch * k.hk, pl.n_splits)](
        k_pool, page_table, lengths, pl.kord, pl.kcnt, pl.wf, pl.base, c["tabf"], pl.logits, pl.mstat, pl.sstat,
        st.scale, st.slots, pl.max_tokens, HQ=k.hq, HKV=k.hk, G=k.g, D=k.d, W=k.w, P=k.p, PPK=ppk, KLOOP=ch.key_walk,
        CH=ch.key_channels, **tier, num_warps=max(1, min(st.num_warps, ch.key_channels * ppk * k.p // 256)))
