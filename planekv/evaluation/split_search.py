"""The flexible reader's K/V split, searched on the dev text (mansfield_park) and then frozen.

For each rate R, teacher-forced perplexity of ``ReadPolicy.flexible(R, k_share)`` over a grid of K
shares; the share with the lowest dev perplexity is chosen. ``--freeze`` writes the choice to
``planekv/evaluation/k_share.json``, where ``common.default_k_share`` (and so every flexible row
and the kernels' default policy) reads it.

Runs directly (and as a Ray job entrypoint): ``python -m planekv.evaluation.split_search --out DIR``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import time
from collections.abc import Sequence
from typing import Any

from .common import FLEXIBLE, RATES, Setup, SystemRow, k_share_path
from .jobs import job_main, write_json
from .perplexity import add_setup_arguments, evaluate_rows
from .texts import DEV_TEXT
from .units import Executor

log = logging.getLogger(__name__)

GRID = (0.5, 0.625, 0.75, 0.875)


def run_split_search(s: Setup, rates: Sequence[float] = RATES, grid: Sequence[float] = GRID, window: int = 2048,
                     n_windows: int = 2, text: str = DEV_TEXT, row_chunk: int = 512,
                     system: str = "readkv-flexible", executor: Executor | None = None) -> dict[str, Any]:
    """Dev perplexity for every (rate, K share), the windows run by ``executor`` (default: this process); the
    chosen share per rate."""
    rows = [SystemRow(system, r, phi) for r in rates for phi in grid]
    res = evaluate_rows(s, rows, [text], window, n_windows, row_chunk, desc="split search", executor=executor)
    chosen = {}
    for r in rates:
        cand = [x for x in res if x["rate"] == r]
        best = min(cand, key=lambda x: x["ppl"])
        chosen[f"{r:g}"] = best["k_share"]
    return {"job": "split_search", "text": text, "window": window, "n_windows": n_windows, "grid": list(grid),
            "rows": [{"rate": x["rate"], "k_share": x["k_share"], "ppl": x["ppl"],
                      "read_fraction": x["read_fraction"], "seconds": x["seconds"]} for x in res],
            "k_share": chosen}


def freeze(result: dict[str, Any], model_id: str, calibration_id: str) -> None:
    """Write the chosen K shares where the library reads its default."""
    write_json(k_share_path(), {
        "k_share": result["k_share"], "chosen_on": result["text"], "window": result["window"],
        "n_windows": result["n_windows"], "grid": result["grid"], "model_id": model_id,
        "calibration_id": calibration_id, "date": dt.date.today().isoformat(),
        "note": "flexible reader K share per rate R, chosen by dev-text perplexity (split_search) and frozen"})


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    p.add_argument("--grid", nargs="+", type=float, default=list(GRID), help="K shares to try")
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--text", default=DEV_TEXT)
    p.add_argument("--row-chunk", type=int, default=512)
    p.add_argument("--system", default="readkv-flexible", choices=list(FLEXIBLE),
                   help="the flexible reader, or one of its named variants (common.VARIANT_OPTIONS)")
    p.add_argument("--freeze", action="store_true",
                   help=f"write the choice to planekv/evaluation/{k_share_path().name}")


def run(args: argparse.Namespace) -> int:
    from .common import setup

    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, args.out,
              codebook=args.codebook)
    t0 = time.perf_counter()
    res = run_split_search(s, args.rates, args.grid, args.window, args.windows, args.text, args.row_chunk,
                           args.system)
    res["seconds"] = time.perf_counter() - t0
    res["calibration_id"] = s.calibration.calibration_id
    write_json(f"{args.out}/split_search.json", res)
    log.info("chosen K shares: %s", res["k_share"])
    if args.freeze:
        freeze(res, s.lm.model_id, s.calibration.calibration_id)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("planekv.evaluation.split_search", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
