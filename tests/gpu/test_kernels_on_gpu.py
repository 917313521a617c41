"""The Triton kernels on a CUDA device, against the torch reference reader: every stage family (the FMA stages,
the int8 stages that only a GPU runs, the fp16-MMA stages of wide groups), both Value allocations, Key
refinement, ragged lengths and CUDA-graph replay, the encoder and the FP8 baseline.

    .venv/bin/python -m pytest -m gpu tests/gpu

Skipped without a CUDA device, and when Triton's interpreter is on (run this directory on its own)."""

from __future__ import annotations

import os

import pytest
import torch

from planekv.bench import Shape, check_against_reference, synthetic_step
from planekv.kernels import FP8Decode, ReaderConfig, TritonReader, quantize_fp8
from planekv.kvstore import ReadPolicy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="Triton's interpreter is on: run `pytest -m gpu tests/gpu` on its own"),
]

LENGTHS = [4096, 4095, 1, 65, 2000, 513, 3000, 64]  # ends mid-page, one token, shorter than one Key split
POLICIES = {"flex-r2": ReadPolicy.flexible(2.0, 0.875), "flex-r4": ReadPolicy.flexible(4.0, 0.75),
            "flex-kr-r2": ReadPolicy.flexible(2.0, 0.875, key_refine=0.3), "cons-r2": ReadPolicy.constrained(2.0)}


def _step(hq: int, hk: int, d: int, codebook: str, v_run: int):
    data = synthetic_step(Shape("gpu-check", len(LENGTHS), max(LENGTHS), hq, hk, d), torch.device("cuda"), 0,
                          codebook=codebook, v_run=v_run)
    data.lengths[:] = torch.tensor(LENGTHS, dtype=torch.int32, device=data.lengths.device)
    return data


@pytest.mark.parametrize("codebook,v_run,hq,hk,d", [
    ("gaussian-lloyd-tree", 1, 32, 8, 128),  # FMA stages
    ("uniform-linear-c3", 1, 32, 8, 128),  # int8 Key and Value stages
    ("uniform-linear-c3", 4, 32, 8, 128),  # int8 stages, V pages in runs of 4
    ("uniform-linear-c3", 1, 9, 3, 64),  # int8 Key stage, FMA Value stage (d = 64)
    ("uniform-linear-c3", 1, 4, 1, 256),  # int8 stages at d = 256
    ("gaussian-lloyd-tree", 1, 32, 2, 128),  # 16 query heads per KV head: the fp16-MMA stages
])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_stage_family_matches_the_reference(codebook: str, v_run: int, hq: int, hk: int, d: int,
                                                  policy: str) -> None:
    """Depths equal to the reference reader's on every sequence (a swap within float32 rounding of lambda at
    most) and the output within float32 accuracy, for both Value allocations."""
    if policy == "flex-kr-r2" and hq // hk > 8:
        pytest.skip("Key refinement runs on the FMA stages (<= 8 query heads per KV head)")
    data = _step(hq, hk, d, codebook, v_run)
    for alloc in ("radix", "two-pass"):
        reader = TritonReader(data.codec, POLICIES[policy], ReaderConfig(value_alloc=alloc))
        plan = reader.plan(len(LENGTHS), max(LENGTHS), data.q.device)
        res = check_against_reference(reader, plan, data, data.codec, n_seq=len(LENGTHS))
        diffs = res["k_depth_mismatch"] + res["v_depth_mismatch"] + res.get("refined_mismatch", 0)
        assert diffs <= 2, res
        assert res["rel_err"] < (1e-3 if diffs else 1e-4), res


def test_a_captured_step_replays_the_eager_one() -> None:
    """run() allocates nothing: a CUDA graph of it replays the eager step's output bit for bit."""
    data = _step(32, 8, 128, "uniform-linear-c3", 1)
    reader = TritonReader(data.codec, ReadPolicy.flexible(2.0, 0.875))
    plan = reader.plan(len(LENGTHS), max(LENGTHS), data.q.device)
    args = (plan, data.q, data.cache.k_pool[0], data.cache.v_pool[0], data.page_table, data.lengths, 0)
    eager = reader.run(*args).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reader.run(*args)
    plan.out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(plan.out, eager)


