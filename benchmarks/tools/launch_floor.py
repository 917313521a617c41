"""The latency floor of a chain of dependent kernel launches in one CUDA graph (a small decode step's
floor: each phase that needs a grid-wide result is one launch).

    PYTHONPATH=. python benchmarks/tools/launch_floor.py --chain 1 6 12 24 --programs 1 8 132 --json out.json

For each chain length n and grid size, a graph of n launches of a Triton kernel that reads one int32
written by the launch before and writes it back plus one (so each launch depends on the previous one's
store, as a step's phases do), timed by graph replay (median); the per-launch time is the slope between
chain lengths. With ``--pdl 1`` / ``2`` the launches are programmatic dependent launches (each program
waits for the launch before at its first statement; 2 also lets the next launch begin at once; KERNEL_NOTES
run 108 measured the step's kernels so launched). torch's SDPA at B=1 T=8192 (GQA 32/8, d=128, fp16) is
timed in the same run for scale.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from planekv.bench import time_graphs


@triton.jit
def _hop(buf_ptr, N: tl.constexpr, PDL: tl.constexpr = 0):
    """Every program reads word 0 and program 0 writes it back plus one (a dependent chain)."""
    if PDL >= 1:  # wait for the launch before (its store visible), as a dependent launch must
        gdc_wait()
    if PDL >= 2:  # and let the next one begin now
        gdc_launch_dependents()
    pid = tl.program_id(0)
    x = tl.load(buf_ptr)
    ii = tl.arange(0, N)
    tl.store(buf_ptr + 1 + pid * N + ii, x + ii)  # each program does a little work of its own
    if pid == 0:
        tl.store(buf_ptr, x + 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chain", type=int, nargs="+", default=[1, 6, 12, 24])
    ap.add_argument("--programs", type=int, nargs="+", default=[1, 8, 132])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--pdl", type=int, nargs="+", default=[0], choices=[0, 1, 2],
                    help="programmatic dependent launch levels to time (0: ordinary launches)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_floor.py needs a GPU")
    if any(n < 1 for n in args.chain) or any(p < 1 for p in args.programs) or args.reps < 1:
        raise SystemExit("--chain, --programs and --reps take positive counts")
    dev = torch.device("cuda")
    rows = []
    for pdl in args.pdl:
        for progs in args.programs:
            buf = torch.zeros(1 + progs * 128, dtype=torch.int32, device=dev)
            ms = {}
            for n in args.chain:
                def step(n=n, progs=progs, buf=buf, pdl=pdl):
                    for _ in range(n):
                        _hop[(progs,)](buf, N=128, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
                ms[n] = time_graphs([step], args.reps)[0]
            lo, hi = min(args.chain), max(args.chain)
            slope = (ms[hi] - ms[lo]) / (hi - lo) * 1e3 if hi > lo else float("nan")
            for n in args.chain:
                rows.append({"pdl": pdl, "programs": progs, "chain": n, "graph_us": ms[n] * 1e3})
                print(f"pdl {pdl} programs {progs:4d} chain {n:3d}: graph {ms[n] * 1e3:8.2f} us")
            print(f"pdl {pdl} programs {progs:4d}: {slope:.2f} us per dependent launch")
            rows.append({"pdl": pdl, "programs": progs, "us_per_launch": slope})
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.float16)
    k = torch.randn(1, 8, 8192, 128, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    sdpa = time_graphs([lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)],
                        args.reps)[0]
    print(f"SDPA B=1 T=8192 (32/8, d=128): {sdpa * 1e3:.2f} us")
    rows.append({"sdpa_b1_t8k_us": sdpa * 1e3})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
