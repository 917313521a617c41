"""Probes: the Key stage as a matrix product of plane bits, for codebooks linear in the planes.

    PYTHONPATH=. python benchmarks/tools/linear_key_probe.py            # sm_90a SASS, no GPU needed
    PYTHONPATH=. python benchmarks/tools/linear_key_probe.py --gpu --shapes b32-t32k ... --json out.json

With a linear codebook (``planekv.kvstore.UniformLinearTree``) the depth-t value of a code is
``a_t + sum_{j<t} w_tj b_j``, so a query head's logit over a token is

    base_g + sum_c wf_cg (a_{t_c} + sum_{j<t_c} w_{t_c j} b_cj) = base'_g + sum_{(c,j)} V_{(c,j) g} b_cj

with ``wf = q~ sigma_K`` (what ``_prep`` writes), ``base' = base + sum_c wf_c a_{t_c}`` and
``V_{(c,j) g} = wf_cg w_{t_c j}``: one product of the bits [tokens x pairs] with V [pairs x G] per
(sequence, KV head), the pairs (c, j) being the planes the channel depths read. The bits are an
fp16 MMA operand (2^-7 per set bit, so V is scaled by 2^7) and V is split into fp16 hi + lo, both
products accumulated in float32: float32-accurate logits.

Two kernels: ``_key_stage_lin`` with ``tl.dot`` (Triton moves the bit tile through shared memory:
6-8 instructions per bit) and ``_key_stage_mma``, which builds mma.sync fragments in registers with
inline PTX (GPU only; ~2.2 per bit; the FMA Key stage's bodies take ~3.3 per bit at 3.5 bits per
channel). Both are checked against the FMA Key stage (tests/kernels/test_linear.py: the first in
Triton's interpreter, the second's operand layout in a torch emulation; on the GPU, ``--gpu`` compares
the second's logits and statistics with the FMA stage's at full size and times both, SDPA beside).
docs/KERNEL_NOTES.md runs 45-46. The reader does not use them yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from planekv.kvstore import UniformLinearTree

KCH = 16  # pairs per MMA step (the K of one tl.dot)
_KCH = tl.constexpr(KCH)
BIT_SCALE = 128.0  # a set bit is fp16 0x2000 = 2^-7; V carries the 2^7


@triton.jit
def _key_stage_lin(kb_ptr, pt_ptr, len_ptr, plist_ptr, pcnt_ptr, vhi_ptr, vlo_ptr, base_ptr, logit_ptr, mstat_ptr,
                   sstat_ptr, scale, SLOTS, TMAX, KMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, PPK: tl.constexpr):
    """Program (b*Hkv + h, split): N = PPK*P tokens (rows) of one (sequence, KV head). Per step of
    KCH pairs (c, j) from the head's list: one plane byte per 8 rows and pair, each row's bit as fp16
    2^-7 or 0 ([N / 8, 8, KCH] reshaped to [N, KCH]), and acc += bits @ V (hi, then lo). Epilogue as
    the FMA Key stage: logits (scaled, -inf past the sequence) and this split's softmax max and sum
    per query head."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = tl.load(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    NB: tl.constexpr = P // 8
    N: tl.constexpr = PPK * P
    NSPLIT = tl.num_programs(1)
    mm = tl.arange(0, N)
    tok = split * N + mm
    # one byte load per 8 rows: rows 8r..8r+7 are the bits of byte r of the program's plane rows
    rr = tl.arange(0, N // 8)
    pg8 = split * PPK + rr // NB
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg8, mask=pg8 < n_pages, other=0).to(tl.int64)
    rbase = page * (W * D * NB) + rr % NB  # [N / 8]: plane 0, channel 0, the byte
    sh = 13 - tl.arange(0, 8)  # bit k of the byte -> bit 13 (fp16 2^-7)
    kk = tl.arange(0, _KCH)
    gg = tl.arange(0, 16)
    acc = tl.zeros([N, 16], dtype=tl.float32)
    n_pairs = tl.load(pcnt_ptr + pid_bh)
    for k0 in range(0, n_pairs, _KCH):
        ent = tl.load(plist_ptr + pid_bh * KMAX + k0 + kk)  # j << 8 | c
        off = (ent >> 8) * (D * NB) + (ent & 0xFF) * NB  # [KCH]
        byt = tl.load(kb_ptr + rbase[:, None] + off[None, :]).to(tl.int32)  # [N / 8, KCH]
        bits = (byt[:, None, :] << sh[None, :, None]) & 0x2000  # [N / 8, 8, KCH]
        bits = tl.reshape(bits, (N, _KCH)).to(tl.int16).to(tl.float16, bitcast=True)
        vrow = (pid_bh * KMAX + k0 + kk)[:, None] * 16 + gg[None, :]
        acc = tl.dot(bits, tl.load(vhi_ptr + vrow), acc)
        acc = tl.dot(bits, tl.load(vlo_ptr + vrow), acc)
    q0 = b * HQ + h * G
    base = tl.load(base_ptr + q0 + gg, mask=gg < G, other=0.0)
    lg = (acc + base[None, :]) * scale  # [N, 16]
    ok = (tok < T)[:, None] & (gg < G)[None, :]
    lg = tl.where(ok, lg, float("-inf"))
    tl.store(logit_ptr + (q0 + gg[None, :]) * TMAX + tok[:, None], lg, mask=ok)
    m = tl.max(lg, 0)  # [16]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(lg - m_safe[None, :]), 0)
    sidx = (q0 + gg) * NSPLIT + split
    tl.store(mstat_ptr + sidx, m, mask=gg < G)
    tl.store(sstat_ptr + sidx, s, mask=gg < G)


