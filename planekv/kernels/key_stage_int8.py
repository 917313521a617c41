"""The Key stage as a product of plane bits on int8 tensor cores, for codebooks linear in the planes (the
``uniform-linear-c3`` format option; CUDA only: inline PTX).

With a linear codebook (``planekv.kvstore.UniformLinearTree``) the depth-t value of a code is
``a_t + sum_{j<t} w_tj b_j``, so a query head's logit over a token is

    base_g + sum_c wf_cg (a_{t_c} + sum_{j<t_c} w_{t_c j} b_cj) = base'_g + sum_{(c,j)} V_{(c,j) g} b_cj

with ``wf = q~ sigma_K`` (what ``_prep`` writes), ``base' = base + sum_c wf_c a_{t_c}`` and
``V_{(c,j) g} = wf_cg w_{t_c j}``: per (sequence, KV head) one product of the plane bits [tokens x pairs
(c, j < t_c)] with V [pairs x G]. ``_lin_prep_i8`` lists each head's pairs plane-major in steps of 32 and
writes V as three int8 digits per query head; ``_key_stage_imma`` feeds the plane bits in place as the
unsigned int8 operand of mma.m16n8k32 against those digits, exact int32 sums, and writes logits and
per-split softmax statistics like the FMA Key stage. :func:`imma_operands` is the torch reference of
``_lin_prep_i8`` (the tests compare them; the stage itself runs only on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kvstore import UniformLinearTree
from .common import _st8, _u8_tiles_asm, _xpose, _xpose_sel
from .plan import Step
from .tables import linear_tables

# V as int8 digits per query head: V ~ S_g (d0 + d1 / BASE + d2 / BASE^2), S_g = max |V_g| / 127. Each
# remainder lies in [-1/2, 1/2], so a base of 254 keeps every digit in [-127, 127]; three digits resolve
# V to 2^-23 of its largest value (float32's own resolution). The products are exact int32 sums.
IMMA_BASE = 254.0


_IMMA_BASE = tl.constexpr(IMMA_BASE)


_IMMA_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 14))


def _imma_tile_asm(i: int) -> str:
    """PTX for M-tile i of one K step of 32 pairs: $0..$3 the new n-tile 0 accumulators, $4..$7 n-tile
    1's, inputs x, y (the plane bytes of the lane's pairs 4q..4q+3 and 16+4q..16+4q+3 as one word each),
    the lane's V digit words of n-tile 0 (two) and 1 (two), then the old accumulators. Row g / g + 8 of
    tile i is bit 2i / 2i + 1 of every byte, left in place: the unsigned A operand is 2^(2i) / 2^(2i+1)
    per set bit (undone per row in the epilogue), one ``and`` per register of four bits."""
    return _u8_tiles_asm(i, "$8", "$9", ("$0, $1, $2, $3", "$10, $11", "$14, $15, $16, $17"),
                         ("$4, $5, $6, $7", "$12, $13", "$18, $19, $20, $21"))


_IMMA_T0 = tl.constexpr(_imma_tile_asm(0))


_IMMA_T1 = tl.constexpr(_imma_tile_asm(1))


_IMMA_T2 = tl.constexpr(_imma_tile_asm(2))


_IMMA_T3 = tl.constexpr(_imma_tile_asm(3))


@triton.jit
def _imma_tile(x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7, ASM: tl.constexpr):
    """One M-tile's two MMAs (``ASM``: its PTX, :func:`_imma_tile_asm`)."""
    return tl.inline_asm_elementwise(ASM, _IMMA_CONS, [x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7],
                                     dtype=(tl.int32,) * 8, is_pure=True, pack=1)


