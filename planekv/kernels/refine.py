"""Triton kernels of the Key-refinement stage (``ReadPolicy.key_refine``, token granularity).

The reference is ``planekv.kvstore.reference._key_refine``. After the Key stage has written logits
from the channel depths (which spent ``(1 - key_refine)`` of B_K), the step continues:

  _refine_score   grid (B*Hkv, NBLK)   per token: p from the stage-1 logits, the benefit
                                       ``sum_g p_g^2 var_g`` per bit (``var_g = scale^2 sum_c
                                       (q~ sigma)_c^2 D(t_c)``, cost ``sum_c (W - t_c)`` bits per
                                       token of the head) as a float32 key; radix pass 1
  _refine_select  grid (groups,)       after each pass: the digit at which the cost-weighted
                                       count crosses the budget (per-head histograms, each head's
                                       cost uniform)
  _refine_radix   (passes 2..8)        histograms of the next digit among matching keys
  _refine_ties    grid (B*Hkv, NBLK)   keys equal to lambda per block
  _refine_order   grid (B*Hkv, NBLK)   the chosen tokens: key > lambda, then ties in (head,
                                       position) order while the budget lasts; compacted per block
  _key_refine_f   grid (B*Hkv, NBLK)   the chosen tokens' Keys at depth W in every channel (one
                                       (token, channel) per thread, bits picked out of the plane
                                       bytes) -> their logits rewritten
  _key_refine_t   grid (B*Hkv, NBLK)   the same over a tiered cache: depth W where the token's Key
                                       page holds a slot (promoted or open), else each channel's
                                       resident depth (hot pool, promoted channel-planes)
  _key_restat     grid (B*Hkv, NSK)    softmax statistics of every Key split recomputed

Selection is greedy by benefit per bit in descending order, stopping at the first token that does
not fit (the reference's prefix of its sorted order, ties in (head, position) order). Over a tiered
cache the selection is the one without a limit, from the depths the Key stage read (capped at the
residency), as the reference's is; only the read of a chosen token stops at its limit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kvstore.tiered_pools import TieredPools
from .common import _block_prog, _load_scalar, _probs, _softmax_stats, next_pow2
from .plan import Step
from .radix import NBINS, NPASS, RBITS, _radix_digit

# int64 words per group in the selection buffer: per pass, the prefix chosen so far and the bits
# still to spend among the keys matching it
RSEL = tl.constexpr(2 * 8)
RSEL_STRIDE = 2 * 8
# int32 words of radix histograms per KV head (NPASS x NBINS)
HIST_STRIDE_R = 8 * 16


@triton.jit
def _refine_score(logit_ptr, mstat_ptr, sstat_ptr, len_ptr, qt_ptr, sig_ptr, kdep_ptr, dist_ptr, rkey_ptr,
                  rcost_ptr, rhist_ptr, scale, TMAX, NSK, HQ: tl.constexpr, HKV: tl.constexpr, HG: tl.constexpr,
                  HG_PAD: tl.constexpr, G: tl.constexpr, G2: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr,
                  W: tl.constexpr, BLK: tl.constexpr, kmax_ptr=None):
    """Program (b*Hkv + h, block): refinement keys of BLK tokens (-1: not a candidate) and radix
    pass 1 into this head's histogram; block 0 stores the head's cost per token. ``kmax_ptr`` (a
    tiered cache: int32 [B, Hkv, D]): the channel depths are those read, capped there."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    h = pid_bh % HKV
    cc = tl.arange(0, D)
    tdep = tl.load(kdep_ptr + pid_bh * D + cc)
    if kmax_ptr is not None:
        tdep = tl.minimum(tdep, tl.load(kmax_ptr + pid_bh * D + cc))
    cost = tl.sum(W - tdep, 0)
    if blk == 0:
        tl.store(rcost_ptr + pid_bh, cost)
    if blk * BLK < T:
        gg = tl.arange(0, G2)
        qt = tl.load(qt_ptr + (b * HQ + h * G + gg[:, None]) * D + cc[None, :], mask=gg[:, None] < G, other=0.0)
        qs = qt * tl.load(sig_ptr + h * D + cc)[None, :]
        dist = tl.load(dist_ptr + tdep)
        var = tl.sum(qs * qs * dist[None, :], 1) * scale * scale  # [G2]: the logit error's variance
        mg, z = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G2, NSK_PAD)
        pos = blk * BLK + tl.arange(0, BLK)
        p = _probs(logit_ptr, b, h, pos, T, mg, z, TMAX, HQ, G, G2)
        imp = tl.sum(p * p * var[:, None], 0)  # [BLK]
        ok = (pos < T) & (cost > 0)
        key = tl.where(ok, (imp / cost.to(tl.float32)).to(tl.int32, bitcast=True), -1)
        tl.store(rkey_ptr + pid_bh * TMAX + pos, key, mask=pos < T)
        SH1: tl.constexpr = 31 - RBITS
        hist = tl.histogram(tl.where(ok, key >> SH1, 0), NBINS, mask=ok)
        bins = tl.arange(0, NBINS)
        tl.atomic_add(rhist_ptr + (grp * HG_PAD + hl) * (NPASS * NBINS) + bins, hist, mask=hist > 0,
                      sem="relaxed")


