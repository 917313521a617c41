"""Prefetch (docs/TIERING.md): the previous step's importance picks the refinement planes to promote for the next.

Consecutive decode steps attend to similar tokens and read similar Key channels deeply. After a step of one layer,
its *unlimited* allocations (``stats.extra["k_wanted"]`` [B, Hkv, d] and ``["v_wanted"]``, per sequence [Hkv, T]:
what the step would have read with every plane resident) say what depth it wanted past the hot planes:

- **Keys**: every channel whose wanted depth passes its hot depth ``h_K`` asks for planes ``[h_K, wanted)``, over
  every page of its head (a Key channel's depth applies to every token).
- **Values**: every sealed page whose tokens wanted depth past ``h_V`` asks for its refinement planes; pages are
  ranked by the planes they asked for beyond ``h_V`` (their demand).
- **Key pages** (Key refinement): every sealed Key page holding a token the step's refinement chose
  (``stats.extra["kr_wanted"]``, per sequence [Hkv, T]: its unlimited selection) asks for every channel's
  refinement planes; pages are ranked by their chosen tokens.

Items already resident are touched first (kept from eviction, least demanded first so the most demanded are the
most recent); then missing items are brought, most demanded first, up to the per-step limits and never more than
the free room that does not evict an item this plan just touched. :class:`StepTally` counts what each step wanted
past the hot planes, what was served from the promotion cache (the hit rate) and what was capped.

**Deadlines** (``run(..., deadline=)``, ``tiered_decode_step`` passes the step's ``ReadPolicy.deadline_ms``): the
items to bring whose pages are held only by the remote tier are fetched by the deadline
(``HostTier.fetch_within``) before anything is promoted; an item whose pages did not arrive is left out of the
plan (``PrefetchPlan.missed``), so the next step reads it at the resident depth, a cap it counts. Local pages
(memory, spill files) are not subject to the deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..kvstore import Residency
from ..kvstore.stats import ReadStats
from .demand import step_demand


class PromotionTarget(Protocol):
    """What prefetch promotes into (a :class:`~planekv.tiering.tiered_cache.TieredCache`)."""

    spec: object
    hot_k: list[int]
    hot_v: list[int]

    def residency(self, layer: int) -> Residency: ...

    def promotion_slots(self, layer: int) -> tuple[int, int]: ...

    def promote_keys(self, layer: int, planes: torch.Tensor) -> int: ...

    def promote_values(self, layer: int, pages: torch.Tensor) -> int: ...

    def key_page_slots(self, layer: int) -> int: ...

    def promote_key_pages(self, layer: int, pages: torch.Tensor) -> int: ...


def _none(width: int) -> torch.Tensor:
    return torch.zeros(0, width, dtype=torch.int64)


@dataclass(frozen=True)
class PrefetchPlan:
    """Items to keep (already resident) and to bring, in order, as int64 CPU tensors: Key channel-planes [n, 4]
    (b, h, c, j), Value pages [n, 3] (b, h, page slot), Key pages [n, 3] (b, h, page slot)."""

    k_keep: torch.Tensor
    k_fetch: torch.Tensor
    v_keep: torch.Tensor
    v_fetch: torch.Tensor
    kp_keep: torch.Tensor = field(default_factory=lambda: _none(3))
    kp_fetch: torch.Tensor = field(default_factory=lambda: _none(3))
    missed: int = 0  # items left out: their remote pages did not arrive by the deadline

    @property
    def n_fetch(self) -> int:
        return self.k_fetch.shape[0] + self.v_fetch.shape[0] + self.kp_fetch.shape[0]


def _channel_planes(rank: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, resident: torch.Tensor, hot: int,
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-planes [lo, hi) of every channel asking for some (lo < hi; all [B, Hkv, d]), channels ranked by
    ``rank`` (the highest first, ties in (b, h, c) order), planes in order within a channel; split into resident
    (j below the channel's ``resident`` depth) and missing. Returns (resident, missing), [n, 4] (b, h, c, j)."""
    idx = (hi > lo).nonzero()  # [n, 3] row-major
    b, h, c = idx.unbind(1)
    order = torch.sort(-rank[b, h, c], stable=True).indices
    idx = idx[order]
    b, h, c = idx.unbind(1)
    j = torch.arange(hot, width, dtype=torch.int64)  # [J] every refinement plane
    asked = (j >= lo[b, h, c][:, None]) & (j < hi[b, h, c][:, None])  # [n, J]
    on = j < resident[b, h, c][:, None]  # [n, J]
    grid = torch.cat([idx[:, None, :].expand(-1, j.numel(), 3), j[None, :, None].expand(idx.shape[0], -1, 1)], 2)
    return grid[asked & on], grid[asked & ~on]


