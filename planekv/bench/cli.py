"""`planekv bench attention`: the decode-attention benchmark (:mod:`planekv.bench.attention`); `planekv bench
tiering`, `planekv bench load` and `planekv bench prefix` (:mod:`planekv.bench.tiering`, :mod:`planekv.bench.load`,
:mod:`planekv.bench.prefix`); `planekv bench spill`
(:mod:`planekv.bench.spill_read`)."""

from __future__ import annotations

import argparse
import dataclasses
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
        run_bench,
    )
    from .output import rows_to_json

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


def _bench_tiering(args: argparse.Namespace) -> int:
    import os

    import torch

    from ..evaluation.decode_data import load_data
    from .output import rows_to_json
    from .tiering import TierSetup, format_table, parse_deep, run_decode, run_timing

    console = Console(width=max(140, Console().width))
    say = lambda s: console.print(f"[dim]{s}[/dim]")  # noqa: E731
    rows = []
    try:
        tier = TierSetup(args.tier, spill_dir=args.spill_dir, store_url=args.store_url,
                         store_token=args.store_token or os.environ.get("PLANEKV_API_TOKEN"),
                         block_bytes=None if args.block_kib is None else int(args.block_kib * 1024),
                         host_bytes=None if args.host_mib is None else int(args.host_mib * 2**20),
                         deadline_ms=args.deadline_ms)
        deep = [parse_deep(text) for text in args.deep_key_channels or []]
    except ValueError as exc:
        raise SystemExit(f"planekv bench tiering: {exc}") from None
    if not args.timing_only:
        real = {"smollm2": True, "synthetic": False}[args.source]
        data = load_data(real=real, n_tokens=args.tokens, n_steps=args.steps, n_layers=args.layers)
        say(f"decode steps: {data.source}")
        rows += run_decode(data, args.policies, args.hots, promotion_mib=args.promotion_mib, warmup=args.warmup,
                           prefetch=not args.no_prefetch, reader=args.reader, progress=say,
                           key_page_mib=args.key_page_mib, tier=tier, deep=deep, deep_rank=args.deep_key_rank,
                           k_margin=args.k_margin, tier_aware=args.tier_aware)
    for shape in args.timing or []:
        rows += run_timing(shape, args.policies, args.hots, reps=args.reps, warm=args.warm,
                           promotion_mib=args.promotion_mib, layers=args.model_layers, budget_gib=args.budget_gib,
                           progress=say, key_page_mib=args.key_page_mib, k_margin=args.k_margin)
    console.print(format_table(rows))
    if args.json:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": dev,
                "torch": torch.__version__, "host": platform.node(), "args": vars(args) | {"func": None}}
        rows_to_json(rows, args.json, meta)
        console.print(f"wrote {args.json}")
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    import os
    import signal

    from .load import LoadConfig, LoadError, format_table, host_meta, parse_mix, result_to_json, run_load

    try:
        cfg = LoadConfig(clients=args.clients, seconds=args.seconds, max_requests=args.max_requests,
                         timeout_s=args.timeout, mix=parse_mix(args.mix or ""), block_pages=args.block_pages,
                         keys_per_client=args.keys_per_client, memory_bytes=int(args.memory_mib * 2**20),
                         file_bytes=int(args.file_mib * 2**20), write_through=args.write_through, seed=args.seed)
        pids = {name: int(pid) for name, _, pid in (p.partition("=") for p in args.pid)}
    except ValueError as exc:
        raise SystemExit(f"planekv bench load: {exc}") from None
    console = Console(width=max(140, Console().width))
    meta = host_meta() | {"args": vars(args) | {"func": None, "token": "(given)" if args.token else None}}

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_load, which stops every process it started

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        res = run_load(cfg, args.store_url, args.control_url, args.token or os.environ.get("PLANEKV_API_TOKEN"),
                       pids, say=lambda s: console.print(f"[dim]{s}[/dim]"))
    except LoadError as exc:
        raise SystemExit(f"planekv bench load: {exc}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta["load_avg_at_end"] = os.getloadavg()
    console.print(format_table(res))
    if args.json:
        result_to_json(res, args.json, meta)
        console.print(f"wrote {args.json}")
    if res["wrong_reads"] or res["errors_5xx"]:
        console.print(f"[red]{res['wrong_reads']} wrong reads, {res['errors_5xx']} answers 5xx[/red]")
        return 1
    return 0


def _bench_prefix(args: argparse.Namespace) -> int:
    import torch

    from ..evaluation.common import setup
    from ..evaluation.jobs import hardware
    from .output import rows_to_json
    from .prefix import PrefixConfig, format_table, run_prefix
    from .tiering import policy_named

    console = Console(width=max(140, Console().width))
    err = Console(stderr=True)
    say = lambda s: err.print(f"[dim]{s}[/dim]")  # noqa: E731
    try:
        cfg = PrefixConfig(prefix_tokens=args.tokens, suffix_tokens=args.suffix, reps=args.reps,
                           max_compressed_tokens=args.max_compressed_tokens, tiered_hot=args.tiered_hot,
                           reader=args.reader, index_from=args.index_from, text=args.text)
        policy = policy_named(args.policy)
    except ValueError as exc:
        raise SystemExit(f"planekv bench prefix: {exc}") from None
    say(f"loading {args.model} ({'calibration ' + args.calibration if args.calibration else 'calibrating'})")
    s = setup(args.model, args.calibration, device=args.device, calib_tokens=args.calib_tokens,
              calib_window=min(args.calib_tokens, 8192))
    if cfg.reader == "auto":
        cfg = dataclasses.replace(cfg, reader="triton" if s.device.type == "cuda" else "reference")
    say(f"{s.lm.model_id} on {s.device}, format {s.codec.spec.format_id}, page {s.codec.spec.page_size} tokens, "
        f"reader {cfg.reader}")
    rows = run_prefix(s.lm.model, s.lm.tokenizer, s.codec, policy, cfg, progress=say)
    console.print(format_table(rows))
    if args.json:
        dev = torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu"
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": dev,
                "hardware": hardware(), "torch": torch.__version__, "host": platform.node(),
                "model": s.lm.model_id, "format_id": s.codec.spec.format_id, "page_size": s.codec.spec.page_size,
                "calibration_id": s.calibration.calibration_id, "config": dataclasses.asdict(cfg),
                "policy": policy.to_dict(), "args": vars(args) | {"func": None}}
        rows_to_json(rows, args.json, meta)
        console.print(f"wrote {args.json}")
    reuse = rows[-1]
    return 1 if reuse.same_as_compressed is False else 0


