"""FP8 e4m3 decode attention with one scale per KV head (vLLM's production KV option), split-K.

Stage 1, grid (B * Hkv, S): each program reads its token range of one (sequence, KV head) once for
the whole GQA group (tl.dot over the group's queries), keeping an online softmax; it writes the
partial output with its max and sum. Stage 2, grid (B * Hkv,): merges the splits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._dispatch import check_device

FP8_MAX = 448.0
BLOCK_T = 64  # tokens per tile


@triton.jit
def _fp8_stage1(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, m_ptr, s_ptr, acc_ptr, scale, TMAX,
                HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                NSPLIT: tl.constexpr, BT: tl.constexpr):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = tl.sum(tl.load(len_ptr + b + tl.arange(0, 1)), 0)
    n_tiles = tl.cdiv(T, BT)
    per = tl.cdiv(n_tiles, NSPLIT)
    t0 = split * per
    t1 = tl.minimum(t0 + per, n_tiles)
    gg = tl.arange(0, G_PAD)
    cc = tl.arange(0, D)
    tt = tl.arange(0, BT)
    gmask = gg < G
    ksc = tl.sum(tl.load(ks_ptr + h + tl.arange(0, 1)), 0)
    vsc = tl.sum(tl.load(vs_ptr + h + tl.arange(0, 1)), 0)
    q = tl.load(q_ptr + (b * HQ + h * G + gg[:, None]) * D + cc[None, :], mask=gmask[:, None], other=0.0)
    q = (q.to(tl.float32) * (scale * ksc)).to(tl.float16)
    m_run = tl.full([G_PAD], float("-inf"), tl.float32)
    s_run = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    base = pid_bh.to(tl.int64) * TMAX * D
    for ti in range(t0, t1):
        pos = ti * BT + tt
        ok = pos < T
        k = tl.load(k_ptr + base + pos[:, None] * D + cc[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        lg = tl.dot(q, tl.trans(k))  # [G_PAD, BT]
        lg = tl.where(ok[None, :], lg, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(lg, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_run - m_safe)
        pr = tl.exp(lg - m_safe[:, None])
        s_run = s_run * alpha + tl.sum(pr, 1)
        v = tl.load(v_ptr + base + pos[:, None] * D + cc[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(pr.to(tl.float16), v)
        m_run = m_new
    row = (b * HQ + h * G + gg) * NSPLIT + split
    tl.store(m_ptr + row, m_run, mask=gmask)
    tl.store(s_ptr + row, s_run, mask=gmask)
    tl.store(acc_ptr + row[:, None] * D + cc[None, :], acc * vsc, mask=gmask[:, None])


@triton.jit
def _fp8_stage2(m_ptr, s_ptr, acc_ptr, out_ptr, HQ: tl.constexpr, D: tl.constexpr, NSPLIT: tl.constexpr,
                NS_PAD: tl.constexpr):
    row = tl.program_id(0)  # b * HQ + query head
    ss = tl.arange(0, NS_PAD)
    cc = tl.arange(0, D)
    msk = ss < NSPLIT
    m = tl.load(m_ptr + row * NSPLIT + ss, mask=msk, other=float("-inf"))
    s = tl.load(s_ptr + row * NSPLIT + ss, mask=msk, other=0.0)
    mg = tl.max(m, 0)
    wgt = tl.where(msk, tl.exp(m - mg), 0.0)
    acc = tl.load(acc_ptr + (row * NSPLIT + ss[:, None]) * D + cc[None, :], mask=msk[:, None], other=0.0)
    out = tl.sum(acc * wgt[:, None], 0) / tl.sum(s * wgt, 0)
    tl.store(out_ptr + row * D + cc, out)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, Hkv, T, d] -> (e4m3 tensor, per-KV-head scales [Hkv] fp32), scale = amax / 448."""
    scale = (x.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (x.float() / scale[None, :, None, None]).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


class FP8Decode:
    """plan/run for FP8 decode; run() allocates nothing."""

    def __init__(self, n_q_heads: int, n_kv_heads: int, head_dim: int, num_warps: int = 4) -> None:
        self.hq, self.hk, self.d, self.num_warps = n_q_heads, n_kv_heads, head_dim, num_warps

    def plan(self, batch: int, max_tokens: int, device: torch.device | str, n_splits: int | None = None) -> dict:
        dev = torch.device(device)
        n_tiles = math.ceil(max_tokens / BLOCK_T)
        if n_splits is None:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
            n_splits = max(1, min(n_tiles, math.ceil(4 * sms / (batch * self.hk))))
        f32 = dict(dtype=torch.float32, device=dev)
        return {"S": n_splits, "T": max_tokens, "m": torch.empty(batch, self.hq, n_splits, **f32),
                "s": torch.empty(batch, self.hq, n_splits, **f32),
                "acc": torch.empty(batch, self.hq, n_splits, self.d, **f32),
                "out": torch.empty(batch, self.hq, self.d, **f32)}

    def run(self, plan: dict, q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, k_scale: torch.Tensor,
            v_scale: torch.Tensor, lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """q [B, Hq, d] fp16; k8/v8 [B, Hkv, T, d] e4m3 (T = plan's max_tokens); lengths [B] int32."""
        check_device(q, k8, v8, lengths)
        b = q.shape[0]
        g = self.hq // self.hk
        s = plan["S"]
        scale = 1.0 / math.sqrt(self.d) if scale is None else scale
        _fp8_stage1[(b * self.hk, s)](q, k8, v8, k_scale, v_scale, lengths, plan["m"], plan["s"], plan["acc"],
                                      scale, k8.shape[2], HQ=self.hq, HKV=self.hk, G=g, G_PAD=max(16, g),
                                      D=self.d, NSPLIT=s, BT=BLOCK_T, num_warps=self.num_warps)
        _fp8_stage2[(b * self.hq,)](plan["m"], plan["s"], plan["acc"], plan["out"], HQ=self.hq, D=self.d, NSPLIT=s,
                                    NS_PAD=1 << max(0, (s - 1).bit_length()), num_warps=self.num_warps)
        return plan["out"]