@dataclass(frozen=True)
class Prefetcher:
    """Per layer and step, at most ``k_planes_per_step`` Key channel-planes, ``v_pages_per_step`` Value pages and
    ``k_pages_per_step`` Key pages are brought (None: as many as the promotion cache / Key page slots hold).

    ``k_margin``: Key planes asked for past each channel's wanted depth (up to W), after every plane actually
    wanted: a channel's depth drifts by a plane or two from one step to the next, and one channel read a plane short
    moves that channel's logit for every token (EVALUATION.md, "Through the tiered reader")."""

    k_planes_per_step: int | None = None
    v_pages_per_step: int | None = None
    k_pages_per_step: int | None = None
    k_margin: int = 1

    def __post_init__(self) -> None:
        for name in ("k_planes_per_step", "v_pages_per_step", "k_pages_per_step"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {v}")
        if self.k_margin < 0:
            raise ValueError(f"k_margin must be >= 0, got {self.k_margin}")

    def plan(self, stats: ReadStats, residency: Residency, hot_k: int, hot_v: int, page_size: int,
             k_slots: int, v_slots: int, kp_slots: int = 0, k_pinned: torch.Tensor | None = None,
             width: int = 8) -> PrefetchPlan:
        """What to promote after a step whose stats carry ``k_wanted`` / ``v_wanted`` (a read under ``residency``)
        and, with Key refinement, ``kr_wanted``. ``k_slots`` / ``v_slots`` / ``kp_slots``: the promotion cache's
        and the Key page slots' capacity (items) for this layer. ``k_pinned`` [B, Hkv, d]: the Key depth each
        channel has pinned (deep Key channels; None: h_K), whose planes are neither kept nor brought. ``width``:
        the format's planes W (``k_margin`` asks for none past it)."""
        if "k_wanted" not in stats.extra:
            raise ValueError("prefetch needs a read under a residency (its stats carry k_wanted and v_wanted)")
        k_keep, k_fetch = self._keys(stats.extra["k_wanted"], residency.k_depth, hot_k, k_slots, k_pinned, width)
        demand = step_demand(stats, hot_v, page_size)
        v_keep, v_fetch = self._pages(demand.v_pages, residency.v_page_depth, hot_v, v_slots, self.v_pages_per_step)
        kp_keep, kp_fetch = _none(3), _none(3)
        if demand.kr_pages is not None and residency.k_page_depth is not None:
            kp_keep, kp_fetch = self._pages(demand.kr_pages, residency.k_page_depth, hot_k, kp_slots,
                                            self.k_pages_per_step)
        return PrefetchPlan(k_keep, k_fetch, v_keep, v_fetch, kp_keep, kp_fetch)

    def _keys(self, wanted: torch.Tensor, resident: torch.Tensor, hot: int, slots: int,
              pinned: torch.Tensor | None = None, width: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """wanted, resident [B, Hkv, d]: channel-planes [hot, wanted) per channel (from the pinned depth where one
        is given, [B, Hkv, d]: those below it are never evicted), deepest wants first; then the margin planes
        [wanted, wanted + k_margin) of every channel that reaches past the hot ones, deepest channels first. Kept
        items are ordered least wanted first (margin planes before wanted ones) so that the most wanted are the most
        recently used; margin planes are brought only into room the wanted ones leave. Returns (keep, fetch),
        [n, 4] (b, h, c, j)."""
        wanted, resident = wanted.cpu().long(), resident.cpu().long()
        start = torch.full_like(wanted, hot) if pinned is None else pinned.cpu().long().clamp_min(hot)
        reach = (wanted + self.k_margin).clamp_max(width)  # [B, Hkv, d] the depth asked for, margin included
        deficit = (wanted - start).clamp_min(0)  # [B, Hkv, d] planes asked for past the hot (and pinned) ones
        # the margin planes: [max(wanted, start), reach) of every channel, ranked by its wanted depth
        keep, fetch = _channel_planes(deficit, start, wanted, resident, hot, width)
        m_keep, m_fetch = _channel_planes(wanted, torch.maximum(wanted, start), reach, resident, hot, width)
        fetch = fetch[: self._room(keep.shape[0], slots, self.k_planes_per_step)]
        limit = None if self.k_planes_per_step is None else self.k_planes_per_step - fetch.shape[0]
        m_fetch = m_fetch[: self._room(keep.shape[0] + fetch.shape[0] + m_keep.shape[0], slots, limit)]
        return torch.cat([m_keep.flip(0), keep.flip(0)]), torch.cat([fetch, m_fetch])

    def _pages(self, demand: torch.Tensor, page_depth: torch.Tensor, hot: int, slots: int,
               limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """demand [B, Hkv, S] (:class:`~planekv.tiering.demand.StepDemand`'s ``v_pages`` or ``kr_pages``: zero
        for the open page and past a sequence's sealed pages), page_depth [B, Hkv, slots]: the pages with demand,
        the most demanded first, split into resident (deeper than ``hot``) and missing. Returns (keep, fetch),
        [n, 3] (b, h, page slot): keep least demanded first."""
        items_t = demand.nonzero()  # [n, 3] (b, h, s), row-major
        if not items_t.shape[0]:
            return _none(3), _none(3)
        b, h, s = items_t.unbind(1)
        demand_t, on_t = demand[b, h, s], page_depth.cpu()[b, h, s] > hot
        order = torch.sort(-demand_t, stable=True).indices  # the most demanded first, ties in (b, h, s) order
        items_t, on_t = items_t[order], on_t[order]
        keep = items_t[on_t].flip(0)
        fetch = items_t[~on_t]
        return keep, fetch[: self._room(keep.shape[0], slots, limit)]

    @staticmethod
    def _room(kept: int, slots: int, limit: int | None) -> int:
        room = max(0, slots - kept)  # bringing more would evict what this plan keeps
        return room if limit is None else min(room, limit)

    def run(self, target: PromotionTarget, layer: int, stats: ReadStats, residency: Residency,
            deadline: float | None = None) -> PrefetchPlan:
        """Plan after a step of ``layer`` and promote into ``target``; returns the plan. ``deadline``
        (``time.monotonic()`` seconds): remote pages that do not arrive by then are not promoted (the module
        docstring)."""
        k_slots, v_slots = target.promotion_slots(layer)
        pinned = getattr(target, "pinned_k_depth", None)  # deep Key channels' pinned planes: never evicted
        plan = self.plan(stats, residency, target.hot_k[layer], target.hot_v[layer],
                         target.spec.page_size, k_slots, v_slots, target.key_page_slots(layer),  # type: ignore[attr-defined]
                         None if pinned is None else pinned(layer), target.spec.width)  # type: ignore[attr-defined]
        host = getattr(target, "host", None)
        timed = deadline is not None and host is not None and getattr(host, "remote", None) is not None
        if timed:
            plan = self._within_deadline(target, layer, plan, deadline)  # type: ignore[arg-type]
        try:
            target.promote_keys(layer, torch.cat([plan.k_keep, plan.k_fetch]))
            target.promote_values(layer, torch.cat([plan.v_keep, plan.v_fetch]))
            if plan.kp_keep.shape[0] or plan.kp_fetch.shape[0]:
                target.promote_key_pages(layer, torch.cat([plan.kp_keep, plan.kp_fetch]))
        finally:
            if timed:
                host.release_staged()  # type: ignore[union-attr]
        return plan

    @staticmethod
    def _within_deadline(target: PromotionTarget, layer: int, plan: PrefetchPlan, deadline: float) -> PrefetchPlan:
        """``plan`` without the items whose pages the remote tier did not deliver by ``deadline``: a Key
        channel-plane needs every sealed Key page of its head, a Value / Key page itself."""
        host, seqs = target.host, target.sequence_ids  # type: ignore[attr-defined]
        p = target.spec.page_size  # type: ignore[attr-defined]

        def k_pages(b: int, h: int) -> list[tuple[tuple[str, str, int, int], int]]:
            stream = (seqs[b], "k", layer, h)
            return [(stream, s) for s in range(target.length(layer, b) // p)]  # type: ignore[attr-defined]

        k_fetch, v_fetch, kp_fetch = (t.tolist() for t in (plan.k_fetch, plan.v_fetch, plan.kp_fetch))
        need: list[tuple[tuple[str, str, int, int], int]] = []
        for b, h in dict.fromkeys((b, h) for b, h, _, _ in k_fetch):
            need += k_pages(b, h)
        need += [((seqs[b], "v", layer, h), s) for b, h, s in v_fetch]
        need += [((seqs[b], "k", layer, h), s) for b, h, s in kp_fetch]
        missing = host.fetch_within(need, deadline)
        if not missing:
            return plan
        k_ok = [not any(pg in missing for pg in k_pages(b, h)) for b, h, _, _ in k_fetch]
        v_ok = [((seqs[b], "v", layer, h), s) not in missing for b, h, s in v_fetch]
        kp_ok = [((seqs[b], "k", layer, h), s) not in missing for b, h, s in kp_fetch]
        missed = sum(not ok for ok in k_ok + v_ok + kp_ok)
        return PrefetchPlan(plan.k_keep, plan.k_fetch[torch.tensor(k_ok, dtype=torch.bool)], plan.v_keep,
                            plan.v_fetch[torch.tensor(v_ok, dtype=torch.bool)], plan.kp_keep,
                            plan.kp_fetch[torch.tensor(kp_ok, dtype=torch.bool)], missed)


@dataclass
class StepTally:
    """Running totals over steps, in bits: asked for (``wanted``), capped, asked for past the hot planes and
    served from the promotion cache (the hit rate; Key refinement's bits included: a refined token wants every
    channel at depth W), and items fetched and later used. Key refinement also in tokens: those the refinement
    chose (``kr_wanted``) and those read at depth W from a promoted or open Key page (``kr_served``, the Key page
    hit rate)."""

    wanted_bits: float = 0.0
    capped_bits: float = 0.0
    beyond_hot_bits: float = 0.0
    served_bits: float = 0.0
    fetched: int = 0
    fetched_k: int = 0  # Key channel-planes
    fetched_v: int = 0  # Value pages
    fetched_kp: int = 0  # Key pages
    fetched_used: int = 0
    kr_wanted: int = 0  # tokens Key refinement chose (token x KV head)
    kr_served: int = 0  # of those, read at depth W (their Key page on the device)
    missed: int = 0  # items prefetch left out: their remote pages did not arrive by the step's deadline
    steps: int = 0
    _pending: dict[int, PrefetchPlan] = field(default_factory=dict, repr=False)

    def add(self, layer: int, stats: ReadStats, hot_k: int, hot_v: int, page_size: int) -> None:
        """Count one step of ``layer`` (stats of a read under a residency; its per-token stats are reduced to
        pages where they live, :func:`~planekv.tiering.demand.step_demand`)."""
        ex = stats.extra
        dem = step_demand(stats, hot_v, page_size)
        self.steps += 1
        self.wanted_bits += float(ex["wanted_bits"].sum())
        kr_caps = ex.get("kr_caps")
        self.capped_bits += float((ex["k_caps"] + ex["v_caps"]).sum()) + (0.0 if kr_caps is None else
                                                                          float(kr_caps.sum()))
        n_tok = stats.tokens.double()  # [B]
        k_read, k_want = stats.k_depths, ex["k_wanted"]  # [B, Hkv, d]
        self.beyond_hot_bits += float(((k_want - hot_k).clamp_min(0).sum((1, 2)).double() * n_tok).sum())
        self.served_bits += float(((torch.minimum(k_read, k_want) - hot_k).clamp_min(0).sum((1, 2)).double()
                                   * n_tok).sum())
        self.beyond_hot_bits += float(dem.v_beyond_bits.sum())
        self.served_bits += float(dem.v_served_bits.sum())
        if dem.kr_chosen is not None:  # a chosen token wants every channel from its depth to W; those below h_K are hot
            hot_part = (k_read.clamp_min(hot_k) - k_read).sum(-1)  # [B, Hkv] hot bits of a token past its depth
            beyond = ex["kr_wanted_bits"].double() - (dem.kr_chosen * hot_part).sum(-1).double()  # [B]
            self.beyond_hot_bits += float(beyond.sum())
            self.served_bits += float((beyond - kr_caps.double()).sum())
            self.kr_wanted += int(dem.kr_chosen.sum())
            self.kr_served += int(dem.kr_served.sum())
        plan = self._pending.pop(layer, None)
        if plan is not None:  # of the items fetched for this step, those it read
            self.fetched += plan.n_fetch
            self.fetched_k += plan.k_fetch.shape[0]
            self.fetched_v += plan.v_fetch.shape[0]
            self.fetched_kp += plan.kp_fetch.shape[0]
            b, h, c, j = plan.k_fetch.unbind(1)
            self.fetched_used += int((k_read.cpu()[b, h, c] > j).sum())
            # a page is used if one of its tokens read past its hot planes (Key pages: at depth W)
            for used, pages in ((dem.v_read_deep, plan.v_fetch), (dem.kr_full_pages, plan.kp_fetch)):
                if used is not None and pages.shape[0]:
                    b, h, s = pages.unbind(1)
                    self.fetched_used += int(used[b, h, s].sum())

    def fetched_for_next(self, layer: int, plan: PrefetchPlan) -> None:
        self._pending[layer] = plan
        self.missed += plan.missed

    def restart(self) -> None:
        """Zero the totals (e.g. after warm-up steps), keeping what was fetched for the next step."""
        pending = self._pending
        self.__init__()  # type: ignore[misc]
        self._pending = pending

    @property
    def hit_rate(self) -> float:
        """Share of the bits asked for past the hot planes that were served (1.0 when none were asked for)."""
        return self.served_bits / self.beyond_hot_bits if self.beyond_hot_bits else 1.0

    @property
    def kr_hit_rate(self) -> float:
        """Share of the tokens Key refinement chose that were read at depth W (1.0 when none were chosen)."""
        return self.kr_served / self.kr_wanted if self.kr_wanted else 1.0

    @property
    def cap_rate(self) -> float:
        """Share of the bits asked for that were capped."""
        return self.capped_bits / self.wanted_bits if self.wanted_bits else 0.0

    def summary(self) -> dict[str, float]:
        return {"steps": self.steps, "wanted_bits": self.wanted_bits, "capped_bits": self.capped_bits,
                "cap_rate": self.cap_rate, "beyond_hot_bits": self.beyond_hot_bits, "served_bits": self.served_bits,
                "hit_rate": self.hit_rate, "fetched": self.fetched, "fetched_k": self.fetched_k,
                "fetched_v": self.fetched_v, "fetched_kp": self.fetched_kp, "fetched_used": self.fetched_used,
                "kr_wanted": self.kr_wanted, "kr_served": self.kr_served, "kr_hit_rate": self.kr_hit_rate,
                "missed": self.missed}
