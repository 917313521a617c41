"""The GPU tiering run's workload on the CPU, smaller batch: prefetch's host time and where the caps come from.

    PYTHONPATH=$PWD python benchmarks/tools/tier_replica.py --batch 8 --tokens 32768 --steps 8 \
        --policy flex-r2 --promotion-mib 8 [--key-page-mib 16]

Synthetic K/V of the GPU run's geometry (32 q / 8 KV heads, d = 128; the distribution of
``planekv.bench.attention.synthetic_step``, encoded with the torch codec), one layer in a TieredCache (h = 4) with
``--promotion-mib`` of promotion cache (the GPU run's share: 32 MiB at B = 32 T = 32K is 3.1% of the 4-bit cache;
B = 8 gets the same room per sequence with 8 MiB), then ``--steps`` decode steps of the torch reference with
queries drifting as in the GPU run (0.1 of their standard deviation of fresh noise a step). Per step it times
``Prefetcher.run`` (plan and promotions: host wall time) and prints, over the steps after the first: the median
prefetch time, caps split into Keys and Values, the Value bits wanted past the hot planes, and how spread those
Value wants are over pages (pages wanted per KV head; the demand the most demanded k pages hold).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import torch

from planekv.bench.tiering import POLICIES, placement, policy_named
from planekv.kvstore import Codec, FormatSpec
from planekv.kvstore.calibration import calibrate
from planekv.kvstore.reference import readkv_decode
from planekv.tiering import Prefetcher, StepTally
from planekv.tiering.tiered_cache import TieredCache

HQ, HKV, D, HOT = 32, 8, 128, 4


def synthetic(b: int, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, T, d] and q [B, Hq, d] (float32) as ``synthetic_step`` draws them."""
    g = torch.Generator().manual_seed(seed)
    gen0 = torch.Generator().manual_seed(1000 + D + HKV)  # distribution parameters: fixed per geometry
    k_scale, k_off = torch.ones(HKV, 1, D), 0.5 * torch.randn(HKV, 1, D, generator=gen0)
    idx = torch.randperm(D, generator=gen0)[:4]
    k_scale[..., idx] = 2.0
    k_off[..., idx] = 8.0 * torch.sign(torch.randn(HKV, 1, 4, generator=gen0))
    v_scale = 1 + 0.5 * torch.rand(HKV, 1, D, generator=gen0)
    k = torch.randn(b, HKV, t, D, generator=g) * k_scale + k_off
    v = torch.randn(b, HKV, t, D, generator=g) * v_scale
    gq = HQ // HKV  # queries: a noisy mix of three keys of the group, logits scaled to a std of 2.5
    pick = torch.randint(0, t, (b, HKV, gq, 3), generator=g)
    kk = torch.gather(k, 2, pick.reshape(b, HKV, -1, 1).expand(-1, -1, -1, D)).reshape(b, HKV, gq, 3, D)
    q = kk.mean(3) + 0.5 * torch.randn(b, HKV, gq, D, generator=g)
    q = q * (2.5 / ((q @ k.transpose(2, 3)) / math.sqrt(D)).std(-1, keepdim=True))
    return k, v, q.reshape(b, HQ, D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=8, help="decode steps (the first fills the cache, not counted)")
    ap.add_argument("--policy", choices=POLICIES, default="flex-r2")
    ap.add_argument("--promotion-mib", type=float, default=8.0)
    ap.add_argument("--key-page-mib", type=float, default=0.0, help="Key page slots (Key refinement policies)")
    args = ap.parse_args()
    if not (1 <= args.batch <= 64 and 64 <= args.tokens <= 131072 and 2 <= args.steps <= 64):
        raise SystemExit("tier_replica: --batch 1..64, --tokens 64..131072, --steps 2..64")
    b, t = args.batch, args.tokens
    k, v, q0 = synthetic(b, t)
    n_cal = min(t, 4096)
    spec0 = FormatSpec(model_id="tier-replica", n_layers=1, n_q_heads=HQ, n_kv_heads=HKV, head_dim=D,
                       calibration_id="-", codebook="gaussian-lloyd-tree", v_run=1)
    cal = calibrate(k[:1, :, :n_cal], v[:1, :, :n_cal], spec0.seed_k, spec0.seed_v)
    spec = dataclasses.replace(spec0, calibration_id=cal.calibration_id)
    codec = Codec(spec, cal)
    policy = policy_named(args.policy)
    cache = TieredCache(spec, b, placement(HOT, spec.format_id), max_tokens=t,
                        promotion_bytes=int(args.promotion_mib * 2**20), host_bytes=64 << 30,
                        key_page_bytes=int(args.key_page_mib * 2**20))
    for i in range(b):
        cache.append(0, codec.encode_k(k[i], 0), codec.encode_v(v[i], 0), seq=i)
    del k, v
    pf, tally = Prefetcher(), StepTally()
    gen = torch.Generator().manual_seed(17)
    took, pages, top = [], [], {16: [], 128: []}
    k_caps = v_caps = kr_caps = wanted = v_beyond = 0.0
    for step in range(args.steps):
        if step == 1:
            tally.restart()
        q = q0 + 0.1 * q0.std() * torch.randn(q0.shape, generator=gen)
        res = cache.residency(0)
        _, st = readkv_decode(q, cache, 0, codec, policy, residency=res)
        tally.add(0, st, HOT, HOT, spec.page_size)
        t0 = time.perf_counter()
        tally.fetched_for_next(0, pf.run(cache, 0, st, res))
        took.append(time.perf_counter() - t0)
        if step == 0:
            continue
        ex = st.extra
        k_caps += float(ex["k_caps"].sum())
        v_caps += float(ex["v_caps"].sum())
        kr_caps += float(ex["kr_caps"].sum()) if "kr_caps" in ex else 0.0
        wanted += float(ex["wanted_bits"].sum())
        for w in ex["v_wanted"]:  # [Hkv, T] the depth each Value token asked for
            past = (w - HOT).clamp_min(0)
            v_beyond += D * float(past.sum())
            n = w.shape[1] // spec.page_size
            demand = past[:, : n * spec.page_size].reshape(HKV, n, spec.page_size).sum(-1).float()  # [Hkv, pages]
            pages.append(float((demand > 0).sum(1).float().mean()))
            ranked = demand.sort(1, descending=True).values
            for kk in top:
                top[kk].append(float(ranked[:, :kk].sum() / ranked.sum().clamp_min(1e-9)))
    sm = tally.summary()
    print(f"B={b} T={t} {args.policy} h={HOT} promotion {args.promotion_mib} MiB, Key pages {args.key_page_mib} MiB; "
          f"{args.steps - 1} steps counted")
    print(f"prefetch ms a layer-step: median {1e3 * statistics.median(took[1:]):.1f} "
          f"(first step {1e3 * took[0]:.1f}; all {[round(1e3 * x, 1) for x in took]})")
    print(f"caps {100 * sm['cap_rate']:.2f}% of the requested bits (Key channels {100 * k_caps / wanted:.2f}%, "
          f"Values {100 * v_caps / wanted:.2f}%, Key refinement's tokens {100 * kr_caps / wanted:.2f}%), "
          f"hits {100 * sm['hit_rate']:.1f}%")
    print(f"Value bits wanted past the hot planes: {100 * v_beyond / wanted:.2f}% of the requested bits, in "
          f"{statistics.mean(pages):.0f} of {t // spec.page_size} pages a KV head; the 16 most demanded pages hold "
          f"{100 * statistics.mean(top[16]):.0f}% of that demand, the 128 most {100 * statistics.mean(top[128]):.0f}%")


if __name__ == "__main__":
    main()
