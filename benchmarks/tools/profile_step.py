"""One ReadKV decode step of the attention benchmark, run eagerly: a driver for Nsight Compute.

    PYTHONPATH=. python benchmarks/tools/profile_step.py --shape b32-t32k --system readkv-flex-r2
    ncu --kernel-name regex:'_key_stage_f|_value_stage_f' --launch-skip-before-match 0 \
        --section ComputeWorkloadAnalysis --section WarpStateStats \
        python benchmarks/tools/profile_step.py --shape b32-t32k --steps 1

The same synthetic data and policies as ``planekv bench attention`` (planekv.bench.attention), one
input set, ``--steps`` decode steps after one warm-up step (compilation happens there).
"""

from __future__ import annotations

import argparse

import torch

from planekv.bench import SHAPES, config_with, parse_settings, policy_of, synthetic_step
from planekv.kernels import TritonReader
from planekv.kvstore.codebook import CODEBOOKS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="b32-t32k", choices=sorted(SHAPES))
    ap.add_argument("--system", default="readkv-flex-r2")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS)
    ap.add_argument("--v-run", type=int, default=1, choices=(1, 2, 4, 8),
                    help="the format's V layout (FormatSpec.v_run)")
    ap.add_argument("--set", action="append", default=[], dest="attrs", metavar="NAME=VALUE",
                    help="a ReaderConfig field (int or float where it parses as one)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    dev = torch.device("cuda")
    data = synthetic_step(shape, dev, 0, None, codebook=args.codebook, v_run=args.v_run)
    pol = policy_of(args.system)
    if pol is None:
        raise SystemExit(f"unknown ReadKV system {args.system}")
    try:
        config = config_with({k: v for item in args.attrs for k, v in parse_settings(item).items()})
    except (TypeError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    reader = TritonReader(data.codec, pol, config=config)
    plan = reader.plan(shape.batch, shape.tokens, dev)
    for _ in range(1 + args.steps):
        reader.run(plan, data.q, data.cache.k_pool[0], data.cache.v_pool[0], data.page_table, data.lengths, 0)
    torch.cuda.synchronize()
    print(f"{args.shape} / {args.system}: {args.steps} step(s) after a warm-up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
