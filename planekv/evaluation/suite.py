"""The whole evaluation in one job: calibration, K/V split search on the dev text, perplexity and
passkey for every system and budget, then the report (JSON, Markdown, PNG) in ``--out``.

``planekv eval all --out DIR`` (or ``python -m planekv.evaluation.suite --out DIR``) with the
defaults reproduces EVALUATION.md; ``--quick`` runs a reduced version in minutes. ``planekv eval all --workers N``
runs the units of the split search, perplexity and passkey on N Ray workers (``executors``); ``--resume`` keeps
finished jobs and the journaled units of unfinished ones.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .common import (
    ALL_SYSTEMS,
    RATES,
    VARIANTS,
    Setup,
    add_tier_budget_arguments,
    check_hot_planes,
    check_tier_budgets,
    setup,
    system_rows,
)
from .executors import EXECUTOR_ARGUMENTS, add_executor_arguments, check_executor_arguments, open_executor
from .jobs import hardware, job_main, write_json
from .passkey import parse_plan, run_passkey
from .perplexity import add_setup_arguments, decode_rows, parse_k_share, run_perplexity
from .report import write_report
from .split_search import GRID, freeze, run_split_search
from .texts import TEST_TEXTS
from .units import Executor

log = logging.getLogger(__name__)

# every row of DESIGN section 7, and PlaneKV's flexible reader with its third stage, Key refinement
DEFAULT_SYSTEMS = (*ALL_SYSTEMS, "readkv-flexible-kr")
LONG_SYSTEMS = ("dense", "readkv-flexible", "readkv-flexible-kr", "readkv-constrained")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=ALL_SYSTEMS + VARIANTS)
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
    p.add_argument("--long-systems", nargs="*", default=list(LONG_SYSTEMS), choices=ALL_SYSTEMS + VARIANTS)
    p.add_argument("--long-rates", nargs="*", type=float, default=[2.0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reader", default="reference")
    p.add_argument("--template", default="chat", choices=["chat", "raw"], help="passkey prompt form")
    p.add_argument("--row-chunk", type=int, default=512)
    p.add_argument("--tiered-hot", nargs="*", type=int, default=[], metavar="H",
                   help="also read every ReadKV row from a tiered cache with H hot planes (docs/TIERING.md): "
                        "perplexity as decode steps beside the same decode steps all-GPU, passkey decode")
    add_tier_budget_arguments(p)
    p.add_argument("--skip", nargs="*", default=[], choices=["perplexity", "passkey"], help="jobs to leave out")
    p.add_argument("--resume", action="store_true",
                   help="keep what an earlier run of the same settings left in --out (split search, perplexity, "
                        "the finished units of perplexity and passkey) and run the rest")
    add_executor_arguments(p)
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
    check_executor_arguments(args)
    check_hot_planes(args.tiered_hot)
    check_tier_budgets(args.promotion_mib, args.key_page_mib)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, out,
              codebook=args.codebook)
    settings = {k: v for k, v in vars(args).items() if k not in ("func", "resume", *EXECUTOR_ARGUMENTS)}
    meta = {"model_id": s.lm.model_id, "model_revision": s.lm.revision,
            "calibration_id": s.calibration.calibration_id, "format_id": s.codec.format_id,
            "hardware": hardware(), "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "planekv eval all " + " ".join(shlex.quote(a) for a in _own_args(sys.argv[1:])),
            "settings": settings, "seconds": {}}
    prev = _previous(out, meta) if args.resume else None
    if prev is not None:  # the same run continued: keep its record, note the continuation
        meta = {**prev, "seconds": prev.get("seconds", {}),
                "continued": [*prev.get("continued", []), {"date": meta["date"], "hardware": meta["hardware"]}]}
    write_json(out / "run.json", meta)
    with open_executor(args, s) as executor:
        _run_jobs(args, s, out, meta, prev, executor)
    meta["seconds"]["total"] = time.perf_counter() - t_all + meta["seconds"].get("total", 0.0)
    write_json(out / "run.json", meta)
    md = write_report(out)
    log.info("evaluation done in %.0f s; report at %s", meta["seconds"]["total"], md)
    return 0


def _run_jobs(args: argparse.Namespace, s: Setup, out: Path, meta: dict, prev: dict | None,
              executor: Executor) -> None:
    """The split search, perplexity and passkey (each unless kept from ``prev`` or skipped), on ``executor``."""
    k_share = parse_k_share(args.k_share)
    if prev is not None and args.split_search and not k_share and (out / "split_search.json").is_file():
        k_share = {float(r): v for r, v in _load(out / "split_search.json")["k_share"].items()}
        log.info("split search kept from the earlier run: %s", k_share)
    elif args.split_search and not k_share:
        t0 = time.perf_counter()
        sp = run_split_search(s, args.rates, args.grid, args.window, args.split_windows, row_chunk=args.row_chunk,
                              executor=executor)
        sp["seconds"] = meta["seconds"]["split_search"] = time.perf_counter() - t0
        write_json(out / "run.json", meta)  # each job's time is on disk as soon as it is done
        write_json(out / "split_search.json", sp)
        k_share = {float(r): v for r, v in sp["k_share"].items()}
        if args.freeze:
            freeze(sp, s.lm.model_id, s.calibration.calibration_id)
    rows = decode_rows(system_rows(args.systems, args.rates, k_share), args.tiered_hot)
    if prev is not None and "perplexity" not in args.skip and _has_rows(out / "perplexity.json", rows):
        log.info("perplexity kept from the earlier run")
    elif "perplexity" not in args.skip:
        t0 = time.perf_counter()
        res = run_perplexity(s, rows, args.texts, args.window, args.windows, args.row_chunk, executor, out,
                             resume=prev is not None, promotion_mib=args.promotion_mib,
                             key_page_mib=args.key_page_mib)
        res["seconds"] = meta["seconds"]["perplexity"] = time.perf_counter() - t0
        write_json(out / "run.json", meta)
        write_json(out / "perplexity.json", res)
        write_report(out)
    if "passkey" not in args.skip:
        t0 = time.perf_counter()
        trials = args.trials if len(args.trials) == len(args.contexts) else [args.trials[0]] * len(args.contexts)
        plan = parse_plan(args.contexts, args.systems, args.rates, args.long_systems, args.long_rates, k_share,
                          args.tiered_hot)
        res = run_passkey(s, plan, dict(zip(args.contexts, trials, strict=True)), args.seed, args.reader,
                          args.template, on_partial=lambda r: (write_json(out / "passkey.json", r), write_report(out)),
                          promotion_mib=args.promotion_mib, executor=executor, out=out, resume=prev is not None,
                          key_page_mib=args.key_page_mib)
        res["seconds"] = meta["seconds"]["passkey"] = time.perf_counter() - t0 + meta["seconds"].get("passkey", 0.0)
        write_json(out / "passkey.json", res)


def _own_args(argv: Sequence[str]) -> list[str]:
    """The suite's own arguments (without ``eval all`` when it ran through the ``planekv`` CLI)."""
    return list(argv[2:]) if list(argv[:2]) == ["eval", "all"] else list(argv)


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _previous(out: Path, meta: dict) -> dict | None:
    """The earlier run's record in ``out`` when it had the same settings, model and calibration
    (None when there is none); refuses to continue a run of other settings."""
    path = out / "run.json"
    if not path.is_file():
        return None
    prev = _load(path)
    for key in ("model_id", "calibration_id", "format_id", "settings"):
        if prev.get(key) != json.loads(json.dumps(meta[key])):
            raise ValueError(f"cannot resume in {out}: the earlier run differs in {key}; use another --out")
    return prev


def _has_rows(path: Path, rows: Sequence) -> bool:
    """Whether a perplexity result holds every one of ``rows``."""
    if not path.is_file():
        return False
    have = {r.get("key") for r in _load(path).get("rows", [])}
    return all(r.key in have for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("planekv.evaluation.suite", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