def _bench_spill(args: argparse.Namespace) -> int:
    import torch

    from .output import rows_to_json
    from .spill_read import SpillConfig, format_table, run_spill

    console = Console(width=max(140, Console().width))
    err = Console(stderr=True)
    say = lambda s: err.print(f"[dim]{s}[/dim]")  # noqa: E731
    try:
        cfg = SpillConfig(blocks=args.blocks, block_bytes=int(args.block_mib * 2**20),
                          page_bytes=int(args.page_kib * 1024), reps=args.reps, backend=args.backend,
                          device=args.device, modes=tuple(args.modes), max_open_files=args.max_open_files)
        if cfg.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for and CUDA is not available")
        rows = run_spill(cfg, args.dir, progress=say)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"planekv bench spill: {exc}") from None
    console.print(format_table(rows))
    console.print("first: the first pass; warm: the median of the later passes. The files were just written, so "
                  "both may be served from the page cache.")
    if args.json:
        dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": dev,
                "torch": torch.__version__, "host": platform.node(), "backend": rows[0].backend,
                "compat_mode": rows[0].compat_mode, "config": dataclasses.asdict(cfg),
                "args": vars(args) | {"func": None}}
        rows_to_json(rows, args.json, meta)
        console.print(f"wrote {args.json}")
    return 0 if all(r.checked for r in rows) else 1


