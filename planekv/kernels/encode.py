"""Encode/append kernel: fp16/bf16/fp32 K and V -> W-bit tree codes -> bit planes in the pages.

The rotation by the Hadamard-sign matrix is one torch matmul over all new tokens (the same op the
reference codec uses); one program then encodes BT consecutive new tokens of one (sequence, KV
head): normalize with the calibration, walk the tree (W comparisons against the thresholds in heap
order), and write layout version 1:
- K words hold 32 tokens of one (plane, channel); BT = 32 new tokens touch at most two words per
  (plane, channel), each written with one atomic OR (a partly filled page is completed in place;
  free pages are zero);
- V rows (plane, token) are written whole.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kvstore import Codec, PlaneKVCache
from ._dispatch import check_device

BT = 32  # new tokens per program: the width of one K word


@triton.jit
def _tree_codes(z, heap_ptr, W: tl.constexpr):
    """Leaf code of every element of z by walking the tree (bit = 1 iff z > node threshold)."""
    idx = tl.full(z.shape, 1, tl.int32)
    for _ in tl.static_range(W):
        thr = tl.load(heap_ptr + idx)
        idx = 2 * idx + (z > thr).to(tl.int32)
    return idx - (1 << W)


@triton.jit
def _codes(xt_ptr, xoff, tok_ok, mu_ptr, sig_ptr, heap_ptr, h, D: tl.constexpr, W: tl.constexpr):
    cc = tl.arange(0, D)
    xt = tl.load(xt_ptr + xoff, mask=tok_ok[:, None], other=0.0)  # [BT, D], already rotated
    mu = tl.load(mu_ptr + h * D + cc)
    sig = tl.load(sig_ptr + h * D + cc)
    return _tree_codes((xt - mu[None, :]) / sig[None, :], heap_ptr, W)


@triton.jit
def _encode_append(k_ptr, v_ptr, kw_ptr, vw_ptr, pt_ptr, start_ptr, muk_ptr, sigk_ptr, muv_ptr, sigv_ptr, heap_ptr,
                   n_new, SLOTS, HKV: tl.constexpr, D: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                   BT: tl.constexpr, VG: tl.constexpr = 1):
    """k_ptr / v_ptr: rotated K~ / V~ [B, Hkv, n_new, D] (float32); VG: the format's ``v_run`` (V rows of
    plane j at run j // VG, row j % VG of the token's run)."""
    pid_bh = tl.program_id(0)
    tile = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    start = tl.sum(tl.load(start_ptr + b + tl.arange(0, 1)), 0)
    i = tile * BT + tl.arange(0, BT)
    ok = i < n_new
    pos = start + i
    cc = tl.arange(0, D)
    xoff = (pid_bh * n_new + i)[:, None] * D + cc[None, :]
    NW: tl.constexpr = P // 32
    NWV: tl.constexpr = D // 32

    # ---- K: channel-major words of 32 tokens; at most two words per (plane, channel) ----
    code = _codes(k_ptr, xoff, ok, muk_ptr, sigk_ptr, heap_ptr, h, D, W)
    wid = pos // 32  # word index along the sequence
    wid0 = tl.min(tl.where(ok, wid, 1 << 30), 0)
    in0 = ok & (wid == wid0)
    in1 = ok & (wid == wid0 + 1)
    page0 = tl.load(pt_ptr + pid_bh * SLOTS + (wid0 * 32) // P).to(tl.int64)
    has1 = tl.sum(in1.to(tl.int32), 0) > 0
    slot1 = tl.where(has1, ((wid0 + 1) * 32) // P, 0)
    page1 = tl.load(pt_ptr + pid_bh * SLOTS + slot1).to(tl.int64)
    w0 = wid0 % NW
    w1 = (wid0 + 1) % NW
    shift = (pos % 32)[:, None]
    for j in tl.static_range(W):
        bit = (code >> (W - 1 - j)) & 1
        contrib = bit << shift  # distinct bits: the sum is the OR
        s0 = tl.sum(tl.where(in0[:, None], contrib, 0), 0)
        s1 = tl.sum(tl.where(in1[:, None], contrib, 0), 0)
        tl.atomic_or(kw_ptr + ((page0 * W + j) * D + cc) * NW + w0, s0, mask=s0 != 0, sem="relaxed")
        tl.atomic_or(kw_ptr + ((page1 * W + j) * D + cc) * NW + w1, s1, mask=(s1 != 0) & has1,
                     sem="relaxed")

    # ---- V: token-major rows of D bits, written whole ----
    code = _codes(v_ptr, xoff, ok, muv_ptr, sigv_ptr, heap_ptr, h, D, W)
    page = tl.load(pt_ptr + pid_bh * SLOTS + pos // P, mask=ok, other=0).to(tl.int64)  # [BT]
    off = pos % P
    wi = tl.arange(0, NWV)
    sh = tl.arange(0, 32)
    for j in tl.static_range(W):
        bit = (code >> (W - 1 - j)) & 1  # [BT, D]
        words = tl.sum(tl.reshape(bit, [BT, NWV, 32]) << sh[None, None, :], 2)  # [BT, NWV]
        row = page * (W * P) + (j // VG) * (VG * P) + off * VG + j % VG
        tl.store(vw_ptr + row[:, None] * NWV + wi[None, :], words,
                 mask=ok[:, None])


def _heap(codec: Codec) -> torch.Tensor:
    """Split thresholds in heap order: heap[2**t + i] splits node i of depth t (heap[0] unused)."""
    w = codec.width
    heap = torch.zeros(1 << w, dtype=torch.float64)
    for t in range(w):
        heap[(1 << t):(1 << (t + 1))] = torch.tensor(codec.tree.split_thresholds(t), dtype=torch.float64)
    return heap.float()


class Encoder:
    """Appends K/V to a PlaneKVCache's pools with the Triton kernel (GPU, or the interpreter)."""

    def __init__(self, codec: Codec) -> None:
        spec = codec.spec
        if spec.head_dim % 32 or spec.head_dim & (spec.head_dim - 1):
            raise ValueError(f"the encode kernel needs a power-of-two head dim >= 32, got {spec.head_dim}")
        self.codec = codec
        c = codec.calibration
        self._cpu = {"mkT": codec.rot_k.matrix.T.float().contiguous(), "mvT": codec.rot_v.matrix.T.float().contiguous(),
                     "mu_k": c.mu_k, "sig_k": c.sigma_k, "mu_v": c.mu_v, "sig_v": c.sigma_v, "heap": _heap(codec)}
        self._dev: dict[torch.device, dict[str, torch.Tensor]] = {}

    def _on(self, dev: torch.device) -> dict[str, torch.Tensor]:
        if dev not in self._dev:
            self._dev[dev] = {k: v.to(dev).contiguous() for k, v in self._cpu.items()}
        return self._dev[dev]

    def launch(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               page_table: torch.Tensor, starts: torch.Tensor, layer: int) -> None:
        """k, v [B, Hkv, n, d] (any float dtype) appended at positions starts [B] (int32, device);
        the page table [B, Hkv, slots] (int32) must already hold pages for every new position."""
        spec = self.codec.spec
        check_device(k, v, k_pool, v_pool, page_table, starts)
        b, hk, n, d = k.shape
        c = self._on(k.device)
        kt = torch.matmul(k.float(), c["mkT"])  # [B, Hkv, n, d] rotated, float32
        vt = torch.matmul(v.float(), c["mvT"])
        grid = (b * hk, triton.cdiv(n, BT))
        _encode_append[grid](kt, vt, k_pool.view(torch.int32), v_pool.view(torch.int32), page_table, starts,
                             c["mu_k"][layer], c["sig_k"][layer], c["mu_v"][layer], c["sig_v"][layer], c["heap"], n,
                             page_table.shape[2], HKV=hk, D=d, W=spec.width, P=spec.page_size, BT=BT, VG=spec.v_run,
                             num_warps=8)

    def append(self, cache: PlaneKVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and append k, v [B, Hkv, n, d] to every sequence of ``cache`` (same n for all)."""
        cache.check_format(self.codec.format_id)
        n = k.shape[2]
        if n == 0:
            return
        starts = cache.lengths[layer].clone()
        p = cache.spec.page_size
        for bi in range(cache.batch_size):
            cache._ensure_pages(bi, int((starts[bi] + n - 1) // p) + 1)
        pt = cache.page_table.to(device=k.device, dtype=torch.int32).contiguous()
        self.launch(k, v, cache.k_pool[layer], cache.v_pool[layer], pt, starts.to(device=k.device, dtype=torch.int32),
                    layer)
        cache.lengths[layer] += n
