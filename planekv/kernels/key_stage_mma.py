"""The Key stage on fp16 tensor cores (the path for more than 8 query heads per KV head, where the FMA stage's
per-head accumulators do not fit).

Program (b*Hkv + h, split) decodes the codes of a tile of PPK pages x D channels by word-level bit
transposition (one byte load per 8 tokens and plane), looks each code's value up as fp16 hi / lo halves and
takes the logits as three fp16 MMAs (hi*hi + hi*lo + lo*hi, float32-accurate) for the whole query group.
The tile is PPK P / 8 rows: 16, 32 or 64 (the MMA's minimum, the registers' limit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _hi_lo, _load_scalar, _transpose8
from .plan import Step


@triton.jit
def _key_stage_t8(kb_ptr, pt_ptr, len_ptr, kdep_ptr, whi_ptr, wlo_ptr, base_ptr, tabr_ptr, logit_ptr,
                  mstat_ptr, sstat_ptr, scale, SLOTS, TMAX,
                  HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, PPK: tl.constexpr):
    """The Key stage with word-level bit transposition. Program (b*Hkv + h, split) covers PPK pages
    as one tile of M = PPK*P/8 rows (one row per page and byte of a plane row, i.e. 8 tokens) by D
    channels: each plane below a channel's depth is one byte load per 8 tokens, OR-ed into byte j of
    an int64; one 8x8 bit transpose per int64 then yields the 8 tokens' codes (plane j at bit j, so
    the table ``tabr`` is indexed by the bit-reversed code). For each k < 8 the codes of tokens
    8*row + k go through the table and three fp16 MMAs (hi*hi + hi*lo + lo*hi) into logits."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = _load_scalar(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    NB: tl.constexpr = P // 8
    M: tl.constexpr = PPK * NB
    NCODE: tl.constexpr = 1 << W
    NSPLIT = tl.num_programs(1)
    cc = tl.arange(0, D)
    gg = tl.arange(0, G_PAD)
    mm = tl.arange(0, M)
    gvalid = gg < G
    pg = split * PPK + mm // NB  # page slot of each row
    byte = mm % NB
    pvalid = pg < n_pages
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg, mask=pvalid, other=0).to(tl.int64)  # [M]
    tdep = tl.load(kdep_ptr + pid_bh * D + cc)  # [D]
    t_max = tl.max(tdep, 0)
    wrow = (b * HQ + h * G + gg[None, :]) * D + cc[:, None]  # [D, G_PAD]
    w_hi = tl.load(whi_ptr + wrow, mask=gvalid[None, :], other=0.0)
    w_lo = tl.load(wlo_ptr + wrow, mask=gvalid[None, :], other=0.0)
    base = tl.load(base_ptr + b * HQ + h * G + gg, mask=gvalid, other=0.0)
    x = tl.zeros([M, D], dtype=tl.int64)
    for j in tl.static_range(W):
        if j < t_max:  # uniform branch: planes no channel of this head reads cost nothing
            addr = kb_ptr + ((page[:, None] * W + j) * D + cc[None, :]) * NB + byte[:, None]
            bj = tl.load(addr, mask=pvalid[:, None] & (tdep[None, :] > j), other=0)  # [M, D] uint8
            x = x | (bj.to(tl.int64) << (8 * j))
    x = _transpose8(x)
    tbase = tdep[None, :] * NCODE
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    for k in range(8):  # a loop, not unrolled: eight unrolled slices exhaust the registers
        code = ((x >> (8 * k)) & 0xFF).to(tl.int32)
        z_hi, z_lo = _hi_lo(tl.load(tabr_ptr + tbase + code))  # [M, D]
        lg = tl.dot(z_hi, w_hi)
        lg = tl.dot(z_hi, w_lo, lg)
        lg = tl.dot(z_lo, w_hi, lg)  # [M, G_PAD]
        lg = tl.trans(lg)  # [G_PAD, M]
        pos = pg * P + byte * 8 + k  # [M]
        lg = (lg + base[:, None]) * scale
        lg = tl.where(pos[None, :] < T, lg, float("-inf"))
        tl.store(logit_ptr + (b * HQ + h * G + gg[:, None]) * TMAX + pos[None, :], lg,
                 mask=gvalid[:, None] & (pos[None, :] < T))
        m_new = tl.maximum(m_run, tl.max(lg, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_run = s_run * tl.exp(m_run - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), 1)
        m_run = m_new
    sidx = (b * HQ + h * G + gg) * NSPLIT + split
    tl.store(mstat_ptr + sidx, m_run, mask=gvalid)
    tl.store(sstat_ptr + sidx, s_run, mask=gvalid)


def launch(st: Step, k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor) -> None:
    """Grid (B*Hkv, n_splits): logits [B, Hq, T] and each split's softmax maximum and sum."""
    k, pl, c, ch = st.k, st.plan, st.c, st.ch
    _key_stage_t8[(pl.batch * k.hk, pl.n_splits)](
        k_pool, page_table, lengths, pl.kdep, pl.w_hi, pl.w_lo, pl.base, c["tabr"], pl.logits, pl.mstat, pl.sstat,
        st.scale, st.slots, pl.max_tokens, HQ=k.hq, HKV=k.hk, G=k.g, G_PAD=st.gpad, D=k.d, W=k.w, P=k.p,
        PPK=ch.pages_per_program, num_warps=st.num_warps)
