"""The host tier holds what it stores: an open block grows as pages arrive, a full block is sealed as a frame, and
a page that does not fit is refused with nothing lost."""

import ctypes

import numpy as np
import pytest
import torch

from planekv.tiering.errors import TierFull
from planekv.tiering.frame import HEADER_BYTES
from planekv.tiering.host_tier import HostTier

PAGE = 1024  # bytes of one page's refinement planes
STREAM = ("seq-0", "k", 0, 0)


def _page(i: int) -> torch.Tensor:
    return torch.full((PAGE,), i % 251, dtype=torch.uint8)


def test_an_open_block_grows_with_its_pages_not_to_a_whole_block():
    tier = HostTier("0123456789abcdef", capacity_bytes=64 << 20, block_bytes=4 << 20)
    tier.put_page(STREAM, 0, (4, 8), _page(0))
    one = tier.used_bytes
    assert one == HEADER_BYTES + 4096  # one page, padded to 4 KiB: not the 4 MiB block
    for i in range(1, 100):
        tier.put_page(STREAM, i, (4, 8), _page(i))
    assert tier.used_bytes <= HEADER_BYTES + 2 * 100 * PAGE + 4096  # at most twice what it holds
    assert all(torch.equal(tier.page(STREAM, i), _page(i)) for i in range(100))  # growing kept every page


def test_a_full_block_is_sealed_as_a_frame_and_the_next_one_starts():
    tier = HostTier("0123456789abcdef", capacity_bytes=64 << 20, block_bytes=HEADER_BYTES + 8 * PAGE)
    for i in range(10):
        tier.put_page(STREAM, i, (4, 8), _page(i))
    frames = tier.frames(STREAM)
    assert len(frames) == 1 and (frames[0][0].page_start, frames[0][0].page_end) == (0, 8)
    assert torch.equal(tier.page(STREAM, 9), _page(9))


def test_a_page_that_does_not_fit_is_refused_and_nothing_stored_is_lost():
    tier = HostTier("0123456789abcdef", capacity_bytes=HEADER_BYTES + 2 * 4096, block_bytes=4 << 20)
    with pytest.raises(TierFull, match="host tier full"):
        for i in range(64):
            tier.put_page(STREAM, i, (4, 8), _page(i))
    held = [i for i in range(64) if _held(tier, i)]
    assert held == list(range(len(held))) and len(held) >= 4  # the pages before the refusal, in order
    assert tier.used_bytes <= tier.capacity_bytes
    assert all(torch.equal(tier.page(STREAM, i), _page(i)) for i in held)


def _held(tier: HostTier, i: int) -> bool:
    try:
        tier.page(STREAM, i)
    except KeyError:
        return False
    return True


def test_a_run_of_pages_reads_as_the_pages_one_by_one_in_memory_and_spilled(tmp_path):
    """``pages`` (a Key channel-plane's read: every page of a head, a block at a time) gives what ``page`` gives,
    across block boundaries, from memory and from the spill tier; a page not held is a KeyError, not zeros."""
    from planekv.tiering.spill_tier import SpillTier

    spill = SpillTier(tmp_path, 64 << 20, backend="posix")
    # room for one sealed block in memory: the first block of 8 pages spills when the second seals
    tier = HostTier("0123456789abcdef", capacity_bytes=2 * (HEADER_BYTES + 8 * PAGE) + 4096,
                    block_bytes=HEADER_BYTES + 8 * PAGE, spill=spill)
    for i in range(20):
        tier.put_page(STREAM, i, (4, 8), _page(i))
    assert tier.spilled_bytes > 0  # some pages come from files
    got = tier.pages(STREAM, 0, 20)
    assert torch.equal(got, torch.stack([_page(i) for i in range(20)]))
    assert torch.equal(tier.pages(STREAM, 5, 6), torch.stack([_page(i) for i in range(5, 11)]))
    with pytest.raises(KeyError):
        tier.pages(STREAM, 15, 10)  # pages 20..24 were never stored
    with pytest.raises(KeyError):
        tier.pages(("seq-9", "k", 0, 0), 0, 1)
    # gather_rows: some rows of each page (a page as 64 rows of 16 bytes), from memory and from files, each into
    # its destination item; the items not named stay untouched
    rows = np.array([63, 0, 7, 7, 20])
    dest = np.array([4, 0, 6, 2, 3])
    varied = [torch.arange(PAGE, dtype=torch.uint8) + i for i in range(20)]
    tier2 = HostTier("0123456789abcdef", capacity_bytes=2 * (HEADER_BYTES + 8 * PAGE) + 4096,
                     block_bytes=HEADER_BYTES + 8 * PAGE, spill=SpillTier(tmp_path / "rows", 64 << 20, backend="posix"))
    for i in range(20):
        tier2.put_page(STREAM, i, (4, 8), varied[i])
    assert tier2.spilled_bytes > 0
    before = tier2.read_bytes["host"]
    out = np.full((7, 21, 16), 255, dtype=np.uint8)
    tier2.gather_rows(STREAM, 19, rows, 16, out, dest)
    for r, i in zip(rows, dest, strict=True):
        assert np.array_equal(out[i, :19], np.stack([varied[p].view(64, 16)[r].numpy() for p in range(19)]))
    assert (out[[1, 5]] == 255).all() and (out[:, 19:] == 255).all()  # other items and pages untouched
    in_memory = sum(1 for i in range(19) if i >= 8)  # pages 0..7 were spilled, the rest are in memory
    assert tier2.read_bytes["host"] - before == in_memory * 5 * 16  # only the rows were copied out of memory
    # row_addresses: where those rows lie in memory, or None (nothing counted) while a page is in a file
    holds: list[torch.Tensor] = []
    before = tier2.read_bytes["host"]
    assert tier2.row_addresses(STREAM, 19, rows, 16, holds) is None and not holds
    assert tier2.read_bytes["host"] == before
    stream2 = ("seq-1", "k", 0, 0)
    for i in range(12):
        tier2.put_page(stream2, i, (4, 8), varied[i])
    addr = tier2.row_addresses(stream2, 12, rows, 16, holds)
    assert addr is not None and addr.shape == (5, 12) and holds
    got = np.stack([[ctypes.string_at(int(a), 16) for a in line] for line in addr])
    want = np.stack([[bytes(varied[p].view(64, 16)[r].numpy()) for p in range(12)] for r in rows])
    assert (got == want).all()
    assert tier2.read_bytes["host"] - before == 12 * 5 * 16
    with pytest.raises(ValueError, match="row_bytes"):
        tier2.row_addresses(stream2, 1, rows, 24, holds)
    with pytest.raises(KeyError):
        tier2.row_addresses(stream2, 13, rows, 16, holds)
    with pytest.raises(ValueError, match="row_bytes"):
        tier2.gather_rows(STREAM, 1, rows, 24, out, dest)
    with pytest.raises(KeyError):
        tier2.gather_rows(STREAM, 21, rows, 16, out, dest)  # page 20 was never stored
    spill.close()