@triton.jit
def _ld64(ptr):
    """The 8-byte word at ptr (8-byte aligned) as two int32 (``ld.global.nc.v2.u32``)."""
    return tl.inline_asm_elementwise("ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l", [ptr],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _vwords(p):
    """A lane's four V digit words of one step (n-tile 0 words 0, 1, n-tile 1 words 0, 1; adjacent), one
    ``ld.global.nc.v4.u32``."""
    return tl.inline_asm_elementwise("ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _page_lanes(kb_ptr, pt_ptr, len_ptr, SLOTS, HKV: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                P: tl.constexpr, NWARP: tl.constexpr):
    """A bit-product Key program's coordinates: (b*Hkv + h, split, b, h, T, splits, warp w, lane group g,
    lane q, and the address of plane 0, channel 0, byte g of the warp's page)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    T = tl.load(len_ptr + b)
    t = tl.arange(0, 32 * NWARP)
    w = t // 32
    pg = split * NWARP + w
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg, mask=pg < tl.cdiv(T, P), other=0).to(tl.int64)
    g = (t % 32) // 4
    return pid_bh, split, b, pid_bh % HKV, T, tl.num_programs(1), w, g, t % 4, kb_ptr + page * (W * D * 8) + g


@triton.jit
def _imma_logit(a0, a1, a2, k: tl.constexpr, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale,
                G: tl.constexpr, STORE: tl.constexpr = True):
    """Query head q's logit of token 8g + k from its three digit sums (bit k's 2^k undone); stored
    unless STORE is off (:func:`_store8` stores a lane's eight at once)."""
    tok = tok8 + k
    ok = (tok < T) & (q < G)
    hl = (a0.to(tl.float32) + (a1.to(tl.float32) + a2.to(tl.float32) / _IMMA_BASE) / _IMMA_BASE)
    sv = tl.load(vs_ptr + q0 + q, mask=q < G, other=0.0) * (1.0 / (1 << k))
    lg = (hl * sv + tl.load(base_ptr + q0 + q, mask=q < G, other=0.0)) * scale
    lg = tl.where(ok, lg, float("-inf"))
    if STORE:
        tl.store(logit_ptr + (q0 + q) * TMAX + tok, lg, mask=ok)
    return lg


@triton.jit
def _store8(l0, l1, l2, l3, l4, l5, l6, l7, tok8, q, logit_ptr, q0, TMAX, G: tl.constexpr):
    """A lane's eight logits (tokens 8g..8g+7 of query head q, contiguous in its row) as two 16-byte
    stores instead of eight scattered 4-byte ones (TMAX a multiple of 8, so that each is aligned). The
    mask is per octet (inside the row's TMAX entries): positions from T on get -inf, which no reader
    looks at."""
    _st8((logit_ptr + (q0 + q) * TMAX + tok8).to(tl.int64, bitcast=True), l0, l1, l2, l3, l4, l5, l6, l7,
         (tok8 + 8 <= TMAX) & (q < G))


@triton.jit
def _split_stats(l0, l1, l2, l3, l4, l5, l6, l7, q, mstat_ptr, sstat_ptr, q0, split, NSPLIT, G: tl.constexpr,
                 NWARP: tl.constexpr):
    """A split's softmax max and sum per query head from the lanes' 8 logits each (lane q: head q), one
    reduction over the lanes as [NWARP * 8, 4] for all heads at once (measured faster than one masked
    reduction per head)."""
    mt = tl.maximum(tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3)), tl.maximum(tl.maximum(l4, l5),
                                                                                  tl.maximum(l6, l7)))
    nn = tl.arange(0, 4)
    m4 = tl.max(tl.reshape(mt, [NWARP * 8, 4]), 0)
    tl.store(mstat_ptr + (q0 + nn) * NSPLIT + split, m4, mask=nn < G)
    m4 = tl.where(m4 == float("-inf"), 0.0, m4)
    msel = tl.reshape(tl.broadcast_to(m4[None, :], [NWARP * 8, 4]), [32 * NWARP])
    e = (tl.exp(l0 - msel) + tl.exp(l1 - msel) + tl.exp(l2 - msel) + tl.exp(l3 - msel) + tl.exp(l4 - msel)
         + tl.exp(l5 - msel) + tl.exp(l6 - msel) + tl.exp(l7 - msel))
    tl.store(sstat_ptr + (q0 + nn) * NSPLIT + split, tl.sum(tl.reshape(e, [NWARP * 8, 4]), 0), mask=nn < G)


