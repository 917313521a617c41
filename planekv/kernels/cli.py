"""`planekv bench attention`: the decode-attention benchmark (see planekv.kernels.bench)."""

from __future__ import annotations

import argparse
import datetime
import platform

from rich.console import Console


def _bench_attention(args: argparse.Namespace) -> int:
    import torch

    from .bench import SHAPES, SYSTEMS, format_table, format_timeline, rows_to_json, run_bench

    console = Console(width=max(140, Console().width))
    shapes = args.shapes or list(SHAPES)
    rows = run_bench(shapes, args.systems or list(SYSTEMS), reps=args.reps, check=not args.no_check,
                     k_share=args.k_share, num_warps=args.num_warps, assembly=args.assembly,
                     pages_per_program=args.pages_per_program,
                     compact_values={"auto": None, "on": True, "off": False}[args.compact],
                     value_alloc=None if args.value_alloc == "auto" else args.value_alloc,
                     timeline=args.timeline, alloc_warps=args.alloc_warps, codebook=args.codebook,
                     v_run=args.v_run, batch_streams=args.batch_streams,
                     progress=lambda s: console.print(f"[dim]{s}[/dim]"))
    table = format_table(rows)
    console.print(table)
    if args.timeline:
        console.print(format_timeline(rows))
    if args.json:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": dev,
                "torch": torch.__version__, "host": platform.node(), "args": vars(args) | {"func": None}}
        rows_to_json(rows, args.json, meta)
        console.print(f"wrote {args.json}")
    return 0


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def register(sub: argparse._SubParsersAction) -> None:
    from ..kvstore import CODEBOOKS
    from .bench import SHAPES, SYSTEMS

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    a = bsub.add_parser("attention", help="decode attention: every system beside torch SDPA, CUDA-graph timed")
    a.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: all")
    a.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all")
    a.add_argument("--reps", type=int, default=30, help="graph replays per system (median)")
    a.add_argument("--k-share", type=float, default=None,
                   help="flexible reader's K share of the bits (default: the share frozen for each rate, "
                        "planekv/evaluation/k_share.json)")
    a.add_argument("--num-warps", type=int, default=4, help="warps per program of the Key and Value stages")
    a.add_argument("--assembly", choices=("fma", "transpose", "serial"), default=None,
                   help="how the Key and Value stages decode: float32 FMAs on the CUDA cores, one row of 8 "
                        "tokens (Key) or one token's 8 channels (Value) per thread (the default up to 8 query "
                        "heads per KV head); bit transposition with MMAs (the default above); bit-serial with MMAs")
    a.add_argument("--pages-per-program", type=int, default=None,
                   help="pages per Key-stage program (default: the reader's, by assembly)")
    a.add_argument("--value-alloc", choices=("auto", "two-pass", "radix"), default="auto",
                   help="how the Value allocation finds lambda (auto: by step size; docs/KERNEL_NOTES.md runs 33-34)")
    a.add_argument("--compact", choices=("auto", "on", "off"), default="auto",
                   help="Value stage over the depth > 0 tokens sorted by depth (on), every 32-token tile (off), "
                        "or the reader's measured choice (auto)")
    a.add_argument("--alloc-warps", type=int, default=None, choices=(1, 2, 4, 8, 16),
                   help="warps per program of the Value allocation's per-block kernels (default: by step size)")
    a.add_argument("--timeline", action="store_true",
                   help="also profile one graph replay per system: GPU time per kernel (torch.profiler)")
    a.add_argument("--no-check", action="store_true", help="skip the full-size check against the reference")
    a.add_argument("--json", help="write rows and metadata here")
    a.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS,
                   help="the format's codebook (a linear one runs the bit-product Key and Value stages where they pay)")
    a.add_argument("--v-run", type=int, default=1, choices=(1, 2, 4, 8),
                   help="the format's V layout: each token's planes in runs of this many rows (1: plane-major; "
                        "docs/DECISIONS.md)")
    a.add_argument("--batch-streams", type=_at_least_one, default=1,
                   help="the ReadKV step as this many batch parts, each on a CUDA stream of its own (TritonReader."
                        "batch_streams; 1: one stream)")
    a.set_defaults(func=_bench_attention)