@triton.jit
def _refine_budget(len_ptr, b, BKR, HG: tl.constexpr):
    """Refinement bits of a group: (B_K - B_K,stage) x T per KV head, times HG when pooled."""
    return _load_scalar(len_ptr + b).to(tl.int64) * BKR * HG


@triton.jit
def _group_costs(rcost_ptr, b, grp, HKV: tl.constexpr, HG: tl.constexpr, HG_PAD: tl.constexpr):
    hh = tl.arange(0, HG_PAD)
    h0 = (grp % (HKV // HG)) * HG
    return tl.load(rcost_ptr + b * HKV + h0 + hh, mask=hh < HG, other=0).to(tl.int64)


@triton.jit
def _refine_select(rhist_ptr, rsel_ptr, rcost_ptr, len_ptr, BKR, PASS: tl.constexpr, HKV: tl.constexpr,
                   HG: tl.constexpr, HG_PAD: tl.constexpr):
    """One program per group after radix pass PASS: the largest digit whose keys (with the prefix so
    far) cost more than the bits left, weighting each head's histogram by its cost per token.
    Prefix -1 means every candidate fits (pass 1 found the total within the budget)."""
    grp = tl.program_id(0)
    b = grp // (HKV // HG)
    cost = _group_costs(rcost_ptr, b, grp, HKV, HG, HG_PAD)
    sbase = rsel_ptr + grp * RSEL
    if PASS == 1:
        pref = tl.zeros([], tl.int64)
        rem = _refine_budget(len_ptr, b, BKR, HG)
    else:
        pref = _load_scalar(sbase + 2 * (PASS - 2))
        rem = _load_scalar(sbase + 2 * (PASS - 2) + 1)
    hh = tl.arange(0, HG_PAD)
    idx = tl.arange(0, NBINS)
    hist = tl.load(rhist_ptr + ((grp * HG_PAD + hh[:, None]) * NPASS + PASS - 1) * NBINS + idx[None, :])
    wsum = tl.sum(hist.to(tl.int64) * cost[:, None], 0)  # [NBINS] bits
    ge = tl.sum(wsum, 0) - tl.cumsum(wsum, 0) + wsum  # bits of keys with digit >= idx
    dsel = tl.max(tl.where(ge > rem, idx, -1), 0)
    above = tl.sum(tl.where(idx > dsel, wsum, 0), 0)
    WIDTH: tl.constexpr = min(RBITS, 31 - RBITS * (PASS - 1))
    new = tl.where(pref < 0, pref, tl.where(dsel < 0, -1, (pref << WIDTH) | dsel.to(tl.int64)))
    rem = tl.where(new < 0, rem, rem - above)
    tl.store(sbase + 2 * (PASS - 1), new)
    tl.store(sbase + 2 * (PASS - 1) + 1, rem)


@triton.jit
def _refine_radix(rkey_ptr, len_ptr, rsel_ptr, rhist_ptr, TMAX, PASS: tl.constexpr, HKV: tl.constexpr,
                  HG: tl.constexpr, HG_PAD: tl.constexpr, BLK: tl.constexpr):
    """Radix pass PASS (2..NPASS) over this block's keys that match the prefix chosen so far."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    pref = _load_scalar(rsel_ptr + grp * RSEL + 2 * (PASS - 2))
    if (blk * BLK < T) & (pref >= 0):
        pos = blk * BLK + tl.arange(0, BLK)
        key = tl.load(rkey_ptr + pid_bh * TMAX + pos, mask=pos < T, other=-1)
        above, digit = _radix_digit(key, PASS)
        match = (key >= 0) & (above.to(tl.int64) == pref)
        if tl.sum(match.to(tl.int32), 0) > 0:
            hist = tl.histogram(tl.where(match, digit, 0), NBINS, mask=match)
            bins = tl.arange(0, NBINS)
            tl.atomic_add(rhist_ptr + ((grp * HG_PAD + hl) * NPASS + PASS - 1) * NBINS + bins, hist, mask=hist > 0,
                          sem="relaxed")


@triton.jit
def _refine_ties(rkey_ptr, len_ptr, rsel_ptr, rtie_ptr, TMAX, HKV: tl.constexpr, HG: tl.constexpr,
                 BLK: tl.constexpr):
    """Keys equal to lambda in this block: rtie[group, hl * NBLK + blk]."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    lam = _load_scalar(rsel_ptr + grp * RSEL + 2 * (NPASS - 1))
    pos = blk * BLK + tl.arange(0, BLK)
    key = tl.load(rkey_ptr + pid_bh * TMAX + pos, mask=pos < T, other=-1)
    eq = (key >= 0) & (key.to(tl.int64) == lam)
    tl.store(rtie_ptr + (grp * HG + hl) * NBLK + blk, tl.sum(eq.to(tl.int32), 0))


@triton.jit
def _refine_order(rkey_ptr, len_ptr, rsel_ptr, rtie_ptr, rcost_ptr, rord_ptr, rcnt_ptr, TMAX, HKV: tl.constexpr,
                  HG: tl.constexpr, HG_PAD: tl.constexpr, BLK: tl.constexpr, NT_PAD: tl.constexpr):
    """The block's chosen tokens in position order (``rord``: position in the block, int16) and how
    many (``rcnt``): keys above lambda, and ties at lambda while the bits left last, in (head,
    position) order."""
    pid_bh, blk, b, grp, hl, T = _block_prog(len_ptr, HKV, HG)
    NBLK = tl.num_programs(1)
    sbase = rsel_ptr + grp * RSEL + 2 * (NPASS - 1)
    lam = _load_scalar(sbase)
    rem = _load_scalar(sbase + 1)
    cost = _group_costs(rcost_ptr, b, grp, HKV, HG, HG_PAD)  # [HG_PAD]
    hh = tl.arange(0, HG_PAD)
    mine = tl.sum(tl.where(hh == hl, cost, 0), 0)
    # bits of the ties that come before this block: (head, block) order
    NT = HG * NBLK
    tt = tl.arange(0, NT_PAD)
    tie = tl.load(rtie_ptr + grp * NT + tt, mask=tt < NT, other=0).to(tl.int64)
    tcost = tl.sum(tl.where((tt // NBLK)[:, None] == hh[None, :], cost[None, :], 0), 1)  # [NT_PAD]
    run = tl.sum(tl.where(tt < hl * NBLK + blk, tie * tcost, 0), 0)
    lp = tl.arange(0, BLK)
    pos = blk * BLK + lp
    key = tl.load(rkey_ptr + pid_bh * TMAX + pos, mask=pos < T, other=-1)
    valid = key >= 0
    eq = valid & (key.to(tl.int64) == lam)
    spent = run + tl.cumsum(eq.to(tl.int64), 0) * mine
    take = valid & ((lam < 0) | (key.to(tl.int64) > lam) | (eq & (spent <= rem)))
    slot = tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(rord_ptr + pid_bh * TMAX + blk * BLK + slot, lp.to(tl.int16), mask=take)
    tl.store(rcnt_ptr + pid_bh * NBLK + blk, tl.sum(take.to(tl.int32), 0))


@triton.jit
def _key_refine_f(kb_ptr, pt_ptr, len_ptr, rord_ptr, rcnt_ptr, qt_ptr, sig_ptr, base_ptr, tabw_ptr, logit_ptr,
                  scale, SLOTS, TMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  W: tl.constexpr, P: tl.constexpr, BLK: tl.constexpr, TS: tl.constexpr):
    """Program (b*Hkv + h, block): the chosen tokens' Keys at depth W, TS tokens x D channels per
    tile, one (token, channel) per thread: bit (position % 8) of each plane byte assembles the
    code, one lookup in the depth-W table, and the logit of each query head of the group is
    rewritten (scaled, as the Key stage writes it)."""
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    NBLK = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    NB: tl.constexpr = P // 8
    n = _load_scalar(rcnt_ptr + pid_bh * NBLK + blk)
    cc = tl.arange(0, D)
    sg = tl.load(sig_ptr + h * D + cc)
    q0 = b * HQ + h * G
    for s0 in range(0, n, TS):
        ii = s0 + tl.arange(0, TS)
        ok = ii < n
        pos = blk * BLK + tl.load(rord_ptr + pid_bh * TMAX + blk * BLK + ii, mask=ok, other=0).to(tl.int32)
        page = tl.load(pt_ptr + pid_bh * SLOTS + pos // P, mask=ok, other=0).to(tl.int64)
        rb = page * (W * D * NB) + (pos % P) // 8  # [TS]: plane 0, channel 0
        bit = (pos % 8)[:, None]
        code = tl.zeros([TS, D], dtype=tl.int32)
        for j in tl.static_range(W):
            byte = tl.load(kb_ptr + rb[:, None] + j * (D * NB) + cc[None, :] * NB, mask=ok[:, None], other=0)
            code = code | (((byte.to(tl.int32) >> bit) & 1) << (W - 1 - j))
        z = tl.load(tabw_ptr + code)  # [TS, D] float32
        for g in tl.static_range(G):
            wq = tl.load(qt_ptr + (q0 + g) * D + cc) * sg
            lg = (tl.sum(z * wq[None, :], 1) + _load_scalar(base_ptr + q0 + g)) * scale
            tl.store(logit_ptr + (q0 + g) * TMAX + pos, lg, mask=ok)


@triton.jit
def _key_refine_t(kh_ptr, pt_ptr, len_ptr, rord_ptr, rcnt_ptr, qt_ptr, sig_ptr, base_ptr, tab_ptr, logit_ptr,
                  kmax_ptr, ks_ptr, kp_ptr, pp_ptr, pslot_ptr, scale, SLOTS, TMAX, HQ: tl.constexpr,
                  HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                  BLK: tl.constexpr, TS: tl.constexpr, HOT: tl.constexpr, MAXSLOTS: tl.constexpr):
    """:func:`_key_refine_f` over a tiered cache: a chosen token reads every channel to depth W where its Key
    page holds a slot in ``pp_ptr`` ([slots, W - HOT, D, P/8]; ``pslot_ptr`` [pages], -1: none), else channel c
    to its resident depth ``kmax[c]`` (planes < HOT from the hot pool ``kh_ptr`` [pages, HOT, D, P/8], the rest
    from the promoted channel-plane vectors ``kp_ptr`` [slots, MAXSLOTS, P/8] at ``ks_ptr`` [B, Hkv, D, W - HOT]).
    Planes past the depth are not loaded; the code's prefix is looked up in the table row of its depth
    (``tab_ptr`` [W + 1, 2^W], stored code order)."""
    pid_bh = tl.program_id(0)
    blk = tl.program_id(1)
    NBLK = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    NB: tl.constexpr = P // 8
    NCOLD: tl.constexpr = W - HOT
    NCODE: tl.constexpr = 1 << W
    n = _load_scalar(rcnt_ptr + pid_bh * NBLK + blk)
    cc = tl.arange(0, D)
    sg = tl.load(sig_ptr + h * D + cc)
    kmax = tl.load(kmax_ptr + pid_bh * D + cc)  # [D]
    q0 = b * HQ + h * G
    for s0 in range(0, n, TS):
        ii = s0 + tl.arange(0, TS)
        ok = ii < n
        pos = blk * BLK + tl.load(rord_ptr + pid_bh * TMAX + blk * BLK + ii, mask=ok, other=0).to(tl.int32)
        page = tl.load(pt_ptr + pid_bh * SLOTS + pos // P, mask=ok, other=0).to(tl.int64)
        ps = tl.load(pslot_ptr + page, mask=ok, other=-1).to(tl.int64)  # [TS]: the Key page's slot
        whole = ps >= 0
        depth = tl.where(whole[:, None], W, kmax[None, :])  # [TS, D]
        byte = ((pos % P) // 8).to(tl.int64)
        bit = (pos % 8)[:, None]
        code = tl.zeros([TS, D], dtype=tl.int32)
        for j in tl.static_range(W):
            live = ok[:, None] & (j < depth)
            if j < HOT:
                addr = kh_ptr + page[:, None] * (HOT * D * NB) + j * (D * NB) + cc[None, :] * NB + byte[:, None]
                bj = tl.load(addr, mask=live, other=0)
            else:
                from_page = tl.load(pp_ptr + ps[:, None] * (NCOLD * D * NB) + (j - HOT) * (D * NB)
                                    + cc[None, :] * NB + byte[:, None], mask=live & whole[:, None], other=0)
                vs = tl.load(ks_ptr + (pid_bh * D + cc) * NCOLD + (j - HOT), mask=j < kmax, other=0).to(tl.int64)
                from_vec = tl.load(kp_ptr + vs[None, :] * (MAXSLOTS * NB) + (pos // P).to(tl.int64)[:, None] * NB
                                   + byte[:, None], mask=live & ~whole[:, None], other=0)
                bj = from_page | from_vec
            code = code | (((bj.to(tl.int32) >> bit) & 1) << (W - 1 - j))
        z = tl.load(tab_ptr + depth * NCODE + code)  # [TS, D] float32
        for g in tl.static_range(G):
            wq = tl.load(qt_ptr + (q0 + g) * D + cc) * sg
            lg = (tl.sum(z * wq[None, :], 1) + _load_scalar(base_ptr + q0 + g)) * scale
            tl.store(logit_ptr + (q0 + g) * TMAX + pos, lg, mask=ok)


@triton.jit
def _key_restat(logit_ptr, len_ptr, mstat_ptr, sstat_ptr, TMAX, HQ: tl.constexpr, HKV: tl.constexpr,
                G: tl.constexpr, G2: tl.constexpr, NTOK: tl.constexpr):
    """Program (b*Hkv + h, split of NTOK tokens): the split's softmax max and sum from its logits
    (after refinement), as the Key stage computes them."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    NSPLIT = tl.num_programs(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = _load_scalar(len_ptr + b)
    gg = tl.arange(0, G2)
    pos = split * NTOK + tl.arange(0, NTOK)
    msk = (gg[:, None] < G) & (pos[None, :] < T)
    q0 = b * HQ + h * G
    lg = tl.load(logit_ptr + (q0 + gg[:, None]) * TMAX + pos[None, :], mask=msk, other=float("-inf"))
    m = tl.max(lg, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(lg - m_safe[:, None]), 1)
    tl.store(mstat_ptr + (q0 + gg) * NSPLIT + split, m, mask=gg < G)
    tl.store(sstat_ptr + (q0 + gg) * NSPLIT + split, s, mask=gg < G)


def launch(st: Step, k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
           tiers: TieredPools | None = None) -> None:
    """After the Key stage: the refinement keys and radix pass 1, passes 2..8 each with its selection, the
    ties, the chosen tokens, their Keys at depth W (logits rewritten) and the splits' statistics recomputed.
    The keys live in ``plan.vimp``, free until the Value allocation writes importances. ``tiers``: a tiered
    cache's layer (``k_pool`` is then its hot pool; chosen tokens read at their limits, :func:`_key_refine_t`)."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    b, nblk, blk, tmax = pl.batch, pl.n_blocks, ch.block_tokens, pl.max_tokens
    grid = (b * k.hk, nblk)
    hgp = next_pow2(k.hg)
    nw = st.num_warps
    rkey = pl.vimp.view(torch.int32)
    sig_k = c["sig_k"][st.layer]
    bkr = k.bk - k.bk_stage  # the budget's share for refinement
    _refine_score[grid](pl.logits, pl.mstat, pl.sstat, lengths, pl.qt, sig_k, pl.kdep, c["dist"], rkey, pl.rcost,
                        pl.rhist, st.scale, tmax, pl.n_splits, HQ=k.hq, HKV=k.hk, HG=k.hg, HG_PAD=hgp, G=k.g,
                        G2=st.g2, NSK_PAD=st.nsk_pad, D=k.d, W=k.w, BLK=blk,
                        **({} if tiers is None else {"kmax_ptr": tiers.k_max}), num_warps=nw)
    sel = dict(HKV=k.hk, HG=k.hg, HG_PAD=hgp, num_warps=1)
    _refine_select[(st.groups,)](pl.rhist, pl.rsel, pl.rcost, lengths, bkr, PASS=1, **sel)
    for pas in range(2, NPASS.value + 1):
        _refine_radix[grid](rkey, lengths, pl.rsel, pl.rhist, tmax, PASS=pas, HKV=k.hk, HG=k.hg, HG_PAD=hgp, BLK=blk,
                            num_warps=nw)
        _refine_select[(st.groups,)](pl.rhist, pl.rsel, pl.rcost, lengths, bkr, PASS=pas, **sel)
    _refine_ties[grid](rkey, lengths, pl.rsel, pl.rtie, tmax, HKV=k.hk, HG=k.hg, BLK=blk, num_warps=nw)
    _refine_order[grid](rkey, lengths, pl.rsel, pl.rtie, pl.rcost, pl.rord, pl.rcnt, tmax, HKV=k.hk, HG=k.hg,
                        HG_PAD=hgp, BLK=blk, NT_PAD=next_pow2(k.hg * nblk), num_warps=nw)
    if tiers is None:
        _key_refine_f[grid](k_pool, page_table, lengths, pl.rord, pl.rcnt, pl.qt, sig_k, pl.base, c["tabw"],
                            pl.logits, st.scale, st.slots, tmax, HQ=k.hq, HKV=k.hk, G=k.g, D=k.d, W=k.w, P=k.p,
                            BLK=blk, TS=max(1, 1024 // k.d), num_warps=nw)
    else:
        _key_refine_t[grid](k_pool, page_table, lengths, pl.rord, pl.rcnt, pl.qt, sig_k, pl.base, c["tabk"],
                            pl.logits, tiers.k_max, tiers.k_slot, tiers.k_promo, tiers.kp_promo, tiers.kp_slot,
                            st.scale, st.slots, tmax, HQ=k.hq, HKV=k.hk, G=k.g, D=k.d, W=k.w, P=k.p, BLK=blk,
                            TS=max(1, 1024 // k.d), HOT=tiers.hot_k, MAXSLOTS=tiers.k_promo.shape[1], num_warps=nw)
    _key_restat[(b * k.hk, pl.n_splits)](pl.logits, lengths, pl.mstat, pl.sstat, tmax, HQ=k.hq, HKV=k.hk, G=k.g,
                                         G2=st.g2, NTOK=ch.key_pages * k.p, num_warps=nw)
