"""The store service as a HostTier's remote tier (StoreRemoteTier over HTTP, the real store, Redis and control
plane of the fixtures): a host tier too small writes its sealed blocks to the store, drops them from memory and
reads every page back equal; dropping the sequence deletes them at the store."""

from __future__ import annotations

import uuid

import torch

from planekv.services.clients import ControlClient
from planekv.services.remote_tier import StoreRemoteTier
from planekv.tiering import BlockKey, HostTier, RemoteTier, RemoteWriter
from planekv.tiering.frame import HEADER_BYTES

from .conftest import TOKEN, start_store
from .test_control import make_calibration, make_spec

PAGE = 2048  # bytes of one page's refinement planes
PER_BLOCK = 4
BLOCK = HEADER_BYTES + PER_BLOCK * PAGE  # 12 KiB frames


def _page(stream: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * stream + i)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def test_a_host_tier_spills_to_the_store_service_and_reads_every_page_back_equal(tmp_path, redis_url, control):
    store = start_store(tmp_path, redis_url, "--spill-dir", str(tmp_path / "spill"),
                        PLANEKV_STORE__REQUIRE_REGISTERED_FORMAT="true")  # the store refuses unknown formats
    try:
        with ControlClient(control.url, TOKEN) as ctl, StoreRemoteTier(store.url, TOKEN, timeout_s=10) as remote:
            assert isinstance(remote, RemoteTier)
            calib = make_calibration(91)
            ctl.register_calibration(calib.calibration_id, calib.to_bytes())
            spec = make_spec(calib)
            ctl.register_format(spec.to_dict())
            seq = f"seq-{uuid.uuid4().hex[:8]}"

            writer = RemoteWriter(remote, max_queued_blocks=4, submit_timeout_s=30.0, retries=2, backoff_s=0.05)
            # room for the 3 streams' open blocks and one sealed block
            tier = HostTier(spec.format_id, capacity_bytes=4 * BLOCK, block_bytes=BLOCK, remote=writer)
            streams = [(seq, "k", 0, 0), (seq, "v", 0, 0), (seq, "v", 1, 1)]
            n_pages = 6 * PER_BLOCK
            for i in range(n_pages):
                for s, stream in enumerate(streams):
                    tier.put_page(stream, i, (3, 8), _page(s, i))
                    assert tier.used_bytes <= tier.capacity_bytes
            writer.flush(30.0)
            assert writer.stats.written == len(streams) * 6 and writer.stats.failed == 0
            assert tier.remote_only_bytes > 0  # most blocks now live only at the store
            stored = {b.key for b in remote.list_blocks(sequence_id=seq).blocks}
            assert stored == {str(BlockKey(spec.format_id, *st[:2], st[2], st[3], PER_BLOCK * b,
                                           PER_BLOCK * (b + 1), 3, 8)) for st in streams for b in range(6)}

            for s, stream in enumerate(streams):
                for i in range(n_pages):
                    assert torch.equal(tier.page(stream, i), _page(s, i)), (stream, i)  # bit for bit
            assert tier.remote_fetches > 0

            tier.drop_sequence(seq)  # deletes the store's copies too
            assert remote.list_blocks(sequence_id=seq).blocks == [] and writer.stats.deleted == len(stored)
            writer.close(10.0)
            assert ctl.delete_cache(seq)  # the store holds nothing of it any more
    finally:
        store.stop()
