"""`planekv bench attention`: the decode-attention benchmark (:mod:`planekv.bench.attention`)."""

from __future__ import annotations

import argparse
import datetime
import platform

from rich.console import Console


def _bench_attention(args: argparse.Namespace) -> int:
    import torch

    from .attention import (
        SHAPES,
        SYSTEMS,
        config_with,
        format_table,
        format_timeline,
        parse_settings,
        rows_to_json,
        run_bench,
    )

    settings: dict = parse_settings(args.config or "")
    for flag, field in (("num_warps", "num_warps"), ("assembly", "assembly"), ("value_alloc", "value_alloc"),
                        ("alloc_warps", "alloc_warps"), ("batch_streams", "batch_streams")):
        if getattr(args, flag) is not None:
            settings[field] = getattr(args, flag)
    if args.compact != "auto":
        settings["compact_values"] = args.compact == "on"
    try:
        config = config_with(settings)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"planekv bench attention: {exc}") from None
    console = Console(width=max(140, Console().width))
    shapes = args.shapes or list(SHAPES)
    rows = run_bench(shapes, args.systems or list(SYSTEMS), reps=args.reps, check=not args.no_check,
                     k_share=args.k_share, config=config, pages_per_program=args.pages_per_program,
                     timeline=args.timeline, codebook=args.codebook, v_run=args.v_run,
                     progress=lambda s: console.print(f"[dim]{s}[/dim]"))
    console.print(format_table(rows))
    if args.timeline:
        console.print(format_timeline(rows))
    if args.json:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": dev,
                "torch": torch.__version__, "host": platform.node(), "config": vars(config),
                "args": vars(args) | {"func": None}}
        rows_to_json(rows, args.json, meta)
        console.print(f"wrote {args.json}")
    return 0


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def register(sub: argparse._SubParsersAction) -> None:
    from ..kernels.config import ASSEMBLIES, VALUE_ALLOCS
    from ..kvstore import CODEBOOKS
    from .attention import SHAPES, SYSTEMS

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    a = bsub.add_parser("attention", help="decode attention: every system beside torch SDPA, CUDA-graph timed")
    a.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: all")
    a.add_argument("--systems", nargs="+", choices=SYSTEMS, help="default: all")
    a.add_argument("--reps", type=int, default=30, help="graph replays per system (median)")
    a.add_argument("--k-share", type=float, default=None,
                   help="flexible reader's K share of the bits (default: the share frozen for each rate, "
                        "planekv/evaluation/k_share.json)")
    a.add_argument("--config", default="",
                   help="reader settings as name=value[,name=value] (planekv.kernels.ReaderConfig's fields)")
    a.add_argument("--num-warps", type=int, default=None, help="ReaderConfig.num_warps")
    a.add_argument("--assembly", choices=ASSEMBLIES, default=None, help="ReaderConfig.assembly (default: auto)")
    a.add_argument("--pages-per-program", type=int, default=None,
                   help="pages per Key-stage program (default: the reader's, by assembly and step size)")
    a.add_argument("--value-alloc", choices=VALUE_ALLOCS, default=None,
                   help="ReaderConfig.value_alloc (default: auto, by step size)")
    a.add_argument("--compact", choices=("auto", "on", "off"), default="auto", help="ReaderConfig.compact_values")
    a.add_argument("--alloc-warps", type=int, default=None, choices=(1, 2, 4, 8, 16), help="ReaderConfig.alloc_warps")
    a.add_argument("--timeline", action="store_true",
                   help="also profile one graph replay per system: GPU time per kernel (torch.profiler)")
    a.add_argument("--no-check", action="store_true", help="skip the full-size check against the reference")
    a.add_argument("--json", help="write rows and metadata here")
    a.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS,
                   help="the format's codebook (a linear one runs the int8 Key and Value stages where they pay)")
    a.add_argument("--v-run", type=int, default=1, choices=(1, 2, 4, 8),
                   help="the format's V layout: each token's planes in runs of this many rows (1: plane-major)")
    a.add_argument("--batch-streams", type=_at_least_one, default=None,
                   help="ReaderConfig.batch_streams: the ReadKV step as this many batch parts on CUDA streams")
    a.set_defaults(func=_bench_attention)
