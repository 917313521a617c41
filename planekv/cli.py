"""The ``planekv`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from . import __version__

# Modules that add subcommands; each has `register(subparsers)`.
_SUBCOMMAND_MODULES: tuple[str, ...] = (
    "planekv.evaluation.cli",  # calibrate, eval
    "planekv.kernels.cli",  # bench attention
    "planekv.services.cli",  # control, store
)


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    console = Console(width=max(120, Console().width))
    t0 = time.perf_counter()
    with console.status("encoding K/V and reading with every system ..."):
        rows, facts = run_demo(n_tokens=args.tokens, batch=args.batch, n_layers=args.layers,
                               rates=tuple(args.rates), seed=args.seed)
    table = Table(title=f"Decode attention, synthetic K/V (T = {args.tokens}, batch {args.batch}, "
                        f"{args.layers} layers, 9 q / 3 KV heads, d = 64)")
    for col in ("system", "target R", "bits read / scalar", "read % of fp16", "capacity bits",
                "capacity % of fp16", "attn-output rel. error"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        table.add_row(r.system, f"{r.target_rate:g}", f"{r.bits_read:.3f}", f"{100 * r.bits_read / 16:.1f}",
                      f"{r.capacity_bits:.2f}", f"{100 * r.capacity_bits / 16:.1f}", f"{r.rel_error:.4f}")
    console.print(table)
    console.print(
        f"PlaneKV capacity: {facts['capacity_bytes'] / 2**20:.2f} MiB (W = 8, calibration and codebook "
        f"included) vs {facts['dense_fp16_bytes'] / 2**20:.2f} MiB dense fp16; "
        f"{facts['pages_in_use']} pages in use.")
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
    d.add_argument("--tokens", type=int, default=4096)
    d.add_argument("--batch", type=int, default=4)
    d.add_argument("--layers", type=int, default=2)
    d.add_argument("--rates", type=float, nargs="+", default=[4.0, 2.0])
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", help="also write the rows as JSON to this path")
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
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
