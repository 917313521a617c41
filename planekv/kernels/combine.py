"""The last stage of a decode step: the Value stage's per-block partial outputs summed, the V transform's
affine part undone (mu_V + sigma_V x sum) and, with fused transforms, the output rotated back (times M_V).
One program per (sequence, KV head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _rotate_rows
from .plan import Step


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


COMBINE_WARPS = 8  # warps of _combine (8 measured faster than 4 at every geometry)


def launch(st: Step) -> None:
    """Grid (B*Hkv,): ``plan.out`` [B, Hq, d] float32, rotated back inside the kernel with fused transforms,
    else by a GEMM after it."""
    k, pl, c = st.k, st.plan, st.c
    fuse = st.ch.fuse_transforms
    inv = dict(INV=True, mv_ptr=c["mv"], fin_ptr=pl.out) if fuse else {}
    _combine[(pl.batch * k.hk,)](pl.part, c["mu_v"][st.layer], c["sig_v"][st.layer], pl.out_t, pl.n_blocks, HQ=k.hq,
                                 HKV=k.hk, G=k.g, G_PAD=st.gpad, D=k.d, **inv, num_warps=COMBINE_WARPS)
    if not fuse:
        torch.mm(pl.out_t.view(-1, k.d), c["mv"], out=pl.out.view(-1, k.d))
