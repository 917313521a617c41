"""`planekv bench tiering`: GPU bytes from the layouts (held to what a TieredCache allocates), the largest batch a
budget holds, decode steps through tiered caches (everything hot reads as all-GPU; less hot caps and prefetches),
the command's JSON, and a whole timing run at a toy size through Triton's interpreter (no meaningful times)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from planekv.bench.attention import Shape
from planekv.bench.tier_memory import GpuBytes, four_bit_bytes, gpu_bytes
from planekv.bench.tiering import placement, run_decode, run_timing
from planekv.evaluation.decode_data import synthetic_data
from planekv.kvstore.synthetic import make_synthetic
from planekv.tiering import TieredCache


def test_tiered_bytes_are_what_a_tiered_cache_allocates() -> None:
    syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=32, seed=1)
    spec = syn.spec
    tokens, promo = 300, 3 << 16
    for hot in (8, 4, 2):
        cache = TieredCache(spec, 3, placement(hot, spec.format_id), max_tokens=tokens, promotion_bytes=promo)
        codes = torch.randint(0, 256, (3, spec.n_kv_heads, tokens, spec.head_dim), dtype=torch.uint8)
        for layer in range(spec.n_layers):
            cache.append(layer, codes, codes)
        mem = gpu_bytes("tiered", spec, tokens, (hot, hot), promo)
        got = cache.bytes()
        assert got.device == mem.total(3), hot  # hot pools of 5 pages a head, open pages, the promotion cache
    flat = gpu_bytes("readkv", spec, tokens)
    assert flat.per_sequence == spec.n_layers * 2 * spec.n_kv_heads * 5 * 64 * spec.head_dim  # 8 bits, whole pages
    assert gpu_bytes("tiered", spec, 320, (4, 4)).per_sequence < 0.5 * 1.3 * flat.per_sequence
    assert four_bit_bytes(spec, 320) == 0.5 * gpu_bytes("fp8", spec, 320).per_sequence
    with pytest.raises(ValueError, match="unknown system"):
        gpu_bytes("tiered", spec, 320)


def test_the_largest_batch_a_budget_holds() -> None:
    mem = GpuBytes(per_sequence=3.0, fixed=10.0)
    assert mem.total(4) == 22.0
    assert mem.max_batch(22.0) == 4 and mem.max_batch(21.9) == 3 and mem.max_batch(5.0) == 0


def test_decode_steps_with_every_plane_hot_read_as_the_all_gpu_reader() -> None:
    """h = 8: nothing is capped or fetched and the tiered read's error is the all-GPU reader's; h = 4 and 2 cap
    some of what is asked for, fetch, and err more."""
    data = synthetic_data(n_tokens=300, n_steps=3, n_layers=2, seed=4)
    rows = run_decode(data, ["flex-r4"], [8, 4, 2], promotion_mib=0.02)
    by = {r.system: r for r in rows}
    full = by["tiered-h8-flex-r4"]
    assert full.cap_rate == 0 and full.fetched_per_step == 0 and full.hit_rate == 1.0
    assert math.isclose(full.rel_err, full.rel_err_all_gpu, rel_tol=1e-4)
    for h in (4, 2):
        r = by[f"tiered-h{h}-flex-r4"]
        assert 0 < r.cap_rate < 1 and r.fetched_per_step > 0 and 0 <= r.hit_rate < 1
        assert r.rel_err > full.rel_err
    assert by["tiered-h2-flex-r4"].cap_rate > by["tiered-h4-flex-r4"].cap_rate
    with pytest.raises(ValueError, match="warmup"):
        run_decode(data, ["flex-r4"], [4], warmup=3)
    with pytest.raises(ValueError, match="unknown policy"):
        run_decode(data, ["flex-r3"], [4])


def test_tier_aware_rows_allocate_within_the_residency_and_say_so() -> None:
    """--tier-aware: rows named "-ta", the caps still those of the unlimited allocation (not hidden), prefetch
    timed apart from the read; the kernels cap, so the Triton reader is refused with what to use."""
    data = synthetic_data(n_tokens=300, n_steps=3, n_layers=1, seed=5)
    (capped,) = run_decode(data, ["flex-r2"], [4], promotion_mib=0.01)
    (aware,) = run_decode(data, ["flex-r2"], [4], promotion_mib=0.01, tier_aware=True)
    assert capped.system == "tiered-h4-flex-r2" and aware.system == "tiered-h4-flex-r2-ta"
    assert aware.cap_rate > 0 and aware.rel_err_all_gpu == capped.rel_err_all_gpu
    assert aware.prefetch_ms is not None and 0 < aware.prefetch_ms < aware.step_ms
    with pytest.raises(ValueError, match="reference reader"):
        run_decode(data, ["flex-r2"], [4], reader="triton", tier_aware=True)


def test_the_command_writes_its_rows(tmp_path) -> None:
    from planekv.cli import main

    out = tmp_path / "tiering.json"
    rc = main(["bench", "tiering", "--source", "synthetic", "--tokens", "200", "--steps", "2", "--layers", "1",
               "--policies", "flex-r2", "--hots", "4", "--promotion-mib", "0.01", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["system"] for r in doc["rows"]] == ["tiered-h4-flex-r2"] and doc["meta"]["device"] == "cpu"
    assert 0 <= doc["rows"][0]["cap_rate"] <= 1


@pytest.mark.slow
def test_a_timing_run_at_a_toy_size() -> None:
    """Every system of a timing run reports a time and GPU bytes (interpreter: the times mean nothing); the tiered
    row keeps fewer bytes than the all-GPU one; a Key refinement policy is timed tiered too."""
    shape = Shape("toy", 2, 256, 4, 2, 32)
    # no Key page slots: sealed pages' Key planes are on the host only, so prefetch has channel-planes to fetch (with
    # every Key page in a slot, a channel reads to W without any)
    rows = run_timing(shape, ["flex-r4", "flex-kr-r2"], [4], reps=1, warm=1, promotion_mib=0.002, layers=2,
                      budget_gib=1.0, key_page_mib=0.0)
    by = {r.system: r for r in rows}
    assert {"sdpa", "fp8", "readkv-flex-r4", "readkv-flex-r4-fma", "tiered-h4-flex-r4", "offload-h4-flex-r4",
            "tiered-h4-flex-kr-r2"} <= set(by)
    for name in ("sdpa", "fp8", "readkv-flex-r4", "tiered-h4-flex-r4", "offload-h4-flex-r4"):
        assert by[name].step_ms is not None and by[name].step_ms > 0 and by[name].gpu_gib > 0
    assert by["tiered-h4-flex-r4"].gpu_gib < by["readkv-flex-r4"].gpu_gib
    assert by["tiered-h4-flex-r4"].max_batch > by["readkv-flex-r4"].max_batch
    kr = by["tiered-h4-flex-kr-r2"]
    assert kr.step_ms is not None and kr.step_ms > 0 and kr.extra["tally"]["kr_wanted"] > 0
    tiered = by["tiered-h4-flex-r4"]
    assert tiered.cap_rate is not None and tiered.extra["tally"]["steps"] == 1 and tiered.fetched_per_step > 0
    assert dataclasses.asdict(tiered)["x_all_gpu"] > 0


def _start_store(tmp_path):
    """A store service (its own process, no Redis index) from the services tests' fixtures, loaded by path (tests/
    services is not a package); skips, saying why, where those fixtures cannot start one here."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "services" / "conftest.py"
    name = "planekv_bench_services_fixtures"
    try:
        mod = sys.modules.get(name)
        if mod is None:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod  # its dataclasses look their module up
            spec.loader.exec_module(mod)
    except (ImportError, pytest.skip.Exception) as exc:
        sys.modules.pop(name, None)
        pytest.skip(f"the store service cannot be started from {path}: {exc}")
    return mod.start_store(tmp_path, None), mod.TOKEN


