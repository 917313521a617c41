"""The ``planekv`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import __version__

# Modules that add subcommands; each has `register(subparsers)`.
_SUBCOMMAND_MODULES: tuple[str, ...] = (
    "planekv.evaluation.cli",  # calibrate, eval
    "planekv.bench.cli",  # bench attention
    "planekv.services.cli",  # control, store
    "planekv.orchestration.cli",  # up, down, status
)


def _stack_demo(args: argparse.Namespace) -> int:
    from .orchestration.stack_demo import TABLE_COLUMNS, run_stack_demo, table_rows

    console = Console(width=max(120, Console().width))
    res = run_stack_demo(Path(args.out), context=args.tokens, rates=tuple(args.rates), hots=tuple(args.hots),
                         calib_tokens=args.calib_tokens, promotion_mib=args.promotion_mib,
                         say=lambda s: console.print(f"[dim]{s}[/dim]"))
    table = Table(title=f"Passkey at {res['context']} tokens on the embedded stack ({res['model']}, {res['device']}; "
                        f"promotion cache {res['promotion_mib']:g} MiB)")
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="left" if col in ("reader", "answer") else "right")
    for row in table_rows(res):
        table.add_row(*row)
    console.print(table)
    w = res["worker"]
    console.print(f"worker: {w['decode_steps']} decode steps, {w['steps_per_second']:.2f} steps/s, caps "
                  f"{100 * w['cap_rate']:.2f}% of the bits asked for; JSON and plot in {args.out}; "
                  f"{res['seconds']:.0f} s in all")
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.stack:
        return _stack_demo(args)
    from .demo import run_demo
    from .evaluation.decode_data import load_data

    console = Console(width=max(120, Console().width))
    t0 = time.perf_counter()
    real = False if args.synthetic else (True if args.model else None)
    with console.status("loading SmolLM2 and recording its attention inputs ...") as status:
        layers = {} if args.layers is None else {"n_layers": args.layers}
        data = load_data(real=real, n_tokens=args.tokens, n_steps=args.steps, calib_tokens=args.calib_tokens,
                         seed=args.seed, **layers)
        rows, facts = run_demo(data, rates=tuple(args.rates),
                               progress=lambda s: status.update(f"reading with {s} ..."))
    table = Table(title=f"Decode attention: {facts['source']}")
    for col in ("system", "target R", "bits read / scalar", "read % of fp16", "capacity bits",
                "capacity % of fp16", "attn-output rel. error"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        table.add_row(r.system, f"{r.target_rate:g}", f"{r.bits_read:.3f}", f"{100 * r.bits_read / 16:.1f}",
                      f"{r.capacity_bits:.2f}", f"{100 * r.capacity_bits / 16:.1f}", f"{r.rel_error:.4f}")
    console.print(table)
    console.print(
        f"One sequence of {facts['tokens']} tokens: PlaneKV stores "
        f"{facts['capacity_bytes_one_sequence'] / 2**20:.2f} MiB "
        f"(W = 8, calibration and codebook included) vs {facts['dense_fp16_bytes_one_sequence'] / 2**20:.2f} MiB "
        f"dense fp16; {facts['pages_in_use']} pages in use for the decode steps.")
    console.print(f"Write amortization (N = 8192, L = 128, W = 8, R = 4): "
                  f"{100 * facts['write_amortization_8192_128_8_4']:.3f}% extra bits over bits read.")
    console.print(f"[dim]{time.perf_counter() - t0:.1f} s[/dim]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [r.__dict__ for r in rows], "facts": facts}, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="planekv", description="PlaneKV: progressive bit-plane KV-cache store")
    p.add_argument("--version", action="version", version=f"planekv {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="encode K/V, read at several budgets with every system, print a table")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--model", action="store_true",
                     help="require the real model (SmolLM2); default: use it if installed")
    src.add_argument("--synthetic", action="store_true", help="use synthetic K/V instead of the model")
    d.add_argument("--tokens", type=int, default=2048, help="context tokens")
    d.add_argument("--steps", type=int, default=4, help="decode steps (the last positions of the context)")
    d.add_argument("--calib-tokens", type=int, default=2048, help="calibration tokens (real model)")
    d.add_argument("--layers", type=int, default=None,
                   help="layers read (model: evenly spaced, default 10; synthetic: default 2)")
    d.add_argument("--rates", type=float, nargs="+", default=[4.0, 2.0])
    d.add_argument("--seed", type=int, default=0, help="synthetic data seed")
    d.add_argument("--json", help="also write the rows as JSON to this path")
    stack = d.add_argument_group("the embedded stack (`make demo`)")
    stack.add_argument("--stack", action="store_true",
                       help="run the main job on the embedded stack: `planekv up`, calibrate, a passkey prompt of "
                            "--tokens decoded at --rates under placement policies changed through the REST API, "
                            "the table and plot, `planekv down`")
    stack.add_argument("--hots", type=int, nargs="+", default=[8, 4, 2],
                       help="hot planes of the policy's successive versions (8: every plane on the device)")
    stack.add_argument("--promotion-mib", type=float, default=4.0, help="the worker's promotion cache, MiB")
    stack.add_argument("--out", default="results/demo", help="where the JSON and the plot go")
    d.set_defaults(func=_demo)

    # Subcommands owned by other parts register themselves here (each module exposes
    # `register(subparsers)`); a part whose optional dependencies are missing is skipped.
    for module in _SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # optional extra not installed
            logging.getLogger(__name__).debug("subcommands of %s unavailable: %s", module, exc)
            continue
        mod.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # one line per HTTP request (health probes, policy lookups) is noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
