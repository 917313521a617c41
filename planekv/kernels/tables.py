"""Host-side constant tables of the kernels, built once per reader from the codec (then copied to each device).

The tree's reconstruction values L_t[code] (depth t, W-bit code) in the layouts the stages read: packed fp16
hi / lo halves in one int32 (the fp16 MMA stages), indexed by bit-reversed codes (stages that assemble codes
with plane j at bit j), float32 (the FMA stages); and a linear codebook's coefficients (the int8 stages).
"""

from __future__ import annotations

import torch

from ..kvstore import Codec, UniformLinearTree


def packed_table(codec: Codec) -> torch.Tensor:
    """Reconstruction table [(W + 1) * 2**W] as int32 words: fp16(L) in the low half, fp16(L - fp16(L))
    in the high half, so z = hi + lo is L to about 2^-22."""
    t = codec.tree.table().reshape(-1).double()
    hi = t.half()
    lo = (t - hi.double()).half()
    return (hi.view(torch.int16).to(torch.int32) & 0xFFFF) | (lo.view(torch.int16).to(torch.int32) << 16)


def bit_reversal(w: int) -> torch.Tensor:
    """rev_W(c) for every W-bit code c."""
    c = torch.arange(1 << w)
    rev = torch.zeros_like(c)
    for j in range(w):
        rev |= ((c >> j) & 1) << (w - 1 - j)
    return rev


def reversed_table(codec: Codec) -> torch.Tensor:
    """:func:`packed_table` indexed by bit-reversed codes: entry [t, c'] is entry [t, rev_W(c')]. The
    transposing stages assemble codes with plane j at bit j (the stored code has it at bit W - 1 - j)."""
    w = codec.width
    return packed_table(codec).reshape(w + 1, 1 << w)[:, bit_reversal(w)].reshape(-1).contiguous()


def reversed_table_f32(codec: Codec) -> torch.Tensor:
    """The reconstruction table in float32, indexed by bit-reversed codes (entry [t, c'] is the tree's value
    for depth t and code rev_W(c')): the FMA stages' table."""
    w = codec.width
    return codec.tree.table().float().reshape(w + 1, 1 << w)[:, bit_reversal(w)].reshape(-1).contiguous()


def linear_tables(tree: UniformLinearTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [W + 1], w [W + 1, W]) of a linear codebook, float32: level = a_t + sum_j w[t, j] b_j."""
    w = tree.depth
    a = torch.tensor([tree.linear_weights(t)[0] for t in range(w + 1)], dtype=torch.float32)
    wt = torch.zeros(w + 1, w, dtype=torch.float32)
    for t in range(1, w + 1):
        wt[t, :t] = torch.tensor(tree.linear_weights(t)[1], dtype=torch.float32)
    return a, wt
