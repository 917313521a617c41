"""Bytes a decode step's plane reads touch, by layout and memory granule, from one step's depths.

    PYTHONPATH=. python benchmarks/tools/value_layout_bytes.py --shape b32-t32k --system readkv-flex-r4 \
        --codebook uniform-linear-c3 [--json out.json]

Runs one step of the attention benchmark's synthetic data and policy (as profile_step.py does) and
counts, from the step's Key and Value depths, the bytes of plane data that granules of 32 bytes (an L1
/ L2 sector), 64 bytes (a DRAM access of two sectors) and 128 bytes (a cache line) would move:

- Value, stored plane-major (the format: a page's plane j is P rows of d/8 bytes, tokens in order):
  per plane j, every granule holding a token of depth > j;
- Value, token-major (a possible format: a token's W plane rows contiguous, W * d/8 bytes per token):
  per token of depth s, the granules its first s rows overlap;
- Key, stored plane-major (a page's plane j is d rows of P/8 bytes, channels in order): per page and
  plane j, every granule holding a channel of depth > j;
- the logical bytes (depth x row bytes), against which the others are ratios.

What the model misses (request coalescing across warps, L2 hits between pages, prefetch) is what the
Nsight Compute figures of the same step (KERNEL_NOTES run 67) measure.
"""

from __future__ import annotations

import argparse
import json

import torch

from planekv.kernels.bench import SHAPES, _gen, _policy, _sector_bytes_k, _sector_bytes_v
from planekv.kernels.reader import TritonReader
from planekv.kvstore.codebook import CODEBOOKS

GRANULES = (32, 64, 128)


def value_plane_major(dep: torch.Tensor, row: int, granule: int, width: int) -> float:
    """dep [B, Hkv, T] (0 past the length): per plane, granules of granule // row tokens with one
    deeper (the benchmark's own sector count, at any granule; ``width`` unused, as token-major takes it)."""
    lengths = torch.full(dep.shape[:1], dep.shape[-1], device=dep.device)
    return _sector_bytes_v(dep, lengths, 8 * row, granule)


def value_token_major(dep: torch.Tensor, row: int, granule: int, width: int) -> float:
    """Token rows of width * row bytes (a multiple of the granule for d >= 32): ceil(s row / g) granules."""
    if (width * row) % granule:
        raise ValueError("token-major model assumes token rows of whole granules")
    return float(torch.ceil(dep.double() * row / granule).sum()) * granule


def key_plane_major(kdep: torch.Tensor, pages: torch.Tensor, page: int, granule: int) -> float:
    """kdep [B, Hkv, d]: per page and plane, granules of granule // (page / 8) channels with one deeper
    (the benchmark's own sector count; ``pages`` per sequence)."""
    return _sector_bytes_k(kdep, pages * page, page, granule)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="b32-t32k", choices=sorted(SHAPES))
    ap.add_argument("--system", default="readkv-flex-r2")
    ap.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS)
    ap.add_argument("--json")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = _gen(shape, dev, 0, None, codebook=args.codebook)
    pol = _policy(args.system, None)
    if pol is None:
        raise SystemExit(f"unknown ReadKV system {args.system}")
    reader = TritonReader(data.codec, pol)
    plan = reader.plan(shape.batch, shape.tokens, dev)
    reader.run(plan, data.q, data.cache.k_pool[0], data.cache.v_pool[0], data.page_table, data.lengths, 0)
    spec = data.codec.spec
    d, w, p = spec.head_dim, spec.width, spec.page_size
    lengths = data.lengths.to(dev)
    t = plan.vdep.shape[-1]
    live = (torch.arange(t, device=dev)[None, None, :] < lengths[:, None, None]).expand_as(plan.vdep)
    vdep = plan.vdep.long() * live
    row_v = d // 8
    pages = torch.ceil(lengths.double() / p)
    logical_v = float(vdep.sum()) * row_v
    logical_k = float((plan.kdep.long().sum((1, 2)).double() * pages).sum()) * (p // 8)
    out = {"shape": args.shape, "system": args.system, "codebook": args.codebook,
           "logical_v": logical_v, "logical_k": logical_k, "mean_v_depth": float(vdep.sum()) / float(live.sum()),
           "listed_tokens": float((vdep > 0).sum()), "tokens": float(live.sum())}
    for g in GRANULES:
        out[f"v_plane_major_{g}"] = value_plane_major(vdep, row_v, g, w)
        out[f"v_token_major_{g}"] = value_token_major(vdep, row_v, g, w)
        out[f"k_plane_major_{g}"] = key_plane_major(plan.kdep.long(), pages, p, g)
    print(f"{args.shape} {args.system} {args.codebook}: mean Value depth {out['mean_v_depth']:.2f}, "
          f"listed tokens {out['listed_tokens'] / out['tokens']:.1%}")
    print(f"  Value logical {logical_v / 1e6:.1f} MB; Key logical {logical_k / 1e6:.1f} MB")
    for g in GRANULES:
        pv, tv, pk = out[f"v_plane_major_{g}"], out[f"v_token_major_{g}"], out[f"k_plane_major_{g}"]
        print(f"  {g:3d}-byte granules: Value plane-major {pv / 1e6:8.1f} MB ({pv / logical_v:.2f}x), token-major "
              f"{tv / 1e6:8.1f} MB ({tv / logical_v:.2f}x); Key plane-major {pk / 1e6:8.1f} MB ({pk / logical_k:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
