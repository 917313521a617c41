"""The Value stage on fp16 tensor cores (the path for more than 8 query heads per KV head).

Program (b*Hkv + h, block of BLK tokens): token depths from lambda, then per 32-token tile the planes each
token needs, z = L_s[code] as fp16 hi / lo, and the p-weighted sum as three fp16 MMAs into a float32
partial per block. ``_value_stage_c`` first compacts the block to its tokens of depth > 0, deepest first
(where few tokens are read); ``_value_stage`` walks every position. Codes are assembled by word-level bit
transposes for head_dim >= 256, bit-serially below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _block_prog, _hi_lo, _probs, _softmax_stats, _split16, _transpose8, _vj, next_pow2
from .plan import Step
from .value_alloc import _block_depths, _depths, _lambda_and_run


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
def _v_slice(x, K: tl.constexpr, sb, tabr_ptr, p_hi, p_lo, acc):
    """Channels 8b + K of a bit-transposed Value tile: codes, table (bit-reversed index), 3 MMAs."""
    code = ((x >> (8 * K)) & 0xFF).to(tl.int32)
    z_hi, z_lo = _hi_lo(tl.load(tabr_ptr + sb + code))  # [32, NB8]
    acc = tl.dot(p_hi, z_hi, acc)
    acc = tl.dot(p_hi, z_lo, acc)
    return tl.dot(p_lo, z_hi, acc)


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
    token. The reader uses it where it measured faster (``ReaderConfig.compact_values``)."""
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


def launch(st: Step, v_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """Grid (B*Hkv, NBLK): the compacting stage (``choices.value_stage == "compact"``) or the one over every
    position; per-block partial outputs [B, Hq, NBLK, d]."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    rate, bk, bv_fixed = st.budget_args()
    grid = (pl.batch * k.hk, pl.n_blocks)
    shape = dict(USE_RATE=k.use_rate, HQ=k.hq, HKV=k.hk, HG=k.hg, G=k.g, G_PAD=st.gpad, NSK_PAD=st.nsk_pad, P=k.p,
                 NT_PAD=next_pow2(k.hg * pl.n_blocks))
    if ch.value_stage == "compact":
        _value_stage_c[grid](v_pool, page_table, lengths, pl.logits, pl.mstat, pl.sstat, pl.vimp, c["rv"], pl.hist,
                             pl.ties, c["tab2"], c["tabr"], pl.vdep, pl.vord, pl.part, st.slots, pl.max_tokens,
                             pl.n_splits, rate, bk, bv_fixed, **shape, T8=ch.value_transposing, VG=k.vg,
                             **st.value_consts(), num_warps=st.num_warps)
    else:
        _value_stage[grid](v_pool, page_table, lengths, pl.logits, pl.mstat, pl.sstat, pl.vimp, c["rv"], pl.hist,
                           pl.ties, c["tab2"], c["tabr"], pl.vdep, pl.part, st.slots, pl.max_tokens, pl.n_splits, rate,
                           bk, bv_fixed, **shape, FIXED_V=k.fixed_depth, T8=ch.value_transposing, VG=k.vg,
                           **st.value_consts(), num_warps=st.num_warps)