def _mma_asm(n_tiles: int) -> str:
    """PTX for one K step of a warp's n_tiles M-tiles: $0..$(4n-1) the new accumulators, then inputs
    z01, z23 (two pairs' plane bytes as 16-bit halves), b0, b1 (V^T words), the old accumulators.
    Tile i's A fragment: rows g / g+8 are bits 2i / 2i+1 of the bytes, as fp16 2^-7 (0x2000). All
    fragments first, then the tiles' MMAs back to back (independent accumulators)."""
    n = 4 * n_tiles
    z01, z23, b0, b1 = (f"${n + k}" for k in range(4))
    lines = ["{", f".reg .b32 a<{n}>;"]
    for i in range(n_tiles):
        for r, (z, sh) in enumerate(((z01, 13 - 2 * i), (z01, 12 - 2 * i), (z23, 13 - 2 * i), (z23, 12 - 2 * i))):
            lines.append(f"shl.b32 a{4 * i + r}, {z}, {sh};")
            lines.append(f"and.b32 a{4 * i + r}, a{4 * i + r}, 0x20002000;")
    for i in range(n_tiles):
        d = ", ".join(f"${4 * i + r}" for r in range(4))
        c = ", ".join(f"${n + 4 + 4 * i + r}" for r in range(4))
        a = ", ".join(f"a{4 * i + r}" for r in range(4))
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{d}}}, {{{a}}}, {{{b0}, {b1}}}, {{{c}}};")
    lines.append("}")
    return "\n".join(lines)


MMA_TILES = 4  # M-tiles of 16 rows per warp: 64 tokens, one 64-token page
_MMA_ASM = tl.constexpr(_mma_asm(MMA_TILES))
_MMA_CONS = tl.constexpr(",".join(["=f"] * (4 * MMA_TILES) + ["r"] * 4 + ["f"] * (4 * MMA_TILES)))


@triton.jit
def _mma_step(z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15):
    return tl.inline_asm_elementwise(
        _MMA_ASM, _MMA_CONS, [z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15],
        dtype=(tl.float32,) * 16, is_pure=True, pack=1)


