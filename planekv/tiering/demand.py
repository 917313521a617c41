"""What one tiered step asked of the refinement tiers, reduced to pages where the read ran (docs/TIERING.md).

A tiered read's stats carry per-token tensors (``stats.extra``, per sequence [Hkv, T]): the depth each Value token
wanted (``v_wanted``) and read (``v_depths``), and with Key refinement the tokens the refinement chose
(``kr_wanted``) and those it read at depth W (``kr_full``). Prefetch ranks pages by their tokens' demand and the
tally counts bits and used pages: neither needs a token, only sums over pages and sequences. :func:`step_demand`
makes those sums on the tensors' device (the GPU, for the Triton reader) and brings only them to the host:
[B, Hkv, pages] and [B] tensors instead of B x Hkv x T per-token values (BENCHMARKS.md, "Prefetch's host time").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kvstore.stats import ReadStats


@dataclass(frozen=True)
class StepDemand:
    """One step of one layer, host tensors. Pages are indexed by page slot; only sealed pages carry demand (the
    open page is always resident).

    ``v_pages`` [B, Hkv, S] int64: refinement planes the page's tokens asked for past h_V (their sum).
    ``v_read_deep`` [B, Hkv, S] bool: a token of the page was read past h_V (a fetched page was used).
    ``v_beyond_bits`` / ``v_served_bits`` [B] float64: Value bits asked for past h_V, and of those the bits read.
    With Key refinement (else None): ``kr_pages`` [B, Hkv, S] int64 tokens chosen, ``kr_full_pages`` [B, Hkv, S]
    bool (a chosen token read at depth W), ``kr_chosen`` [B, Hkv] int64 and ``kr_served`` [B] int64 (chosen tokens
    and of those the ones read at depth W)."""

    v_pages: torch.Tensor
    v_read_deep: torch.Tensor
    v_beyond_bits: torch.Tensor
    v_served_bits: torch.Tensor
    kr_pages: torch.Tensor | None = None
    kr_full_pages: torch.Tensor | None = None
    kr_chosen: torch.Tensor | None = None
    kr_served: torch.Tensor | None = None


def _padded(per_seq: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """Per sequence [Hkv, T_b] -> [B, Hkv, tokens] on their device, zero past each sequence's T_b."""
    out = torch.zeros(len(per_seq), per_seq[0].shape[0], tokens, dtype=per_seq[0].dtype, device=per_seq[0].device)
    for b, x in enumerate(per_seq):
        out[b, :, : x.shape[1]] = x
    return out


def step_demand(stats: ReadStats, hot_v: int, page_size: int) -> StepDemand:
    """The page and sequence sums of a tiered read's per-token stats (the module docstring), made on the device the
    stats live on. Computed once per stats and hot depth: kept in ``stats.extra["demand"]``."""
    ex = stats.extra
    memo = ex.get("demand")
    if memo is not None and memo[0] == (hot_v, page_size):
        return memo[1]
    wanted, read = ex["v_wanted"], ex["v_depths"]  # per sequence [Hkv, T_b]
    lengths = [w.shape[1] for w in wanted]
    n_pages = -(-max(lengths) // page_size)
    dev = wanted[0].device
    sealed = torch.tensor([t // page_size for t in lengths], device=dev)  # [B]
    is_sealed = torch.arange(n_pages, device=dev)[None, :] < sealed[:, None]  # [B, S]
    b, hk, t = len(wanted), wanted[0].shape[0], n_pages * page_size
    w_all = _padded(wanted, t).to(torch.int32)  # [B, Hkv, T] zero past T_b: no demand there
    r_all = _padded(read, t).to(torch.int32)
    past = (w_all - hot_v).clamp_min(0)  # [B, Hkv, T] planes asked for past h_V
    served = (torch.minimum(r_all, w_all) - hot_v).clamp_min(0)
    d = stats.head_dim
    v_pages = past.view(b, hk, n_pages, page_size).sum(-1, dtype=torch.int64) * is_sealed[:, None, :]
    v_read_deep = (r_all > hot_v).view(b, hk, n_pages, page_size).any(-1)
    sums = [d * past.sum((1, 2), dtype=torch.int64), d * served.sum((1, 2), dtype=torch.int64)]
    kr = None
    if "kr_wanted" in ex:
        chosen = _padded(ex["kr_wanted"], t).bool()  # [B, Hkv, T]
        full = chosen & _padded(ex["kr_full"], t).bool()
        kr = (chosen.view(b, hk, n_pages, page_size).sum(-1, dtype=torch.int64) * is_sealed[:, None, :],
              full.view(b, hk, n_pages, page_size).any(-1), chosen.sum(-1, dtype=torch.int64))
        sums.append(full.sum((1, 2), dtype=torch.int64))
    host = torch.stack(sums).cpu()  # one transfer for the [B] sums
    demand = StepDemand(
        v_pages=v_pages.cpu(), v_read_deep=v_read_deep.cpu(), v_beyond_bits=host[0].double(),
        v_served_bits=host[1].double(),
        kr_pages=None if kr is None else kr[0].cpu(), kr_full_pages=None if kr is None else kr[1].cpu(),
        kr_chosen=None if kr is None else kr[2].cpu(), kr_served=None if kr is None else host[2])
    ex["demand"] = ((hot_v, page_size), demand)
    return demand
