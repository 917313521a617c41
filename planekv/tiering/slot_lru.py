"""SlotLru: the promotion cache's slots, handed out least recently used first, many at a time.

A slot's recency is a stamp (``stamp`` [n] int64): touching slots gives them the next stamps of a clock, in the
order given, so the last touched is the most recent; a free slot's stamp is below every held one, so free slots
go first, the most recently released first (a stack, as a free list would be). Taking m slots is a top-k (or
one sort, for many): the m lowest stamps. Nothing here loops over items in Python, so a prefetch that keeps
thousands of resident channel-planes a step costs a few tensor ops instead of thousands of dictionary moves.

Each held slot records its owner as one int64 (``owner`` [n], -1 when free): the caller's encoding of what the
slot holds (a page id, or a flat index into a Key channel-plane table), so an eviction can clear the caller's
table in one indexed write. Slots ``[0, reserved)`` are never handed out (the open pages' slots).
"""

from __future__ import annotations

import torch

_FREE_BASE = -(1 << 40)  # stamps of slots free from the start (held stamps count up from 0, releases down from here)


class SlotLru:
    """``n`` slots, ``[0, reserved)`` kept out of the LRU; the rest taken lowest stamp first."""

    def __init__(self, n: int, reserved: int = 0) -> None:
        if not 0 <= reserved <= n:
            raise ValueError(f"reserved slots must be in [0, {n}], got {reserved}")
        self.n = n
        self.reserved = reserved
        self.owner = torch.full((n,), -1, dtype=torch.int64)  # [n] what each slot holds (-1: free)
        # [n]: free slots first, slot `reserved` first of them; reserved slots never (the largest stamp)
        self.stamp = torch.arange(n, dtype=torch.int64) + _FREE_BASE
        self.stamp[:reserved] = torch.iinfo(torch.int64).max
        self._clock = 0  # the next stamp of a touched or taken slot
        self._low = _FREE_BASE - 1  # the next stamp of a released slot (below every other)

    @property
    def capacity(self) -> int:
        """Slots the LRU hands out."""
        return self.n - self.reserved

    @property
    def held(self) -> int:
        """Slots holding something now."""
        return int((self.owner[self.reserved:] >= 0).sum())

    def touch(self, slots: torch.Tensor) -> None:
        """Mark ``slots`` [m] (distinct, held) most recently used, the last the most recent; slots outside the
        LRU (reserved, or past ``n``: a deep Key channel's pinned plane) are ignored."""
        slots = slots.to(torch.int64)
        slots = slots[(slots >= self.reserved) & (slots < self.n)]
        self.stamp[slots] = self._clock + torch.arange(slots.numel(), dtype=torch.int64)
        self._clock += slots.numel()

    def take(self, owners: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slots for ``owners`` [m] (in order: the last becomes the most recent), least recently used first.
        Returns (kept [k] bool mask over ``owners``: those that hold a slot at the end, slots [k] theirs,
        evicted [e] the owners whose slots were taken). With more owners than slots, taking goes round the slots in
        LRU order as one take at a time would, so the last ``capacity`` owners keep theirs."""
        owners = owners.to(torch.int64)
        m, cap = owners.numel(), self.capacity
        kept = torch.zeros(m, dtype=torch.bool)
        if m == 0 or cap == 0:
            return kept, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        stamps = self.stamp[self.reserved:]  # [cap], distinct: a sort and a top-k give the same order
        if m * 8 < cap:  # a few slots (a page sealed): the m least recent, without sorting them all
            order = self.reserved + torch.topk(stamps, m, largest=False, sorted=True).indices
        else:
            order = self.reserved + torch.sort(stamps).indices  # [cap] least recently used first
        used = order[: min(m, cap)]
        evicted = self.owner[used]
        evicted = evicted[evicted >= 0]
        first = max(0, m - cap)  # owners before it lose their slot to a later one
        kept[first:] = True
        slots = order[torch.arange(first, m) % cap]
        self.owner[slots] = owners[first:]
        self.stamp[slots] = self._clock + torch.arange(m - first, dtype=torch.int64)
        self._clock += m - first
        return kept, slots, evicted

    def release(self, slots: torch.Tensor | list[int] | int) -> None:
        """Free ``slots`` (the last released is taken first); slots outside the LRU are ignored."""
        slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
        slots = slots[(slots >= self.reserved) & (slots < self.n)]
        self.owner[slots] = -1
        self.stamp[slots] = self._low - torch.arange(slots.numel(), dtype=torch.int64)
        self._low -= slots.numel()


def first_occurrences(keys: torch.Tensor) -> torch.Tensor:
    """keys [m] int64 -> [m] bool: True at the first place each key appears (an item listed twice counts once)."""
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    _, inverse = torch.unique(keys, return_inverse=True)
    pos = torch.arange(keys.numel())
    first = torch.full((int(inverse.max()) + 1,), keys.numel(), dtype=torch.int64).scatter_reduce(
        0, inverse, pos, reduce="amin")
    return first[inverse] == pos
