"""The spill tier's kvikio reads, with a stub kvikio (``CuFile.pread`` copies with ``os.preadv`` in a one-thread
pool, like kvikio's compatibility mode): a run or a large page read as a few chunked preads lands the bytes
written, a corrupt page inside a chunk is named (BlockCorrupt, never served), every pread has ended when a read
returns, and the streaming hash of a page's pieces equals its stored checksum."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import types

import numpy as np
import pytest
import torch
import xxhash

from planekv.tiering import BlockCorrupt, SpillTier
from planekv.tiering.frame import HEADER_BYTES, BlockKey, encode_frame
from planekv.tiering.spill_tier import _page_checksum, _spans

FORMAT = "0123456789abcdef"


class _StubKvikio:
    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.preads: list[tuple[int, int]] = []  # (file offset, size) of every pread
        self.in_flight = 0
        stub = self

        class CuFile:
            def __init__(self, path, flags="r"):
                self.fd = os.open(path, os.O_RDONLY)

            def pread(self, buf, size=None, file_offset=0, task_size=None):
                view = memoryview(buf).cast("B")
                size = view.nbytes if size is None else size
                stub.preads.append((file_offset, size))
                stub.in_flight += 1

                def run():
                    try:
                        return os.preadv(self.fd, [view[:size]], file_offset)
                    finally:
                        stub.in_flight -= 1

                fut = stub.pool.submit(run)
                return types.SimpleNamespace(get=fut.result)

            def close(self):
                os.close(self.fd)

        self.module = types.ModuleType("kvikio")
        self.module.CuFile = CuFile
        self.module.defaults = types.SimpleNamespace(compat_mode=lambda: True)


@pytest.fixture
def kv(monkeypatch):
    stub = _StubKvikio()
    monkeypatch.setitem(sys.modules, "kvikio", stub.module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", stub.module.defaults)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    yield stub
    stub.pool.shutdown()


def _write(spill: SpillTier, n_pages: int, page_bytes: int, seed: int = 0):
    key = BlockKey(FORMAT, f"s{seed}", "v", 0, 0, 0, n_pages, 4, 8)
    payload = np.random.default_rng(seed).integers(0, 256, n_pages * page_bytes, dtype=np.uint8).tobytes()
    frame = encode_frame(key, payload)
    spill.write(key, torch.frombuffer(bytearray(frame), dtype=torch.uint8), HEADER_BYTES, page_bytes)
    pages = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(n_pages, page_bytes)
    return key, pages


def _corrupt(spill: SpillTier, key: BlockKey, at: int) -> None:
    with open(spill.path(key), "r+b") as f:
        f.seek(HEADER_BYTES + at)
        b = f.read(1)[0]
        f.seek(HEADER_BYTES + at)
        f.write(bytes([(b + 1) % 256]))


def test_a_run_is_read_in_chunks_of_whole_pages_and_lands_the_bytes_written(tmp_path, kv):
    spill = SpillTier(tmp_path, 64 << 20, backend="kvikio")
    assert spill.backend == "kvikio"
    key, pages = _write(spill, 64, 16 << 10)
    out = torch.empty(64, 16 << 10, dtype=torch.uint8)
    kv.preads.clear()
    assert spill.read_pages(key, 0, 64, out=out) is out and torch.equal(out, pages)
    assert kv.preads == [(HEADER_BYTES + i * (256 << 10), 256 << 10) for i in range(4)]  # not one a page
    assert kv.in_flight == 0
    assert torch.equal(spill.read_pages(key, 5, 40), pages[5:45])  # a run not on a chunk boundary
    for i in (0, 17, 63):
        assert torch.equal(spill.read_page(key, i), pages[i])


def test_a_corrupt_page_in_the_middle_of_a_chunked_run_is_named_and_every_read_has_ended(tmp_path, kv):
    spill = SpillTier(tmp_path, 64 << 20, backend="kvikio")
    key, pages = _write(spill, 64, 16 << 10)
    _corrupt(spill, key, 37 * (16 << 10) + 5000)  # page 37: inside the third chunk
    with pytest.raises(BlockCorrupt, match="page 37 of spilled block"):
        spill.read_pages(key, 0, 64)
    assert kv.in_flight == 0  # no pread still writes into the buffer
    with pytest.raises(BlockCorrupt, match="page 37 of spilled block"):
        spill.read_page(key, 37)
    assert torch.equal(spill.read_pages(key, 0, 37), pages[:37])
    assert torch.equal(spill.read_pages(key, 38, 26), pages[38:])


def test_a_large_page_is_read_in_pieces_and_hashed_as_they_land(tmp_path, kv):
    spill = SpillTier(tmp_path, 64 << 20, backend="kvikio")
    key, pages = _write(spill, 2, 1 << 20)
    kv.preads.clear()
    assert torch.equal(spill.read_page(key, 1), pages[1])
    assert kv.preads == [(HEADER_BYTES + (1 << 20) + i * (256 << 10), 256 << 10) for i in range(4)]
    assert torch.equal(spill.read_pages(key, 0, 2), pages)
    _corrupt(spill, key, (1 << 20) + 700_000)  # page 1, its third piece
    with pytest.raises(BlockCorrupt, match="page 1 of spilled block"):
        spill.read_pages(key, 0, 2)
    assert kv.in_flight == 0 and torch.equal(spill.read_page(key, 0), pages[0])


def test_a_short_file_is_a_corrupt_page_never_stale_bytes(tmp_path, kv):
    spill = SpillTier(tmp_path, 64 << 20, backend="kvikio")
    key, _ = _write(spill, 64, 16 << 10)
    os.truncate(spill.path(key), HEADER_BYTES + 50 * (16 << 10) + 100)
    with pytest.raises(BlockCorrupt, match="page 50 of spilled block"):
        spill.read_pages(key, 0, 64)


def test_the_streaming_hash_of_a_pages_pieces_equals_its_stored_checksum():
    data = np.random.default_rng(1).integers(0, 256, (1 << 20) + 300, dtype=np.uint8)
    for spans in (_spans(data.size, data.size, 256 << 10), _spans(data.size, data.size, 4096)):
        h = xxhash.xxh3_64()
        for lo, hi in spans:
            h.update(memoryview(data)[lo:hi])
        assert spans[-1][1] == data.size and h.intdigest() == _page_checksum(data)


def test_odd_page_sizes_split_on_page_boundaries():
    assert _spans(10 * 3000, 3000, 8192) == tuple((lo, lo + 6000) for lo in range(0, 30000, 6000))
    assert _spans(2 * 5000, 5000, 4096) == ((0, 4096), (4096, 5000), (5000, 9096), (9096, 10000))
