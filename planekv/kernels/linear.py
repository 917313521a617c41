"""The Key and Value stages as products of plane bits, for codebooks linear in the planes
(docs/DECISIONS.md, docs/KERNEL_NOTES.md runs 45-50).

With a linear codebook (``planekv.kvstore.UniformLinearTree``) the depth-t value of a code is
``a_t + sum_{j<t} w_tj b_j``, so a query head's logit over a token is

    base_g + sum_c wf_cg (a_{t_c} + sum_{j<t_c} w_{t_c j} b_cj) = base'_g + sum_{(c,j)} V_{(c,j) g} b_cj

with ``wf = q~ sigma_K`` (what ``_prep`` writes), ``base' = base + sum_c wf_c a_{t_c}`` and
``V_{(c,j) g} = wf_cg w_{t_c j}``: per (sequence, KV head) one product of the plane bits [tokens x
pairs (c, j < t_c)] with V [pairs x G]. The bits enter mma.sync as fp16 2^-7 per set bit (so V carries
2^7) and V as fp16 hi + lo halves, accumulated in float32: float32-accurate logits.

``_lin_prep`` (one program per (sequence, KV head), after ``_prep``) lists the pairs plane-major in
steps of 16 laid out in fragment order and folds the weights; ``_key_stage_mma`` builds the MMA
fragments in registers with inline PTX (GPU only) and writes logits and per-split softmax statistics
like the FMA Key stage. :func:`mma_operands` is the torch reference of ``_lin_prep``.

``_value_stage_mma`` is the mirror image for the Value stage (bits [channels x tokens] times the
tokens' probabilities folded with w_tj), over the depth-sorted token lists of ``_value_order``; its
bits enter the MMAs signed (+1 / -1) so that float32 accumulation stays at the output's scale.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..kvstore import UniformLinearTree
from .decode import _load_scalar, _softmax_stats, _vj

BIT_SCALE = 128.0  # a set bit is fp16 0x2000 = 2^-7; V carries the 2^7
_BIT_SCALE = tl.constexpr(BIT_SCALE)
_KCH = tl.constexpr(16)  # pairs per MMA step (the K of one mma.m16n8k16)


# how a plane bit becomes an fp16 MMA operand (the BITS constexpr of the bit-product stages; docs/KERNEL_NOTES.md
# run 50): 0 "shifted" to 2^-7 (a shift and a mask per register of two bits), 1 "in-place" as the fp16
# subnormal 2^(k - 24) of its position k (one mask; measured less accurate), 2 "signed": +1 for a clear
# bit, -1 for a set one (a shift, a mask and an or), so that sums of p w_j b_j do not pile up a large positive
# part that the constant a_t takes back (the Value stage's float32 accumulation error, run 50)
MMA_BITS = ("shifted", "in-place", "signed")


def _mma_asm(n_tiles: int, bits: str = "shifted") -> str:
    """PTX for one K step of a warp's n_tiles M-tiles: $0..$(4n-1) the new accumulators, then inputs
    z01, z23 (two pairs' plane bytes as 16-bit halves), b0, b1 (V^T words), the old accumulators.
    Tile i's A fragment: rows g / g+8 are bits 2i / 2i+1 of the bytes, as ``bits`` (:data:`MMA_BITS`)
    says: in place, row g / g+8 of tile i come out scaled by 2^(2i - 24) / 2^(2i - 23). All fragments
    first, then the tiles' MMAs back to back (independent accumulators)."""
    if bits not in MMA_BITS:
        raise ValueError(f"bits must be one of {MMA_BITS}, got {bits!r}")
    n = 4 * n_tiles
    z01, z23, b0, b1 = (f"${n + k}" for k in range(4))
    lines = ["{", f".reg .b32 a<{n}>;"]
    if bits == "signed":
        lines += [".reg .b32 one;", "mov.b32 one, 0x3c003c00;"]
    for i in range(n_tiles):
        for r, (z, sh) in enumerate(((z01, 13 - 2 * i), (z01, 12 - 2 * i), (z23, 13 - 2 * i), (z23, 12 - 2 * i))):
            a = f"a{4 * i + r}"
            if bits == "in-place":
                lines.append(f"and.b32 {a}, {z}, {hex(0x10001 << (13 - sh))};")
            elif bits == "signed":  # bit k to the sign bit of 1.0: (z << (15 - k)) & 0x80008000 | one
                lines.append(f"shl.b32 {a}, {z}, {sh + 2};")
                lines.append(f"lop3.b32 {a}, {a}, 0x80008000, one, 0xea;")
            else:
                lines.append(f"shl.b32 {a}, {z}, {sh};")
                lines.append(f"and.b32 {a}, {a}, 0x20002000;")
    for i in range(n_tiles):
        d = ", ".join(f"${4 * i + r}" for r in range(4))
        c = ", ".join(f"${n + 4 + 4 * i + r}" for r in range(4))
        a = ", ".join(f"a{4 * i + r}" for r in range(4))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d}}}, {{{a}}}, {{{b0}, {b1}}}, {{{c}}};")
    lines.append("}")
    return "\n".join(lines)


MMA_TILES = 4  # M-tiles of 16 rows per warp: 64 tokens, one 64-token page
_MMA_ASM = tl.constexpr(_mma_asm(MMA_TILES))
_MMA_ASM_IN_PLACE = tl.constexpr(_mma_asm(MMA_TILES, "in-place"))
_MMA_ASM_SIGNED = tl.constexpr(_mma_asm(MMA_TILES, "signed"))
_MMA_CONS = tl.constexpr(",".join(["=f"] * (4 * MMA_TILES) + ["r"] * 4 + ["f"] * (4 * MMA_TILES)))


