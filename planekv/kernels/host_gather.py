"""Zero-copy row gather: the device reads rows of pinned host memory in place (docs/TIERING.md, "Promotions").

A promotion of Key channel-planes needs one row (P/8 bytes: one plane of one channel over a page's tokens) of every
sealed page of its (sequence, KV head), spread over the host tier's blocks. Gathering them on the host costs
microseconds per row; here the device gathers them itself: pinned host memory is mapped into the device's address
space (CUDA's unified addressing), so a kernel given each row's host address loads it over the bus and writes it
into its promotion slot. The host only builds the table of addresses.

Grid: (items, page blocks of ``BLOCK_P`` pages); each program copies ``BLOCK_P`` rows of one item. Under
``TRITON_INTERPRET=1`` the same kernel reads plain CPU memory (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import check_device
from .common import next_pow2

BLOCK_P = 32  # pages a program copies: 32 rows of 32 bytes at P = 256


@triton.jit
def _gather_rows(src_ptr, slot_ptr, dst_ptr, n_pages, dst_stride, ROW: tl.constexpr, ROW_P2: tl.constexpr,
                 BLOCK: tl.constexpr):
    i = tl.program_id(0)  # the item
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] its pages
    r = tl.arange(0, ROW_P2)  # [ROW_P2] bytes of a row
    on = s < n_pages
    addr = tl.load(src_ptr + i.to(tl.int64) * n_pages + s, mask=on, other=0)  # [BLOCK] int64 host addresses, 0: none
    have = addr != 0
    src = addr.to(tl.pointer_type(tl.uint8))[:, None] + r[None, :]  # [BLOCK, ROW_P2]
    rows = tl.load(src, mask=have[:, None] & (r[None, :] < ROW), other=0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    dst = dst_ptr + slot * dst_stride + s[:, None].to(tl.int64) * ROW + r[None, :]
    tl.store(dst, rows, mask=on[:, None] & (r[None, :] < ROW))


def gather_rows(addresses: torch.Tensor, slots: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[slots[i], s] = `` the ``dst.shape[2]`` bytes at host address ``addresses[i, s]`` (zero where the
    address is 0). addresses [n, pages] int64 (each a row of pinned host memory on CUDA hosts; plain memory under
    the interpreter), slots [n] int64, dst uint8 [slots, pages, row bytes] (contiguous), all on dst's device.
    Asynchronous on CUDA: the caller keeps the host memory alive until the stream has passed the copy."""
    check_device(addresses, slots, dst)
    n, pages = addresses.shape
    if dst.dim() != 3 or dst.shape[1] != pages or not dst.is_contiguous() or dst.dtype != torch.uint8:
        raise ValueError(f"dst must be contiguous uint8 [slots, {pages}, row bytes], got {tuple(dst.shape)} "
                         f"{dst.dtype}")
    if slots.shape != (n,) or addresses.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"addresses must be int64 [n, pages] and slots int64 [n], got {addresses.dtype} "
                         f"{tuple(addresses.shape)} and {slots.dtype} {tuple(slots.shape)}")
    if not n:
        return
    row = dst.shape[2]
    _gather_rows[(n, triton.cdiv(pages, BLOCK_P))](addresses.contiguous(), slots.contiguous(), dst, pages,
                                                   dst.stride(0), ROW=row, ROW_P2=next_pow2(row), BLOCK=BLOCK_P)
