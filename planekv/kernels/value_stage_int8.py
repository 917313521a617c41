"""The Value stage as a product of plane bits on int8 tensor cores, for codebooks linear in the planes (the
``uniform-linear-c3`` format option; CUDA only: inline PTX).

The mirror image of :mod:`.key_stage_int8`: per block, the V plane bits [channels x tokens] enter
mma.m16n8k32 in place as the unsigned operand against Y = rint(p w_tj / S) in three int8 digits per query
head (exact int32 sums), over the depth-sorted token list of ``_value_order`` in steps of 16 tokens.
Forms: planes one at a time or two at a time (head_dim >= 256), and a software-pipelined loop that loads a
step's entries and pages ahead and its plane rows four planes at a time (widths that are a multiple of 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _load_scalar, _softmax_stats, _st8, _u8_tiles_asm, _vj, _xpose, _xpose_sel
from .plan import Step


@triton.jit
def _v_kv(obase, e, n_items, W: tl.constexpr):
    """List entry e ((W - depth) << 11 | position in the block); past the list a depth-0 entry."""
    return tl.load(obase + e, mask=e < n_items, other=W << 11).to(tl.int32)


@triton.jit
def _v_first(obase, e, n_items, W: tl.constexpr):
    """Entry e as a scalar (the first entry of a step: its deepest)."""
    i = e + tl.arange(0, 1)
    return tl.sum(tl.load(obase + i, mask=i < n_items, other=W << 11).to(tl.int32), 0)


@triton.jit
def _v_fetch(kv, pgrow, lrow, blk, col_ok, BLK: tl.constexpr, P: tl.constexpr, W: tl.constexpr):
    """An entry's page and logit (issued a step before they are used)."""
    live = (kv >> 11) < W
    pos = blk * BLK + (kv & 2047)
    page = tl.load(pgrow + pos // P, mask=live, other=0)
    lg = tl.load(lrow + pos, mask=live & col_ok, other=float("-inf"))
    return page, lg


@triton.jit
def _v_row(kv, page, bc, W: tl.constexpr, P: tl.constexpr, NB8: tl.constexpr, VG: tl.constexpr = 1):
    """(offset of list entry kv's plane-0 byte in column bc, given its page; its depth). VG: planes per
    token run of the pool (1: plane-major ``[W][P][d/8]``; else ``[W/VG][P][VG][d/8]``, :func:`decode._vj`)."""
    return (page.to(tl.int64) * (W * P) + ((kv & 2047) % P) * VG) * NB8 + bc, W - (kv >> 11)


@triton.jit
def _v_lanes(HKV: tl.constexpr, NWARP: tl.constexpr):
    """A bit-product Value-stage program's (b*Hkv + h, block, blocks, b, h) and its lanes' (warp, gid, q)."""
    pid_bh = tl.program_id(0)
    t = tl.arange(0, 32 * NWARP)
    return (pid_bh, tl.program_id(1), tl.num_programs(1), pid_bh // HKV, pid_bh % HKV, t // 32, (t % 32) // 4,
            t % 4)


# The Value stage on int8 tensor cores: per plane and
# step of 32 listed tokens, A = the plane bytes in place (unsigned 2^k per set bit, as the Key stage's),
# B = the bytes of Y = rint(p w / S) (|Y| <= 2^22): n-tile 0 column 2n the top byte of query head n
# (signed), odd columns zero; n-tile 1 columns 2n / 2n + 1 its bytes 1 / 0 (unsigned).
_VIMMA_CONS = tl.constexpr(",".join(["=r"] * 6 + ["r"] * 12))


def _vimma_tile_asm(i: int) -> str:
    """PTX for M-tile i of one plane and step: $0, $1 n-tile 0's live accumulators (rows gid / gid + 8,
    column 2q; its odd columns, always zero, stay in registers local to the block), $2..$5 n-tile 1's,
    inputs x, y (the lane's eight token bytes of its byte column), the B words of n-tile 0 (two) and 1
    (two), then the old accumulators in the same order."""
    return _u8_tiles_asm(i, "$6", "$7", ("$0, z1, $1, z2", "$8, $9", "$12, z0, $13, z0"),
                         ("$2, $3, $4, $5", "$10, $11", "$14, $15, $16, $17"), "u8", ", z<3>", "mov.b32 z0, 0;")


_VIMMA_T0 = tl.constexpr(_vimma_tile_asm(0))


_VIMMA_T1 = tl.constexpr(_vimma_tile_asm(1))


_VIMMA_T2 = tl.constexpr(_vimma_tile_asm(2))


_VIMMA_T3 = tl.constexpr(_vimma_tile_asm(3))


# B words of four tokens from their p w / S: Y = cvt.rni, n-tile 0 the bytes 2 (masked by $7: zero in odd
# columns), n-tile 1 the bytes picked by the lane's selector $6 (0x51: bytes 1, 0x40: bytes 0)
_VB4 = tl.constexpr("{ .reg .b32 y0, y1, y2, y3, t0, t1; cvt.rni.s32.f32 y0, $2; cvt.rni.s32.f32 y1, $3; "
                    "cvt.rni.s32.f32 y2, $4; cvt.rni.s32.f32 y3, $5; prmt.b32 t0, y0, y1, $6; "
                    "prmt.b32 t1, y2, y3, $6; prmt.b32 $1, t0, t1, 0x5410; prmt.b32 t0, y0, y1, 0x62; "
                    "prmt.b32 t1, y2, y3, 0x62; prmt.b32 t0, t0, t1, 0x5410; and.b32 $0, t0, $7; }")


@triton.jit
def _vb4(f0, f1, f2, f3, sel, msk):
    return tl.inline_asm_elementwise(_VB4, "=r,=r,f,f,f,f,r,r", [f0, f1, f2, f3, sel, msk],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _vimma_tile(x, y, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, ASM: tl.constexpr):
    """One M-tile's two MMAs (``ASM``: its PTX, :func:`_vimma_tile_asm`)."""
    return tl.inline_asm_elementwise(ASM, _VIMMA_CONS, [x, y, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5],
                                     dtype=(tl.int32,) * 6, is_pure=True, pack=1)


@triton.jit
def _vimma_col(x, y, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17,
               c18, c19, c20, c21, c22, c23):
    """The four M-tiles of one byte column (6 live accumulators each)."""
    c0, c1, c2, c3, c4, c5 = _vimma_tile(x, y, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, _VIMMA_T0)
    c6, c7, c8, c9, c10, c11 = _vimma_tile(x, y, b0, b1, b2, b3, c6, c7, c8, c9, c10, c11, _VIMMA_T1)
    c12, c13, c14, c15, c16, c17 = _vimma_tile(x, y, b0, b1, b2, b3, c12, c13, c14, c15, c16, c17, _VIMMA_T2)
    c18, c19, c20, c21, c22, c23 = _vimma_tile(x, y, b0, b1, b2, b3, c18, c19, c20, c21, c22, c23, _VIMMA_T3)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22,
            c23)


@triton.jit
def _vi_kvs(obase, first, q, n_items, W: tl.constexpr):
    """A lane's eight list entries of the step starting at ``first`` (4q..4q+3, 16+4q..16+4q+3)."""
    e = first + 4 * q
    return (_v_kv(obase, e, n_items, W), _v_kv(obase, e + 1, n_items, W), _v_kv(obase, e + 2, n_items, W),
            _v_kv(obase, e + 3, n_items, W), _v_kv(obase, e + 16, n_items, W), _v_kv(obase, e + 17, n_items, W),
            _v_kv(obase, e + 18, n_items, W), _v_kv(obase, e + 19, n_items, W))


@triton.jit
def _vi_entry(kv, pgrow, lrow, blk, col_ok, m_t, bc, BLK: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
              NB8: tl.constexpr, VG: tl.constexpr = 1):
    """(byte offset of the entry's plane-0 byte in column bc, its depth, exp(logit - the block's max))."""
    page, lg = _v_fetch(kv, pgrow, lrow, blk, col_ok, BLK, P, W)
    row, dep = _v_row(kv, page, bc, W, P, NB8, VG)
    return row, dep, tl.exp(lg - m_t)


@triton.jit
def _vi_val(top, b1, b0, k: tl.constexpr, sc, ab):
    """Channel bit k of a byte column (M-tile k // 2, row k % 2): the sums of Y's three bytes, bit k's
    2^k undone, plus the constant term, times the scale."""
    v = top.to(tl.float32) * 65536.0 + b1.to(tl.float32) * 256.0 + b0.to(tl.float32)
    return (v * (1.0 / (1 << k)) + ab) * sc


@triton.jit
def _vi_store8(part_ptr, prow, OFF: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14,
               c15, c16, c17, c18, c19, c20, c21, c22, c23, sc, ab, ok):
    """The 8 channels OFF + 0..7 of one byte column (M-tile i: c(6i), c(6i+1) top sums of rows gid /
    gid + 8, c(6i+2), c(6i+3) bytes 1 / 0 of row gid, c(6i+4), c(6i+5) of row gid + 8)."""
    _st8((part_ptr + prow + OFF).to(tl.int64, bitcast=True), _vi_val(c0, c2, c3, 0, sc, ab),
         _vi_val(c1, c4, c5, 1, sc, ab), _vi_val(c6, c8, c9, 2, sc, ab), _vi_val(c7, c10, c11, 3, sc, ab),
         _vi_val(c12, c14, c15, 4, sc, ab), _vi_val(c13, c16, c17, 5, sc, ab), _vi_val(c18, c20, c21, 6, sc, ab),
         _vi_val(c19, c22, c23, 7, sc, ab), ok)


_VLDX4 = tl.constexpr("{ .reg .pred p; setp.lt.s32 p, $5, $6; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; "
                      "mov.b32 $3, 0; @p ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4]; }")


_VLDX2 = tl.constexpr("{ .reg .pred p; setp.lt.s32 p, $3, $4; mov.b32 $0, 0; mov.b32 $1, 0; "
                      "@p ld.global.nc.v2.u32 {$0, $1}, [$2]; }")


@triton.jit
def _vi_rows(vb_ptr, r, s, jj, PLANE: tl.constexpr, TWO: tl.constexpr, NB8: tl.constexpr = 16,
             VG: tl.constexpr = 1):
    """Plane jj's row words of a lane's own entry: its 16 bytes (8 when d = 64, returned twice), none
    (zeros, the load predicated off) at or below its depth s."""
    ptr = (vb_ptr + r + _vj(jj, PLANE, VG, NB8)).to(tl.int64, bitcast=True)
    if TWO:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_VLDX4, "=r,=r,=r,=r,l,r,r", [ptr, jj, s],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        return w0, w1, w2, w3
    w0, w1 = tl.inline_asm_elementwise(_VLDX2, "=r,=r,l,r,r", [ptr, jj, s], dtype=(tl.int32, tl.int32),
                                       is_pure=True, pack=1)
    return w0, w1, w0, w1


@triton.jit
def _vi_rows4(vb_ptr, r, s, jj, PLANE: tl.constexpr, TWO: tl.constexpr, NB8: tl.constexpr = 16,
              VG: tl.constexpr = 1):
    """:func:`_vi_rows` of planes jj .. jj + 3 (16 words; predicated off at or below the depth s)."""
    w0, w1, w2, w3 = _vi_rows(vb_ptr, r, s, jj, PLANE, TWO, NB8, VG)
    u0, u1, u2, u3 = _vi_rows(vb_ptr, r, s, jj + 1, PLANE, TWO, NB8, VG)
    v0, v1, v2, v3 = _vi_rows(vb_ptr, r, s, jj + 2, PLANE, TWO, NB8, VG)
    t0, t1, t2, t3 = _vi_rows(vb_ptr, r, s, jj + 3, PLANE, TWO, NB8, VG)
    return w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, t0, t1, t2, t3


@triton.jit
def _vi_xp(w0, w1, w2, w3, e0, e1, e2, e3, e4, e5, e6, e7, TWO: tl.constexpr):
    """Row words byte-transposed in the lane group (:data:`_XPOSE`, selectors e0..e7) into (x, y) of
    byte column bc and (x2, y2) of bc + 8."""
    x, y = _xpose(w0, w1, e0, e1, e2, e3, e4, e5, e6, e7)
    if TWO:
        x2, y2 = _xpose(w2, w3, e0, e1, e2, e3, e4, e5, e6, e7)
        return x, y, x2, y2
    return x, y, x, y


@triton.jit
def _vi_loadx(vb_ptr, r, s, jj, e0, e1, e2, e3, e4, e5, e6, e7, PLANE: tl.constexpr, TWO: tl.constexpr,
              NB8: tl.constexpr = 16, VG: tl.constexpr = 1):
    """Plane jj's bytes of a lane's eight entries from one row load per lane (:func:`_vi_rows`),
    byte-transposed (:func:`_vi_xp`)."""
    w0, w1, w2, w3 = _vi_rows(vb_ptr, r, s, jj, PLANE, TWO, NB8, VG)
    return _vi_xp(w0, w1, w2, w3, e0, e1, e2, e3, e4, e5, e6, e7, TWO)


@triton.jit
def _vi_ents(obase, first, q, own, n_items, W: tl.constexpr):
    """The list entries of the step starting at ``first``: the lane's eight (:func:`_vi_kvs`) and the
    one whose rows it loads (``own``)."""
    k0, k1, k2, k3, k4, k5, k6, k7 = _vi_kvs(obase, first, q, n_items, W)
    return k0, k1, k2, k3, k4, k5, k6, k7, _v_kv(obase, first + own, n_items, W)


@triton.jit
def _vi_pack(k0, k1, k2, k3, k4, k5, k6, k7, W: tl.constexpr):
    """Eight list entries' depths (<= W <= 15), 4 bits each in one int32 (entry i in bits 4i..4i+3)."""
    return ((W - (k0 >> 11)) | ((W - (k1 >> 11)) << 4) | ((W - (k2 >> 11)) << 8) | ((W - (k3 >> 11)) << 12)
            | ((W - (k4 >> 11)) << 16) | ((W - (k5 >> 11)) << 20) | ((W - (k6 >> 11)) << 24)
            | ((W - (k7 >> 11)) << 28))


@triton.jit
def _vi_fetch9(k0, k1, k2, k3, k4, k5, k6, k7, ko, pgrow, lrow, blk, col_ok, BLK: tl.constexpr, P: tl.constexpr,
               W: tl.constexpr):
    """The own entry's page and the eight entries' logits (the other loads of :func:`_v_fetch` are dead)."""
    pg, _ = _v_fetch(ko, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l0 = _v_fetch(k0, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l1 = _v_fetch(k1, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l2 = _v_fetch(k2, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l3 = _v_fetch(k3, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l4 = _v_fetch(k4, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l5 = _v_fetch(k5, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l6 = _v_fetch(k6, pgrow, lrow, blk, col_ok, BLK, P, W)
    _, l7 = _v_fetch(k7, pgrow, lrow, blk, col_ok, BLK, P, W)
    return pg, l0, l1, l2, l3, l4, l5, l6, l7


@triton.jit
def _vi_mma(linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, sel, msk0, j, x, y, x2, y2, c0,
           c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23,
           d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22,
           d23, W: tl.constexpr, TWO: tl.constexpr):
    """Plane j's B words from the entries' p / S and w_sj, and the MMAs of both byte columns."""
    lw = linw_ptr + j
    b0, b2 = _vb4(p0 * tl.load(lw + s0 * W), p1 * tl.load(lw + s1 * W), p2 * tl.load(lw + s2 * W),
                  p3 * tl.load(lw + s3 * W), sel, msk0)
    b1, b3 = _vb4(p4 * tl.load(lw + s4 * W), p5 * tl.load(lw + s5 * W), p6 * tl.load(lw + s6 * W),
                  p7 * tl.load(lw + s7 * W), sel, msk0)
    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22,
     c23) = _vimma_col(x, y, b0, b1, b2, b3, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14,
                       c15, c16, c17, c18, c19, c20, c21, c22, c23)
    if TWO:
        (d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21,
         d22, d23) = _vimma_col(x2, y2, b0, b1, b2, b3, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                                d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22, d23)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22,
            c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21,
            d22, d23)


@triton.jit
def _vi_pmma(w0, w1, w2, w3, e0, e1, e2, e3, e4, e5, e6, e7, linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
             p4, p5, p6, p7, sel, msk0, j, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16,
             c17, c18, c19, c20, c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,
             d16, d17, d18, d19, d20, d21, d22, d23, W: tl.constexpr, TWO: tl.constexpr):
    """Plane j from its row words (:func:`_vi_rows`): the byte transpose and :func:`_vi_mma`."""
    x, y, x2, y2 = _vi_xp(w0, w1, w2, w3, e0, e1, e2, e3, e4, e5, e6, e7, TWO)
    return _vi_mma(linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, sel, msk0, j, x, y, x2,
                   y2, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
                   c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18,
                   d19, d20, d21, d22, d23, W, TWO)


@triton.jit
def _vi_plane(vb_ptr, linw_ptr, ro, so, e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3,
              p4, p5, p6, p7, sel, msk0, jj, j, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
              c16, c17, c18, c19, c20, c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14,
              d15, d16, d17, d18, d19, d20, d21, d22, d23, PLANE: tl.constexpr, W: tl.constexpr, TWO: tl.constexpr,
              PAIR: tl.constexpr, NB8: tl.constexpr = 16, VG: tl.constexpr = 1):
    """Plane j (``jj`` the same as an int32 tensor) of a step of :func:`_value_stage_imma`, and with
    PAIR plane j + 1 too (its rows loaded with plane j's; where it is below every entry's depth its
    loads are predicated off and its B words are zero). ro, so: the lane's own entry's row and depth,
    e0..e7 its transpose selectors (:func:`_vi_loadx`)."""
    x, y, x2, y2 = _vi_loadx(vb_ptr, ro, so, jj, e0, e1, e2, e3, e4, e5, e6, e7, PLANE, TWO, NB8, VG)
    if PAIR:
        xb, yb, x2b, y2b = _vi_loadx(vb_ptr, ro, so, jj + 1, e0, e1, e2, e3, e4, e5, e6, e7, PLANE, TWO, NB8, VG)
    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, d0,
     d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22,
     d23) = _vi_mma(
        linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, sel, msk0, j, x, y, x2, y2, c0, c1,
        c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, d0, d1,
        d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22, d23, W, TWO)
    if PAIR:
        (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23,
         d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22,
         d23) = _vi_mma(
            linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7, p0, p1, p2, p3, p4, p5, p6, p7, sel, msk0, j + 1, xb, yb, x2b,
            y2b, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21,
            c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20,
            d21, d22, d23, W, TWO)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22,
            c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21,
            d22, d23)


@triton.jit
def _value_stage_imma(vb_ptr, pt_ptr, len_ptr, logit_ptr, mstat_ptr, sstat_ptr, vord_ptr, vcnt_ptr, lina_ptr,
                      linw_ptr, part_ptr, wmax, SLOTS, TMAX, NSK, HQ: tl.constexpr, HKV: tl.constexpr,
                      G: tl.constexpr, G2: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                      P: tl.constexpr, BLK: tl.constexpr, TS: tl.constexpr, PAIR: tl.constexpr = False,
                      PIPELINED: tl.constexpr = False, VG: tl.constexpr = 1):
    """The bit product of a block's V planes and its tokens' probabilities (GPU only: inline PTX). Per
    step of 32 list entries (the K of ``mma.m16n8k32``) lane (gid, q) holds entries 4q..4q+3 and
    16+4q..16+4q+3; per plane j below the step's deepest it loads their bytes of its byte column gid
    (and gid + 8) into two words each, and M-tile i's A is those words masked to bits 2i / 2i + 1
    (channels 8 gid + 2i / + 1, unsigned 2^(2i) / 2^(2i+1) per set bit). B is Y = rint(p w_sj / S),
    exact int32, with S per (block, query head) = the block's largest p (its split maxima in ``mstat``,
    TS tokens per split) times max |w| over 2^22, so that |Y| <= 2^22 and a block's products resolve to
    2^-22 of its largest: n-tile 0 column 2n carries query head n's top byte (signed), n-tile 1 columns
    2n / 2n + 1 its bytes 1 / 0 (unsigned); lane (gid, q) builds column gid of its own eight entries and
    its accumulators hold query head q's sums of the three bytes. The values are the unsigned form
    ``a_s + sum_{j<s} w_sj b_j`` (``lina``, ``linw``). The plane loop is unrolled (immediate offsets);
    PAIR takes the planes two at a time (both planes' loads issued together); PIPELINED (without PAIR)
    loads the list entries, pages and logits steps ahead of their use and the plane rows four planes at a
    time, the next step's first four during this step."""
    tl.static_assert(G <= 4, "three bytes of up to 4 query heads in two n-tiles")
    tl.static_assert(D % 64 == 0, "64 channels per 4 M-tiles")
    tl.static_assert(W % 2 == 0 or not PAIR, "planes in pairs need an even width")
    tl.static_assert(not (PIPELINED and PAIR), "the pipelined loop loads its planes four at a time")
    tl.static_assert(not PIPELINED or (W <= 15 and W % 4 == 0), "depths in 4-bit fields, planes in fours")
    TWO: tl.constexpr = D >= 128  # 8 M-tiles (two byte columns, 128 channels) per warp, else 4
    CW: tl.constexpr = 128 if D >= 128 else 64
    NWARP: tl.constexpr = D // CW
    NB8: tl.constexpr = D // 8
    PLANE: tl.constexpr = P * NB8
    pid_bh, blk, NBLK, b, h, w, gid, q = _v_lanes(HKV, NWARP)
    gc = gid // 2  # the query head of B column gid
    col_ok = gc < G
    sel = tl.where(gid % 2 == 0, 0x51, 0x40)  # n-tile 1: bytes 1 (even columns) or 0 (odd)
    msk0 = tl.where(gid % 2 == 0, -1, 0)  # n-tile 0: top bytes in even columns only
    mg, zs = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G2, NSK_PAD)
    # the block's largest logit per query head, from the splits it overlaps
    gg = tl.arange(0, G2)
    ss = tl.arange(0, NSK_PAD)
    s_lo = blk * BLK // TS
    s_hi = ((blk + 1) * BLK - 1) // TS
    bm = (gg[:, None] < G) & (ss[None, :] >= s_lo) & (ss[None, :] <= s_hi) & (ss[None, :] < NSK)
    mb = tl.max(tl.load(mstat_ptr + (b * HQ + h * G + gg[:, None]) * NSK + ss[None, :], mask=bm,
                        other=float("-inf")), 1)
    mb = tl.where(mb == float("-inf"), mg, mb)
    # S_n = exp(mb_n - mg_n) / Z_n * wmax / 2^22; the lanes' p / S = exp(lg - mb) * 2^22 / wmax
    sq = tl.exp(mb - mg) / zs * (wmax / 4194304.0)
    m_t = tl.zeros([32 * NWARP], tl.float32)
    sc = m_t
    for n in tl.static_range(G):
        m_t = tl.where(gc == n, tl.sum(tl.where(gg == n, mb, 0.0), 0), m_t)
        sc = tl.where(q == n, tl.sum(tl.where(gg == n, sq, 0.0), 0), sc)
    kw = 4194304.0 / wmax
    lrow = logit_ptr + (b * HQ + h * G + tl.minimum(gc, G - 1)) * TMAX
    pgrow = pt_ptr + pid_bh * SLOTS
    obase = vord_ptr + pid_bh * TMAX + blk * BLK
    n_items = _load_scalar(vcnt_ptr + pid_bh * NBLK + blk)
    zero = tl.zeros([32 * NWARP], tl.int32)
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, \
        zero, zero
    c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23 = zero, zero, zero, zero, zero, zero, zero, zero, \
        zero, zero, zero, zero
    d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11 = zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, \
        zero, zero
    d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22, d23 = zero, zero, zero, zero, zero, zero, zero, zero, \
        zero, zero, zero, zero
    asum = tl.zeros([32 * NWARP], tl.float32)
    # lane (gid, q) loads the rows of one entry, 4 q + gid % 4 + 16 (gid // 4), from byte column (CW / 8) w, and
    # the lanes of each q swap bytes (:data:`_XPOSE`): one 16-byte load per plane instead of 16 byte loads
    e0, e1, e2, e3, e4, e5, e6, e7 = _xpose_sel(gid)
    own = 4 * q + gid % 4 + 16 * (gid // 4)
    f0 = _v_first(obase, 0, n_items, W)
    bc = (CW // 8) * w
    if PIPELINED:
        # software-pipelined: the list entries of step k + 3, the pages of step k + 2 and the logits of step k + 1
        # are loaded during step k (the next step's eight depths carried packed in one register), and a step's
        # plane rows four planes at a time, the next step's first four during this step, so that a step waits on
        # one row round trip per four planes instead of one per plane after the entry -> page / logit chain
        a0, a1, a2, a3, a4, a5, a6, a7, ao = _vi_ents(obase, 0, q, own, n_items, W)
        pg, l0, l1, l2, l3, l4, l5, l6, l7 = _vi_fetch9(a0, a1, a2, a3, a4, a5, a6, a7, ao, pgrow, lrow, blk, col_ok,
                                                        BLK, P, W)
        n0, n1, n2, n3, n4, n5, n6, n7, no = _vi_ents(obase, 32, q, own, n_items, W)
        sp = _vi_pack(a0, a1, a2, a3, a4, a5, a6, a7, W)
        # step 0's rows, step 1's page, step 2's own entry
        ro, so = _v_row(ao, pg, bc, W, P, NB8, VG)
        (w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, t0, t1, t2, t3) = _vi_rows4(
            vb_ptr, ro, so, zero, PLANE, TWO, NB8, VG)
        pg1, _ = _v_fetch(no, pgrow, lrow, blk, col_ok, BLK, P, W)
        ao1 = no
        ao2 = _v_kv(obase, 64 + own, n_items, W)
        for k in range(0, tl.cdiv(n_items, 32)):
            fn = _v_first(obase, 32 * k + 32, n_items, W)
            # the next step's rows (its page arrived during the last step)
            ro1, so1 = _v_row(ao1, pg1, bc, W, P, NB8, VG)
            (wn0, wn1, wn2, wn3, un0, un1, un2, un3, vn0, vn1, vn2, vn3, tn0, tn1, tn2,
             tn3) = _vi_rows4(vb_ptr, ro1, so1, zero, PLANE, TWO, NB8, VG)
            s0, s1, s2, s3 = sp & 15, (sp >> 4) & 15, (sp >> 8) & 15, (sp >> 12) & 15
            s4, s5, s6, s7 = (sp >> 16) & 15, (sp >> 20) & 15, (sp >> 24) & 15, (sp >> 28) & 15
            p0, p1, p2, p3 = tl.exp(l0 - m_t) * kw, tl.exp(l1 - m_t) * kw, tl.exp(l2 - m_t) * kw, tl.exp(l3 - m_t) * kw
            p4, p5, p6, p7 = tl.exp(l4 - m_t) * kw, tl.exp(l5 - m_t) * kw, tl.exp(l6 - m_t) * kw, tl.exp(l7 - m_t) * kw
            # the next step's logits, the page of the one after it, entries further on
            pg1, l0, l1, l2, l3, l4, l5, l6, l7 = _vi_fetch9(n0, n1, n2, n3, n4, n5, n6, n7, ao2, pgrow, lrow,
                                                             blk, col_ok, BLK, P, W)
            sp = _vi_pack(n0, n1, n2, n3, n4, n5, n6, n7, W)
            ao1 = ao2
            n0, n1, n2, n3, n4, n5, n6, n7 = _vi_kvs(obase, 32 * k + 64, q, n_items, W)
            ao2 = _v_kv(obase, 32 * k + 96 + own, n_items, W)
            asum += (p0 * tl.load(lina_ptr + s0) + p1 * tl.load(lina_ptr + s1) + p2 * tl.load(lina_ptr + s2)
                     + p3 * tl.load(lina_ptr + s3) + p4 * tl.load(lina_ptr + s4) + p5 * tl.load(lina_ptr + s5)
                     + p6 * tl.load(lina_ptr + s6) + p7 * tl.load(lina_ptr + s7))
            npl = W - (f0 >> 11)
            # four planes' rows in flight at a time
            for j0 in tl.static_range(0, W, 4):
                if j0 > 0:
                    if j0 < npl:
                        (w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, t0, t1, t2, t3) = _vi_rows4(
                            vb_ptr, ro, so, zero + j0, PLANE, TWO, NB8, VG)
                for i in tl.static_range(4):
                    if j0 + i < npl:
                        if i == 0:
                            r0, r1, r2, r3 = w0, w1, w2, w3
                        elif i == 1:
                            r0, r1, r2, r3 = u0, u1, u2, u3
                        elif i == 2:
                            r0, r1, r2, r3 = v0, v1, v2, v3
                        else:
                            r0, r1, r2, r3 = t0, t1, t2, t3
                        (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19,
                         c20, c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,
                         d16, d17, d18, d19, d20, d21, d22, d23) = _vi_pmma(
                            r0, r1, r2, r3, e0, e1, e2, e3, e4, e5, e6, e7, linw_ptr, s0, s1, s2, s3, s4, s5, s6, s7,
                            p0, p1, p2, p3, p4, p5, p6, p7, sel, msk0, j0 + i, c0, c1, c2, c3, c4, c5, c6, c7, c8,
                            c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, d0, d1, d2, d3,
                            d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22,
                            d23, W, TWO)
            w0, w1, w2, w3, u0, u1, u2, u3 = wn0, wn1, wn2, wn3, un0, un1, un2, un3
            v0, v1, v2, v3, t0, t1, t2, t3 = vn0, vn1, vn2, vn3, tn0, tn1, tn2, tn3
            ro = ro1
            so = so1
            f0 = fn
    else:
        for k in range(0, tl.cdiv(n_items, 32)):
            fn = _v_first(obase, 32 * k + 32, n_items, W)
            k0, k1, k2, k3, k4, k5, k6, k7 = _vi_kvs(obase, 32 * k, q, n_items, W)
            ko = _v_kv(obase, 32 * k + own, n_items, W)
            ro, so, _ = _vi_entry(ko, pgrow, lrow, blk, col_ok, m_t, bc, BLK, W, P, NB8, VG)
            # the eight entries' depths and probabilities (their rows are dead code: only the own entry's is read)
            _, s0, p0 = _vi_entry(k0, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s1, p1 = _vi_entry(k1, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s2, p2 = _vi_entry(k2, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s3, p3 = _vi_entry(k3, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s4, p4 = _vi_entry(k4, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s5, p5 = _vi_entry(k5, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s6, p6 = _vi_entry(k6, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            _, s7, p7 = _vi_entry(k7, pgrow, lrow, blk, col_ok, m_t, 0, BLK, W, P, NB8)
            p0, p1, p2, p3, p4, p5, p6, p7 = p0 * kw, p1 * kw, p2 * kw, p3 * kw, p4 * kw, p5 * kw, p6 * kw, p7 * kw
            asum += (p0 * tl.load(lina_ptr + s0) + p1 * tl.load(lina_ptr + s1) + p2 * tl.load(lina_ptr + s2)
                     + p3 * tl.load(lina_ptr + s3) + p4 * tl.load(lina_ptr + s4) + p5 * tl.load(lina_ptr + s5)
                     + p6 * tl.load(lina_ptr + s6) + p7 * tl.load(lina_ptr + s7))
            npl = W - (f0 >> 11)  # planes below the step's deepest entry
            # planes unrolled: their offsets are immediates
            for j in tl.static_range(0, W, 2 if PAIR else 1):
                if j < npl:
                    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
                     c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17,
                     d18, d19, d20, d21, d22, d23) = _vi_plane(
                        vb_ptr, linw_ptr, ro, so, e0, e1, e2, e3, e4, e5, e6, e7, s0, s1, s2, s3, s4, s5, s6, s7, p0,
                        p1, p2, p3, p4, p5, p6, p7, sel, msk0, zero + j, j, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10,
                        c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, d0, d1, d2, d3, d4, d5, d6, d7,
                        d8, d9, d10, d11, d12, d13, d14, d15, d16, d17, d18, d19, d20, d21, d22, d23, PLANE, W, TWO,
                        PAIR, NB8, VG)
            f0 = fn
    # sum_t (p / S) a_s of query head n: the lanes of B column 2n (q = 0..3 cover a step's 32 entries;
    # warp 0's copy: every warp computed the same)
    ab = tl.zeros([32 * NWARP], tl.float32)
    for n in tl.static_range(G):
        ab = tl.where(q == n, tl.sum(tl.where((gid == 2 * n) & (w == 0), asum, 0.0), 0), ab)
    ok = q < G
    prow = ((b * HQ + h * G + tl.minimum(q, G - 1)) * NBLK + blk) * D + CW * w + 8 * gid
    _vi_store8(part_ptr, prow, 0, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17,
               c18, c19, c20, c21, c22, c23, sc, ab, ok)
    if TWO:  # M-tiles 4-7: byte column bc + 8
        _vi_store8(part_ptr, prow, 64, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, d16, d17,
                   d18, d19, d20, d21, d22, d23, sc, ab, ok)


def launch(st: Step, v_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """Grid (B*Hkv, NBLK) of d / 128 warps (one for d = 64): per-block partial outputs [B, Hq, NBLK, d]."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    cap = ch.value_int8_maxnreg
    _value_stage_imma[(pl.batch * k.hk, pl.n_blocks)](
        v_pool, page_table, lengths, pl.logits, pl.mstat, pl.sstat, pl.vord, pl.vcnt, c["lin_a"], c["lin_w"], pl.part,
        k.wmax, st.slots, pl.max_tokens, pl.n_splits, HQ=k.hq, HKV=k.hk, G=k.g, G2=st.g2, NSK_PAD=st.nsk_pad, D=k.d,
        W=k.w, P=k.p, BLK=ch.block_tokens, TS=ch.key_pages * k.p, PAIR=ch.value_int8_pair,
        PIPELINED=ch.value_int8_pipelined, VG=k.vg, **({"maxnreg": cap} if cap else {}),
        num_warps=max(1, k.d // 128))