def _at_least_one(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _at_least_zero(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
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
    _register_tiering(bsub)
    _register_load(bsub)
    _register_prefix(bsub)
    _register_spill(bsub)


def _register_tiering(bsub: argparse._SubParsersAction) -> None:
    from .attention import SHAPES
    from .tiering import DEEP_RANKS, HOTS, POLICIES, TIERS

    t = bsub.add_parser("tiering", help="hot planes on the GPU, refinement planes in host memory: caps, prefetch "
                                        "hits, GPU bytes, step time (docs/TIERING.md)")
    t.add_argument("--source", choices=("smollm2", "synthetic"), default="smollm2",
                   help="decode steps over SmolLM2's real K/V (CPU, the evaluation extra) or synthetic K/V")
    t.add_argument("--tokens", type=_at_least_one, default=2048, help="tokens before the last decode step")
    t.add_argument("--steps", type=_at_least_one, default=16, help="consecutive decode steps")
    t.add_argument("--layers", type=_at_least_one, default=10, help="layers read (evenly spaced)")
    t.add_argument("--warmup", type=int, default=1, help="first steps not counted (they fill the promotion cache)")
    t.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    t.add_argument("--hots", nargs="+", type=int, choices=range(0, 9), default=list(HOTS), metavar="H",
                   help="hot planes h (K and V alike)")
    t.add_argument("--promotion-mib", type=float, default=64.0, help="promotion cache, MiB (per model; per layer "
                                                                     "in --timing)")
    t.add_argument("--key-page-mib", type=float, default=0.0,
                   help="Key page slots for Key refinement, MiB (per model; per layer in --timing; beside the "
                        "promotion cache; 0: refined tokens of sealed pages read at their channels' resident depth)")
    t.add_argument("--no-prefetch", action="store_true", help="no prefetch (only the pages kept at sealing)")
    t.add_argument("--k-margin", type=_at_least_zero, default=1, metavar="N",
                   help="prefetch N Key planes past each channel's wanted depth, after the wanted ones (default 1; "
                        "0: only what the step asked for)")
    t.add_argument("--tier-aware", action="store_true",
                   help="decode steps: allocate within what is resident (ReadPolicy.tier_aware: the budget of an "
                        "increment that is not resident goes to resident ones; caps still count the unlimited "
                        "allocation's increments past it); reference reader only")
    t.add_argument("--reader", choices=("reference", "triton"), default="reference",
                   help="the tiered read of the decode steps (Key refinement always runs the reference)")
    t.add_argument("--tier", choices=TIERS, default="host",
                   help="decode steps: the refinement planes in host memory, in spill files below a small host tier "
                        "(nvme) or at the store service below a small host tier (remote)")
    t.add_argument("--spill-dir", help="--tier nvme: where the spill files go (default: a temporary directory, "
                                       "removed afterwards)")
    t.add_argument("--store-url", help="--tier remote: the store service (it must take the format: registered, or "
                                       "a store without require_registered_format)")
    t.add_argument("--store-token", help="--tier remote: the store's bearer token (default: $PLANEKV_API_TOKEN)")
    t.add_argument("--block-kib", type=float, help="--tier nvme / remote: the host tier's block size, KiB (default: "
                                                   "the 4 KiB header and 4 pages)")
    t.add_argument("--host-mib", type=float, help="--tier nvme / remote: the host tier's capacity, MiB (default: 2 "
                                                  "blocks per stream, the rest goes below)")
    t.add_argument("--deadline-ms", type=float, help="the read policy's deadline: remote fetches that miss it are "
                                                     "left out and the reads capped (counted)")
    t.add_argument("--deep-key-channels", nargs="+", metavar="SHARE:EXTRA",
                   help="decode steps: after each hot depth h, a row per option with deep Key channels at the same "
                        "average Key depth: h_K = h - SHARE x EXTRA (a whole number), h_V = h, and SHARE of each KV "
                        "head's Key channels pinned to h_K + EXTRA planes (e.g. 0.25:4 0.5:2)")
    t.add_argument("--deep-key-rank", choices=DEEP_RANKS, default="profile",
                   help="which Key channels are deep: profile (the all-GPU reader's Key depths on the warm-up steps, "
                        "not counted), sigma (the calibration's Key scale per channel) or oracle (the depths over "
                        "every step, counted ones included: an upper bound, not available to a real cache)")
    t.add_argument("--timing", nargs="+", choices=sorted(SHAPES), metavar="SHAPE",
                   help="also time these benchmark shapes (CUDA): SDPA, FP8, all-GPU, tiered, whole-chunk offload")
    t.add_argument("--timing-only", action="store_true", help="skip the decode steps")
    t.add_argument("--reps", type=int, default=30, help="graph replays per system (median)")
    t.add_argument("--warm", type=int, default=4, help="--timing: drifting-query steps that fill the promotion cache")
    t.add_argument("--model-layers", type=_at_least_one, default=32,
                   help="--timing: layers of the model whose GPU bytes are counted")
    t.add_argument("--budget-gib", type=float, default=40.0, help="--timing: the GPU KV budget for the largest batch")
    t.add_argument("--json", help="write rows and metadata here")
    t.set_defaults(func=_bench_tiering)


def _register_load(bsub: argparse._SubParsersAction) -> None:
    from .load import DEFAULT_MIX, OPS

    t = bsub.add_parser("load", help="N clients for M seconds against the store service and the control plane: "
                                     "throughput, p50/p99, errors, wrong reads, peak RSS (issue 32)")
    t.add_argument("--clients", type=_at_least_one, default=16, help="concurrent clients (asyncio tasks)")
    t.add_argument("--seconds", type=float, default=60.0, help="how long the clients send requests")
    t.add_argument("--max-requests", type=_at_least_one, default=2_000_000, help="at most this many, all clients")
    t.add_argument("--timeout", type=float, default=10.0, help="per-request timeout, s")
    t.add_argument("--mix", default="", help=f"op=weight[,op=weight] over {', '.join(OPS)} (default "
                                             + ",".join(f"{k}={v:g}" for k, v in DEFAULT_MIX.items()) + ")")
    t.add_argument("--block-pages", type=_at_least_one, default=128,
                   help="pages per block; a page is 8 KiB of payload (default 128: 1 MiB)")
    t.add_argument("--keys-per-client", type=_at_least_one, default=16, help="distinct blocks each client cycles")
    t.add_argument("--memory-mib", type=float, default=64.0, help="the started store's memory tier, MiB")
    t.add_argument("--file-mib", type=float, default=128.0, help="the started store's file tier, MiB")
    t.add_argument("--write-through", action="store_true", help="start the store in write-through mode")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--store-url", help="target this running store instead of starting one (with --control-url)")
    t.add_argument("--control-url", help="target this running control plane (with --store-url)")
    t.add_argument("--token", help="bearer token of the targeted services (default: $PLANEKV_API_TOKEN)")
    t.add_argument("--pid", action="append", default=[], metavar="NAME=PID",
                   help="a targeted process whose peak RSS to report (repeatable)")
    t.add_argument("--json", help="write the result and metadata here")
    t.set_defaults(func=_bench_load)


def _register_prefix(bsub: argparse._SubParsersAction) -> None:
    from .prefix import DEFAULT_TEXT, INDEX_FROM
    from .tiering import POLICIES

    t = bsub.add_parser("prefix", help="prefix reuse: time to first token of a prompt whose prefix's pages are in a "
                                       "prefix index, against fresh dense and compressed prefills (issue 33)")
    t.add_argument("--model", default="smollm2", help="smollm2, a local HF directory or a .gguf")
    t.add_argument("--calibration", help="a calibration .pt (default: computed on the calibration text)")
    t.add_argument("--calib-tokens", type=_at_least_one, default=2048, help="tokens calibrated on, if computed")
    t.add_argument("--tokens", type=_at_least_one, default=1024, help="prefix tokens (shared)")
    t.add_argument("--suffix", type=_at_least_one, default=16, help="new tokens after the shared prefix")
    t.add_argument("--text", default=DEFAULT_TEXT, help="the prompt's text: a shipped text's name or a file")
    t.add_argument("--device", default="auto")
    t.add_argument("--reps", type=_at_least_one, default=3, help="timed repetitions (median), after one warm-up")
    t.add_argument("--max-compressed-tokens", type=int, default=2048,
                   help="skip the fresh compressed prefill (token by token) above this many prompt tokens")
    t.add_argument("--tiered-hot", type=int, choices=range(0, 9), metavar="H",
                   help="every cache tiered, H hot planes (default: untiered)")
    t.add_argument("--reader", choices=("auto", "reference", "triton"), default="auto",
                   help="the compressed reads (auto: triton on CUDA, else reference)")
    t.add_argument("--policy", choices=POLICIES, default="flex-r4", help="the read policy")
    t.add_argument("--index-from", choices=INDEX_FROM, default="auto",
                   help="build the index by a compressed prefill of the prefix, or from a dense prefill's codes "
                        "(a stand-in of the same size: TTFT only); auto: compressed where it runs")
    t.add_argument("--json", help="write rows and metadata here")
    t.set_defaults(func=_bench_prefix)


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def _register_spill(bsub: argparse._SubParsersAction) -> None:
    from .spill_read import BACKENDS, MODES

    t = bsub.add_parser("spill", help="the spill tier's reads against a plain read loop of the same library (kvikio "
                                      "or posix) over the same files, in one run (issue 33)")
    t.add_argument("--backend", choices=BACKENDS, default="auto", help="the tier's backend and the plain loop's "
                                                                       "library (auto: kvikio where it runs)")
    t.add_argument("--blocks", type=_at_least_one, default=64, help="blocks written (per mode)")
    t.add_argument("--block-mib", type=_positive, default=1.0, help="payload per block, MiB")
    t.add_argument("--page-kib", type=_positive, default=16.0, help="--modes page: bytes per read, KiB")
    t.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="page: each block's pages; block: whole blocks (one page each)")
    t.add_argument("--reps", type=_at_least_one, default=5, help="passes per system (first, then the median of "
                                                                 "the rest)")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: pinned host buffers, and a plain kvikio loop straight into a CUDA tensor")
    t.add_argument("--max-open-files", type=_at_least_one, default=64, help="the tier's handle cache")
    t.add_argument("--dir", help="where the files go (default: a temporary directory, removed afterwards)")
    t.add_argument("--json", help="write rows and metadata here")
    t.set_defaults(func=_bench_spill)
