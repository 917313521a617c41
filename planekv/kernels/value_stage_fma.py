"""The Value stage on the CUDA cores (the default for up to 8 query heads per KV head).

Program (b*Hkv + h, block of BLK tokens): tiles of TS tokens x D/8 plane-byte columns, one (token, byte
column) per thread: the token's planes below its depth, a bit transpose giving its 8 channels' codes, 8
lookups in the float32 table and 8 x G FMAs with the token's probabilities, reduced once per program into a
partial output per block. Compacting (the default), the tiles walk only the block's tokens of depth > 0 as
``_value_order`` listed them; otherwise (and for the Full Reader's fixed depth) every position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kvstore.tiered_pools import TieredPools
from .common import (
    _block_prog,
    _bytes8,
    _codes,
    _load_scalar,
    _pack_planes,
    _pack_planes_split,
    _softmax_stats,
    next_pow2,
)
from .plan import Step
from .value_alloc import _depths, _lambda_and_run


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
def _v_tile_f(vb_ptr, pt_ptr, tabf_ptr, lrow, pid_bh, SLOTS, TMAX, tp, st, em, bcol, mg, izs, gg, acc0, acc1, acc2,
              acc3, acc4, acc5, acc6, acc7, G: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NB8: tl.constexpr,
              NPL: tl.constexpr, VG: tl.constexpr = 1, vp_ptr=None, vs_ptr=None, TIERED: tl.constexpr = False,
              HOT: tl.constexpr = 0):
    """One tile of the FMA Value stage: each thread's token ``tp`` (depth ``st``, live ``em``) and byte
    column: its planes below its depth (at most NPL loads; NPL <= 4: one word, a 4x8 transpose), the 8
    codes, 8 table lookups and 8 x G FMAs with the token's probabilities. TIERED: ``vb_ptr`` is the hot pool
    (HOT planes a page); a token's depth is capped at its page's resident depth (W where ``vs_ptr`` gives
    the page a promotion slot in ``vp_ptr``, whose page holds planes >= HOT, else HOT)."""
    NCODE: tl.constexpr = 1 << W
    tp = tl.where(em, tp, 0)
    page = tl.load(pt_ptr + pid_bh * SLOTS + tp // P, mask=em, other=0).to(tl.int64)
    if TIERED:
        ps = tl.load(vs_ptr + page, mask=em, other=-1).to(tl.int64)
        st = tl.minimum(st, tl.where(ps >= 0, W, HOT))
        ph = vb_ptr + (page * HOT * P + (tp % P) * VG) * NB8 + bcol  # plane 0 in the hot pool
        pc = vp_ptr + (tl.maximum(ps, 0) * (W - HOT) * P + (tp % P) * VG) * NB8 + bcol  # plane HOT, promoted
        lo, hi = _pack_planes_split(ph, pc, P * NB8, NPL, HOT, st, VG, NB8)
    else:
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
                   TS: tl.constexpr, VG: tl.constexpr = 1, vp_ptr=None, vs_ptr=None, TIERED: tl.constexpr = False,
                   HOT: tl.constexpr = 0):
    """The Value stage on the CUDA cores. Program (b*Hkv + h, block of BLK tokens): token depths as in
    :func:`_value_stage` (FIXED_V > 0: every token at that depth, the Full Reader), then tiles of TS
    tokens x D/8 plane-byte columns, one (token, byte column) per thread: the token's planes below
    its depth (masked byte loads), an 8x8 bit transpose (the codes of its 8 channels), 8 lookups in
    the float32 table and 8 x G FMAs with the token's probabilities into per-thread accumulators,
    reduced over the tile's tokens once per program. With COMPACT the tiles walk only the block's
    depth > 0 tokens, as :func:`_value_order` listed them, so depth-0 tokens cost nothing;
    otherwise positions in order (depth-0 tokens' loads are masked off). TIERED: a tiered cache's pools
    (:func:`_v_tile_f`); ``vdep`` keeps the allocation's depths, the reads are capped."""
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
    # own loop, cost more registers than the 4x8 transpose saved); only the Full Reader at
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
            acc3, acc4, acc5, acc6, acc7, G, W, P, NB8, NPL, VG, vp_ptr, vs_ptr, TIERED, HOT)
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


def launch(st: Step, v_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
           tiers: TieredPools | None = None) -> None:
    """Grid (B*Hkv, NBLK): per-block partial outputs [B, Hq, NBLK, d]; tiles of 32 num_warps / (d / 8) tokens.
    ``tiers``: a tiered cache's promotion cache (``v_pool`` is then its hot pool)."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    tier = {} if tiers is None else dict(vp_ptr=tiers.v_promo, vs_ptr=tiers.v_slot, TIERED=True, HOT=tiers.hot_v)
    rate, bk, bv_fixed = st.budget_args()
    nw = st.num_warps
    _value_stage_f[(pl.batch * k.hk, pl.n_blocks)](
        v_pool, page_table, lengths, pl.logits, pl.mstat, pl.sstat, pl.vimp, c["rv"], pl.hist, pl.ties, c["tabf"],
        pl.vdep, pl.vord, pl.vcnt, pl.part, st.slots, pl.max_tokens, pl.n_splits, rate, bk, bv_fixed,
        USE_RATE=k.use_rate, HQ=k.hq, HKV=k.hk, HG=k.hg, G=k.g, G_PAD=st.gpad, NSK_PAD=st.nsk_pad, P=k.p,
        NT_PAD=next_pow2(k.hg * pl.n_blocks), FIXED_V=k.fixed_depth, COMPACT=ch.compact, TS=32 * nw // (k.d // 8),
        VG=k.vg, **st.value_consts(), **tier, num_warps=nw)
