"""Physical traffic of a ReadKV step, counted from the layout (DESIGN section 2): the K and V bytes a step's
depths touch in 32-byte sectors, the workspace written and read back, and the output. Counted, not measured
(Nsight Compute's DRAM figures are in docs/KERNELS.md)."""

from __future__ import annotations

import torch

from ..kernels import Plan, TritonReader
from ..kernels.radix import NPASS
from ..kvstore import FormatSpec


def sector_bytes_k(kdep: torch.Tensor, lengths: torch.Tensor, page: int, granule: int = 32) -> float:
    """K words touched: per page and plane j, every 32-byte sector (32*8/page channels; or granule of
    ``granule`` bytes) holding a channel with depth > j. kdep [B, Hkv, d]."""
    row = page // 8
    per_sector = max(1, granule // row)
    b, hk, d = kdep.shape
    grp = kdep.reshape(b, hk, d // per_sector, per_sector).amax(-1)  # [B, Hkv, sectors]
    pages = torch.ceil(lengths.double() / page)  # [B]
    return float((grp.sum((1, 2)).double() * pages).sum()) * max(granule, row)


def sector_bytes_v(vdep: torch.Tensor, lengths: torch.Tensor, d: int, granule: int = 32, v_run: int = 1,
                    width: int = 8, page: int = 64) -> float:
    """V rows touched: every 32-byte sector (or granule of ``granule`` bytes) holding a row that a token's
    depth reaches, in the format's layout: per plane, rows of consecutive tokens (``v_run`` = 1); with
    ``v_run`` = g, per run of g planes, each token's g rows together (``width`` planes, ``page`` tokens
    a page: a run of a page is P g rows)."""
    row = d // 8
    per_sector = max(1, granule // row)
    b, hk, t = vdep.shape
    mask = torch.arange(t, device=vdep.device)[None, None, :] < lengths.to(vdep.device)[:, None, None]
    dep = vdep.long() * mask
    if v_run == 1:
        pad = -t % per_sector
        if pad:
            dep = torch.nn.functional.pad(dep, (0, pad))
        dep = dep.reshape(b, hk, -1, per_sector).amax(-1)
        return float(dep.sum()) * max(granule, row)
    dep = torch.nn.functional.pad(dep, (0, -t % page)).reshape(b, hk, -1, page, 1)
    total = 0
    for r in range(width // v_run):  # run r: rows (token, i) in order, row i of a token read where depth > r g + i
        read = dep > (r * v_run + torch.arange(v_run, device=dep.device))  # [b, hk, pages, P, g]
        total += int(read.reshape(b, hk, -1, per_sector).any(-1).sum())
    return float(total) * max(granule, row)


def readkv_physical(plan: Plan, reader: TritonReader, lengths: torch.Tensor, spec: FormatSpec) -> float:
    b, hq, hk, d = plan.batch, spec.n_q_heads, spec.n_kv_heads, spec.head_dim
    kdep = plan.kdep
    vdep = plan.vdep if not reader.fixed_depth else torch.full_like(plan.vdep, reader.fixed_depth)
    data = sector_bytes_k(kdep, lengths, spec.page_size) + sector_bytes_v(vdep, lengths, d, v_run=spec.v_run,
                                                                             width=spec.width, page=spec.page_size)
    n = float(lengths.double().sum())  # tokens over the batch
    logits = 4.0 * hq * n
    if reader.fixed_depth:
        ws = logits * 2  # written by the Key stage, read by the Value stage
    else:
        # logits: written, read by the importance pass and the Value stage; importance: written, read
        # by radix passes 2..NPASS, the tie count and the Value stage (compaction); Value depths written
        vimp_reads = NPASS.value - 1 + 2
        if plan.two_pass:
            # two-pass: the candidates pass, the ties and the compaction read it; the gated radix
            # passes (all NPASS) only in the groups whose candidates overflowed; one histogram
            # read-modify-write (8 bytes) per token; the candidates written and read once
            over = float(plan.cmeta[:, 4].double().mean())
            vimp_reads = 3 + NPASS.value * over
            ws_alloc = 8.0 * hk * n + 8.0 * float(plan.cmeta[:, 2].clamp(max=plan.cand.shape[1]).double().sum())
        else:
            ws_alloc = 0.0
        ws = logits * 2 + 4.0 * hk * n * (1 + vimp_reads) + 1.0 * hk * n + ws_alloc
        if reader.compact_values:
            # the Value stage reads the logits of depth > 0 tokens only: every 32-byte sector (8
            # tokens) of a query head's row holding one; and writes and reads a 2-byte key per token
            tok = torch.arange(vdep.shape[2], device=vdep.device)
            mask = tok[None, None, :] < lengths.to(vdep.device)[:, None, None]
            live = (vdep.long() * mask) > 0
            pad = -live.shape[2] % 8
            sectors = torch.nn.functional.pad(live, (0, pad)).reshape(b, hk, -1, 8).any(-1).sum()
            ws += float(sectors) * 32 * (hq // hk) + 4.0 * float(live.sum())
        else:
            ws += logits
    if plan.choices.key_stage == "int8":  # the int8 Key stage's operands: written by _lin_prep_i8, read back (per
        # step: 16 int32 offsets and 64 int32 V words), and base'
        ws += 2.0 * (float(plan.lin_steps.double().sum()) * (16 + 64) * 4 + 4.0 * b * hq)
    out = 4.0 * b * hq * d * 2 + 4.0 * b * hq * plan.n_blocks * d * 2
    if reader.refine:
        data += refine_sector_bytes(reader.refined(plan).to(kdep.device), kdep, lengths, spec)
        n_ref = float(plan.rcnt.sum())
        # logits read by the keys pass and the stats pass; keys written, read by passes 2..NPASS, the
        # ties and the order; chosen positions written and read; chosen logits rewritten (a 32-byte
        # sector per query head)
        ws += logits * 2 + 4.0 * hk * n * (1 + NPASS.value - 1 + 2) + 2.0 * 2 * n_ref + 32.0 * (hq // hk) * n_ref
    return data + ws + out


def refine_sector_bytes(refined: torch.Tensor, kdep: torch.Tensor, lengths: torch.Tensor, spec: FormatSpec) -> float:
    """K sectors the refinement touches: per page holding a refined token, per plane j, every 32-byte
    sector (32*8/page channels) holding a channel of depth <= j (the planes the channel stage left)."""
    p, w = spec.page_size, spec.width
    row = p // 8
    per_sector = max(1, 32 // row)
    b, hk, d = kdep.shape
    tmax = refined.shape[2]
    pad = torch.nn.functional.pad(refined, (0, -tmax % p))
    pages = pad.view(b, hk, -1, p).any(-1).sum(-1).double()  # [B, Hkv]
    left = (w - kdep.long().reshape(b, hk, d // per_sector, per_sector).amin(-1)).sum(-1).double()  # [B, Hkv]
    return float((pages * left).sum()) * max(32, row)
