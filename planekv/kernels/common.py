"""Triton helpers shared by several kernel families (docs/KERNELS.md).

Scalar loads; a program's sequence, KV head and allocation group; the softmax statistics of the Key stage's
splits and the probabilities they give; fp16 hi/lo splits; word-level bit transposes and plane packing; the
offset of a plane in a V page stored in runs of planes; the tf32x3 rotation of query and output rows; the
inline-PTX byte transpose and vector stores of the two int8 stages. A helper used by one family lives beside
that family's kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_scalar(ptr):
    """A scalar load that is 0-d in both the compiler and the interpreter (which returns [1])."""
    return tl.sum(tl.load(ptr + tl.arange(0, 1)), 0)


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


@triton.jit
def _rotate_rows(x_ptr, sx_r, sx_c, m_ptr, y_ptr, n_rows, ROWS: tl.constexpr, D: tl.constexpr):
    """y[r, :] = x[r, :] @ m for the first n_rows of ROWS (>= 16) rows: x at x_ptr with row / column
    strides sx_r / sx_c (any float dtype, taken as float32), m a contiguous float32 [D, D], y contiguous
    float32 rows of D. One program; K in chunks of 32, each a tf32x3 product (three TF32 MMAs: the operands
    split in high and low TF32 parts, the low x low term dropped; float32 sums, ~2^-22 relative; the FMA
    form, input_precision="ieee", measured slower)."""
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
def _pack_planes_split(p_hot, p_cold, STRIDE: tl.constexpr, NPL: tl.constexpr, HOT: tl.constexpr, depth,
                       VG: tl.constexpr = 1, ROW: tl.constexpr = 0):
    """:func:`_pack_planes` (MASKED) of a tiered V page: planes j < HOT at ``p_hot``'s, the refinement planes
    j >= HOT at ``p_cold``'s (plane j - HOT there, the promotion cache's page). ``depth`` never passes what is
    resident (the caller caps it), so a load from ``p_cold`` happens only where that page is promoted."""
    lo = tl.zeros(p_hot.shape, dtype=tl.uint32)
    hi = tl.zeros(p_hot.shape, dtype=tl.uint32)
    for j in tl.static_range(NPL):
        if j < HOT:
            bj = tl.load(p_hot + _vj(j, STRIDE, VG, ROW), mask=depth > j, other=0).to(tl.uint32)
        else:
            bj = tl.load(p_cold + _vj(j - HOT, STRIDE, VG, ROW), mask=depth > j, other=0).to(tl.uint32)
        if j < 4:
            lo = lo | (bj << (8 * j))
        else:
            hi = hi | (bj << (8 * (j - 4)))
    return lo, hi


@triton.jit
def _pack_k_tiered(kb_ptr, rbase, c, kp_ptr, ks_row, vbase, pp_ptr, pbase, STRIDE: tl.constexpr,
                   NPL: tl.constexpr, HOT: tl.constexpr, NCOLD: tl.constexpr, NB: tl.constexpr,
                   MAXSLOTS: tl.constexpr):
    """:func:`_pack_planes` (every load runs) of Key channel ``c`` in a tiered cache: planes j < HOT from the hot
    pool (``kb_ptr + rbase + c * NB``, planes STRIDE apart), planes j >= HOT from the promotion cache's
    channel-plane vectors where the plane is promoted (slot ``ks_row[c * NCOLD + j - HOT]`` >= 0; ``vbase`` = page
    slot x NB + byte within it), else from each row's Key page slot (``pp_ptr`` [slots, NCOLD, D, NB];
    ``pbase`` = Key page slot x NCOLD*D*NB + byte, negative where the page has none). ``_prep`` capped the
    channel's depth at its residency: its promoted planes, or W where every page of the head has a Key page slot,
    so one of the two is there."""
    lo = tl.zeros(rbase.shape, dtype=tl.uint32)
    hi = tl.zeros(rbase.shape, dtype=tl.uint32)
    for j in tl.static_range(NPL):
        if j < HOT:
            bj = tl.load(kb_ptr + rbase + c * NB + j * STRIDE).to(tl.uint32)
        else:
            s = tl.load(ks_row + c * NCOLD + (j - HOT)).to(tl.int64)
            vec = s >= 0
            from_vec = tl.load(kp_ptr + tl.maximum(s, 0) * (MAXSLOTS * NB) + vbase, mask=(vbase >= 0) & vec,
                               other=0)
            from_page = tl.load(pp_ptr + pbase + (j - HOT) * (STRIDE) + c * NB, mask=(pbase >= 0) & ~vec, other=0)
            bj = (from_vec | from_page).to(tl.uint32)
        if j < 4:
            lo = lo | (bj << (8 * j))
        else:
            hi = hi | (bj << (8 * (j - 4)))
    return lo, hi


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


@triton.jit
def _codes(lo, hi, NPL: tl.constexpr):
    """The 8 codes (plane j at bit j) of packed plane words, [M, 8]: the 8x8 bit transpose, or the
    4x8 one when at most 4 planes were packed."""
    if NPL > 4:
        lo, hi = _transpose8_32(lo, hi)
    else:
        lo, hi = _transpose4_32(lo)
    return _bytes8(lo, hi)

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

def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())