@triton.jit
def _mma_step(z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
              BITS: tl.constexpr = 0):
    if BITS == 2:
        asm: tl.constexpr = _MMA_ASM_SIGNED
    elif BITS == 1:
        asm: tl.constexpr = _MMA_ASM_IN_PLACE
    else:
        asm: tl.constexpr = _MMA_ASM
    return tl.inline_asm_elementwise(
        asm, _MMA_CONS, [z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
        dtype=(tl.float32,) * 16, is_pure=True, pack=1)


@triton.jit
def _mma_logit(hi, lo, k: tl.constexpr, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G: tl.constexpr,
               BITS: tl.constexpr = 0):
    """Query head q's logit of token 8g + k (a thread's two accumulator columns: the V hi and lo
    products); stored, and returned (-inf where it is no logit) for the split's statistics."""
    tok = tok8 + k
    ok = (tok < T) & (q < G)
    if BITS == 1:  # bit k as fp16 2^(k - 24), V 2^7
        hl = (hi + lo) * (1 << (17 - k))
    else:  # bits 2^-7 x V 2^7
        hl = hi + lo
    lg = (hl + tl.load(base_ptr + q0 + q, mask=q < G, other=0.0)) * scale
    lg = tl.where(ok, lg, float("-inf"))
    tl.store(logit_ptr + (q0 + q) * TMAX + tok, lg, mask=ok)
    return lg


@triton.jit
def _mma_offsets(op, s):
    """A thread's four byte offsets of K step s (offsets [S, 4 registers, 4 lanes]: scalar loads per
    register; a [threads, 4] load would make Triton reshuffle it through shared memory)."""
    o = op + s * 16
    return tl.load(o), tl.load(o + 4), tl.load(o + 8), tl.load(o + 12)


@triton.jit
def _mma_bytes(pb, o0, o1, o2, o3):
    """The four pairs' bytes of the thread's tokens as two words of 16-bit lanes."""
    x0 = tl.load(pb + o0).to(tl.int32)
    x1 = tl.load(pb + o1).to(tl.int32)
    x2 = tl.load(pb + o2).to(tl.int32)
    x3 = tl.load(pb + o3).to(tl.int32)
    return x0 | (x1 << 16), x2 | (x3 << 16)


@triton.jit
def _mma_operands(pb, op, vp, s):
    """A thread's operands of K step s: its pairs' bytes and its two V words ([S, 2, 8 columns, 4 lanes])."""
    o0, o1, o2, o3 = _mma_offsets(op, s)
    z01, z23 = _mma_bytes(pb, o0, o1, o2, o3)
    return z01, z23, tl.load(vp + s * 64), tl.load(vp + s * 64 + 32)


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
def _key_stage_mma(kb_ptr, pt_ptr, len_ptr, off_ptr, vf_ptr, nst_ptr, base_ptr, logit_ptr, mstat_ptr, sstat_ptr,
                   scale, SLOTS, TMAX, SMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   W: tl.constexpr, P: tl.constexpr, NWARP: tl.constexpr, PREFETCH: tl.constexpr = 0,
                   BITS: tl.constexpr = 0):
    """The bit product with mma.sync fragments built in registers (GPU only: inline PTX). Program
    (b*Hkv + h, split) of NWARP pages of 64 tokens, one page per warp, one tensor element per thread
    (lane 4g + q). Per K step of 16 pairs (:func:`mma_operands`' fragment order) a thread loads byte g
    of its four pairs (tokens 8g..8g+7 of its page; lanes q = 0..3 read neighbouring channels of one
    plane) and its two V words, then :func:`_mma_asm`: M-tile i's rows g / g+8 are tokens 8g + 2i /
    8g + 2i + 1, and a thread's two columns are query head q's hi and lo products, so its 8 logits need
    no other lane."""
    tl.static_assert(P == 64, "one 64-token page per warp")
    tl.static_assert(BITS < 2, "0/1 bits (shifted or in place)")
    tl.static_assert(G <= 4, "hi and lo halves of up to 4 query heads in the 8 MMA columns")
    pid_bh, split, b, h, T, NSPLIT, w, g, q, pb = _page_lanes(kb_ptr, pt_ptr, len_ptr, SLOTS, HKV, D, W, P, NWARP)
    op = off_ptr + pid_bh * SMAX * 16 + q  # lane q's offset of register r in step s at + 16 s + 4 r
    vp = vf_ptr + pid_bh * SMAX * 64 + g * 4 + q  # column g, lane q: word b of step s at + 64 s + 32 b
    zero = tl.zeros([32 * NWARP], tl.float32)
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    c8, c9, c10, c11, c12, c13, c14, c15 = zero, zero, zero, zero, zero, zero, zero, zero
    n_steps = tl.load(nst_ptr + pid_bh)
    if PREFETCH == 2:  # offsets two steps ahead, bytes and V words one step ahead of the MMAs
        o0, o1, o2, o3 = _mma_offsets(op, tl.minimum(1, n_steps - 1))
        z01, z23, b0, b1 = _mma_operands(pb, op, vp, 0)
        for s in range(0, n_steps):
            nxt = tl.minimum(s + 1, n_steps - 1)
            p0, p1, p2, p3 = _mma_offsets(op, tl.minimum(s + 2, n_steps - 1))
            z01n, z23n = _mma_bytes(pb, o0, o1, o2, o3)
            b0n = tl.load(vp + nxt * 64)
            b1n = tl.load(vp + nxt * 64 + 32)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BITS)
            z01, z23, b0, b1 = z01n, z23n, b0n, b1n
            o0, o1, o2, o3 = p0, p1, p2, p3
    elif PREFETCH == 1:  # the next step's bytes and V words requested before this step's MMAs
        z01, z23, b0, b1 = _mma_operands(pb, op, vp, 0)
        for s in range(0, n_steps):
            z01n, z23n, b0n, b1n = _mma_operands(pb, op, vp, tl.minimum(s + 1, n_steps - 1))
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BITS)
            z01, z23, b0, b1 = z01n, z23n, b0n, b1n
    else:
        for s in range(0, n_steps):
            z01, z23, b0, b1 = _mma_operands(pb, op, vp, s)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BITS)
    q0 = b * HQ + h * G
    tok8 = split * (NWARP * P) + w * P + 8 * g  # token 8g of the warp's page
    # M-tile i: c(4i), c(4i+1) are row g (token 8g + 2i), c(4i+2), c(4i+3) row g + 8 (token 8g + 2i + 1);
    # columns 2q / 2q + 1 are query head q's V hi / lo products
    l0 = _mma_logit(c0, c1, 0, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l1 = _mma_logit(c2, c3, 1, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l2 = _mma_logit(c4, c5, 2, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l3 = _mma_logit(c6, c7, 3, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l4 = _mma_logit(c8, c9, 4, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l5 = _mma_logit(c10, c11, 5, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l6 = _mma_logit(c12, c13, 6, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    l7 = _mma_logit(c14, c15, 7, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G, BITS)
    _split_stats(l0, l1, l2, l3, l4, l5, l6, l7, q, mstat_ptr, sstat_ptr, q0, split, NSPLIT, G, NWARP, 0)


# ----------------------------------------------------------------------------- the Key stage on int8 MMAs

# V as int8 digits per query head: V ~ S_g (d0 + d1 / BASE + d2 / BASE^2), S_g = max |V_g| / 127. Each
# remainder lies in [-1/2, 1/2], so a base of 254 keeps every digit in [-127, 127]; three digits resolve
# V to 2^-23 of its largest value (float32's own resolution). The products are exact int32 sums.
IMMA_BASE = 254.0
_IMMA_BASE = tl.constexpr(IMMA_BASE)
_IMMA_CONS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 14))


def _u8_tiles_asm(i: int, x: str, y: str, n0: tuple[str, str, str], n1: tuple[str, str, str], b1_type: str = "s8",
                  regs: str = "", pre: str = "") -> str:
    """PTX for M-tile i of a K step of 32: A (rows g / g + 8 = bit 2i / 2i + 1 of the bytes in the words
    x and y, left in place: one ``and`` per register) against two n-tiles, each given as (D, B, C)
    register lists; n-tile 0's B is signed, n-tile 1's ``b1_type``. ``regs`` / ``pre``: more local
    registers and instructions before the products."""
    lo, hi = hex(0x01010101 << (2 * i)), hex(0x02020202 << (2 * i))
    return "\n".join([
        "{", f".reg .b32 a<4>{regs};", *([pre] if pre else []),
        f"and.b32 a0, {x}, {lo};", f"and.b32 a1, {x}, {hi};", f"and.b32 a2, {y}, {lo};", f"and.b32 a3, {y}, {hi};",
        f"mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {{{n0[0]}}}, {{a0, a1, a2, a3}}, {{{n0[1]}}}, "
        f"{{{n0[2]}}};",
        f"mma.sync.aligned.m16n8k32.row.col.s32.u8.{b1_type}.s32 {{{n1[0]}}}, {{a0, a1, a2, a3}}, {{{n1[1]}}}, "
        f"{{{n1[2]}}};",
        "}"])


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
# four bytes (the low byte of each input) in one word, the first lowest
_PACK4 = tl.constexpr("{ .reg .b32 t0, t1; prmt.b32 t0, $1, $2, 0x0040; prmt.b32 t1, $3, $4, 0x0040; "
                      "prmt.b32 $0, t0, t1, 0x5410; }")


@triton.jit
def _pack4(x0, x1, x2, x3):
    return tl.inline_asm_elementwise(_PACK4, "=r,r,r,r,r", [x0, x1, x2, x3], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _imma_tile(x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7, ASM: tl.constexpr):
    """One M-tile's two MMAs (``ASM``: its PTX, :func:`_imma_tile_asm`)."""
    return tl.inline_asm_elementwise(ASM, _IMMA_CONS, [x, y, v0, v1, v2, v3, c0, c1, c2, c3, c4, c5, c6, c7],
                                     dtype=(tl.int32,) * 8, is_pure=True, pack=1)


# The plane loads of the int8 Key stage: lane 4g + q loads the whole 8-byte word of pair m = g of its
# group (offsets at off[s, 4 g + q]: list entry 16 v + 4 q + k with g = 4 v + k, the pair whose byte g the
# lane needs), and the 8 lanes of one q swap bytes in three butterfly stages (lanes ^16, ^8, ^4: blocks of
# 4, 2, 1 bytes; prmt, shfl, two prmt each, selectors by the lane's bits of g: :func:`xpose_selectors`)
# until lane g holds byte g of the group's 8 words, as the words x, y. One 8-byte load and 12 instructions
# per lane and step instead of eight byte loads, their 64-bit addresses, eight offset loads and 6 prmt.
_XPOSE_STAGE = "prmt.b32 s, {l}, {h}, {s}; shfl.sync.bfly.b32 r, s, {d}, 0x1f, 0xffffffff; " \
    "prmt.b32 {lo}, {l}, r, {sl}; prmt.b32 {ho}, {h}, r, {sh}; "
_XPOSE = tl.constexpr(
    "{ .reg .b32 s, r, l, h; "
    + _XPOSE_STAGE.format(l="$2", h="$3", s="$4", d=16, lo="l", ho="h", sl="$5", sh="$4")
    + _XPOSE_STAGE.format(l="l", h="h", s="$6", d=8, lo="l", ho="h", sl="$7", sh="$8")
    + _XPOSE_STAGE.format(l="l", h="h", s="$9", d=4, lo="$0", ho="$1", sl="$10", sh="$11") + "}")


def xpose_selectors(g: int) -> list[int]:
    """The eight prmt selectors of lane group g's byte transpose (:data:`_XPOSE`: stage A's send (also
    its new high word) and new low word; stages B and C: send, new low, new high). Mirrored by
    :func:`_xpose_sel` in the kernel."""
    g2, g1, g0 = (g >> 2) & 1, (g >> 1) & 1, g & 1
    sa = 0x3210 if g2 else 0x7654
    return [sa, sa ^ 0x4444, 0x5410 if g1 else 0x7632, 0x3254 if g1 else 0x5410, 0x3276 if g1 else 0x7610,
            0x6420 if g0 else 0x7531, 0x3514 if g0 else 0x5240, 0x3716 if g0 else 0x7260]


@triton.jit
def _xpose_sel(g):
    """:func:`xpose_selectors` of each lane's group index g (int32 tensors)."""
    g2 = (g & 4) != 0
    g1 = (g & 2) != 0
    g0 = (g & 1) != 0
    sa = tl.where(g2, 0x3210, 0x7654)
    return (sa, sa ^ 0x4444, tl.where(g1, 0x5410, 0x7632), tl.where(g1, 0x3254, 0x5410), tl.where(g1, 0x3276, 0x7610),
            tl.where(g0, 0x6420, 0x7531), tl.where(g0, 0x3514, 0x5240), tl.where(g0, 0x3716, 0x7260))


@triton.jit
def _xpose(lo, hi, s0, s1, s2, s3, s4, s5, s6, s7):
    """(x, y) of the lane from the group's words (lo, hi: octets 0-3 / 4-7 of the lane's own pair word)."""
    return tl.inline_asm_elementwise(_XPOSE, "=r,=r,r,r,r,r,r,r,r,r,r,r", [lo, hi, s0, s1, s2, s3, s4, s5, s6, s7],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


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


_ST4 = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $6, 0; @p st.global.v4.f32 [$1], {$2, $3, $4, $5}; "
                    "mov.b32 $0, 0; }")


@triton.jit
def _st8(ptr, x0, x1, x2, x3, x4, x5, x6, x7, ok):
    """Eight floats to ptr (32-byte aligned; as int64) in two 16-byte stores where ok (inline PTX)."""
    ok = ok.to(tl.int32)
    tl.inline_asm_elementwise(_ST4, "=r,l,f,f,f,f,r", [ptr, x0, x1, x2, x3, ok], dtype=tl.int32, is_pure=False,
                              pack=1)
    tl.inline_asm_elementwise(_ST4, "=r,l,f,f,f,f,r", [ptr + 16, x4, x5, x6, x7, ok], dtype=tl.int32,
                              is_pure=False, pack=1)


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
                 NWARP: tl.constexpr, STATS: tl.constexpr = 0):
    """A split's softmax max and sum per query head from the lanes' 8 logits each (lane q: head q).
    STATS 1: one reduction over the lanes as [NWARP * 8, 4] for all heads at once, else one masked
    reduction per head (KERNEL_NOTES run 56: the int8 stage 525 -> 493 us with 1, the fp16 one 534 ->
    591 us, so each keeps its faster form)."""
    mt = tl.maximum(tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3)), tl.maximum(tl.maximum(l4, l5),
                                                                                  tl.maximum(l6, l7)))
    if STATS == 1:
        nn = tl.arange(0, 4)
        m4 = tl.max(tl.reshape(mt, [NWARP * 8, 4]), 0)
        tl.store(mstat_ptr + (q0 + nn) * NSPLIT + split, m4, mask=nn < G)
        m4 = tl.where(m4 == float("-inf"), 0.0, m4)
        msel = tl.reshape(tl.broadcast_to(m4[None, :], [NWARP * 8, 4]), [32 * NWARP])
        e = (tl.exp(l0 - msel) + tl.exp(l1 - msel) + tl.exp(l2 - msel) + tl.exp(l3 - msel) + tl.exp(l4 - msel)
             + tl.exp(l5 - msel) + tl.exp(l6 - msel) + tl.exp(l7 - msel))
        tl.store(sstat_ptr + (q0 + nn) * NSPLIT + split, tl.sum(tl.reshape(e, [NWARP * 8, 4]), 0), mask=nn < G)
        return
    msel = tl.zeros([32 * NWARP], tl.float32)
    for n in tl.static_range(G):
        m = tl.max(tl.where(q == n, mt, float("-inf")), 0)
        tl.store(mstat_ptr + (q0 + n) * NSPLIT + split, m)
        msel = tl.where(q == n, tl.where(m == float("-inf"), 0.0, m), msel)
    e = (tl.exp(l0 - msel) + tl.exp(l1 - msel) + tl.exp(l2 - msel) + tl.exp(l3 - msel) + tl.exp(l4 - msel)
         + tl.exp(l5 - msel) + tl.exp(l6 - msel) + tl.exp(l7 - msel))
    for n in tl.static_range(G):
        tl.store(sstat_ptr + (q0 + n) * NSPLIT + split, tl.sum(tl.where(q == n, e, 0.0), 0))


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
                    VST: tl.constexpr = False, PF: tl.constexpr = 1):
    """The bit product on int8 tensor cores (GPU only: inline PTX; ``key_bits="int8"``). As
    :func:`_key_stage_mma` (program (b*Hkv + h, split) of NWARP 64-token pages, one per warp, lane 4g + q
    owns byte g: tokens 8g..8g+7), but per K step of 32 pairs (:func:`imma_operands`' order) a lane
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
    # One 8-byte pair word per lane (pair 4 g + q of the step's list: offsets at off[s, 4 g + q]), one step
    # ahead (PF 1) or two (PF 3: the loop over pairs of steps, so that no register moves wait for the loads),
    # turned into the lane's words x, y by the byte transpose of its lane group (_XPOSE); the V words loaded
    # in the step they are used in (L1 hits; four registers fewer). KERNEL_NOTES runs 80-81: B=32 T=32768 Key
    # stage 410 -> 376-378 us at R=2, 623 -> 568-578 at R=4 against eight byte loads per lane and step; run
    # 86: PF 3 376 -> 315, 568 -> 466.
    s0, s1, s2, s3, s4, s5, s6, s7 = _xpose_sel(g)
    pw = pb - g  # the page's plane 0, channel 0 (pb points at byte g)
    ol = off_ptr + pid_bh * SMAX * 32 + 4 * g + q  # lane 4g + q's word offset of step s at + 32 s
    last = n_steps - 1
    tl.static_assert((PF == 1) | (PF == 3), "rows one step ahead, or two over pairs of steps")
    lo, hi = _ld64(pw + tl.load(ol))
    if PF == 1:
        o = tl.load(ol + tl.minimum(1, last) * 32)
        for s in range(0, n_steps):
            on = tl.load(ol + tl.minimum(s + 2, last) * 32)
            (lo, hi, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20,
             c21, c22, c23, c24, c25, c26, c27, c28, c29, c30, c31) = _imma_kstep(
                lo, hi, pw, o, vp, s, last, n_steps, s0, s1, s2, s3, s4, s5, s6, s7, c0, c1, c2, c3, c4, c5, c6, c7,
                c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19, c20, c21, c22, c23, c24, c25, c26, c27, c28,
                c29, c30, c31, False)
            o = on
    else:
        # rows two steps ahead with the loop over pairs of steps, so that no register rotation (which ptxas
        # turns into moves that wait for the load one step after it; KERNEL_NOTES run 85) stands between a
        # load and its use; a second step past the last one multiplies by zero V words
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
    _split_stats(l0, l1, l2, l3, l4, l5, l6, l7, q, mstat_ptr, sstat_ptr, q0, split, NSPLIT, G, NWARP, 1)


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


# ----------------------------------------------------------------------------- the Value stage


@triton.jit
def _pack_f16x2(lo, hi):
    """Two float32 tensors rounded to fp16 (nearest) in one word: ``lo`` in bits 0-15."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _v_half(pv, s, j, linw_ptr, lo_f, W: tl.constexpr):
    """An entry's B value in plane j: pv (its probability times the B scale) times w_{s,j}, the fp16
    high half (lo_f = 0) or the rest below it (lo_f = 1), in float32 for :func:`_pack_f16x2`."""
    x = pv * tl.load(linw_ptr + s * W + j)
    return x - lo_f * x.to(tl.float16).to(tl.float32)


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
def _v_entry(kv, page, lg, m_t, iz_t, bc, W: tl.constexpr, P: tl.constexpr, NB8: tl.constexpr,
             VG: tl.constexpr = 1):
    """(offset of the entry's plane-0 byte in column bc, its depth, its probability x the B scale)."""
    row, dep = _v_row(kv, page, bc, W, P, NB8, VG)
    return row, dep, tl.exp(lg - m_t) * iz_t


@triton.jit
def _v_bytes(vb_ptr, r0, r1, r2, r3, s0, s1, s2, s3, j, PLANE: tl.constexpr, NB8: tl.constexpr = 16,
             VG: tl.constexpr = 1):
    """Plane j's bytes of the four entries (masked below their depths) as two words of 16-bit lanes."""
    o = _vj(j, PLANE, VG, NB8)
    x0 = tl.load(vb_ptr + r0 + o, mask=j < s0, other=0).to(tl.int32)
    x1 = tl.load(vb_ptr + r1 + o, mask=j < s1, other=0).to(tl.int32)
    x2 = tl.load(vb_ptr + r2 + o, mask=j < s2, other=0).to(tl.int32)
    x3 = tl.load(vb_ptr + r3 + o, mask=j < s3, other=0).to(tl.int32)
    return x0 | (x1 << 16), x2 | (x3 << 16)


@triton.jit
def _v_kvs(obase, first, e0, n_items, W: tl.constexpr):
    """A lane's four entries of the step starting at list entry ``first`` (2q, 2q+1, 2q+8, 2q+9) and
    the step's first (deepest) entry."""
    return (_v_kv(obase, first + e0, n_items, W), _v_kv(obase, first + e0 + 1, n_items, W),
            _v_kv(obase, first + e0 + 8, n_items, W), _v_kv(obase, first + e0 + 9, n_items, W),
            _v_first(obase, first, n_items, W))


@triton.jit
def _v_fetches(k0, k1, k2, k3, pgrow, lrow, blk, col_ok, BLK: tl.constexpr, P: tl.constexpr, W: tl.constexpr):
    """The four entries' pages and logits: (page x 4, logit x 4)."""
    g0, l0 = _v_fetch(k0, pgrow, lrow, blk, col_ok, BLK, P, W)
    g1, l1 = _v_fetch(k1, pgrow, lrow, blk, col_ok, BLK, P, W)
    g2, l2 = _v_fetch(k2, pgrow, lrow, blk, col_ok, BLK, P, W)
    g3, l3 = _v_fetch(k3, pgrow, lrow, blk, col_ok, BLK, P, W)
    return g0, g1, g2, g3, l0, l1, l2, l3


@triton.jit
def _v_bytes2(vb_ptr, r0, r1, r2, r3, s0, s1, s2, s3, j, PLANE: tl.constexpr, TWO: tl.constexpr,
              NB8: tl.constexpr = 16, VG: tl.constexpr = 1):
    """:func:`_v_bytes` of both byte columns (the second one 8 bytes on; a copy of the first when d = 64)."""
    z01, z23 = _v_bytes(vb_ptr, r0, r1, r2, r3, s0, s1, s2, s3, j, PLANE, NB8, VG)
    if TWO:
        y01, y23 = _v_bytes(vb_ptr, r0 + 8, r1 + 8, r2 + 8, r3 + 8, s0, s1, s2, s3, j, PLANE, NB8, VG)
    else:
        y01, y23 = z01, z23
    return z01, z23, y01, y23


@triton.jit
def _v_plane(z01, z23, y01, y23, p0, p1, p2, p3, s0, s1, s2, s3, j, linw_ptr, lo_f, c0, c1, c2, c3, c4, c5, c6, c7,
             c8, c9, c10, c11, c12, c13, c14, c15, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14,
             d15, W: tl.constexpr, TWO: tl.constexpr, BITS: tl.constexpr):
    """One plane of a step: B from the entries' probabilities and w_{s,j}, the MMAs of both byte columns."""
    b0 = _pack_f16x2(_v_half(p0, s0, j, linw_ptr, lo_f, W), _v_half(p1, s1, j, linw_ptr, lo_f, W))
    b1 = _pack_f16x2(_v_half(p2, s2, j, linw_ptr, lo_f, W), _v_half(p3, s3, j, linw_ptr, lo_f, W))
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
        z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, BITS)
    if TWO:
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15 = _mma_step(
            y01, y23, b0, b1, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, BITS)
    return (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, d0, d1, d2, d3, d4, d5, d6, d7, d8,
            d9, d10, d11, d12, d13, d14, d15)


@triton.jit
def _v_store8(part_ptr, prow, OFF: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
              inv, ab, ok, BITS: tl.constexpr):
    """The 8 channels OFF + 0..7 of one byte column from 4 M-tiles' accumulators (hi, lo pairs), in
    two 16-byte stores (prow + OFF is a multiple of 8)."""
    _st8((part_ptr + prow + OFF).to(tl.int64, bitcast=True), _v_val(c0, c1, 0, inv, ab, BITS),
         _v_val(c2, c3, 1, inv, ab, BITS), _v_val(c4, c5, 2, inv, ab, BITS), _v_val(c6, c7, 3, inv, ab, BITS),
         _v_val(c8, c9, 4, inv, ab, BITS), _v_val(c10, c11, 5, inv, ab, BITS), _v_val(c12, c13, 6, inv, ab, BITS),
         _v_val(c14, c15, 7, inv, ab, BITS), ok)


@triton.jit
def _v_val(hi, lo, k: tl.constexpr, inv, ab, BITS: tl.constexpr):
    """Channel bit k of the lane's byte column (M-tile k // 2, row k % 2) from its hi and lo sums."""
    if BITS == 1:
        return (hi + lo) * (inv * (1 << (24 - k))) + ab
    elif BITS == 2:
        return (hi + lo) * inv + ab
    else:
        return (hi + lo) * (inv * 128.0) + ab


@triton.jit
def _v_lanes(HKV: tl.constexpr, NWARP: tl.constexpr):
    """A bit-product Value-stage program's (b*Hkv + h, block, blocks, b, h) and its lanes' (warp, gid, q)."""
    pid_bh = tl.program_id(0)
    t = tl.arange(0, 32 * NWARP)
    return (pid_bh, tl.program_id(1), tl.num_programs(1), pid_bh // HKV, pid_bh % HKV, t // 32, (t % 32) // 4,
            t % 4)


@triton.jit
def _value_stage_mma(vb_ptr, pt_ptr, len_ptr, logit_ptr, mstat_ptr, sstat_ptr, vord_ptr, vcnt_ptr, lina_ptr,
                     linw_ptr, part_ptr, vscale, SLOTS, TMAX, NSK, HQ: tl.constexpr, HKV: tl.constexpr,
                     G: tl.constexpr, G2: tl.constexpr, NSK_PAD: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                     P: tl.constexpr, BLK: tl.constexpr, BITS: tl.constexpr = 2, VG: tl.constexpr = 1):
    """The Value stage as a product of plane bits (linear codebooks; GPU only: inline PTX), the mirror
    of :func:`_key_stage_mma`. Program (b*Hkv + h, block of BLK tokens) over the block's depth > 0
    tokens as ``_value_order`` listed them deepest first (SORT), in steps of 16 list entries, one warp
    per 128 channels (64 for d = 64). A token's value is ``a_s + sum_{j<s} w_sj b_j`` (with BITS = 2,
    the signed form: ``lina`` holds c_s = a_s + sum_j w_sj / 2 and ``linw`` -w_sj / 2, b_j the sign
    1 - 2 b_j), so

        part[g, c] = sum_t p_gt a_{s_t} + sum_j sum_t (p_gt w_{s_t j}) b_tcj

    and per step and plane j below the step's deepest token: A = the bits [channels x 16 tokens], one
    byte load per token and 8 channels (M-tile i's rows gid / gid + 8 are channels 8 gid + 2i / + 1 of
    byte column gid, as the Key stage's tokens), B = [16 tokens x 8 columns] with column 2n query head
    n's ``p w`` fp16 high half and 2n + 1 its low half; lane (gid, q) holds B column gid of the same four
    tokens (2q, 2q+1, 2q+8, 2q+9) whose bytes it loads, and its accumulator columns 2q / 2q + 1 are
    query head q's two halves. Entries, pages and logits are loaded a step ahead; the emulation in
    tests/kernels/test_linear.py follows this lane by lane."""
    tl.static_assert(G <= 4, "hi and lo halves of up to 4 query heads in the 8 MMA columns")
    tl.static_assert(D % 64 == 0, "64 channels per 4 M-tiles")
    TWO: tl.constexpr = D >= 128  # 8 M-tiles (two byte columns, 128 channels) per warp, else 4
    CW: tl.constexpr = 128 if D >= 128 else 64
    NWARP: tl.constexpr = D // CW
    NB8: tl.constexpr = D // 8
    PLANE: tl.constexpr = P * NB8
    pid_bh, blk, NBLK, b, h, w, gid, q = _v_lanes(HKV, NWARP)
    gc = gid // 2  # the query head of B column gid (even: high half, odd: low half)
    lo_f = (gid % 2).to(tl.float32)
    col_ok = gc < G
    mg, zs = _softmax_stats(mstat_ptr, sstat_ptr, b, h, NSK, HQ, G, G2, NSK_PAD)
    gg = tl.arange(0, G2)
    zero = tl.zeros([32 * NWARP], tl.float32)
    m_t = zero
    iz_t = zero
    for n in tl.static_range(G):
        m_t = tl.where(gc == n, tl.sum(tl.where(gg == n, mg, 0.0), 0), m_t)
        iz_t = tl.where(gc == n, tl.sum(tl.where(gg == n, 1.0 / zs, 0.0), 0), iz_t)
    iz_t = iz_t * vscale  # B carries the scale (fp16 range for p w, kept above the subnormals)
    lrow = logit_ptr + (b * HQ + h * G + tl.minimum(gc, G - 1)) * TMAX
    pgrow = pt_ptr + pid_bh * SLOTS
    obase = vord_ptr + pid_bh * TMAX + blk * BLK
    n_items = _load_scalar(vcnt_ptr + pid_bh * NBLK + blk)
    bc = (CW // 8) * w + gid  # the lane's byte column (and bc + 8 for M-tiles 4-7)
    e0 = 2 * q
    c0, c1, c2, c3, c4, c5, c6, c7 = zero, zero, zero, zero, zero, zero, zero, zero
    c8, c9, c10, c11, c12, c13, c14, c15 = zero, zero, zero, zero, zero, zero, zero, zero
    d0, d1, d2, d3, d4, d5, d6, d7 = zero, zero, zero, zero, zero, zero, zero, zero
    d8, d9, d10, d11, d12, d13, d14, d15 = zero, zero, zero, zero, zero, zero, zero, zero
    asum = zero
    # entries two steps ahead, pages and logits one
    k0, k1, k2, k3, f0 = _v_kvs(obase, 0, e0, n_items, W)
    pg0, pg1, pg2, pg3, lg0, lg1, lg2, lg3 = _v_fetches(k0, k1, k2, k3, pgrow, lrow, blk, col_ok, BLK, P, W)
    n0, n1, n2, n3, fn = _v_kvs(obase, 16, e0, n_items, W)
    for k in range(0, tl.cdiv(n_items, 16)):
        nn0, nn1, nn2, nn3, fnn = _v_kvs(obase, 16 * k + 32, e0, n_items, W)
        qg0, qg1, qg2, qg3, mg0, mg1, mg2, mg3 = _v_fetches(n0, n1, n2, n3, pgrow, lrow, blk, col_ok, BLK, P, W)
        r0, s0, p0 = _v_entry(k0, pg0, lg0, m_t, iz_t, bc, W, P, NB8, VG)
        r1, s1, p1 = _v_entry(k1, pg1, lg1, m_t, iz_t, bc, W, P, NB8, VG)
        r2, s2, p2 = _v_entry(k2, pg2, lg2, m_t, iz_t, bc, W, P, NB8, VG)
        r3, s3, p3 = _v_entry(k3, pg3, lg3, m_t, iz_t, bc, W, P, NB8, VG)
        asum += (p0 * tl.load(lina_ptr + s0) + p1 * tl.load(lina_ptr + s1) + p2 * tl.load(lina_ptr + s2)
                 + p3 * tl.load(lina_ptr + s3))
        for j in range(0, W - (f0 >> 11)):  # planes below the step's deepest token
            z01, z23, y01, y23 = _v_bytes2(vb_ptr, r0, r1, r2, r3, s0, s1, s2, s3, j, PLANE, TWO, NB8, VG)
            (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, d0, d1, d2, d3, d4, d5, d6, d7,
             d8, d9, d10, d11, d12, d13, d14, d15) = _v_plane(
                z01, z23, y01, y23, p0, p1, p2, p3, s0, s1, s2, s3, j, linw_ptr, lo_f, c0, c1, c2, c3, c4, c5,
                c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11,
                d12, d13, d14, d15, W, TWO, BITS)
        k0, k1, k2, k3, f0 = n0, n1, n2, n3, fn
        pg0, pg1, pg2, pg3, lg0, lg1, lg2, lg3 = qg0, qg1, qg2, qg3, mg0, mg1, mg2, mg3
        n0, n1, n2, n3, fn = nn0, nn1, nn2, nn3, fnn
    # sum_t p a_s: B column gid = 2n (high halves) holds query head n's; lanes q = 0..3 of those
    # columns cover the 16 entries of every step (warp 0's copy: every warp computed the same)
    asum = asum / vscale
    ab = zero
    for n in tl.static_range(G):
        ab = tl.where(q == n, tl.sum(tl.where((gid == 2 * n) & (w == 0), asum, 0.0), 0), ab)
    inv = 1.0 / vscale  # B x vscale; the bits' fp16 values undone per M-tile row by _v_store
    ok = q < G
    prow = ((b * HQ + h * G + tl.minimum(q, G - 1)) * NBLK + blk) * D + CW * w + 8 * gid
    # M-tile i: c(4i), c(4i+1) row gid (channel 8 gid + 2i of the byte column), c(4i+2), c(4i+3) row gid + 8
    _v_store8(part_ptr, prow, 0, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, inv, ab, ok,
              BITS)
    if TWO:  # M-tiles 4-7: byte column bc + 8
        _v_store8(part_ptr, prow, 64, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, inv, ab, ok,
                  BITS)


# The Value stage on int8 tensor cores (KERNEL_NOTES, "the Value stage on int8 tensor cores"): per plane and
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
                      VPF: tl.constexpr = 0, VG: tl.constexpr = 1):
    """:func:`_value_stage_mma` on int8 tensor cores (GPU only: inline PTX; ``value_bits="int8"``). Per
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
    PAIR takes the planes two at a time (both planes' loads issued together); VPF 1 (without PAIR) loads
    the list entries two steps and the pages and logits one step ahead of their use, and the plane rows
    four planes at a time; VPF 2 also the next step's first four plane rows during this step (its own
    entries three steps and its pages two steps ahead)."""
    tl.static_assert(G <= 4, "three bytes of up to 4 query heads in two n-tiles")
    tl.static_assert(D % 64 == 0, "64 channels per 4 M-tiles")
    tl.static_assert(W % 2 == 0 or not PAIR, "planes in pairs need an even width")
    tl.static_assert(not (VPF and PAIR), "the pipelined loop loads its planes four at a time")
    tl.static_assert(not VPF or (W <= 15 and W % 4 == 0), "depths in 4-bit fields, planes in fours")
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
    # (KERNEL_NOTES run 82, with the 128-register cap of the launch: B=32 T=32768 Value stage 197 -> 180 us
    # at R=2, 560 -> 493 at R=4)
    e0, e1, e2, e3, e4, e5, e6, e7 = _xpose_sel(gid)
    own = 4 * q + gid % 4 + 16 * (gid // 4)
    f0 = _v_first(obase, 0, n_items, W)
    bc = (CW // 8) * w
    if VPF:
        # software-pipelined (KERNEL_NOTES runs 88-93): the pages and logits of step k + 1 and the list entries
        # of step k + 2 are loaded during step k (the next step's eight depths carried packed in one register),
        # and a step's plane rows four planes at a time, so that it waits on one row round trip per four planes
        # instead of one per plane after the entry -> page / logit chain (run 89, B=32 T=32768 Value stage 512 ->
        # 457 us at R=4, 186 -> 171 at R=2); VPF 2 issues step k + 1's first four rows during step k as well (run
        # 92: 442 -> 415, 166 -> 153)
        a0, a1, a2, a3, a4, a5, a6, a7, ao = _vi_ents(obase, 0, q, own, n_items, W)
        pg, l0, l1, l2, l3, l4, l5, l6, l7 = _vi_fetch9(a0, a1, a2, a3, a4, a5, a6, a7, ao, pgrow, lrow, blk, col_ok,
                                                        BLK, P, W)
        n0, n1, n2, n3, n4, n5, n6, n7, no = _vi_ents(obase, 32, q, own, n_items, W)
        sp = _vi_pack(a0, a1, a2, a3, a4, a5, a6, a7, W)
        if VPF == 2:  # step 0's rows, step 1's page, step 2's own entry
            ro, so = _v_row(ao, pg, bc, W, P, NB8, VG)
            (w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, t0, t1, t2, t3) = _vi_rows4(
                vb_ptr, ro, so, zero, PLANE, TWO, NB8, VG)
            pg1, _ = _v_fetch(no, pgrow, lrow, blk, col_ok, BLK, P, W)
            ao1 = no
            ao2 = _v_kv(obase, 64 + own, n_items, W)
        for k in range(0, tl.cdiv(n_items, 32)):
            fn = _v_first(obase, 32 * k + 32, n_items, W)
            if VPF == 2:  # the next step's rows (its page arrived during the last step)
                ro1, so1 = _v_row(ao1, pg1, bc, W, P, NB8, VG)
                (wn0, wn1, wn2, wn3, un0, un1, un2, un3, vn0, vn1, vn2, vn3, tn0, tn1, tn2,
                 tn3) = _vi_rows4(vb_ptr, ro1, so1, zero, PLANE, TWO, NB8, VG)
            else:
                ro, so = _v_row(ao, pg, bc, W, P, NB8, VG)
                # planes 0..3's rows (predicated off at or below the own entry's depth)
                (w0, w1, w2, w3, u0, u1, u2, u3, v0, v1, v2, v3, t0, t1, t2, t3) = _vi_rows4(
                    vb_ptr, ro, so, zero, PLANE, TWO, NB8, VG)
            s0, s1, s2, s3 = sp & 15, (sp >> 4) & 15, (sp >> 8) & 15, (sp >> 12) & 15
            s4, s5, s6, s7 = (sp >> 16) & 15, (sp >> 20) & 15, (sp >> 24) & 15, (sp >> 28) & 15
            p0, p1, p2, p3 = tl.exp(l0 - m_t) * kw, tl.exp(l1 - m_t) * kw, tl.exp(l2 - m_t) * kw, tl.exp(l3 - m_t) * kw
            p4, p5, p6, p7 = tl.exp(l4 - m_t) * kw, tl.exp(l5 - m_t) * kw, tl.exp(l6 - m_t) * kw, tl.exp(l7 - m_t) * kw
            if VPF == 2:  # the next step's logits, the page of the one after it, entries further on
                pg1, l0, l1, l2, l3, l4, l5, l6, l7 = _vi_fetch9(n0, n1, n2, n3, n4, n5, n6, n7, ao2, pgrow, lrow,
                                                                 blk, col_ok, BLK, P, W)
                sp = _vi_pack(n0, n1, n2, n3, n4, n5, n6, n7, W)
                ao1 = ao2
                n0, n1, n2, n3, n4, n5, n6, n7 = _vi_kvs(obase, 32 * k + 64, q, n_items, W)
                ao2 = _v_kv(obase, 32 * k + 96 + own, n_items, W)
            else:
                # the next step's pages and logits (its entries arrived during this one), the entries after it
                pg, l0, l1, l2, l3, l4, l5, l6, l7 = _vi_fetch9(n0, n1, n2, n3, n4, n5, n6, n7, no, pgrow, lrow,
                                                                blk, col_ok, BLK, P, W)
                sp = _vi_pack(n0, n1, n2, n3, n4, n5, n6, n7, W)
                ao = no
                n0, n1, n2, n3, n4, n5, n6, n7, no = _vi_ents(obase, 32 * k + 64, q, own, n_items, W)
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
            if VPF == 2:
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
            # planes unrolled: their offsets are immediates (KERNEL_NOTES run 70: B=32 T=32768 R=2 254 -> 198 us)
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


def value_scale(tree: UniformLinearTree) -> float:
    """The bit-product Value stage's B scale: the largest power of two that keeps p w_tj (p <= 1)
    below 2^15 in fp16."""
    _, wt = linear_tables(tree)
    return float(2.0 ** math.floor(math.log2(32768.0 / float(wt.abs().max()))))


@triton.jit
def _lin_prep(kdep_ptr, wf_ptr, base_ptr, lina_ptr, linw_ptr, off_ptr, vf_ptr, nst_ptr, base2_ptr, SMAX,
              HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
              P: tl.constexpr):
    """Program b*Hkv + h: the operands of :func:`_key_stage_mma` for this step (as
    :func:`mma_operands`). Pairs (c, j < t_c) plane-major; list entry e = 16 s + 8 v + 4 h + q goes to
    register r = h + 2 v of lane q in step s: its byte offset (j D + c) P/8 at off[s, r, q], and 2^7 V
    (fp16 hi in column 2g, lo in 2g + 1) at the fp16 index ((((s * 2 + v) * 8 + column) * 4 + q) * 2
    + h of vf. The last step's unused entries get offset 0 and V 0 (columns >= 2G stay 0 from the
    plan). base' = base + sum_c wf_c a_{t_c}."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    NB: tl.constexpr = P // 8
    cc = tl.arange(0, D)
    dep = tl.load(kdep_ptr + pid * D + cc)
    a_dep = tl.load(lina_ptr + dep)
    offs = off_ptr + pid * SMAX * 16
    vfs = vf_ptr + pid * SMAX * 128  # fp16 elements: 2 words x 8 columns x 4 lanes x 2 halves per step
    run = tl.sum(dep * 0, 0)
    for j in tl.static_range(W):
        act = dep > j
        pos = run + tl.cumsum(act.to(tl.int32), 0) - 1
        run += tl.sum(act.to(tl.int32), 0)
        st = pos // 16
        wi = pos % 16
        v = wi // 8
        hh = (wi // 4) % 2
        q = wi % 4
        tl.store(offs + st * 16 + (2 * v + hh) * 4 + q, (j * D + cc) * NB, mask=act)
        wj = tl.load(linw_ptr + dep * W + j, mask=act, other=0.0)
        vbase = vfs + (st * 2 + v) * 64 + q * 2 + hh
        for g in tl.static_range(G):
            val = tl.load(wf_ptr + (pid * D + cc) * G + g) * wj * _BIT_SCALE
            hi = val.to(tl.float16)
            lo = (val - hi.to(tl.float32)).to(tl.float16)
            tl.store(vbase + (2 * g) * 8, hi, mask=act)
            tl.store(vbase + (2 * g + 1) * 8, lo, mask=act)
    n_steps = (run + 15) // 16
    pp = run + tl.arange(0, 16)
    pad = pp < n_steps * 16
    pst, pwi = pp // 16, pp % 16
    tl.store(offs + pst * 16 + (2 * (pwi // 8) + (pwi // 4) % 2) * 4 + pwi % 4, pp * 0, mask=pad)
    pvb = vfs + (pst * 2 + pwi // 8) * 64 + (pwi % 4) * 2 + (pwi // 4) % 2
    for col in tl.static_range(2 * G):
        tl.store(pvb + col * 8, tl.zeros([16], tl.float16), mask=pad)
    tl.store(nst_ptr + pid, n_steps)
    for g in tl.static_range(G):
        wfg = tl.load(wf_ptr + (pid * D + cc) * G + g)
        tl.store(base2_ptr + b * HQ + h * G + g, tl.load(base_ptr + b * HQ + h * G + g) + tl.sum(wfg * a_dep, 0))


def linear_tables(tree: UniformLinearTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [W + 1], w [W + 1, W]) of a linear codebook, float32: level = a_t + sum_j w[t, j] b_j."""
    w = tree.depth
    a = torch.tensor([tree.linear_weights(t)[0] for t in range(w + 1)], dtype=torch.float32)
    wt = torch.zeros(w + 1, w, dtype=torch.float32)
    for t in range(1, w + 1):
        wt[t, :t] = torch.tensor(tree.linear_weights(t)[1], dtype=torch.float32)
    return a, wt


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


def mma_operands(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, ...]:
    """The operands of :func:`_key_stage_mma`: per head its pairs plane-major (:func:`_pair_list`) in
    steps of 16 laid out in fragment order: (byte offsets [B*Hkv, S, 4 registers r, 4 lanes q] int32,
    V [B*Hkv, S, 2 words, 8 columns, 4 lanes q] int32 words of fp16 pairs, the number of steps
    [B*Hkv], base' [B, Hq]). Lane q's registers r = 0..3 take list entries 16 s + 8 v + 4 h + q ((h, v) = (0, 0),
    (1, 0), (0, 1), (1, 1)): the A fragment's columns 2q, 2q+1, 2q+8, 2q+9. Column 2n of V is query
    head n's 2^7 V hi, column 2n + 1 its lo half (G <= 4)."""
    bsz, hk, _ = kdep.shape
    g = wf.shape[-1]
    live, vjc, rows, pos, offl, cnt, n_steps, base2 = _pair_list(tree, kdep, wf, base, page_size, 16)
    bh = bsz * hk
    vl = torch.zeros(bh, n_steps * 16, 8, dtype=torch.float32, device=kdep.device)
    vv = vjc[live] * BIT_SCALE  # [n_live, G]
    if float(vv.abs().max()) > 60000.0:
        raise ValueError("2^7 V exceeds the fp16 range; the probe has no other scaling")
    hi = vv.half()
    lo = (vv - hi.float()).half()
    vl[rows, pos, 0: 2 * g: 2] = hi.float()
    vl[rows, pos, 1: 2 * g: 2] = lo.float()
    # fragment order: entry 16 s + 8 v + 4 h + q -> [s, q, r] with r = h + 2 v
    offf = offl.view(bh, n_steps, 2, 2, 4).reshape(bh, n_steps, 4, 4).contiguous()  # [s, r = h + 2 v, q]
    vf = vl.half().view(bh, n_steps, 2, 2, 4, 8).permute(0, 1, 2, 5, 4, 3)  # [s, v, column, q, h]
    vf = vf.contiguous().view(torch.int32).squeeze(-1)  # [bh, S, 2 (b0 = r0 r1, b1 = r2 r3), 8, 4]
    steps = ((cnt + 15) // 16).int()
    return offf, vf, steps, base2.reshape(bsz, hk * g).contiguous()


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


def key_stage_mma(k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                  ops: tuple[torch.Tensor, ...], logits: torch.Tensor, mstat: torch.Tensor, sstat: torch.Tensor,
                  scale: float, n_q_heads: int, num_warps: int = 4, prefetch: int = 0) -> None:
    """Launch :func:`_key_stage_mma` over :func:`mma_operands` (stats [B, Hq, splits], splits = pages /
    num_warps)."""
    offf, vf, steps, base2 = ops
    bsz, hk, slots = page_table.shape
    _, w, d, nb = k_pool.shape
    _key_stage_mma[(bsz * hk, mstat.shape[2])](k_pool, page_table, lengths, offf, vf, steps, base2, logits, mstat,
                                               sstat, scale, slots, logits.shape[2], offf.shape[1], HQ=n_q_heads,
                                               HKV=hk, G=n_q_heads // hk, D=d, W=w, P=nb * 8, NWARP=num_warps,
                                               PREFETCH=prefetch, num_warps=num_warps)


__all__ = ["BIT_SCALE", "IMMA_BASE", "imma_operands", "key_stage_mma", "linear_fold", "linear_tables", "mma_operands",
           "value_scale"]