@triton.jit
def _mma_logit(hi, lo, k: tl.constexpr, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G: tl.constexpr):
    """Query head q's logit of token 8g + k (a thread's two accumulator columns: the V hi and lo
    products); stored, and returned (-inf where it is no logit) for the split's statistics."""
    tok = tok8 + k
    ok = (tok < T) & (q < G)
    lg = (hi + lo + tl.load(base_ptr + q0 + q, mask=q < G, other=0.0)) * scale  # bits 2^-7 x V 2^7
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
def _key_stage_mma(kb_ptr, pt_ptr, len_ptr, off_ptr, vf_ptr, nst_ptr, base_ptr, logit_ptr, mstat_ptr, sstat_ptr,
                   scale, SLOTS, TMAX, SMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   W: tl.constexpr, P: tl.constexpr, NWARP: tl.constexpr, PREFETCH: tl.constexpr = 0):
    """The bit product with mma.sync fragments built in registers (GPU only: inline PTX). Program
    (b*Hkv + h, split) of NWARP pages of 64 tokens, one page per warp, one tensor element per thread
    (lane 4g + q). Per K step of 16 pairs (:func:`mma_operands`' fragment order) a thread loads byte g
    of its four pairs (tokens 8g..8g+7 of its page; lanes q = 0..3 read neighbouring channels of one
    plane) and its two V words, then :func:`_mma_asm`: M-tile i's rows g / g+8 are tokens 8g + 2i /
    8g + 2i + 1, and a thread's two columns are query head q's hi and lo products, so its 8 logits need
    no other lane."""
    tl.static_assert(P == 64, "one 64-token page per warp")
    tl.static_assert(G <= 4, "hi and lo halves of up to 4 query heads in the 8 MMA columns")
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = tl.load(len_ptr + b)
    NSPLIT = tl.num_programs(1)
    t = tl.arange(0, 32 * NWARP)
    w = t // 32
    g = (t % 32) // 4
    q = t % 4
    pg = split * NWARP + w
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg, mask=pg < tl.cdiv(T, P), other=0).to(tl.int64)
    pb = kb_ptr + page * (W * D * 8) + g  # plane 0, channel 0, byte g of the warp's page
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
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
            z01, z23, b0, b1 = z01n, z23n, b0n, b1n
            o0, o1, o2, o3 = p0, p1, p2, p3
    elif PREFETCH == 1:  # the next step's bytes and V words requested before this step's MMAs
        z01, z23, b0, b1 = _mma_operands(pb, op, vp, 0)
        for s in range(0, n_steps):
            z01n, z23n, b0n, b1n = _mma_operands(pb, op, vp, tl.minimum(s + 1, n_steps - 1))
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
            z01, z23, b0, b1 = z01n, z23n, b0n, b1n
    else:
        for s in range(0, n_steps):
            z01, z23, b0, b1 = _mma_operands(pb, op, vp, s)
            c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15 = _mma_step(
                z01, z23, b0, b1, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15)
    q0 = b * HQ + h * G
    tok8 = split * (NWARP * P) + w * P + 8 * g  # token 8g of the warp's page
    # M-tile i: c(4i), c(4i+1) are row g (token 8g + 2i), c(4i+2), c(4i+3) row g + 8 (token 8g + 2i + 1);
    # columns 2q / 2q + 1 are query head q's V hi / lo products
    l0 = _mma_logit(c0, c1, 0, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l1 = _mma_logit(c2, c3, 1, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l2 = _mma_logit(c4, c5, 2, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l3 = _mma_logit(c6, c7, 3, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l4 = _mma_logit(c8, c9, 4, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l5 = _mma_logit(c10, c11, 5, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l6 = _mma_logit(c12, c13, 6, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    l7 = _mma_logit(c14, c15, 7, tok8, q, base_ptr, logit_ptr, q0, T, TMAX, scale, G)
    mt = tl.maximum(tl.maximum(tl.maximum(l0, l1), tl.maximum(l2, l3)), tl.maximum(tl.maximum(l4, l5),
                                                                                  tl.maximum(l6, l7)))
    msel = tl.zeros([32 * NWARP], tl.float32)
    for n in tl.static_range(G):
        m = tl.max(tl.where(q == n, mt, float("-inf")), 0)
        tl.store(mstat_ptr + (q0 + n) * NSPLIT + split, m)
        msel = tl.where(q == n, tl.where(m == float("-inf"), 0.0, m), msel)
    e = (tl.exp(l0 - msel) + tl.exp(l1 - msel) + tl.exp(l2 - msel) + tl.exp(l3 - msel) + tl.exp(l4 - msel)
         + tl.exp(l5 - msel) + tl.exp(l6 - msel) + tl.exp(l7 - msel))
    for n in tl.static_range(G):
        tl.store(sstat_ptr + (q0 + n) * NSPLIT + split, tl.sum(tl.where(q == n, e, 0.0), 0))


def linear_operands(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's operands from the channel depths ``kdep`` [B, Hkv, D], the weights ``wf`` [B, Hkv,
    D, G] and ``base`` [B, Hq] of one step: (pair lists [B*Hkv, KMAX] int32 (j << 8 | c, channel
    order, padded with zero-weight copies of pair 0 to a multiple of KCH), their lengths [B*Hkv],
    V hi and lo [B*Hkv, KMAX, 16] fp16 (2^7 V), base' [B, Hq] f32)."""
    if not isinstance(tree, UniformLinearTree):
        raise TypeError(f"the bit-product Key stage needs a codebook linear in the planes, got {tree!r}")
    bsz, hk, d = kdep.shape
    g = wf.shape[-1]
    w = tree.depth
    dev = kdep.device
    a = torch.tensor([tree.linear_weights(t)[0] for t in range(w + 1)], dtype=torch.float32, device=dev)
    wt = torch.zeros(w + 1, w, dtype=torch.float32, device=dev)
    for t in range(1, w + 1):
        wt[t, :t] = torch.tensor(tree.linear_weights(t)[1], dtype=torch.float32)
    dep = kdep.long()
    base2 = base.view(bsz, hk, g) + (wf * a[dep][..., None]).sum(2)  # [B, Hkv, G]
    jj = torch.arange(w, device=dev)
    live = (jj[None, None, None, :] < dep[..., None]).reshape(bsz * hk, d * w)  # pairs (c, j), c-major
    v = (wf[..., None, :] * wt[dep][..., None]).reshape(bsz * hk, d * w, g)  # [BH, D*W, G]
    ent = ((jj[None, :] << 8) | torch.arange(d, device=dev)[:, None]).reshape(d * w).int()  # [D*W]
    cnt = live.sum(1)
    kmax = max(KCH, -(-int(cnt.max()) // KCH) * KCH)
    pos = torch.cumsum(live.int(), 1) - 1
    plist = torch.full((bsz * hk, kmax), int(ent[0]), dtype=torch.int32, device=dev)
    vf = torch.zeros(bsz * hk, kmax, 16, dtype=torch.float32, device=dev)
    rows = torch.arange(bsz * hk, device=dev)[:, None].expand(-1, d * w)
    plist[rows[live], pos[live]] = ent[None, :].expand(bsz * hk, -1)[live]
    vf[rows[live], pos[live], :g] = v[live] * BIT_SCALE
    if float(vf.abs().max()) > 60000.0:
        raise ValueError("2^7 V exceeds the fp16 range; the prototype has no other scaling")
    vhi = vf.half()
    vlo = (vf - vhi.float()).half()
    pcnt = ((cnt + KCH - 1) // KCH * KCH).int()
    return plist, pcnt, vhi.contiguous(), vlo.contiguous(), base2.reshape(bsz, hk * g).contiguous()


def key_stage_linear(k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                     ops: tuple[torch.Tensor, ...], logits: torch.Tensor, mstat: torch.Tensor, sstat: torch.Tensor,
                     scale: float, n_q_heads: int, pages_per_program: int, num_warps: int = 4) -> None:
    """Launch the prototype over the operands of :func:`linear_operands` (page_table [B, Hkv, slots],
    logits [B, Hq, TMAX], stats [B, Hq, splits])."""
    plist, pcnt, vhi, vlo, base2 = ops
    bsz, hk, slots = page_table.shape
    _, w, d, nb = k_pool.shape
    p = nb * 8
    nsplit = mstat.shape[2]
    _key_stage_lin[(bsz * hk, nsplit)](k_pool, page_table, lengths, plist, pcnt, vhi, vlo, base2, logits, mstat,
                                       sstat, scale, slots, logits.shape[2], plist.shape[1], HQ=n_q_heads, HKV=hk,
                                       G=n_q_heads // hk, D=d, W=w, P=p, PPK=pages_per_program,
                                       num_warps=num_warps)


def mma_operands(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, ...]:
    """The operands of :func:`_key_stage_mma`: per head its pairs (c, j < t_c) plane-major (so that
    neighbouring list entries are neighbouring channels of one plane, whose bytes share a sector),
    in steps of 16 laid out in fragment order: (byte offsets [B*Hkv, S, 4 registers r, 4 lanes q] int32,
    V [B*Hkv, S, 2 words, 8 columns, 4 lanes q] int32 words of fp16 pairs, the number of steps
    [B*Hkv], base' [B, Hq]). Lane q's registers r = 0..3 take list entries 16 s + 8 v + 4 h + q ((h, v) = (0, 0),
    (1, 0), (0, 1), (1, 1)): the A fragment's columns 2q, 2q+1, 2q+8, 2q+9. Column 2n of V is query
    head n's 2^7 V hi, column 2n + 1 its lo half (G <= 4)."""
    if not isinstance(tree, UniformLinearTree):
        raise TypeError(f"the bit-product Key stage needs a codebook linear in the planes, got {tree!r}")
    bsz, hk, d = kdep.shape
    g = wf.shape[-1]
    if g > 4:
        raise ValueError("the mma probe takes at most 4 query heads per KV head")
    w, nb, dev = tree.depth, page_size // 8, kdep.device
    a = torch.tensor([tree.linear_weights(t)[0] for t in range(w + 1)], dtype=torch.float32, device=dev)
    wt = torch.zeros(w + 1, w, dtype=torch.float32, device=dev)
    for t in range(1, w + 1):
        wt[t, :t] = torch.tensor(tree.linear_weights(t)[1], dtype=torch.float32)
    dep = kdep.long()
    base2 = (base.view(bsz, hk, g) + (wf * a[dep][..., None]).sum(2)).reshape(bsz, hk * g).contiguous()
    bh = bsz * hk
    jj = torch.arange(w, device=dev)
    live = (jj[None, :, None] < dep.reshape(bh, 1, d)).reshape(bh, w * d)  # plane-major (j, c)
    vjc = (wf.reshape(bh, 1, d, g) * wt[dep.reshape(bh, d)].transpose(1, 2)[..., None]).reshape(bh, w * d, g)
    off = ((jj[:, None] * d + torch.arange(d, device=dev)[None, :]) * nb).reshape(w * d).int()
    cnt = live.sum(1)
    n_steps = max(1, -(-int(cnt.max()) // 16))
    pos = torch.cumsum(live.int(), 1) - 1
    rows = torch.arange(bh, device=dev)[:, None].expand(-1, w * d)
    offl = torch.zeros(bh, n_steps * 16, dtype=torch.int32, device=dev)
    vl = torch.zeros(bh, n_steps * 16, 8, dtype=torch.float32, device=dev)
    offl[rows[live], pos[live]] = off[None, :].expand(bh, -1)[live]
    vv = vjc[live] * BIT_SCALE  # [n_live, G]
    if float(vv.abs().max()) > 60000.0:
        raise ValueError("2^7 V exceeds the fp16 range; the probe has no other scaling")
    hi = vv.half()
    lo = (vv - hi.float()).half()
    vl[rows[live], pos[live], 0: 2 * g: 2] = hi.float()
    vl[rows[live], pos[live], 1: 2 * g: 2] = lo.float()
    # fragment order: entry 16 s + 8 v + 4 h + q -> [s, q, r] with r = h + 2 v
    offf = offl.view(bh, n_steps, 2, 2, 4).reshape(bh, n_steps, 4, 4).contiguous()  # [s, r = h + 2 v, q]
    vf = vl.half().view(bh, n_steps, 2, 2, 4, 8).permute(0, 1, 2, 5, 4, 3)  # [s, v, column, q, h]
    vf = vf.contiguous().view(torch.int32).squeeze(-1)  # [bh, S, 2 (b0 = r0 r1, b1 = r2 r3), 8, 4]
    steps = ((cnt + 15) // 16).int()
    return offf, vf, steps, base2


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


def _probe_rate(data, shape, rate: float, share: float, reps: int) -> dict:  # noqa: ANN001
    """One shape and rate (see :func:`gpu_main`)."""
    import math

    from planekv.kernels import TritonReader
    from planekv.kernels.bench import _time_graphs
    from planekv.kernels.decode import _key_stage_f
    from planekv.kvstore import ReadPolicy

    dev = data.q.device
    b, t, hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    w, p = data.spec.width, data.spec.page_size
    reader = TritonReader(data.codec, ReadPolicy.flexible(rate, share))
    plan = reader.plan(b, t, dev)
    scale = 1.0 / math.sqrt(d)
    kp, vp = data.cache.k_pool[0], data.cache.v_pool[0]
    reader.run(plan, data.q.float(), kp, vp, data.page_table, data.lengths, 0, scale)
    torch.cuda.synchronize()
    ref_lg = plan.logits.clone()
    c = reader._consts[plan.device]
    slots = data.page_table.shape[2]
    fma_warps = max(1, min(reader.num_warps, plan.key_ch * reader._ppk * p // 256))

    def fma() -> None:
        _key_stage_f[(b * hk, plan.n_splits)](kp, data.page_table, data.lengths, plan.kord, plan.kcnt, plan.wf,
                                              plan.base, c["tabf"], plan.logits, plan.mstat, plan.sstat, scale, slots,
                                              t, HQ=hq, HKV=hk, G=hq // hk, D=d, W=w, P=p, PPK=reader._ppk,
                                              KLOOP=plan.key_loop, CH=plan.key_ch, num_warps=fma_warps)

    ops = mma_operands(data.codec.tree, plan.kdep, plan.wf, plan.base.view(b, hq), p)
    res = {"shape": shape.name, "rate": rate, "pairs_per_head": 16 * float(ops[2].float().mean())}
    gm_ref = plan.mstat.max(-1).values
    z_ref = (plan.sstat * torch.exp(plan.mstat - gm_ref[..., None])).sum(-1)
    for nw, pf in ((4, 0), (4, 1), (4, 2), (2, 2), (8, 2)):
        n_spl = math.ceil(t / (nw * p))
        lg = torch.full_like(plan.logits, float("nan"))
        ms, ss = torch.empty(b, hq, n_spl, device=dev), torch.empty(b, hq, n_spl, device=dev)

        def mma(lg=lg, ms=ms, ss=ss, nw=nw, pf=pf) -> None:
            key_stage_mma(kp, data.page_table, data.lengths, ops, lg, ms, ss, scale, hq, num_warps=nw, prefetch=pf)

        mma()
        torch.cuda.synchronize()
        tag = f"mma_w{nw}_pf{pf}"
        res[f"{tag}_logit_err"] = float(((lg - ref_lg).abs() / ref_lg.abs().clamp(min=1.0)).max())
        gm = ms.max(-1).values
        z = (ss * torch.exp(ms - gm[..., None])).sum(-1)
        res[f"{tag}_stat_err"] = float(max((gm - gm_ref).abs().max(), ((z - z_ref) / z_ref).abs().max()))
        res[f"{tag}_ms"], _ = _time_graphs([mma], reps)
    res["fma_ms"], _ = _time_graphs([fma], reps)
    return res


def gpu_main(shapes: list[str], reps: int, out: str | None) -> int:
    """On the GPU: for each shape and rate, the flexible reader's step with the linear codebook, then
    the FMA Key stage (as the reader launches it) and :func:`_key_stage_mma` on its operands: logits
    and global softmax statistics compared, each timed alone (median of CUDA-graph replays), SDPA
    timed in the same run."""
    import json

    from planekv.kernels.bench import SHAPES, _gen, _time_graphs

    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name in shapes:
        shape = SHAPES[name]
        data = _gen(shape, torch.device("cuda"), 0, None, codebook="uniform-linear-c3")
        qs = data.q[:, :, None]
        sdpa_ms, _ = _time_graphs([lambda data=data, qs=qs: sdpa(qs, data.k, data.v, enable_gqa=True)], reps)
        for rate, share in ((2.0, 0.875), (4.0, 0.75)):
            res = {"sdpa_ms": sdpa_ms, **_probe_rate(data, shape, rate, share, reps)}
            print(json.dumps(res), flush=True)
            rows.append(res)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main() -> int:
    import argparse
    import os
    import re
    import runpy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="check and time the mma probe on the GPU")
    ap.add_argument("--shapes", nargs="+", default=["b32-t32k"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.gpu:
        return gpu_main(args.shapes, args.reps, args.json)

    cc = runpy.run_path(os.path.join(os.path.dirname(__file__), "compile_check.py"), run_name="compile_check")
    sig = dict(kb_ptr="*u8", pt_ptr="*i32", len_ptr="*i32", plist_ptr="*i32", pcnt_ptr="*i32", vhi_ptr="*fp16",
               vlo_ptr="*fp16", base_ptr="*fp32", logit_ptr="*fp32", mstat_ptr="*fp32", sstat_ptr="*fp32",
               scale="fp32", SLOTS="i32", TMAX="i32", KMAX="i32")
    geo = dict(HQ=32, HKV=8, G=4, D=128, W=8, P=64)
    runs = [("tl.dot", _key_stage_lin, sig, dict(geo, PPK=ppk), nw, ppk * 64 * KCH // (32 * nw))
            for ppk, nw in ((2, 4), (4, 4), (16, 8))]
    sig_mma = dict(kb_ptr="*u8", pt_ptr="*i32", len_ptr="*i32", off_ptr="*i32", vf_ptr="*i32", nst_ptr="*i32",
                   base_ptr="*fp32", logit_ptr="*fp32", mstat_ptr="*fp32", sstat_ptr="*fp32", scale="fp32",
                   SLOTS="i32", TMAX="i32", SMAX="i32")
    runs += [("mma fragments", _key_stage_mma, sig_mma, dict(geo, NWARP=nw, PREFETCH=pf), nw, 64 * KCH // 32)
             for nw, pf in ((4, 0), (8, 2))]
    with __import__("tempfile").TemporaryDirectory() as sd:
        for i, (name, fn, sg, consts, nw, bits) in enumerate(runs):
            cc["compile_one"](fn, sg, consts, num_warps=nw, sass_dir=sd, tag=f"-{i}")
            sass = open(os.path.join(sd, f"{fn.__name__}-{i}.sass")).read()
            # the K loop: the backward branch's target .. the branch
            back = [(int(a, 16), int(t, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4})\*/\s+@!?P\d BRA 0x([0-9a-f]+)",
                                                                     sass) if int(t, 16) < int(a, 16)]
            end, start = back[0]
            n_instr = (end - start) // 16 + 1
            extra = {k: v for k, v in consts.items() if k in ("PPK", "NWARP", "PREFETCH")}
            print(f"{name} {extra}, {nw} warps: {n_instr} instructions per K step, {bits} bits per thread: "
                  f"{n_instr / bits:.1f} per bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
