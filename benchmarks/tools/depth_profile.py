"""Depth profile of one decode step of the Triton reader on the benchmark's synthetic data.

    PYTHONPATH=. python benchmarks/tools/depth_profile.py --shape b32-t32k [--k-share 0.75]

Prints, per flexible rate, the Key channel and Value token depth histograms and how the Value
stage's 32-token tiles are filled: the share of tiles with any token deeper than 0 (tiles it cannot
skip) and the planes it reads per tile (its deepest token) against the mean depth. That ratio is
what token compaction would save.
"""

from __future__ import annotations

import argparse

import torch

from planekv.kernels import TritonReader
from planekv.kernels.bench import SHAPES, _gen, _policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="b32-t32k", choices=sorted(SHAPES))
    ap.add_argument("--k-share", type=float, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    s = _gen(SHAPES[args.shape], dev, 0, None)
    t = s.k.shape[2]
    for system in ("readkv-flex-r4", "readkv-flex-r2"):
        pol = _policy(system, args.k_share)
        reader = TritonReader(s.codec, pol)
        plan = reader.plan(s.q.shape[0], t, dev)
        reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)
        kd = plan.kdep.flatten().long().cpu()
        vd = plan.vdep[..., :t].long().cpu()
        tiles = vd.reshape(*vd.shape[:-1], -1, 32)
        smax = tiles.max(-1).values.float()
        print(f"{system} (K share {pol.k_share:g}): K depth mean {kd.float().mean():.2f}, histogram "
              f"{torch.bincount(kd, minlength=9).tolist()}")
        print(f"  V depth mean {vd.float().mean():.3f}, histogram {torch.bincount(vd.flatten(), minlength=9).tolist()}")
        print(f"  32-token tiles with a nonzero depth: {(smax > 0).float().mean():.3f}; planes per tile "
              f"(deepest token) {smax.mean():.2f} vs mean depth {vd.float().mean():.3f} "
              f"-> compaction bound {smax.mean() / max(vd.float().mean().item(), 1e-9):.1f}x")


if __name__ == "__main__":
    main()
