"""The whole evaluation in one job: calibration, K/V split search on the dev text, perplexity and
passkey for every system and budget, then the report (JSON, Markdown, PNG) in ``--out``.

``planekv eval all --out DIR`` (or ``python -m planekv.evaluation.suite --out DIR``) with the
defaults reproduces EVALUATION.md; ``--quick`` runs a reduced version in minutes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .common import ALL_SYSTEMS, RATES, hardware, setup, system_rows, write_json
from .passkey import parse_plan, run_passkey
from .perplexity import add_setup_arguments, parse_k_share, run_perplexity
from .report import write_report
from .split_search import GRID, freeze, run_split_search
from .texts import TEST_TEXTS

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    p.add_argument("--window", type=int, default=2048, help="perplexity window, tokens")
    p.add_argument("--windows", type=int, default=4, help="perplexity windows per test text")
    p.add_argument("--texts", nargs="+", default=list(TEST_TEXTS))
    p.add_argument("--split-search", action=argparse.BooleanOptionalAction, default=True,
                   help="search the flexible reader's K share on the dev text first (else use the frozen one)")
    p.add_argument("--grid", nargs="+", type=float, default=list(GRID), help="K shares to try")
    p.add_argument("--split-windows", type=int, default=4, help="dev-text windows for the split search")
    p.add_argument("--freeze", action="store_true", help="write the chosen K shares to planekv/evaluation/k_share.json")
    p.add_argument("--contexts", nargs="+", type=int, default=[8192, 4096, 2048],
                   help="passkey contexts, run in this order (the longest first)")
    p.add_argument("--trials", nargs="+", type=int, default=[50, 8, 8], help="passkey trials per context")
    p.add_argument("--long-systems", nargs="*", default=["dense", "readkv-flexible", "readkv-constrained"],
                   choices=ALL_SYSTEMS)
    p.add_argument("--long-rates", nargs="*", type=float, default=[2.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reader", default="reference")
    p.add_argument("--template", default="chat", choices=["chat", "raw"], help="passkey prompt form")
    p.add_argument("--row-chunk", type=int, default=512)
    p.add_argument("--skip", nargs="*", default=[], choices=["perplexity", "passkey"], help="jobs to leave out")
    p.add_argument("--quick", action="store_true",
                   help="reduced run: 512-token windows, 2K passkey only with 4 trials, few systems")


def apply_quick(args: argparse.Namespace) -> None:
    args.window, args.windows, args.split_windows = 512, 1, 1
    args.grid = [0.375, 0.5, 0.625]
    args.contexts, args.trials = [2048], [4]
    args.long_systems, args.long_rates = [], None
    args.calib_tokens, args.calib_window = 4096, 4096


def run(args: argparse.Namespace) -> int:
    if args.quick:
        apply_quick(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, out)
    meta = {"model_id": s.lm.model_id, "model_revision": s.lm.revision,
            "calibration_id": s.calibration.calibration_id, "format_id": s.codec.format_id,
            "hardware": hardware(), "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "planekv eval all " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items() if k != "func"}, "seconds": {}}
    write_json(out / "run.json", meta)
    k_share = parse_k_share(args.k_share)
    if args.split_search and not k_share:
        t0 = time.perf_counter()
        sp = run_split_search(s, args.rates, args.grid, args.window, args.split_windows, row_chunk=args.row_chunk)
        sp["seconds"] = meta["seconds"]["split_search"] = time.perf_counter() - t0
        write_json(out / "split_search.json", sp)
        k_share = {float(r): v for r, v in sp["k_share"].items()}
        if args.freeze:
            freeze(sp, s.lm.model_id, s.calibration.calibration_id)
    if "perplexity" not in args.skip:
        t0 = time.perf_counter()
        rows = system_rows(args.systems, args.rates, k_share)
        res = run_perplexity(s, rows, args.texts, args.window, args.windows, args.row_chunk)
        res["seconds"] = meta["seconds"]["perplexity"] = time.perf_counter() - t0
        write_json(out / "perplexity.json", res)
        write_report(out)
    if "passkey" not in args.skip:
        t0 = time.perf_counter()
        trials = args.trials if len(args.trials) == len(args.contexts) else [args.trials[0]] * len(args.contexts)
        plan = parse_plan(args.contexts, args.systems, args.rates, args.long_systems, args.long_rates, k_share)
        res = run_passkey(s, plan, dict(zip(args.contexts, trials, strict=True)), args.seed, args.reader,
                          args.template, on_context=lambda r: (write_json(out / "passkey.json", r), write_report(out)))
        res["seconds"] = meta["seconds"]["passkey"] = time.perf_counter() - t0
        write_json(out / "passkey.json", res)
    meta["seconds"]["total"] = time.perf_counter() - t_all
    write_json(out / "run.json", meta)
    md = write_report(out)
    log.info("evaluation done in %.0f s; report at %s", meta["seconds"]["total"], md)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .common import job_main

    return job_main("planekv.evaluation.suite", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