def test_fp8_baseline_matches_dequantized_attention() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    b, hq, hk, t, d = 4, 32, 8, 4096, 128
    q = torch.randn(b, hq, d, device="cuda", generator=g).half()
    k = torch.randn(b, hk, t, d, device="cuda", generator=g).half()
    v = torch.randn(b, hk, t, d, device="cuda", generator=g).half()
    (k8, ks), (v8, vs) = quantize_fp8(k), quantize_fp8(v)
    f = FP8Decode(hq, hk, d)
    out = f.run(f.plan(b, t, "cuda"), q, k8, v8, ks, vs, torch.full((b,), t, dtype=torch.int32, device="cuda"))
    kk, vv = k8.float() * ks[None, :, None, None], v8.float() * vs[None, :, None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q.float()[:, :, None], kk, vv, enable_gqa=True)[:, :, 0]
    assert float((out - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.parametrize("codebook,v_run", [("gaussian-lloyd-tree", 1), ("uniform-linear-c3", 4)])
def test_the_encoder_writes_the_reference_codes(codebook: str, v_run: int) -> None:
    """The step's cache was written by the Triton encoder on the GPU: its planes read back as the codec's
    codes (torch, CPU), except where z sits within float rounding of a threshold."""
    from planekv.kvstore import PlaneKVCache

    data = synthetic_step(Shape("enc", 2, 1000, 8, 2, 128), torch.device("cuda"), 1, codebook=codebook, v_run=v_run)
    ref = PlaneKVCache(data.spec, 2)
    ref.append(0, data.codec.encode_k(data.k.float().cpu(), 0), data.codec.encode_v(data.v.float().cpu(), 0))
    for b in range(2):
        for got, want in ((data.cache.read_k(0, b, 8).cpu(), ref.read_k(0, b, 8)),
                          (data.cache.read_v(0, b, 8).cpu(), ref.read_v(0, b, 8))):
            assert got.shape == want.shape and (got != want).float().mean().item() < 1e-4


@pytest.mark.parametrize("hot", [4, 2])
@pytest.mark.parametrize("policy", ["flex-r2", "flex-r4", "cons-r2"])
def test_the_tiered_read_matches_the_reference_at_full_size(hot: int, policy: str) -> None:
    """The FMA stages over a tiered cache (hot pools, promoted Key channel-planes and Value pages from a few
    prefetched steps) against the reference with the same residency: depths, caps and output."""
    from planekv.kvstore.reference import readkv_decode
    from planekv.tiering import HotPlanes, PlacementPolicy, Prefetcher, TieredCache, tiered_decode_step

    data = _step(32, 8, 128, "gaussian-lloyd-tree", 1)
    spec = data.codec.spec
    cache = TieredCache(spec, len(LENGTHS), PlacementPolicy(format_id=spec.format_id, block_bytes=1 << 20,
                                                            hot_planes=HotPlanes(k=hot, v=hot)),
                        max_tokens=max(LENGTHS), device="cuda", promotion_bytes=16 << 20)
    for b, t in enumerate(LENGTHS):
        cache.append(0, data.cache.read_k(0, b, 8)[:, :t], data.cache.read_v(0, b, 8)[:, :t], seq=b)
    cfg = ReaderConfig(assembly="fma", key_int8=False, value_int8=False)
    reader = TritonReader(data.codec, POLICIES[policy], cfg)
    plan = reader.plan(len(LENGTHS), max(LENGTHS), "cuda")
    read = lambda q, c, layer, scale: reader.decode_tiered(q, c, layer, scale, plan)  # noqa: E731
    for _ in range(2):  # prefetch fills the promotion cache
        tiered_decode_step(data.q.float(), cache, 0, data.codec, POLICIES[policy], Prefetcher(), read=read)
    res = cache.residency(0)
    out, st = reader.decode_tiered(data.q.float(), cache, 0, plan=plan)
    ref, rst = readkv_decode(data.q.float(), cache, 0, data.codec, POLICIES[policy], residency=res)
    k_diff = int((st.k_depths != rst.k_depths).sum())
    v_diff = sum(int((a.cpu() != b.cpu()).sum()) for a, b in zip(st.extra["v_depths"], rst.extra["v_depths"],
                                                                  strict=True))
    assert k_diff + v_diff <= 2, (k_diff, v_diff)
    rel = float((out - ref.to(out.device)).norm() / ref.norm())
    assert rel < (1e-3 if k_diff + v_diff else 2e-5), rel
    if not k_diff + v_diff:  # the same depths: the same caps, counted by each side
        assert torch.equal(st.extra["k_caps"], rst.extra["k_caps"]) and torch.equal(st.extra["v_caps"],
                                                                                    rst.extra["v_caps"])


def test_tiered_promotions_read_pinned_host_blocks_in_place_equal_to_the_host_gather() -> None:
    """On CUDA a tiered cache promotes Key channel-planes by the device reading the host tier's pinned blocks in
    place (zero copy); the promoted planes equal those of the host gather and read back as the stored codes."""
    from planekv.tiering import HotPlanes, PlacementPolicy, TieredCache

    data = _step(32, 8, 128, "gaussian-lloyd-tree", 1)
    spec = data.codec.spec
    caches = [TieredCache(spec, len(LENGTHS), PlacementPolicy(format_id=spec.format_id, block_bytes=1 << 20,
                                                              hot_planes=HotPlanes(k=4, v=4)),
                          max_tokens=max(LENGTHS), device="cuda", promotion_bytes=64 << 20, zero_copy=zc)
              for zc in (True, False)]
    for cache in caches:
        for b, t in enumerate(LENGTHS):
            cache.append(0, data.cache.read_k(0, b, 8)[:, :t], data.cache.read_v(0, b, 8)[:, :t], seq=b)
    g = torch.Generator().manual_seed(5)
    n = 300
    items = torch.stack([torch.randint(0, len(LENGTHS), (n,), generator=g), torch.randint(0, 8, (n,), generator=g),
                         torch.randint(0, 128, (n,), generator=g), torch.randint(4, 8, (n,), generator=g)], 1)
    for cache in caches:
        cache.promote_keys(0, items)
    torch.cuda.synchronize()
    zc, host = caches
    assert zc.counters["k_zero_copy"] == zc.counters["k_promoted"] > 0 and host.counters["k_zero_copy"] == 0
    assert torch.equal(zc.k_slot[0], host.k_slot[0]) and torch.equal(zc.k_promo[0], host.k_promo[0])
    everything = torch.tensor([(b, h, c, j) for b in range(len(LENGTHS)) for h in range(8) for c in range(128)
                               for j in range(4, 8)])
    zc.promote_keys(0, everything)
    for b in range(len(LENGTHS)):
        assert torch.equal(zc.read_k(0, b, 8).cpu(), data.cache.read_k(0, b, 8)[:, :LENGTHS[b]].cpu())