def test_decode_steps_with_the_refinement_planes_in_each_tier_read_the_same(tmp_path) -> None:
    """--tier host, nvme (a small host tier spilling to files) and remote (a small host tier over a real store
    service): the same caps, hits and error (the tiers hold the same bytes, reads are checked), the bytes counted in
    the chosen tier, a fetch bandwidth for it, the spill directory removed and the store's copies deleted."""
    from planekv.bench.tiering import TierSetup
    from planekv.services.clients import StoreClient

    data = synthetic_data(n_tokens=300, n_steps=3, n_layers=2, seed=4)
    block = 4096 + 2 * 1024  # two pages of 4 refinement planes per block: most blocks seal and go below
    store, token = _start_store(tmp_path)
    try:
        rows = {}
        for tier in ("host", "nvme", "remote"):
            setup = TierSetup(tier, spill_dir=str(tmp_path / "spill") if tier == "nvme" else None,
                              store_url=store.url if tier == "remote" else None, store_token=token,
                              block_bytes=None if tier == "host" else block)
            (rows[tier],) = run_decode(data, ["flex-r4"], [4], promotion_mib=0.02, tier=setup)
        with StoreClient(store.url, token) as sc:
            assert sc.list_blocks().blocks == []  # the bench's cache was freed: its copies deleted
    finally:
        store.stop()
    host, nvme, remote = rows["host"], rows["nvme"], rows["remote"]
    for r in rows.values():
        assert r.step_ms > 0 and r.fetch_mib_s is not None and r.fetch_mib_s > 0, r.tier
        assert (r.cap_rate, r.hit_rate, r.fetched_per_step) == (host.cap_rate, host.hit_rate, host.fetched_per_step)
        assert math.isclose(r.rel_err, host.rel_err, rel_tol=1e-6)
    assert host.tier == "host" and host.nvme_mib == host.remote_mib == 0 and host.host_mib > 0
    assert nvme.nvme_mib > 0 and nvme.extra["fetched_bytes"]["nvme"] > 0 and nvme.remote_mib == 0
    assert not any((tmp_path / "spill").iterdir())  # the spill tier removed its files
    assert remote.remote_mib > 0 and remote.extra["fetched_bytes"]["remote"] > 0 and remote.nvme_mib == 0
    assert remote.extra["remote_writes"]["failed"] == 0
    with pytest.raises(ValueError, match="store-url"):
        TierSetup("remote")


def test_the_command_takes_a_tier(tmp_path) -> None:
    from planekv.cli import main

    out = tmp_path / "tiering.json"
    rc = main(["bench", "tiering", "--source", "synthetic", "--tokens", "200", "--steps", "2", "--layers", "1",
               "--policies", "flex-r2", "--hots", "4", "--promotion-mib", "0.01", "--tier", "nvme", "--block-kib", "6",
               "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tier"] == "nvme" and row["nvme_mib"] > 0 and row["step_ms"] > 0
    with pytest.raises(SystemExit, match="store-url"):
        main(["bench", "tiering", "--source", "synthetic", "--tier", "remote"])
