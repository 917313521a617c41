"""Reference two-stage reader (torch, CPU and CUDA) and the baselines behind one interface.

The reader follows DESIGN section 1, steps 5-8, for one layer:

1. Key stage: ``a_c = sum_{h in group} (q~_{h,c} sigma_{K,c})^2``; channel depths by the threshold
   allocator (addresses are fixed before any Key bit is read); logits from K reconstructed at
   those depths; softmax.
2. Value stage: ``b_i = sum_{h in group} p_{h,i}^2``; token depths; weighted sum of V reconstructed
   at those depths; inverse transform.

Query heads map to KV heads as in Hugging Face's ``repeat_kv``: query head h reads KV head
``h // G``. Shapes: q [Hq, M, d] (M query rows), K/V [Hkv, T, d]; each row m reads tokens
``[starts[m], lengths[m])``. A decode step is one row reading everything; the teacher-forced mode
(for perplexity) has row i read tokens ``[0, i]``: the token's own K/V is appended before its read,
exactly as in a decode step, and every row allocates its own depths.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .accounting import two_stage_workspace_bytes
from .allocate import threshold_allocate

# The baselines live in their own module; they are part of this module's public API.
from .baselines import (  # noqa: E402,F401
    FP8,
    KIVI,
    Dense,
    FullReader,
    KVSystem,
    SparQ,
    TurboQuant,
    attention,
    row_mask,
)
from .codec import Codec
from .planes import PlaneKVCache
from .policy import PLANEKV_KEY_REFINE, ReadPolicy
from .residency import Residency
from .stats import ReadStats

__all__ = [
    "FP8", "KIVI", "Dense", "FullReader", "KVSystem", "ReadKV", "SparQ", "TurboQuant",
    "attention", "readkv_decode", "readkv_rows", "readkv_teacher_forced", "row_mask",
    "make_system", "SYSTEM_NAMES",
]


def _row_budgets(policy: ReadPolicy, n_tokens: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    memo: dict[int, tuple[int, int]] = {}
    bk, bv = [], []
    for t in n_tokens.tolist():
        if t not in memo:
            memo[t] = policy.budgets(int(t), head_dim)
        bk.append(memo[t][0])
        bv.append(memo[t][1])
    return torch.tensor(bk, dtype=torch.int64), torch.tensor(bv, dtype=torch.int64)


def _allocate(importance: torch.Tensor, budget: torch.Tensor, policy: ReadPolicy, distortion: list[float],
              min_depth: int, packet: int, valid: torch.Tensor | None,
              spent: torch.Tensor | None = None, max_depth: torch.Tensor | None = None) -> torch.Tensor:
    """importance [M, Hkv, n], budget [M] per head -> depths [M, Hkv, n]; pooled or per head.

    ``spent`` [M, Hkv] (planes of this stage's size already spent elsewhere, e.g. on sink Keys) is
    taken from the budget (from the pooled sum when pooled), never below the minimum depths.
    ``max_depth`` [M, Hkv, n]: the deepest readable depth per item (a tiered cache's residency)."""
    m, hk, n = importance.shape
    dev = importance.device
    floor = torch.full((m, hk), n, dtype=torch.int64) if valid is None else valid.sum(-1).cpu()
    floor = floor * min_depth
    if policy.pool_heads:
        v = None if valid is None else valid.reshape(m, hk * n)
        bud = budget.cpu() * hk
        if spent is not None:
            bud = torch.maximum(bud - spent.cpu().sum(1), floor.sum(1))
        md = None if max_depth is None else max_depth.reshape(m, hk * n)
        dep = threshold_allocate(importance.reshape(m, hk * n), bud.to(dev), distortion,
                                 policy.width, min_depth, packet, v, max_depth=md)
        return dep.reshape(m, hk, n)
    bud = budget.cpu()[:, None].expand(m, hk)
    if spent is not None:
        bud = torch.maximum(bud - spent.cpu(), floor)
    return threshold_allocate(importance, bud.to(dev), distortion, policy.width, min_depth, packet, valid,
                              max_depth=max_depth)


def _within(wanted: torch.Tensor, limit: torch.Tensor | None, policy: ReadPolicy,
            allocate_within: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The depths a read under a residency ``limit`` uses: the all-resident allocation ``wanted`` capped at the
    limit, or with ``policy.tier_aware`` an allocation within the limit (the budget of an unreadable increment
    goes to readable ones)."""
    if limit is None:
        return wanted
    if policy.tier_aware:
        return allocate_within(limit)
    return torch.minimum(wanted, limit.to(wanted.device))


def _past(wanted: torch.Tensor, max_depth: torch.Tensor) -> torch.Tensor:
    """Per row [M]: the planes of ``wanted`` [M, Hkv, n] past ``max_depth`` (a tiered read's caps)."""
    return (wanted - max_depth.to(wanted.device)).clamp_min(0).sum((1, 2)).cpu().double()


def _codes_for(src: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], depths: torch.Tensor) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        return src
    if depths.shape[0] != 1:
        raise ValueError("a fetch callback serves one query row (a decode step)")
    return src(depths[0])


def readkv_rows(q: torch.Tensor, k_src: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                v_src: torch.Tensor | Callable[[torch.Tensor], torch.Tensor], codec: Codec, layer: int,
                policy: ReadPolicy, lengths: torch.Tensor, starts: torch.Tensor | None = None,
                scale: float | None = None, k_max: torch.Tensor | None = None,
                v_max: torch.Tensor | None = None,
                k_page_max: torch.Tensor | None = None) -> tuple[torch.Tensor, ReadStats]:
    """Two-stage read for M query rows of one sequence and layer.

    q [Hq, M, d] (after RoPE, model domain). ``k_src``/``v_src``: codes [Hkv, T, d] (uint8), or a
    callback that receives the depths of a single row ([Hkv, d] for K, [Hkv, T] for V) and returns
    code prefixes read at those depths (the paged decode path). ``k_max`` [Hkv, d] / ``v_max`` [Hkv, T]:
    the deepest depth that can be read per Key channel / Value token (a tiered cache's residency; None:
    W). ``k_page_max`` [Hkv, T]: the depth each token's Key page makes readable in every channel (a promoted
    or open Key page: W; None: none), so a token's Key channel c reads to max(k_max[c], k_page_max[token]).
    Nothing past them is read: the depths the allocations choose are capped at them (with
    ``policy.tier_aware`` the allocations stay within them instead, so that the budget of an unreadable
    increment goes to readable ones); sink Keys read each channel at its resident depth, Key refinement
    reads a refined token at its own limit (W where its Key page is resident).
    Caps, in bits per row: ``stats.extra["k_caps"]`` (Key channel planes an allocation without the limit
    would have taken past it, T bits each, and the planes of sink tokens past it, 1 bit per token and
    channel), ``["kr_caps"]`` (the planes past the limit of the tokens Key refinement chose without it, 1
    bit per token and channel) and ``["v_caps"]`` (d bits per Value token plane); ``["k_wanted"]``
    [M, Hkv, d] / ``["v_wanted"]`` [M, Hkv, T] / ``["kr_wanted"]`` [Hkv, M, T] (bool) are the unlimited
    allocations and refinement choice (what prefetch fetches for the next step), ``["kr_full"]`` [Hkv, M, T]
    the refined tokens read at depth W, ``["kr_wanted_bits"]`` [M] what the unlimited choice costs and
    ``["wanted_bits"]`` [M] the bits the read asked for (read + capped). Returns out [Hq, M, d] (float32) and
    per-row stats.
    """
    spec = codec.spec
    if policy.width != spec.width:
        raise ValueError(f"policy width W={policy.width} != stored width {spec.width}")
    hq, m, d = q.shape
    hk = spec.n_kv_heads
    if hq != spec.n_q_heads or d != spec.head_dim:
        raise ValueError(f"q must be [{spec.n_q_heads}, M, {spec.head_dim}], got {tuple(q.shape)}")
    g = hq // hk
    dev = q.device
    lengths = lengths.to(torch.int64).cpu()
    starts = torch.zeros_like(lengths) if starts is None else starts.to(torch.int64).cpu()
    n_tok = lengths - starts
    if (n_tok < 1).any():
        raise ValueError("every query row must read at least one token")
    t_max = int(lengths.max())
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    dist = codec.tree.distortion
    table = codec.table(dev)
    mu_k, sig_k = codec.stats(layer, "k", dev)
    mu_v, sig_v = codec.stats(layer, "v", dev)
    bk, bv = _row_budgets(policy, n_tok, d)

    # ---- Key stage ----
    qt = codec.rot_k.forward(q.float()).view(hk, g, m, d)  # [Hkv, G, M, d]
    qs = qt * sig_k[:, None, None, :]
    a = (qs * qs).sum(1).permute(1, 0, 2)  # [M, Hkv, d]: one importance per physical KV head
    bk_stage = bk
    if policy.key_refine:  # the channel stage gets (1 - key_refine) of B_K, the rest refines tokens
        bk_stage = torch.maximum(torch.floor(bk.double() * (1.0 - policy.key_refine)).to(torch.int64),
                                 torch.full_like(bk, policy.min_depth_k * d))
    limited = k_max is not None or v_max is not None
    # the deepest readable Key depth per channel [Hkv, d] (sink and refined tokens are read at it)
    top = (torch.full((hk, d), policy.width, dtype=torch.int64) if k_max is None else k_max.to(torch.int64).cpu())
    k_lim = None if k_max is None else top[None].expand(m, hk, d)
    k_wanted = _allocate(a, bk_stage, policy, dist, policy.min_depth_k, 1, None)  # [M, Hkv, d], all resident
    t_dep = _within(k_wanted, k_lim, policy, lambda lim: _allocate(a, bk_stage, policy, dist, policy.min_depth_k, 1,
                                                                   None, max_depth=lim))
    k_caps = torch.zeros(m, dtype=torch.float64)
    if k_lim is not None:
        k_caps = _past(k_wanted, k_lim) * n_tok.double()
    k_codes = _codes_for(k_src, t_dep)[:, :t_max].long()  # [Hkv, T, d]
    n_code = table.shape[1]
    flat = table.reshape(-1)
    logits = (qt * mu_k[:, None, None, :]).sum(-1, keepdim=True).expand(hk, g, m, t_max).clone()
    kvc = policy.key_variance_correction
    if kvc:  # logit += scale * V / 2 before the scale: E[exp(logit) | codes], second order
        var_tab = codec.variance_table(dev)
        qv = (0.5 * scale) * qs * qs  # [Hkv, G, M, d]
    if m == 1:  # one row (a decode step): one gather at the per-channel depths
        idx = t_dep[0][:, None, :] * n_code + k_codes  # [Hkv, T, d]
        kz = flat[idx]
        logits += qs @ kz.transpose(1, 2)[:, None]
        if kvc:  # depth-0 channels: the same variance for every token, skipped as below
            kvar = var_tab.reshape(-1)[idx]
            logits += (qv * (t_dep[0] > 0)[:, None, None, :]) @ kvar.transpose(1, 2)[:, None]
    else:  # rows have their own depths: one masked product per depth value
        t_perm = t_dep.permute(1, 0, 2)[:, None]  # [Hkv, 1, M, d]
        for tau in t_dep.unique().tolist():
            if tau == 0:
                continue  # depth 0 reconstructs mu, already in `logits`
            kz = table[tau][k_codes]  # [Hkv, T, d]
            logits += (qs * (t_perm == tau)) @ kz.transpose(1, 2)[:, None]
            if kvc:
                logits += (qv * (t_perm == tau)) @ var_tab[tau][k_codes].transpose(1, 2)[:, None]
    spent_v = None
    sink_bits = torch.zeros(m, dtype=torch.float64)
    if policy.sink_keys:  # the first sink_keys tokens of each row: Keys at full depth W
        w = policy.width
        ns = n_tok.clamp(max=policy.sink_keys)  # [M]
        cols = torch.unique(torch.cat([torch.arange(int(s0), int(s0 + k)) for s0, k in zip(starts, ns, strict=True)]))
        top_d = top.to(dev)
        full = _codes_for(k_src, top_d[None].expand_as(t_dep))[:, cols].long()  # [Hkv, S, d]
        at_top = top_d[:, None, :] * n_code + full  # [Hkv, S, d]: flat table index at the resident depth
        sink_logits = (qt * mu_k[:, None, None, :]).sum(-1, keepdim=True) + qs @ flat[at_top].transpose(1, 2)[:, None]
        if kvc:
            sink_logits += qv @ var_tab.reshape(-1)[at_top].transpose(1, 2)[:, None]
            # the other tokens leave out depth-0 channels' variance (1 each, the same for all of
            # them); leave it out here too so the softmax sees the same shift
            sink_logits -= (qv * (t_dep.permute(1, 0, 2)[:, None] == 0)).sum(-1, keepdim=True)
        in_sink = (cols[None, :] >= starts[:, None]) & (cols[None, :] < (starts + ns)[:, None])  # [M, S]
        cols_d = cols.to(dev)
        logits[..., cols_d] = torch.where(in_sink.to(dev), sink_logits, logits[..., cols_d])
        extra = ns[:, None].to(torch.float64) * (top - t_dep.cpu()).sum(-1).double()  # [M, Hkv] extra Key bits
        sink_bits = extra.sum(1)
        k_caps += ns.double() * float((w - top).sum())
        spent_v = torch.ceil(extra / d).to(torch.int64)  # in Value planes (d bits each)
    mask = row_mask(lengths, starts, t_max, dev)  # [M, T]
    refine_bits = torch.zeros(m, dtype=torch.float64)
    refined = None
    kr_caps = torch.zeros(m, dtype=torch.float64)
    if policy.key_refine:
        # the deepest readable Key depth per token and channel: None (W), [Hkv, d] or [Hkv, T, d]
        lim = None if k_max is None else top.to(dev)
        if k_page_max is not None:
            lim = torch.maximum(top.to(dev)[:, None, :], k_page_max[:, :t_max].to(dev, torch.int64)[:, :, None])
            if bool((lim == lim[:, :1]).all()):  # the same for every token: read per channel
                lim = lim[:, 0]
        if isinstance(k_src, torch.Tensor):
            full = k_codes
        elif lim is None:
            full = _codes_for(k_src, top.to(dev)[None].expand_as(t_dep))
        elif lim.dim() == 2:  # the same limit for every token: per channel, as the channel stage reads
            full = _codes_for(k_src, lim[None].expand_as(t_dep))
        else:  # per token and channel
            full = _codes_for(k_src, lim[None])
        ref = _key_refine(logits, qt, qs, mu_k, table, full[:, :t_max].long(), t_dep, (bk - bk_stage) * n_tok,
                          mask, scale, policy, dist, lim)
        logits, refine_bits, refined, kr_wanted, kr_full, kr_caps, kr_wanted_bits = ref
    logits = (logits * scale).masked_fill(~mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)  # [Hkv, G, M, T]

    # ---- Value stage ----
    b = (p * p).sum(1).permute(1, 0, 2)  # [M, Hkv, T]
    if policy.value_head_weight:
        b = b * (sig_v * sig_v).sum(-1)[None, :, None]
    valid = mask[:, None, :].expand(m, hk, t_max)
    v_lim = None if v_max is None else v_max[:, :t_max].to(torch.int64)[None].expand(m, hk, t_max)
    v_wanted = _allocate(b, bv, policy, dist, policy.min_depth_v, policy.v_packet, valid, spent_v)  # [M, Hkv, T]
    s_dep = _within(v_wanted, v_lim, policy, lambda lim: _allocate(b, bv, policy, dist, policy.min_depth_v,
                                                                   policy.v_packet, valid, spent_v, max_depth=lim))
    v_caps = torch.zeros(m, dtype=torch.float64) if v_lim is None else _past(v_wanted, v_lim) * d
    v_codes = _codes_for(v_src, s_dep)[:, :t_max].long()
    out = mu_v[:, None, None, :] * p.sum(-1, keepdim=True)  # [Hkv, G, M, d]
    if m == 1:
        vz = flat[s_dep[0][:, :, None] * n_code + v_codes]  # [Hkv, T, d]
        acc = p @ vz[:, None]
    else:
        s_perm = s_dep.permute(1, 0, 2)[:, None]  # [Hkv, 1, M, T]
        acc = torch.zeros_like(out)
        for tau in s_dep.unique().tolist():
            if tau == 0:
                continue
            vz = table[tau][v_codes]  # [Hkv, T, d]
            acc += (p * (s_perm == tau)) @ vz[:, None]
    out = out + sig_v[:, None, None, :] * acc
    out = codec.rot_v.inverse(out).reshape(hq, m, d)

    stats = ReadStats(
        k_bits=(n_tok.to(torch.float64) * t_dep.sum((1, 2)).cpu().double()) + sink_bits + refine_bits,
        v_bits=(d * s_dep.sum((1, 2)).cpu().double()),
        tokens=n_tok.double(),
        n_kv_heads=hk,
        head_dim=d,
        workspace_bytes=two_stage_workspace_bytes(hq, hk, int(n_tok.max()), d),
        k_depths=t_dep.cpu(),
        v_depths=s_dep.cpu(),
    )
    if refined is not None:
        stats.extra["k_refined"] = refined.cpu()  # [Hkv, M, T] bool: tokens whose Keys were refined
    if limited:
        stats.extra.update(k_caps=k_caps, v_caps=v_caps, kr_caps=kr_caps, k_wanted=k_wanted.cpu(),
                           v_wanted=v_wanted.cpu(), wanted_bits=stats.k_bits + stats.v_bits + k_caps + v_caps + kr_caps)
        if refined is not None:
            stats.extra.update(kr_wanted=kr_wanted.cpu(), kr_full=kr_full.cpu(), kr_wanted_bits=kr_wanted_bits)
    return out, stats


def _key_refine(logits: torch.Tensor, qt: torch.Tensor, qs: torch.Tensor, mu_k: torch.Tensor,
                table: torch.Tensor, codes: torch.Tensor, t_dep: torch.Tensor, budget: torch.Tensor,
                mask: torch.Tensor, scale: float, policy: ReadPolicy, distortion: list[float],
                lim: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Key refinement (``ReadPolicy.key_refine``): logits [Hkv, G, M, T] (unscaled, from the channel
    depths t_dep [M, Hkv, d]) -> logits with the chosen blocks' tokens read at depth W in every
    channel, or, under a tiered cache's residency, at ``lim`` (the deepest readable depth per channel
    [Hkv, d] or per token and channel [Hkv, T, d]; ``codes`` are then read to it). Returns the logits,
    the bits read per row [M], the refined tokens [Hkv, M, T] (bool), the tokens the choice without a
    limit takes (``kr_wanted``, bool; the refined ones unless ``policy.tier_aware``), those of them read at
    depth W in every channel (``kr_full``), their planes past the limit per row [M] (``kr_caps``, 1 bit
    per token and channel) and what they cost without it [M] (``kr_wanted_bits``).

    A token's logit error has variance ``scale^2 sum_c (q~ sigma)_c^2 D(t_c)`` (D: the tree's
    distortion per depth), the same for every token of a head; its effect on the output grows with
    p_i^2. So a block's benefit is ``sum_h p_{h,i}^2 * var_h`` over its tokens and its cost is
    ``n_tokens * sum_c (W - t_c)`` bits; blocks are taken by benefit per bit, in order, while the
    row's budget [M] (bits per KV head; times Hkv when pooled) lasts. Under a limit the choice is the
    unlimited one, each chosen token read at its limit (the planes past it are caps), or with
    ``policy.tier_aware`` a choice whose benefit and cost stop at the limit."""
    hk, g, m, t_max = logits.shape
    dev = logits.device
    w = policy.width
    p = torch.softmax((logits * scale).masked_fill(~mask, float("-inf")), dim=-1)
    dtab = torch.tensor(distortion, dtype=torch.float32, device=dev)  # [W + 1]
    t_perm = t_dep.to(dev).permute(1, 0, 2)  # [Hkv, M, d]
    var = ((qs * qs) * dtab[t_perm][:, None]).sum(-1) * scale * scale  # [Hkv, G, M]
    imp = (p * p * var[..., None]).sum(1)  # [Hkv, M, T]
    per_tok = (w - t_perm).sum(-1)  # [Hkv, M] bits to refine one token
    tok_cost = per_tok[:, :, None].expand(hk, m, t_max)  # [Hkv, M, T]
    wanted, _ = _refine_choice(imp, tok_cost, budget, mask, policy)
    lim3 = None if lim is None else (lim[:, None, :].expand(hk, t_max, lim.shape[-1]) if lim.dim() == 2 else lim)
    sel_t = wanted
    if lim3 is not None and policy.tier_aware:  # benefit and cost stop at each token's limit
        gain = (qs * qs * scale * scale) @ dtab[lim3].transpose(1, 2)[:, None]  # [Hkv, G, M, T] error left at it
        imp_l = (p * p * (var[..., None] - gain)).sum(1)
        cost_l = (lim3[:, None] - t_perm[:, :, None]).clamp_min(0).sum(-1)  # [Hkv, M, T]
        sel_t, _ = _refine_choice(imp_l, cost_l, budget, mask, policy)
    if lim3 is None:
        bits = (sel_t * tok_cost).sum((0, 2)).double()
        full_t, caps, read_at = sel_t, torch.zeros(m, dtype=torch.float64), None
    else:
        read_cost = (lim3[:, None] - t_perm[:, :, None]).clamp_min(0).sum(-1)  # [Hkv, M, T] bits at the limit
        bits = (sel_t * read_cost).sum((0, 2)).double()
        on = (lim3 >= w).all(-1)[:, None, :]  # [Hkv, 1, T]: the token's Key page is resident
        full_t = wanted & sel_t & on
        caps = (wanted & ~on) * (w - lim3).sum(-1)[:, None, :]  # [Hkv, M, T]
        caps = caps.sum((0, 2)).double()
        read_at = lim3
    wanted_bits = (wanted * tok_cost).sum((0, 2)).double()
    if not bool(sel_t.any()):
        return logits, bits.cpu(), sel_t, wanted, full_t, caps.cpu(), wanted_bits.cpu()
    kz = table[w][codes] if read_at is None else table.reshape(-1)[read_at * table.shape[1] + codes]
    full = (qt * mu_k[:, None, None, :]).sum(-1, keepdim=True) + qs @ kz.transpose(1, 2)[:, None]
    return (torch.where(sel_t[:, None], full, logits), bits.cpu(), sel_t, wanted, full_t, caps.cpu(),
            wanted_bits.cpu())


def _refine_choice(imp: torch.Tensor, tok_cost: torch.Tensor, budget: torch.Tensor, mask: torch.Tensor,
                   policy: ReadPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """imp, tok_cost [Hkv, M, T] (benefit, bits per token) -> the chosen tokens [Hkv, M, T] (bool) and the bits
    they cost per row [M]: blocks of ``key_refine_block`` tokens by benefit per bit while the budget [M] lasts."""
    hk, m, t_max = imp.shape
    dev = imp.device
    blk = policy.key_refine_block
    nb = -(-t_max // blk)
    pad = nb * blk - t_max
    imp_b = torch.nn.functional.pad(imp, (0, pad)).view(hk, m, nb, blk).sum(-1)  # [Hkv, M, NB]
    cost = torch.nn.functional.pad(tok_cost * mask[None], (0, pad)).view(hk, m, nb, blk).sum(-1).double()
    score = torch.where(cost > 0, imp_b.double() / cost.clamp_min(1.0), torch.full_like(cost, -1.0))
    if policy.pool_heads:
        score_r, cost_r = score.permute(1, 0, 2).reshape(m, hk * nb), cost.permute(1, 0, 2).reshape(m, hk * nb)
        bud = budget.to(dev).double() * hk
    else:
        score_r, cost_r = score.reshape(hk * m, nb), cost.reshape(hk * m, nb)
        bud = budget.to(dev).double()[None, :].expand(hk, m).reshape(hk * m)
    order = torch.argsort(score_r, dim=1, descending=True, stable=True)  # ties: (head, position)
    c_sorted = torch.gather(cost_r, 1, order)
    take_sorted = (c_sorted.cumsum(1) <= bud[:, None]) & (torch.gather(score_r, 1, order) >= 0)
    take = torch.zeros_like(take_sorted).scatter(1, order, take_sorted)
    spent = (take * cost_r)
    if policy.pool_heads:
        sel = take.view(m, hk, nb).permute(1, 0, 2)
        bits = spent.sum(1)
    else:
        sel = take.view(hk, m, nb)
        bits = spent.view(hk, m, nb).sum((0, 2))
    return sel.repeat_interleave(blk, dim=2)[..., :t_max] & mask[None], bits


def readkv_decode(q: torch.Tensor, cache: PlaneKVCache, layer: int, codec: Codec, policy: ReadPolicy,
                  scale: float | None = None, residency: Residency | None = None) -> tuple[torch.Tensor, ReadStats]:
    """One decode step over a paged cache: q [B, Hq, d] -> out [B, Hq, d] (float32), stats [B rows].

    Planes are read from the pages at the allocated depths only (K after the Key allocation, V
    after the Value allocation). Sequences may have different lengths. With a ``residency`` (a tiered
    cache's) no depth passes it; the caps are counted per sequence as :func:`readkv_rows` counts them
    (``stats.extra["k_caps"]``, ``["v_caps"]``, ``["wanted_bits"]``, ``["k_wanted"]`` [B, Hkv, d]) and
    ``["v_wanted"]`` is a list of [Hkv, T] per sequence.
    """
    cache.check_format(codec.format_id)
    if residency is not None:
        residency.check(codec.spec, q.shape[0])
    outs, parts = [], []
    for b in range(q.shape[0]):
        t = cache.length(layer, b)
        if t == 0:
            raise ValueError(f"sequence {b} has no tokens in layer {layer}")
        lim = {} if residency is None else dict(
            k_max=residency.k_depth[b], v_max=residency.v_depth(b, t, codec.spec.page_size),
            k_page_max=residency.k_token_depth(b, t, codec.spec.page_size))
        out, st = readkv_rows(
            q[b][:, None, :], lambda dep, b=b: cache.read_k(layer, b, dep),
            lambda dep, b=b: cache.read_v(layer, b, dep), codec, layer, policy,
            torch.tensor([t]), scale=scale, **lim)
        refined = st.extra["k_refined"][:, 0] if "k_refined" in st.extra else None  # [Hkv, T]
        st.physical_bytes = cache.physical_read_bytes(layer, b, st.k_depths[0], st.v_depths[0], refined)
        outs.append(out[:, 0])
        parts.append(st)
    stats = ReadStats.concat(parts)
    stats.k_depths = torch.cat([p.k_depths for p in parts])  # type: ignore[misc]
    stats.extra["v_depths"] = [p.v_depths[0] for p in parts]  # type: ignore[index]
    if policy.key_refine:
        stats.extra["k_refined"] = [p.extra["k_refined"][:, 0] for p in parts]  # per sequence [Hkv, T]
    if residency is not None:
        for key in ("k_caps", "v_caps", "kr_caps", "wanted_bits", "k_wanted"):
            stats.extra[key] = torch.cat([p.extra[key] for p in parts])
        stats.extra["v_wanted"] = [p.extra["v_wanted"][0] for p in parts]  # per sequence [Hkv, T]
        if policy.key_refine:  # per sequence [Hkv, T] bool; [B]
            stats.extra["kr_wanted"] = [p.extra["kr_wanted"][:, 0] for p in parts]
            stats.extra["kr_full"] = [p.extra["kr_full"][:, 0] for p in parts]
            stats.extra["kr_wanted_bits"] = torch.cat([p.extra["kr_wanted_bits"] for p in parts])
    return torch.stack(outs), stats


def readkv_teacher_forced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, codec: Codec, layer: int,
                          policy: ReadPolicy, scale: float | None = None, window: int | None = None,
                          row_chunk: int = 512) -> tuple[torch.Tensor, ReadStats]:
    """Causal pass over a whole sequence: q [Hq, N, d], k/v [Hkv, N, d] (model domain).

    K/V are encoded once (the write path); row i then reads tokens [0, i] (or the last ``window``
    tokens) with its own depths, as decode step i would. Rows are processed in chunks to bound
    memory; the result does not depend on the chunking.
    """
    n = q.shape[1]
    kc = codec.encode_k(k, layer)
    vc = codec.encode_v(v, layer)
    lengths = torch.arange(1, n + 1)
    starts = torch.zeros_like(lengths) if window is None else (lengths - window).clamp_min(0)
    outs, parts = [], []
    for s in range(0, n, row_chunk):
        e = min(n, s + row_chunk)
        out, st = readkv_rows(q[:, s:e], kc[:, :e], vc[:, :e], codec, layer, policy,
                              lengths[s:e], starts[s:e], scale)
        outs.append(out)
        st.k_depths, st.v_depths = None, None  # rows of different T: keep only the bit counts
        parts.append(st)
    stats = ReadStats.concat(parts)
    stats.workspace_bytes = max(p.workspace_bytes for p in parts)
    return torch.cat(outs, 1), stats


class ReadKV(KVSystem):
    """The two-stage reader as a system: encode with the codec, read with a ReadPolicy."""

    def __init__(self, codec: Codec, policy: ReadPolicy) -> None:
        self.codec = codec
        self.policy = policy
        self.name = policy.label

    def describe(self) -> dict:
        return {"system": "readkv", "policy": self.policy.to_dict(), "format_id": self.codec.format_id}

    def capacity_bits(self, n_tokens: int, head_dim: int) -> float:
        return float(self.codec.width)

    def encode(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> dict:
        return {"k": self.codec.encode_k(k, layer), "v": self.codec.encode_v(v, layer), "layer": layer}

    def attend(self, q: torch.Tensor, enc: dict, lengths: torch.Tensor, starts: torch.Tensor | None = None,
               scale: float | None = None) -> tuple[torch.Tensor, ReadStats]:
        return readkv_rows(q, enc["k"], enc["v"], self.codec, enc["layer"], self.policy, lengths, starts, scale)


# planekv-flexible = PlaneKV's flexible reader: readkv-flexible + Key refinement (PLANEKV_KEY_REFINE)
SYSTEM_NAMES = ("dense", "readkv-flexible", "planekv-flexible", "readkv-constrained", "full-reader", "turboquant",
                "kivi", "sparq", "fp8")


def make_system(name: str, rate: float, codec: Codec | None = None, k_share: float = 0.5,
                seed: int = 1234) -> KVSystem:
    """A system of SYSTEM_NAMES at a rate R (bits per scalar; fixed-bit systems round it)."""
    b = max(1, int(round(rate)))
    if name == "dense":
        return Dense(torch.float16)
    if name in ("readkv-flexible", "planekv-flexible", "readkv-constrained", "full-reader"):
        if codec is None:
            raise ValueError(f"{name} needs a codec")
        if name == "full-reader":
            return FullReader(codec, b)
        if name == "readkv-constrained":
            return ReadKV(codec, ReadPolicy.constrained(rate, codec.width))
        kr = {"key_refine": PLANEKV_KEY_REFINE} if name == "planekv-flexible" else {}
        return ReadKV(codec, ReadPolicy.flexible(rate, k_share, codec.width, **kr))
    if name == "turboquant":
        return TurboQuant(b, seed)
    if name == "kivi":
        return KIVI(b)
    if name == "sparq":
        return SparQ(rate)
    if name == "fp8":
        return FP8()
    raise ValueError(f"unknown system {name!r}; known: {SYSTEM_NAMES}")
