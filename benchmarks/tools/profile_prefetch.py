"""Where prefetch's host time goes at full size: cProfile and torch.profiler around ``Prefetcher.run``.

    PYTHONPATH=$PWD python benchmarks/tools/profile_prefetch.py --shape b32-t32k --policy flex-r2 --hot 4 \
        --promotion-mib 32 [--key-page-mib 64] [--out DIR]

The workload of ``planekv bench tiering --timing`` (``planekv.bench.tiering._time_tiered``): synthetic K/V of the
shape in a TieredCache at hot depth ``--hot``, drifting queries, the Triton tiered read (the torch reference with
``--reader reference``, for a plumbing run on the CPU at a small ``--shape``). After ``--warm`` steps it profiles
``--steps`` steps and prefetches: the step's host wall time (read, stats, tally), the plan alone (timed apart),
the whole run (cProfile, top functions by cumulative and own time), and one step and one run under torch.profiler
(host ops by self CPU time). Printed; with ``--out`` also written there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch

from planekv.bench.attention import SHAPES, synthetic_step
from planekv.bench.tiering import FMA, _tiered_from, policy_named
from planekv.bench.timing import sync
from planekv.kernels import TritonReader
from planekv.tiering import Prefetcher, StepTally
from planekv.tiering.decode import tiered_decode_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="b32-t32k", choices=sorted(SHAPES))
    ap.add_argument("--policy", default="flex-r2")
    ap.add_argument("--hot", type=int, default=4)
    ap.add_argument("--promotion-mib", type=float, default=32.0)
    ap.add_argument("--key-page-mib", type=float, default=0.0)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reader", choices=("triton", "reference"), default="triton")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = synthetic_step(SHAPES[args.shape], dev, 0)
    codec, policy = s.codec, policy_named(args.policy)
    cache = _tiered_from(s, codec, args.hot, args.promotion_mib, args.key_page_mib if policy.key_refine else 0.0)
    read = None
    if args.reader == "triton":
        reader = TritonReader(codec, policy, config=FMA)
        plan = reader.plan(s.q.shape[0], int(s.lengths.max()), dev)

        def read(qq, c, layer, scale):  # noqa: ANN001, ANN202
            return reader.decode_tiered(qq, c, layer, scale, plan)

    pf, tally = Prefetcher(), StepTally()
    gen = torch.Generator(device=dev).manual_seed(17)
    report = io.StringIO()

    def say(text: str) -> None:
        print(text, flush=True)
        report.write(text + "\n")

    def step() -> tuple:
        q = s.q.float() + 0.1 * s.q.float().std() * torch.randn(s.q.shape, device=dev, generator=gen)
        residency = cache.residency(0)
        _, stats = tiered_decode_step(q, cache, 0, codec, policy, None, tally, None, read, residency=residency)
        sync(dev)
        return stats, residency

    for _ in range(args.warm):
        stats, residency = step()
        tally.fetched_for_next(0, pf.run(cache, 0, stats, residency))
    plan_s, run_s, step_s = [], [], []
    prof = cProfile.Profile()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        stats, residency = step()
        step_s.append(time.perf_counter() - t0)
        k_slots, v_slots = cache.promotion_slots(0)
        t0 = time.perf_counter()
        pf.plan(stats, residency, cache.hot_k[0], cache.hot_v[0], codec.spec.page_size, k_slots, v_slots,
                cache.key_page_slots(0), cache.pinned_k_depth(0), codec.spec.width)
        sync(dev)
        plan_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        prof.enable()
        p = pf.run(cache, 0, stats, residency)
        sync(dev)
        prof.disable()
        run_s.append(time.perf_counter() - t0)
        tally.fetched_for_next(0, p)
        say(f"step: plan {1e3 * plan_s[-1]:.1f} ms, run {1e3 * run_s[-1]:.1f} ms; fetch K {p.k_fetch.shape[0]} "
            f"keep K {p.k_keep.shape[0]}, fetch V {p.v_fetch.shape[0]} keep V {p.v_keep.shape[0]}, "
            f"fetch KP {p.kp_fetch.shape[0]} keep KP {p.kp_keep.shape[0]}")
    say(f"median: step (read, stats, tally) {1e3 * statistics.median(step_s):.1f} ms, plan "
        f"{1e3 * statistics.median(plan_s):.1f} ms, run (plan + promotions) {1e3 * statistics.median(run_s):.1f} ms "
        f"over {args.steps} steps ({args.shape}, {args.policy}, h = "
        f"{args.hot}, {dev.type})")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(35)
        say(buf.getvalue())
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda"
                                                    else [])
    with torch.profiler.profile(activities=acts) as tp:
        stats, residency = step()
    say("one step (read, stats, tally):\n" + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    with torch.profiler.profile(activities=acts) as tp:
        pf.run(cache, 0, stats, residency)
        sync(dev)
    say("one prefetch:\n" + tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile-prefetch.txt").write_text(report.getvalue())


if __name__ == "__main__":
    main()
