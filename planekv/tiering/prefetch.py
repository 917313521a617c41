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


class PromotionTarget(Protocol):
    """What prefetch promotes into (a :class:`~planekv.tiering.tiered_cache.TieredCache`)."""

    spec: object
    hot_k: list[int]
    hot_v: list[int]

    def residency(self, layer: int) -> Residency: ...

    def promotion_slots(self, layer: int) -> tuple[int, int]: ...

    def promote_keys(self, layer: int, planes: list[tuple[int, int, int, int]]) -> int: ...

    def promote_values(self, layer: int, pages: list[tuple[int, int, int]]) -> int: ...

    def key_page_slots(self, layer: int) -> int: ...

    def promote_key_pages(self, layer: int, pages: list[tuple[int, int, int]]) -> int: ...


@dataclass(frozen=True)
class PrefetchPlan:
    """Items to keep (already resident) and to bring, in order: Key channel-planes (b, h, c, j), Value pages
    (b, h, page slot), Key pages (b, h, page slot)."""

    k_keep: list[tuple[int, int, int, int]]
    k_fetch: list[tuple[int, int, int, int]]
    v_keep: list[tuple[int, int, int]]
    v_fetch: list[tuple[int, int, int]]
    kp_keep: list[tuple[int, int, int]] = field(default_factory=list)
    kp_fetch: list[tuple[int, int, int]] = field(default_factory=list)
    missed: int = 0  # items left out: their remote pages did not arrive by the deadline


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
        v_keep, v_fetch = self._values(stats.extra["v_wanted"], residency, hot_v, page_size, v_slots)
        kp_keep: list[tuple[int, int, int]] = []
        kp_fetch: list[tuple[int, int, int]] = []
        if "kr_wanted" in stats.extra and residency.k_page_depth is not None:
            kp_keep, kp_fetch = self._key_pages(stats.extra["kr_wanted"], residency.k_page_depth, hot_k, page_size,
                                                kp_slots)
        return PrefetchPlan(k_keep, k_fetch, v_keep, v_fetch, kp_keep, kp_fetch)

    def _keys(self, wanted: torch.Tensor, resident: torch.Tensor, hot: int, slots: int,
              pinned: torch.Tensor | None = None, width: int = 8) -> tuple[list[tuple[int, int, int, int]],
                                                                          list[tuple[int, int, int, int]]]:
        """wanted, resident [B, Hkv, d]: channel-planes [hot, wanted) per channel (from the pinned depth where one
        is given, [B, Hkv, d]: those below it are never evicted), deepest wants first; then the margin planes
        [wanted, wanted + k_margin) of every channel that reaches past the hot ones, deepest channels first. Kept
        items are ordered least wanted first (margin planes before wanted ones) so that the most wanted are the most
        recently used; margin planes are brought only into room the wanted ones leave."""
        start = torch.full_like(wanted, hot) if pinned is None else pinned.to(wanted).clamp_min(hot)
        reach = (wanted + self.k_margin).clamp_max(width)  # [B, Hkv, d] the depth asked for, margin included
        deficit = (wanted - start).clamp_min(0)  # [B, Hkv, d] planes asked for past the hot (and pinned) ones
        margin = (reach - torch.maximum(wanted, start)).clamp_min(0)  # [B, Hkv, d] margin planes past those
        keep, fetch, m_keep, m_fetch = [], [], [], []
        # the channels asked past the hot planes [n, 3], and their values gathered once as lists (indexing a tensor
        # per item costs microseconds each: thousands of channels at B = 32)
        idx = deficit.nonzero()
        cols = [t[idx[:, 0], idx[:, 1], idx[:, 2]].tolist() for t in (deficit, resident, start, wanted)]
        chans = sorted(zip(idx.tolist(), *cols, strict=True), key=lambda x: -x[1])
        for (b, h, c), _, r, lo, hi in chans:
            for j in range(lo, hi):
                (keep if j < r else fetch).append((b, h, c, j))
        idx = margin.nonzero()
        cols = [t[idx[:, 0], idx[:, 1], idx[:, 2]].tolist() for t in (wanted, resident, start, reach)]
        m_chans = sorted(zip(idx.tolist(), *cols, strict=True), key=lambda x: -x[1])
        for (b, h, c), want, r, st, hi in m_chans:
            for j in range(max(want, st), hi):
                (m_keep if j < r else m_fetch).append((b, h, c, j))
        fetch = fetch[: self._room(len(keep), slots, self.k_planes_per_step)]
        limit = None if self.k_planes_per_step is None else self.k_planes_per_step - len(fetch)
        m_fetch = m_fetch[: self._room(len(keep) + len(fetch) + len(m_keep), slots, limit)]
        return m_keep[::-1] + keep[::-1], fetch + m_fetch

    def _values(self, wanted: list[torch.Tensor], residency: Residency, hot: int, page_size: int,
                slots: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """wanted: per sequence [Hkv, T]; pages ranked by the planes their tokens asked for past ``hot``."""
        ranked: list[tuple[float, int, int, int, bool]] = []
        for b, w_b in enumerate(wanted):
            hk_n, t = w_b.shape
            n_sealed = t // page_size  # the open page is always resident
            if n_sealed == 0:
                continue
            demand = (w_b[:, : n_sealed * page_size] - hot).clamp_min(0).view(hk_n, n_sealed, page_size).sum(-1)
            on = residency.v_page_depth[b, :, :n_sealed] > hot  # [Hkv, sealed]
            idx = demand.nonzero()
            hs, ss = idx[:, 0], idx[:, 1]
            ranked += [(float(dm), b, h, s, o) for (h, s), dm, o in
                       zip(idx.tolist(), demand[hs, ss].tolist(), on[hs, ss].tolist(), strict=True)]
        ranked.sort(key=lambda x: -x[0])
        keep = [(b, h, s) for _, b, h, s, on in reversed(ranked) if on]
        fetch = [(b, h, s) for _, b, h, s, on in ranked if not on]
        return keep, fetch[: self._room(len(keep), slots, self.v_pages_per_step)]

    def _key_pages(self, wanted: list[torch.Tensor], page_depth: torch.Tensor, hot: int, page_size: int,
                   slots: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """wanted: per sequence [Hkv, T] bool (tokens the refinement chose); page_depth [B, Hkv, slots]: sealed Key
        pages ranked by their chosen tokens."""
        ranked: list[tuple[int, int, int, int, bool]] = []
        for b, w_b in enumerate(wanted):
            hk_n, t = w_b.shape
            n_sealed = t // page_size  # the open page is always resident
            if n_sealed == 0:
                continue
            demand = w_b[:, : n_sealed * page_size].view(hk_n, n_sealed, page_size).sum(-1)  # [Hkv, sealed]
            on = page_depth[b, :, :n_sealed] > hot
            idx = demand.nonzero()
            hs, ss = idx[:, 0], idx[:, 1]
            ranked += [(int(dm), b, h, s, o) for (h, s), dm, o in
                       zip(idx.tolist(), demand[hs, ss].tolist(), on[hs, ss].tolist(), strict=True)]
        ranked.sort(key=lambda x: -x[0])
        keep = [(b, h, s) for _, b, h, s, on in reversed(ranked) if on]
        fetch = [(b, h, s) for _, b, h, s, on in ranked if not on]
        return keep, fetch[: self._room(len(keep), slots, self.k_pages_per_step)]

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
            target.promote_keys(layer, plan.k_keep + plan.k_fetch)
            target.promote_values(layer, plan.v_keep + plan.v_fetch)
            if plan.kp_keep or plan.kp_fetch:
                target.promote_key_pages(layer, plan.kp_keep + plan.kp_fetch)
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

        need: list[tuple[tuple[str, str, int, int], int]] = []
        for b, h in dict.fromkeys((b, h) for b, h, _, _ in plan.k_fetch):
            need += k_pages(b, h)
        need += [((seqs[b], "v", layer, h), s) for b, h, s in plan.v_fetch]
        need += [((seqs[b], "k", layer, h), s) for b, h, s in plan.kp_fetch]
        missing = host.fetch_within(need, deadline)
        if not missing:
            return plan
        k_fetch = [it for it in plan.k_fetch if not any(pg in missing for pg in k_pages(it[0], it[1]))]
        v_fetch = [it for it in plan.v_fetch if ((seqs[it[0]], "v", layer, it[1]), it[2]) not in missing]
        kp_fetch = [it for it in plan.kp_fetch if ((seqs[it[0]], "k", layer, it[1]), it[2]) not in missing]
        missed = len(plan.k_fetch) + len(plan.v_fetch) + len(plan.kp_fetch) - len(k_fetch) - len(v_fetch) \
            - len(kp_fetch)
        return PrefetchPlan(plan.k_keep, k_fetch, plan.v_keep, v_fetch, plan.kp_keep, kp_fetch, missed)


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
        """Count one step of ``layer`` (stats of a read under a residency)."""
        ex = stats.extra
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
        d = stats.head_dim
        for v_read, v_want in zip(ex["v_depths"], ex["v_wanted"], strict=True):
            self.beyond_hot_bits += d * float((v_want - hot_v).clamp_min(0).sum())
            self.served_bits += d * float((torch.minimum(v_read, v_want) - hot_v).clamp_min(0).sum())
        if "kr_wanted" in ex:  # a chosen token wants every channel from its depth to W; those below h_K are hot
            for b, (want_b, full_b) in enumerate(zip(ex["kr_wanted"], ex["kr_full"], strict=True)):
                hot_part = (stats.k_depths[b].clamp_min(hot_k) - stats.k_depths[b]).sum(-1)  # [Hkv] per token
                beyond = float(ex["kr_wanted_bits"][b]) - float((want_b.sum(-1) * hot_part).sum())
                self.beyond_hot_bits += beyond
                self.served_bits += beyond - float(kr_caps[b])
                self.kr_wanted += int(want_b.sum())
                self.kr_served += int((want_b & full_b).sum())
        plan = self._pending.pop(layer, None)
        if plan is not None:  # of the items fetched for this step, those it read
            self.fetched += len(plan.k_fetch) + len(plan.v_fetch) + len(plan.kp_fetch)
            self.fetched_k += len(plan.k_fetch)
            self.fetched_v += len(plan.v_fetch)
            self.fetched_kp += len(plan.kp_fetch)
            if "kr_full" in ex:
                for b, h, s in plan.kp_fetch:
                    self.fetched_used += int(bool(ex["kr_full"][b][h, s * page_size: (s + 1) * page_size].any()))
            self.fetched_used += sum(int(k_read[b, h, c]) > j for b, h, c, j in plan.k_fetch)
            for b, h, s in plan.v_fetch:
                page = ex["v_depths"][b][h, s * page_size: (s + 1) * page_size]
                self.fetched_used += int(bool((page > hot_v).any()))

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
