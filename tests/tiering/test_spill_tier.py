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
