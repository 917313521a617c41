"""The promotion cache's LRU hands out slots as a one-at-a-time LRU would: free slots first (the last released
first), then the least recently used; reserved slots never; many at a time with the same result."""

from collections import OrderedDict

import pytest
import torch

from planekv.tiering.slot_lru import SlotLru, first_occurrences


class _OneAtATime:
    """The LRU as a free list and an ordered dict, one item at a time (what SlotLru must equal)."""

    def __init__(self, n: int, reserved: int) -> None:
        self.free = [s for s in range(n - 1, -1, -1) if s >= reserved]
        self.order: OrderedDict[int, int] = OrderedDict()
        self.n, self.reserved = n, reserved

    def touch(self, slot: int) -> None:
        if slot in self.order:
            self.order.move_to_end(slot)

    def take(self, owner: int) -> tuple[int, int | None]:
        if self.free:
            slot = self.free.pop()
            self.order[slot] = owner
            return slot, None
        slot, old = next(iter(self.order.items()))
        del self.order[slot]
        self.order[slot] = owner
        return slot, old

    def release(self, slot: int) -> None:
        if self.reserved <= slot < self.n and (slot in self.order or slot not in self.free):
            self.order.pop(slot, None)
            self.free.append(slot)


@pytest.mark.parametrize("n,reserved", [(6, 0), (9, 3), (1, 0), (70, 6)])
def test_many_at_a_time_equals_one_at_a_time(n: int, reserved: int) -> None:
    """Random rounds of (touch some held slots, take for new owners, release some): the same slots, the same
    owners evicted, the same final owners as a one-at-a-time LRU, including more owners than slots in one take."""
    gen = torch.Generator().manual_seed(n * 7 + reserved)
    lru, model = SlotLru(n, reserved), _OneAtATime(n, reserved)
    next_owner = 0
    for _ in range(60):
        held = (lru.owner >= 0).nonzero().flatten()
        touched = held[torch.randperm(held.numel(), generator=gen)[: int(torch.randint(0, 4, (1,), generator=gen))]]
        lru.touch(touched)
        for s in touched.tolist():
            model.touch(s)
        m = int(torch.randint(0, n - reserved + 3, (1,), generator=gen))
        owners = torch.arange(next_owner, next_owner + m)
        next_owner += m
        kept, slots, evicted = lru.take(owners)
        want: dict[int, int] = {}  # owner -> slot, for the owners that keep theirs at the end
        want_evicted = []
        for o in owners.tolist():
            slot, old = model.take(o)
            if old is not None:
                if old in want:
                    del want[old]  # an owner of this same take lost its slot again
                else:
                    want_evicted.append(old)
            want[o] = slot
        assert dict(zip(owners[kept].tolist(), slots.tolist(), strict=True)) == want
        assert sorted(evicted.tolist()) == sorted(want_evicted)
        assert {s: o for s, o in model.order.items()} == {s: int(lru.owner[s]) for s in range(n)
                                                           if int(lru.owner[s]) >= 0}
        if torch.rand(1, generator=gen).item() < 0.3:
            held = (lru.owner >= 0).nonzero().flatten()
            gone = held[torch.randperm(held.numel(), generator=gen)[:2]]
            lru.release(gone)
            for s in gone.tolist():
                model.release(s)
    assert next_owner > n  # slots were taken back


def test_reserved_slots_are_never_handed_out_and_free_slots_go_first() -> None:
    lru = SlotLru(5, reserved=2)
    kept, slots, evicted = lru.take(torch.tensor([10, 11]))
    assert slots.tolist() == [2, 3] and bool(kept.all()) and not evicted.numel()
    lru.touch(torch.tensor([2]))  # 3 is now the least recently used held slot; 4 is free
    _, slots, evicted = lru.take(torch.tensor([12, 13]))
    assert slots.tolist() == [4, 3] and evicted.tolist() == [11]
    lru.release(torch.tensor([0, 1]))  # reserved: ignored
    assert lru.owner.tolist() == [-1, -1, 10, 13, 12] and lru.capacity == 3 and lru.held == 3
    with pytest.raises(ValueError, match="reserved"):
        SlotLru(2, reserved=3)
    assert SlotLru(3, reserved=3).take(torch.tensor([1]))[1].numel() == 0  # no slot to give


def test_first_occurrences_keeps_the_first_of_each_key() -> None:
    assert first_occurrences(torch.tensor([5, 3, 5, 9, 3, 1])).tolist() == [True, True, False, True, False, True]
    assert first_occurrences(torch.zeros(0, dtype=torch.int64)).numel() == 0
