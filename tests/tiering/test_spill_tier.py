"""The spill tier (NVMe; POSIX reads here): a full host tier moves its least recently read sealed blocks to files
and reads their pages back checked; bounded; nothing lost when a write fails; files of dead processes removed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from planekv.tiering import BlockCorrupt, HostTier, SpillTier, TierFull
from planekv.tiering.frame import HEADER_BYTES, verify_frame

FORMAT = "0123456789abcdef"
PAGE = 4096  # bytes of one page's refinement planes
BLOCK = HEADER_BYTES + 4 * PAGE  # four pages per block


def _page(stream: int, slot: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * stream + slot)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def _fill(tier: HostTier, streams: int, pages: int) -> None:
    for p in range(pages):
        for s in range(streams):
            tier.put_page((f"seq{s}", "v", 0, 0), p, (4, 8), _page(s, p))


def test_a_full_host_tier_spills_sealed_blocks_and_every_page_reads_back(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="planekv.tiering.spill_tier"):
        spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="auto")
    assert spill.backend == "posix" and "POSIX reads" in caplog.text  # the choice is logged (no GPU here)
    tier = HostTier(FORMAT, capacity_bytes=4 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=3, pages=12)  # 9 sealed blocks of 4 pages; 4 fit in memory (3 open while they fill)
    assert tier.used_bytes <= 4 * BLOCK and tier.spilled_bytes >= 5 * BLOCK
    files = list(spill.dir.glob("*.blk"))
    assert len(files) >= 6 and all(f.stat().st_size % 4096 == 0 for f in files)
    for s in range(3):
        for p in range(12):
            assert torch.equal(tier.page((f"seq{s}", "v", 0, 0), p), _page(s, p))
        for key, frame in tier.frames((f"seq{s}", "v", 0, 0)):
            assert verify_frame(frame.numpy().tobytes()).key == key


def test_recently_read_blocks_stay_in_memory(tmp_path):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=3 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=1, pages=8)  # blocks 0 and 1 in memory
    assert tier.spilled_bytes == 0
    tier.page(("seq0", "v", 0, 0), 1)  # block 0 read most recently
    for p in range(8, 12):  # a third block, growing, needs room
        tier.put_page(("seq0", "v", 0, 0), p, (4, 8), _page(0, p))
    spilled = {f.name.split(".")[4] for f in spill.dir.glob("*.blk")}
    assert spilled == {"4-8"}  # block 1 (pages 4-8) went, block 0 (read last) stayed


def test_a_full_spill_tier_refuses_the_page_and_keeps_everything_stored(tmp_path):
    spill = SpillTier(tmp_path, capacity_bytes=2 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=2 * BLOCK, block_bytes=BLOCK, spill=spill)
    stored = 0
    with pytest.raises(TierFull, match="spill tier full"):
        for p in range(64):  # bounded: 16 blocks' worth, far past both tiers
            tier.put_page(("seq0", "v", 0, 0), p, (4, 8), _page(0, p))
            stored += 1
    assert stored >= 12 and spill.used_bytes == 2 * BLOCK  # both tiers filled before the refusal
    for p in range(stored):
        assert torch.equal(tier.page(("seq0", "v", 0, 0), p), _page(0, p))


def test_a_failed_spill_write_loses_nothing(tmp_path, monkeypatch):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=3 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=1, pages=8)  # two sealed blocks in memory, nothing spilled yet
    assert tier.spilled_bytes == 0

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("planekv.tiering.spill_tier.atomic_write_bytes", disk_full)
    stored = 8
    with pytest.raises(OSError, match="No space"):
        for p in range(8, 12):  # the third block's growth needs a spill, which fails
            tier.put_page(("seq0", "v", 0, 0), p, (4, 8), _page(0, p))
            stored += 1
    assert stored < 12 and spill.used_bytes == 0 and not list(spill.dir.iterdir())
    for p in range(stored):
        assert torch.equal(tier.page(("seq0", "v", 0, 0), p), _page(0, p))


def test_a_corrupted_spilled_page_is_refused_never_served(tmp_path):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=2 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=1, pages=8)  # block 0 spilled while block 1 grew
    (path,) = spill.dir.glob("*.0-4.*.blk")
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + PAGE + 100)  # inside page 1
        f.write(bytes([(_page(0, 1)[100].item() + 1) % 256]))
    assert torch.equal(tier.page(("seq0", "v", 0, 0), 0), _page(0, 0))
    with pytest.raises(BlockCorrupt, match="page 1 of spilled block"):
        tier.page(("seq0", "v", 0, 0), 1)


def test_dropping_a_sequence_removes_its_files_and_closing_removes_the_directory(tmp_path):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=3 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=2, pages=12)
    assert any("seq0." in f.name for f in spill.dir.glob("*.blk"))
    tier.drop_sequence("seq0")
    assert not any("seq0." in f.name for f in spill.dir.glob("*.blk"))
    assert spill.used_bytes == sum(f.stat().st_size for f in spill.dir.glob("*.blk"))
    spill.close()
    assert not spill.dir.exists()


def test_files_of_a_process_that_is_gone_are_removed_at_open(tmp_path):
    code = ("import sys; from planekv.tiering import SpillTier; "
            "t = SpillTier(sys.argv[1], 1 << 20, backend='posix'); (t.dir / 'x.blk').write_bytes(b'0' * 4096); "
            "print(t.dir)")
    dead_dir = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                              check=True, timeout=120).stdout.strip()
    assert os.path.isdir(dead_dir)  # the process exited without closing its tier
    mine = SpillTier(tmp_path, 1 << 20, backend="posix")
    assert not os.path.exists(dead_dir) and mine.dir.exists()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        SpillTier(tmp_path, 1 << 20, backend="gds")
    with pytest.raises(ValueError, match="capacity"):
        SpillTier(tmp_path, -1)
    with pytest.raises(RuntimeError, match="kvikio spill backend was asked for and cannot run here"):
        SpillTier(tmp_path, 1 << 20, backend="kvikio")  # no CUDA device on this machine


def _block(spill: SpillTier, seq: str, salt: int = 0):
    """Write one block of 4 pages straight to ``spill``; its key and the pages written."""
    from planekv.tiering.frame import BlockKey, encode_frame

    key = BlockKey(FORMAT, seq, "v", 0, 0, 0, 4, 4, 8)
    pages = [_page(salt, i) for i in range(4)]
    frame = encode_frame(key, torch.cat(pages).numpy().tobytes())
    spill.write(key, torch.frombuffer(bytearray(frame), dtype=torch.uint8), HEADER_BYTES, PAGE)
    return key, pages


def _count_block_opens(monkeypatch) -> tuple[list[int], list[int]]:
    """The descriptors of block files opened, and those of them closed, from now on."""
    opened: list[int] = []
    closed: list[int] = []
    live: set[int] = set()
    real_open, real_close = os.open, os.close

    def counting_open(path, *a, **k):
        fd = real_open(path, *a, **k)
        if str(path).endswith(".blk"):
            opened.append(fd)
            live.add(fd)
        return fd

    def counting_close(fd):
        if fd in live:
            live.discard(fd)
            closed.append(fd)
        return real_close(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "close", counting_close)
    return opened, closed


def test_many_reads_of_a_block_reuse_one_open_handle(tmp_path, monkeypatch):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    key, pages = _block(spill, "seq0")
    opened, _ = _count_block_opens(monkeypatch)
    for _ in range(5):
        for i in range(4):
            assert torch.equal(spill.read_page(key, i), pages[i])
    assert len(opened) == 1 and spill.open_handles == 1


def test_a_deleted_block_closes_its_handle_and_a_new_block_under_its_key_reads_the_new_bytes(tmp_path, monkeypatch):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix")
    key, old = _block(spill, "seq0", salt=1)
    opened, closed = _count_block_opens(monkeypatch)
    assert torch.equal(spill.read_page(key, 2), old[2])
    spill.delete(key)
    assert spill.open_handles == 0 and closed == opened and len(opened) == 1
    with pytest.raises(KeyError):
        spill.read_page(key, 0)
    key2, new = _block(spill, "seq0", salt=2)
    assert key2 == key and not torch.equal(new[2], old[2])
    assert torch.equal(spill.read_page(key, 2), new[2])
    _, newer = _block(spill, "seq0", salt=3)  # rewritten without a delete: the cached handle is dropped too
    assert torch.equal(spill.read_page(key, 2), newer[2])


def test_the_handle_cache_is_bounded_and_close_closes_every_handle(tmp_path, monkeypatch):
    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix", max_open_files=3)
    blocks = [_block(spill, f"seq{i}", salt=i) for i in range(6)]
    opened, closed = _count_block_opens(monkeypatch)
    for key, pages in blocks:
        assert torch.equal(spill.read_page(key, 0), pages[0])
        assert spill.open_handles <= 3
    assert len(opened) == 6 and len(closed) == 3 and spill.open_handles == 3
    key, pages = blocks[-1]
    assert torch.equal(spill.read_page(key, 1), pages[1]) and len(opened) == 6  # still cached: no reopen
    key, pages = blocks[0]
    assert torch.equal(spill.read_page(key, 1), pages[1]) and len(opened) == 7  # evicted earlier: reopened
    spill.close()
    assert spill.open_handles == 0 and len(closed) == len(opened)


def test_reads_from_several_threads_share_the_cache(tmp_path):
    import concurrent.futures

    spill = SpillTier(tmp_path, capacity_bytes=64 * BLOCK, backend="posix", max_open_files=2)
    blocks = [_block(spill, f"seq{i}", salt=i) for i in range(5)]

    def read_all(t: int) -> bool:
        return all(torch.equal(spill.read_page(k, (i + t) % 4), p[(i + t) % 4])
                   for i in range(20) for k, p in blocks)

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(read_all, range(4)))
    assert spill.open_handles <= 2


def test_a_bad_handle_bound_is_refused(tmp_path):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_open_files"):
            SpillTier(tmp_path, 1 << 20, backend="posix", max_open_files=bad)


def test_kvikio_compat_mode_is_read_from_either_api() -> None:
    """kvikio 26 (``defaults.get`` returning an enum) and older releases (``defaults.compat_mode()``) both name
    the mode the tier logs and the spill benchmark reports."""
    import enum
    import types

    from planekv.tiering.spill_tier import _compat_mode

    mode = enum.Enum("CompatMode", "OFF ON AUTO")
    new = types.SimpleNamespace(get=lambda key: {"compat_mode": mode.AUTO}[key], is_compat_mode_preferred=lambda: True)
    assert _compat_mode(new) == "AUTO (POSIX reads: True)"
    assert _compat_mode(types.SimpleNamespace(compat_mode=lambda: False)) == "OFF"


def test_a_run_of_pages_reads_as_its_pages_and_names_the_first_bad_one(tmp_path) -> None:
    """``read_pages`` (one read of the run on POSIX; all preads in flight with kvikio) gives what ``read_page``
    gives page by page; a corrupt page in the run is named, never returned; the host tier reads a spilled block's
    pages as one run."""
    spill = SpillTier(tmp_path, 64 << 20, backend="posix")
    key, pages = _block(spill, "seq0")
    run = spill.read_pages(key, 1, 3)
    assert run.shape == (3, PAGE) and all(torch.equal(run[i], pages[1 + i]) for i in range(3))
    with pytest.raises(IndexError):
        spill.read_pages(key, 3, 2)
    with open(spill.path(key), "r+b") as f:
        f.seek(HEADER_BYTES + 2 * PAGE + 100)  # inside page 2
        f.write(bytes([(pages[2][100].item() + 1) % 256]))
    assert torch.equal(spill.read_pages(key, 0, 2), torch.stack(pages[:2]))
    with pytest.raises(BlockCorrupt, match="page 2 of spilled block"):
        spill.read_pages(key, 0, 4)
    spill.close()
    spill = SpillTier(tmp_path / "tier", capacity_bytes=64 * BLOCK, backend="posix")
    tier = HostTier(FORMAT, capacity_bytes=2 * BLOCK, block_bytes=BLOCK, spill=spill)
    _fill(tier, streams=1, pages=8)  # block 0 spilled while block 1 grew
    before = tier.read_bytes["nvme"]
    assert torch.equal(tier.pages(("seq0", "v", 0, 0), 0, 8), torch.stack([_page(0, p) for p in range(8)]))
    assert tier.read_bytes["nvme"] - before == 4 * PAGE
