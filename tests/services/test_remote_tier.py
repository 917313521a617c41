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


def _tiered_with_store(url: str, lengths: tuple[int, ...] = (300, 200)):
    """A TieredCache (h_K = 4, h_V = 2, 64-token pages) whose host tier holds a few small blocks, with the store
    as its remote tier: most sealed blocks live only at the store. Returns (codec, cache, flat, writer, q)."""
    import dataclasses

    from planekv.kvstore import Codec, PlaneKVCache
    from planekv.kvstore.synthetic import make_synthetic
    from planekv.tiering import PlacementPolicy, TieredCache
    from planekv.tiering.placement import HotPlanes

    syn = make_synthetic(n_tokens=max(lengths), n_rows=4 * len(lengths), n_layers=1, n_q_heads=4, n_kv_heads=2,
                         head_dim=32, seed=5)
    codec = Codec(dataclasses.replace(syn.spec), syn.calibration)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    remote = StoreRemoteTier(url, TOKEN, timeout_s=10)
    writer = RemoteWriter(remote, submit_timeout_s=30.0)
    block = HEADER_BYTES + 2 * 1024  # two Key pages (4 planes x 32 channels x 8 bytes) per block
    cache = TieredCache(codec.spec, len(lengths), PlacementPolicy(hot_planes=HotPlanes(k=4, v=2), block_bytes=1 << 20),
                        max_tokens=512, promotion_bytes=4 << 20, host_bytes=8 * block, remote=writer,
                        sequence_ids=[f"dl-{uuid.uuid4().hex[:8]}-{b}" for b in range(len(lengths))])
    cache.host.block_bytes = block
    flat = PlaneKVCache(codec.spec, len(lengths))
    for b, t in enumerate(lengths):
        for c in (cache, flat):
            c.append(0, kc[:, :t], vc[:, :t], seq=b)
    writer.flush(30.0)
    assert cache.bytes().remote > 0 and writer.stats.failed == 0
    return codec, cache, flat, writer, syn.q[0].transpose(0, 1).contiguous()  # [4 B, Hq, d]: 4 steps' queries


def test_a_stopped_store_caps_the_tiered_read_within_the_deadline_and_serves_it_again_once_continued(tmp_path):
    """The store (its own process, no Redis index) is SIGSTOPped: a decode step whose prefetch needs blocks held
    only there returns by its deadline (plus a bound: no hang) with those items left out and counted; the next step
    reads them capped, equal to the plane cache read under the same residency (never wrong data). After SIGCONT
    the same steps fetch them and the reads are served past the hot planes again."""
    import dataclasses
    import os
    import signal
    import time

    from planekv.kvstore import ReadPolicy
    from planekv.kvstore.reference import readkv_decode
    from planekv.tiering import Prefetcher, StepTally, tiered_decode_step

    store = start_store(tmp_path, None)
    stopped = False
    try:
        codec, cache, flat, writer, q_all = _tiered_with_store(store.url)
        policy = ReadPolicy.flexible(4.0, 0.5, deadline_ms=400.0)
        pf, tally = Prefetcher(), StepTally()

        def step(i: int, pol: ReadPolicy) -> tuple[float, torch.Tensor]:
            b_n = cache.batch_size
            q = q_all[i * b_n: (i + 1) * b_n].float()  # [B, Hq, d]
            res = cache.residency(0)
            t0 = time.monotonic()
            out, stats = tiered_decode_step(q, cache, 0, codec, pol, pf, tally)
            spent = time.monotonic() - t0
            ref, _ = readkv_decode(q, flat, 0, codec, pol, residency=res)  # the plane cache, capped alike
            assert torch.equal(out, ref)
            caps = stats.extra["k_caps"].sum() + stats.extra["v_caps"].sum()
            return spent, caps

        os.kill(store.proc.pid, signal.SIGSTOP)
        stopped = True
        spent, caps = step(0, policy)
        assert spent < 0.4 + 8.0  # the deadline plus a bound; without it: the client's 10 s timeout, retried
        assert tally.missed > 0 and cache.host.remote_deadline_misses > 0 and caps > 0
        missed = tally.missed
        spent, caps = step(1, policy)  # still stopped: what the last step wanted is still capped, and counted
        assert spent < 0.4 + 8.0 and caps > 0 and tally.missed > missed and tally.capped_bits > 0

        os.kill(store.proc.pid, signal.SIGCONT)
        stopped = False
        served = dataclasses.replace(policy, deadline_ms=20_000.0)  # generous: the store answers now
        fetches, missed = cache.host.remote_fetches, tally.missed
        step(2, served)
        assert tally.missed == missed and cache.host.remote_fetches > fetches  # fetched from the store again
        res = cache.residency(0)
        sealed = res.v_page_depth[:, :, :3]  # both sequences' first sealed pages: some now read to W
        assert bool((sealed == 8).any()) and bool((res.k_depth > 4).any())
        step(3, served)
        assert tally.missed == missed
        for b in range(cache.batch_size):
            cache.free(b)
        writer.close(10.0)
        cache.host.close()
    finally:
        if stopped:
            os.kill(store.proc.pid, signal.SIGCONT)
        store.stop()
