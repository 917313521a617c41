"""A/B timings of reader settings (ReaderConfig fields), one process, SDPA timed beside them.

    PYTHONPATH=. python benchmarks/tools/ab_config.py --shapes b32-t32k b1-t8k \
        --systems readkv-flex-r2 --set num_warps=4 --set num_warps=8

Each ``--set name=value[,name=value]`` is one variant: a reader built as the benchmark builds it, with those
ReaderConfig fields (``pages_per_program`` and ``block_tokens`` go to ``plan()`` instead, and ``v_run`` to the
format: the same inputs encoded with that V layout). Median of graph replays (planekv.bench.timing).
"""

from __future__ import annotations

import argparse
import json

import torch

from planekv.bench import (
    SHAPES,
    check_against_reference,
    config_with,
    parse_settings,
    policy_of,
    synthetic_step,
    time_graphs,
    timeline,
)
from planekv.kernels import TritonReader
from planekv.kvstore.codebook import CODEBOOKS

PLAN_ARGS = ("pages_per_program", "block_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["b32-t32k"], choices=sorted(SHAPES))
    ap.add_argument("--systems", nargs="+", default=["readkv-flex-r2"])
    ap.add_argument("--set", action="append", default=[], dest="variants")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--timeline", action="store_true", help="also each variant's per-kernel GPU time")
    ap.add_argument("--check", action="store_true", help="also each variant against the reference reader "
                    "(depth differences, output error; the first two sequences)")
    ap.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS,
                    help="the format's codebook (the int8 stages need a linear one)")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        datas = {1: synthetic_step(shape, dev, 0, None, codebook=args.codebook)}
        data = datas[1]
        q4 = data.q[:, :, None, :]
        sdpa, _ = time_graphs([lambda q4=q4, d=data: torch.nn.functional.scaled_dot_product_attention(
            q4, d.k, d.v, enable_gqa=True)], args.reps)
        print(f"{name} sdpa {sdpa:.4f} ms")
        for system in args.systems:
            for spec in args.variants or [""]:
                var = parse_settings(spec)
                vr = int(var.pop("v_run", 1))
                if vr not in datas:
                    datas[vr] = synthetic_step(shape, dev, 0, None, codebook=args.codebook, v_run=vr)
                data = datas[vr]
                plan_kw = {k: var.pop(k) for k in PLAN_ARGS if k in var}
                try:
                    config = config_with(var)
                except (TypeError, ValueError) as exc:
                    raise SystemExit(str(exc)) from None
                if system == "full4":
                    reader = TritonReader(data.codec, fixed_depth=4, config=config)
                else:
                    pol = policy_of(system)
                    if pol is None:
                        raise SystemExit(f"unknown system {system}")
                    reader = TritonReader(data.codec, pol, config=config)
                plan = reader.plan(shape.batch, shape.tokens, dev, **plan_kw)
                ms, graphs = time_graphs([lambda r=reader, p=plan, d=data: r.run(p, d.q, d.cache.k_pool[0],
                                                                           d.cache.v_pool[0], d.page_table,
                                                                           d.lengths, 0)], args.reps)
                row = {"shape": name, "system": system, "variant": spec, "codebook": args.codebook, "ms": ms,
                       "sdpa_ms": sdpa}
                print(f"{name} {system} [{spec or 'default'}] {ms:.4f} ms x{ms / sdpa:.3f} SDPA")
                if plan.two_pass:  # the last step's two-pass allocation: brackets that fell back, candidates
                    cm = plan.cmeta[:, :5].cpu()
                    row["alloc"] = al = {"groups": cm.shape[0], "fallback_groups": int(cm[:, 4].sum()),
                                         "cand_mean": round(float(cm[:, 2].float().mean()), 1),
                                         "cand_max": int(cm[:, 2].max())}
                    print("  alloc " + ", ".join(f"{k}={v}" for k, v in al.items()))
                if args.check:
                    row["check"] = chk = check_against_reference(reader, plan, data, data.codec)
                    print("  check " + ", ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in chk.items()))
                if args.timeline and graphs:
                    row["timeline"] = tl = timeline(graphs[0])
                    print(f"  graph {tl['graph_us']} us, kernels {tl['kernel_sum_us']} us: " + ", ".join(
                        f"{k} {n:g}x {us:g}" for k, (n, us) in tl["kernels_us"].items()))
                rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