@triton.jit
def _imma_step(x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16,
               c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31):
    """One K step (32 pairs) of the four M-tiles (8 accumulators each: n-tile 0 then n-tile 1)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _imma_tile(x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7, _IMMA_T0)
    c8, c9, c10, c11, c12, c13, c14, c15 = _imma_tile(x, y, v0, v1, v2, v3, c8, c9, c10, c11, c12, c13, c14, c15,
                                                      _IMMA_T1)
    c16, c17, c18, c19, c20, c21, c22, c23 = _imma_tile(x, y, v0, v1, v2, v3, c16, c17, c18, c19, c20, c21, c22,
                                                        c23, _IMMA_T2)
    c24, c25, c26, c27, c28, c29, c30, c31 = _imma_tile(x, y, v0, v1, v2, v3, c24, c25, c26, c27, c28, c29, c30,
                                                        c31, _IMMA_T3)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22,
            c23, c24, c25, c26, c27, c28, c29, c30, c31)


@triton.jit
def _imma_kstep(lo, hi, pw, o, vp, sv, last, n_steps, s0, s1, s2, s3, s4, s5, s6, s7, c0, c1, c2, c3, c4, c5, c6,
                c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27,
                c28, c29, c30, c31, TAIL: tl.constexpr):
    """One step of :func:`_key_stage_imma`: the lane's words from its row (lo, hi) by the byte transpose,
    the row at pw + o loaded into the same registers, step sv's V words from vp and the MMAs; returns the
    row and the accumulators. TAIL: sv may be past the last step (its V words are then zero)."""
    x, y = _xpose(lo, hi, s0, s1, s2, s3, s4, s5, s6, s7)
    lo, hi = _ld64(pw + o)
    if TAIL:
        v0, v1, v2, v3 = _vwords(vp + tl.minimum(sv, last) * 128)
        real = sv < n_steps
        v0 = tl.where(real, v0, 0)
        v1 = tl.where(real, v1, 0)
        v2 = tl.where(real, v2, 0)
        v3 = tl.where(real, v3, 0)
    else:
        v0, v1, v2, v3 = _vwords(vp + sv * 128)
    return (lo, hi) + _imma_step(x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13,
                                 c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28, c29, c30,
                                 c31)


@triton.jit
def _key_stage_imma(kb_ptr, pt_ptr, len_ptr, off_ptr, vd_ptr, nst_ptr, base_ptr, vs_ptr, logit_ptr, mstat_ptr,
                    sstat_ptr, scale, SLOTS, TMAX, SMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                    D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, NWARP: tl.constexpr,
                    VST: tl.constexpr = False):
    """The bit product on int8 tensor cores (GPU only: inline PTX). Program (b*Hkv + h, split) of NWARP
    64-token pages, one per warp; lane 4g + q owns byte g of its page's plane rows (tokens 8g..8g+7). Per K
    step of 32 pairs (:func:`imma_operands`' order) a lane
    holds byte g of its pairs 4q..4q+3 and 16+4q..16+4q+3 as two words (from one pair word per lane and
    the lane group's byte transpose, :data:`_XPOSE`), and M-tile i's A fragment
    is those words masked to bits 2i / 2i + 1 (one ``and`` per register of four bits: unsigned 2^k per
    set bit); B is V as three int8 digits per query head (n-tile 0: columns 2n / 2n + 1 digits 0 / 1 of
    head n, n-tile 1: column 2n digit 2), so a lane's accumulators again hold its query head's sums of
    its own tokens, exact in int32."""
    tl.static_assert(P == 64, "one 64-token page per warp")
    tl.static_assert(G <= 4, "three digits of up to 4 query heads in two n-tiles")
    pid_bh, split, b, h, T, NSPLIT, w, g, q, pb = _page_lanes(kb_ptr, pt_ptr, len_ptr, SLOTS, HKV, D, W, P, NWARP)
    # column g, lane q: word (n-tile n, v) of step s at + 128 s + 4 (4 g + q) + 2 n + v (one 16-byte load)
    vp = vd_ptr + pid_bh * SMAX * 128 + (g * 4 + q) * 4
    zero = tl.zeros([32 * NWARP], tl.int32)
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    c8, c9, c10, c11, c12, c13, c14, c15 = zero, zero, zero, zero, zero, zero, zero, zero
    c16, c17, c18, c19, c20, c21, c22, c23 = zero, zero, zero, zero, zero, zero, zero, zero
    c24, c25, c26, c27, c28, c29, c30, c31 = zero, zero, zero, zero, zero, zero, zero, zero
    n_steps = tl.load(nst_ptr + pid_bh)
    # One 8-byte pair word per lane (pair 4 g + q of the step's list: offsets at off[s, 4 g + q]), two steps
    # ahead with the loop over pairs of steps (so that no register moves wait for the loads), turned into the
    # lane's words x, y by the byte transpose of its lane group (_XPOSE); the V words loaded in the step they
    # are used in (L1 hits; four registers fewer).
    s0, s1, s2, s3, s4, s5, s6, s7 = _xpose_sel(g)
    pw = pb - g  # the page's plane 0, channel 0 (pb points at byte g)
    ol = off_ptr + pid_bh * SMAX * 32 + 4 * g + q  # lane 4g + q's word offset of step s at + 32 s
    last = n_steps - 1
    lo, hi = _ld64(pw + tl.load(ol))
    # rows two steps ahead with the loop over pairs of steps, so that no register rotation (which ptxas
    # turns into moves that wait for the load one step after it) stands between a load and its use; a
    # second step past the last one multiplies by zero V words
    lo1, hi1 = _ld64(pw + tl.load(ol + tl.minimum(1, last) * 32))
    o = tl.load(ol + tl.minimum(2, last) * 32)
    o1 = tl.load(ol + tl.minimum(3, last) * 32)
    for s in range(0, n_steps, 2):
        on = tl.load(ol + tl.minimum(s + 4, last) * 32)
        on1 = tl.load(ol + tl.minimum(s + 5, last) * 32)
        (lo, hi, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
         c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31) = _imma_kstep(
            lo, hi, pw, o, vp, s, last, n_steps, s0, s1, s2, s3, s4, s5, s6, s7, c0, c1, c2, c3, c4, c5, c6, c7,
            c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28,
            c29, c30, c31, False)
        (lo1, hi1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
         c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31) = _imma_kstep(
            lo1, hi1, pw, o1, vp, s + 1, last, n_steps, s0, s1, s2, s3, s4, s5, s6, s7, c0, c1, c2, c3, c4, c5,
            c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26,
            c27, c28, c29, c30, c31, True)
        o = on
        o1 = on1
    q0 = b * HQ + h * G
    tok8 = split * (NWARP * P) + w * P + 8 * g
    # M-tile i: n-tile 0 c(8i), c(8i+1) row g (token 8g + 2i) digits 0, 1 of head q, c(8i+2), c(8i+3) row g + 8
    # (token 8g + 2i + 1); n-tile 1 c(8i+4) / c(8i+6) digit 2 of rows g / g + 8 (c(8i+5), c(8i+7): zero columns)
    l0 = _imma_logit(c0, c1, c4, 0, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l1 = _imma_logit(c2, c3, c6, 1, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l2 = _imma_logit(c8, c9, c12, 2, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l3 = _imma_logit(c10, c11, c14, 3, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l4 = _imma_logit(c16, c17, c20, 4, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l5 = _imma_logit(c18, c19, c22, 5, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l6 = _imma_logit(c24, c25, c28, 6, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    l7 = _imma_logit(c26, c27, c30, 7, tok8, q, base_ptr, vs_ptr, logit_ptr, q0, T, TMAX, scale, G, not VST)
    if VST:
        _store8(l0, l1, l2, l3, l4, l5, l6, l7, tok8, q, logit_ptr, q0, TMAX, G)
    _split_stats(l0, l1, l2, l3, l4, l5, l6, l7, q, mstat_ptr, sstat_ptr, q0, split, NSPLIT, G, NWARP)


@triton.jit
def _lin_prep_i8(kdep_ptr, wf_ptr, base_ptr, lina_ptr, linw_ptr, off_ptr, vd_ptr, nst_ptr, base2_ptr, vs_ptr, SMAX,
                 HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                 P: tl.constexpr):
    """Program (b*Hkv + h, plane j): plane j's part of the operands of :func:`_key_stage_imma` (as
    :func:`imma_operands`). Pairs (c, j < t_c) plane-major (plane j's list starts after sum_c min(t_c, j)
    pairs); list entry e = 32 s + 16 v + 4 q + k is byte k of word v of lane q in step s: its byte offset
    (j D + c) P/8 at off[s, v, k, q], and V's digits as bytes k of the words (n-tile n, v, column, q) of
    vd ([S, 2, 2, 8, 4] words; column 2g: digit 0 (n = 0) / 2 (n = 1), column 2g + 1 of n-tile 0: digit
    1), all four query-head slots at once ([D, 4] tensors: slots g >= G get zeros). The scale S_g = max
    |V_g| / 127 per query head (every program computes it; plane 0's stores it with base' = base +
    sum_c wf_c a_{t_c}, the step count and the last step's padding: offset 0, digits 0). Every column
    without a digit is written 0 (the buffers are shared with :func:`_lin_prep`'s layout)."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    NB: tl.constexpr = P // 8
    cc = tl.arange(0, D)
    gg = tl.arange(0, 4)
    gok = gg < G
    dep = tl.load(kdep_ptr + pid * D + cc)
    wf = tl.load(wf_ptr + (pid * D + cc)[:, None] * G + gg[None, :], mask=gok[None, :], other=0.0)  # [D, 4]
    vmax = tl.zeros([D, 4], tl.float32)
    for jj in tl.static_range(W):
        vmax = tl.maximum(vmax, tl.abs(wf * tl.load(linw_ptr + dep * W + jj, mask=dep > jj, other=0.0)[:, None]))
    sg = tl.maximum(tl.max(vmax, 0), 1e-30) / 127.0  # [4]
    offs = off_ptr + pid * SMAX * 32
    vds = vd_ptr + pid * SMAX * 512  # bytes: 128 words per step
    act = dep > j
    pos = tl.sum(tl.minimum(dep, j), 0) + tl.cumsum(act.to(tl.int32), 0) - 1
    st = pos // 32
    wi = pos % 32
    tl.store(offs + st * 32 + ((wi // 16) * 4 + wi % 4) * 4 + (wi // 4) % 4, (j * D + cc) * NB, mask=act)
    # byte k of word (n-tile n, v) of column col, lane q: + 16 (4 col + q) + 4 (2 n + v) + k (a lane's four
    # words adjacent); CO: the next column, NT: the next n-tile
    CO: tl.constexpr = 64
    NT: tl.constexpr = 8
    byte = (vds + st * 512 + ((wi // 4) % 4) * 16 + (wi // 16) * 4 + wi % 4)[:, None] + gg[None, :] * 128
    x = wf * tl.load(linw_ptr + dep * W + j, mask=act, other=0.0)[:, None] / sg[None, :]  # as imma_operands
    d0 = tl.floor(x + 0.5)
    r = (x - d0) * _IMMA_BASE
    d1 = tl.floor(r + 0.5)
    d2 = tl.floor((r - d1) * _IMMA_BASE + 0.5)
    am = act[:, None]
    tl.store(byte, d0.to(tl.int8), mask=am)  # n-tile 0, column 2g
    tl.store(byte + CO, d1.to(tl.int8), mask=am)  # column 2g + 1
    tl.store(byte + NT, d2.to(tl.int8), mask=am)  # n-tile 1, column 2g
    tl.store(byte + NT + CO, tl.zeros([D, 4], tl.int8), mask=am)
    if j == 0:
        q0 = b * HQ + h * G
        tl.store(vs_ptr + q0 + gg, sg, mask=gok)
        tl.store(base2_ptr + q0 + gg, tl.load(base_ptr + q0 + gg, mask=gok, other=0.0)
                 + tl.sum(wf * tl.load(lina_ptr + dep)[:, None], 0), mask=gok)
        run = tl.sum(dep, 0)
        n_steps = (run + 31) // 32
        pp = run + tl.arange(0, 32)
        pad = pp < n_steps * 32
        pst, pwi = pp // 32, pp % 32
        tl.store(offs + pst * 32 + ((pwi // 16) * 4 + pwi % 4) * 4 + (pwi // 4) % 4, pp * 0, mask=pad)
        pbyte = vds + pst * 512 + ((pwi // 4) % 4) * 16 + (pwi // 16) * 4 + pwi % 4
        for col in tl.static_range(8):
            tl.store(pbyte + col * CO, tl.zeros([32], tl.int8), mask=pad)
            tl.store(pbyte + NT + col * CO, tl.zeros([32], tl.int8), mask=pad)
        tl.store(nst_ptr + pid, n_steps)


def linear_fold(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every bit-product operand layout starts from (torch, on ``kdep``'s device): the depths as
    int64, w[t, j] on that device, and base' = base + sum_c wf_c a_{t_c} as [B, Hkv, G]."""
    if not isinstance(tree, UniformLinearTree):
        raise TypeError(f"the bit-product Key stage needs a codebook linear in the planes, got {tree!r}")
    bsz, hk, _ = kdep.shape
    a, wt = (x.to(kdep.device) for x in linear_tables(tree))
    dep = kdep.long()
    return dep, wt, base.view(bsz, hk, -1) + (wf * a[dep][..., None]).sum(2)


def _pair_list(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor, page_size: int,
               step: int) -> tuple[torch.Tensor, ...]:
    """What both operand layouts share: per head its pairs (c, j < t_c) plane-major (so that
    neighbouring list entries are neighbouring channels of one plane, whose bytes share a sector) in
    steps of ``step``: (live [B*Hkv, W*D] (j, c) bool, V [B*Hkv, W*D, G], the list rows and positions
    of the live pairs, byte offsets in list order [B*Hkv, S*step] int32 (0 past the list), pairs per
    head, S, base' [B, Hkv, G])."""
    bsz, hk, d = kdep.shape
    g = wf.shape[-1]
    if g > 4:
        raise ValueError("the bit-product Key stage takes at most 4 query heads per KV head")
    dep, wt, base2 = linear_fold(tree, kdep, wf, base)
    w, nb, dev = tree.depth, page_size // 8, kdep.device
    bh = bsz * hk
    jj = torch.arange(w, device=dev)
    live = (jj[None, :, None] < dep.reshape(bh, 1, d)).reshape(bh, w * d)  # plane-major (j, c)
    vjc = (wf.reshape(bh, 1, d, g) * wt[dep.reshape(bh, d)].transpose(1, 2)[..., None]).reshape(bh, w * d, g)
    off = ((jj[:, None] * d + torch.arange(d, device=dev)[None, :]) * nb).reshape(w * d).int()
    cnt = live.sum(1)
    n_steps = max(1, -(-int(cnt.max()) // step))
    pos = (torch.cumsum(live.int(), 1) - 1)[live]
    rows = torch.arange(bh, device=dev)[:, None].expand(-1, w * d)[live]
    offl = torch.zeros(bh, n_steps * step, dtype=torch.int32, device=dev)
    offl[rows, pos] = off[None, :].expand(bh, -1)[live]
    return live, vjc, rows, pos, offl, cnt, n_steps, base2


def imma_operands(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, ...]:
    """The operands of :func:`_key_stage_imma` (the torch reference of ``_lin_prep_i8``): per head its
    pairs plane-major (:func:`_pair_list`) in steps of 32, list entry 32 s + 16 v + 4 q + k at (byte offsets
    [B*Hkv, S, 2 words v, 4 bytes k, 4 lanes q] int32, V digits [B*Hkv, S, 8 columns, 4 lanes q, 2 n-tiles,
    2 words v, 4 bytes k] int8, the number of steps [B*Hkv], base' [B, Hq], the digit scale S_g [B, Hq]).
    Column 2n of n-tile 0 holds query head n's digit 0 of V / S_n, column 2n + 1 digit 1, column 2n of
    n-tile 1 digit 2 (base :data:`IMMA_BASE`); the other columns are zero."""
    bsz, hk, _ = kdep.shape
    g = wf.shape[-1]
    live, vjc, rows, pos, offl, cnt, n_steps, base2 = _pair_list(tree, kdep, wf, base, page_size, 32)
    bh = bsz * hk
    vjc = vjc * live[..., None]
    sg = vjc.abs().amax(1).clamp_min(1e-30) / 127.0  # [bh, G]
    x = vjc / sg[:, None, :]
    d0 = torch.floor(x + 0.5)
    r = (x - d0) * IMMA_BASE
    d1 = torch.floor(r + 0.5)
    d2 = torch.floor((r - d1) * IMMA_BASE + 0.5)
    dl = torch.zeros(bh, n_steps * 32, 2, 8, dtype=torch.int8, device=kdep.device)  # [entry, n-tile, column]
    for n in range(g):
        dl[rows, pos, 0, 2 * n] = d0[live][:, n].to(torch.int8)
        dl[rows, pos, 0, 2 * n + 1] = d1[live][:, n].to(torch.int8)
        dl[rows, pos, 1, 2 * n] = d2[live][:, n].to(torch.int8)
    # entry 32 s + 16 v + 4 q + k
    offf = offl.view(bh, n_steps, 2, 4, 4).transpose(3, 4).contiguous()  # [s, v, k, q]
    # [s, v, q, k, n, col] -> [s, col, q, n, v, k]: lane 4 col + q's four words of a step adjacent
    vd = dl.view(bh, n_steps, 2, 4, 4, 2, 8).permute(0, 1, 6, 3, 5, 2, 4).contiguous()
    steps = ((cnt + 31) // 32).int()
    return offf, vd, steps, base2.reshape(bsz, hk * g).contiguous(), sg.reshape(bsz, hk * g)


def launch(st: Step, k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """``_lin_prep_i8`` on grid (B*Hkv, W), then the stage on grid (B*Hkv, n_splits) of ``key_pages`` warps."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    smax = pl.lin_off.shape[1] // 2  # steps of 32 pairs in buffers sized for steps of 16
    consts = dict(HQ=k.hq, HKV=k.hk, G=k.g, D=k.d, W=k.w, P=k.p)
    _lin_prep_i8[(pl.batch * k.hk, k.w)](pl.kdep, pl.wf, pl.base, c["lin_a"], c["lin_w"], pl.lin_off,
                                         pl.lin_v.view(torch.int8), pl.lin_steps, pl.lin_base, pl.lin_scale, smax,
                                         **consts, num_warps=4)
    cap = ch.key_int8_maxnreg
    _key_stage_imma[(pl.batch * k.hk, pl.n_splits)](
        k_pool, page_table, lengths, pl.lin_off, pl.lin_v.view(torch.int32), pl.lin_steps, pl.lin_base, pl.lin_scale,
        pl.logits, pl.mstat, pl.sstat, st.scale, st.slots, pl.max_tokens, smax, **consts, NWARP=ch.key_pages,
        VST=ch.key_int8_vector_store, num_warps=ch.key_pages, **({"maxnreg": cap} if cap else {}))
