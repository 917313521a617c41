"""Teacher-forced perplexity (DESIGN section 7) for every system and budget.

Every position i of every layer reads the compressed cache of tokens [0, i] with its own depths,
exactly as decode step i would (``planekv.models.hf.teacher_forced``); errors of one layer's reads
propagate into the next layer's queries, keys and values, as in real decoding.

The work is one unit per (row, text, window) (``window_unit``; ``units``), run in this process or, with
``planekv eval perplexity ... --workers N``, by N Ray workers (``executors``); each finished unit is journaled in
``--out`` and ``--resume`` runs only the missing ones.

Runs directly (and as a Ray job entrypoint), in one process:
``python -m planekv.evaluation.perplexity --out DIR [--window 2048 --windows 2 --systems ...]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..kvstore import CODEBOOKS
from .common import (
    ALL_SYSTEMS,
    RATES,
    VARIANTS,
    Setup,
    SystemRow,
    build_system,
    label,
    system_rows,
)
from .executors import InProcess, add_executor_arguments, check_executor_arguments, open_executor
from .jobs import job_main, write_json
from .texts import TEST_TEXTS, tokenize_text, windows
from .units import Executor, Unit, add_resume_argument, job_journal, run_units

log = logging.getLogger(__name__)

MODEL_ROW = "model"  # the row part of the unit keys of the model's own loss (no PlaneKV)


def window_nll(model: Any, ids: torch.Tensor) -> tuple[float, int]:
    """(sum of next-token NLL in nats, number of predicted tokens) for one window [N]."""
    dev = next(model.parameters()).device
    x = ids[None].to(dev)
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
    return float(nll), ids.numel() - 1


def model_nll(model: Any, ids: torch.Tensor) -> tuple[float, int]:
    """The model's own loss (its default dense attention, no PlaneKV) over one window."""
    return window_nll(model, ids)


def _unit_key(row_key: str, text: str, index: int) -> str:
    return f"{row_key}|{text}|{index}"


def window_units(rows: Sequence[SystemRow | None], texts: Sequence[str], window: int, n_windows: int,
                 row_chunk: int = 512) -> list[Unit]:
    """One unit per (row, text, window index), in that order; a None row is the model's own loss."""
    return [Unit(_unit_key(MODEL_ROW if row is None else row.key, text, i),
                 {"row": None if row is None else row.to_dict(), "text": text, "window": window,
                  "n_windows": n_windows, "index": i, "row_chunk": row_chunk})
            for row in rows for text in texts for i in range(n_windows)]


def window_unit(s: Setup, spec: dict[str, Any]) -> dict[str, Any]:
    """One window (``spec`` of window_units) read teacher-forced by its row, or by the model itself:
    {nll (nats), tokens (predicted), k_bits, v_bits, dense_bits (logical read), seconds}."""
    from ..models.hf import teacher_forced

    ids = windows(tokenize_text(s.lm.tokenizer, spec["text"]), spec["window"], spec["n_windows"])[spec["index"]]
    t0 = time.perf_counter()
    if spec["row"] is None:
        nll, n = model_nll(s.lm.model, ids)
        k_bits = v_bits = dense_bits = 0.0
    else:
        with teacher_forced(build_system(SystemRow(**spec["row"]), s.codec), spec["row_chunk"]) as tally:
            nll, n = window_nll(s.lm.model, ids)
        k_bits, v_bits, dense_bits = float(tally.k_bits), float(tally.v_bits), float(tally.dense_bits)
    return {"nll": nll, "tokens": n, "k_bits": k_bits, "v_bits": v_bits, "dense_bits": dense_bits,
            "seconds": time.perf_counter() - t0}


def row_table(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str], window: int, n_windows: int,
              results: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's perplexity per text and overall, logical read and capacity, from its window units' results
    (summed in unit order)."""
    d = s.codec.spec.head_dim
    table = []
    for row in rows:
        system = build_system(row, s.codec)
        res: dict[str, Any] = {
            **row.to_dict(), "key": row.key, "label": label(row, system), "describe": system.describe(),
            "capacity_bits": system.capacity_bits(window, d), "texts": {}, "k_bits": 0.0, "v_bits": 0.0,
            "dense_bits": 0.0, "seconds": 0.0}
        for text in texts:
            nll = n = 0.0
            for i in range(n_windows):
                w = results[_unit_key(row.key, text, i)]
                nll, n = nll + w["nll"], n + w["tokens"]
                for k in ("k_bits", "v_bits", "dense_bits", "seconds"):
                    res[k] += w[k]
            res["texts"][text] = {"nll": nll, "tokens": n, "ppl": math.exp(nll / n)}
        nll = sum(v["nll"] for v in res["texts"].values())
        n = sum(v["tokens"] for v in res["texts"].values())
        res["ppl"] = math.exp(nll / n)
        res["read_fraction"] = (res["k_bits"] + res["v_bits"]) / res["dense_bits"]
        res["capacity_fraction"] = res["capacity_bits"] / 16.0
        log.info("%s: perplexity %.4f", res["label"], res["ppl"])
        table.append(res)
    return table


def evaluate_rows(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str], window: int, n_windows: int,
                  row_chunk: int = 512, desc: str = "perplexity", executor: Executor | None = None
                  ) -> list[dict[str, Any]]:
    """Perplexity of every row over ``n_windows`` windows of ``window`` tokens of each text (row_table), the
    windows run by ``executor`` (default: this process)."""
    units = window_units(rows, texts, window, n_windows, row_chunk)
    results = run_units(units, window_unit, executor or InProcess(s), desc=desc)
    return row_table(s, rows, texts, window, n_windows, results)


def run_perplexity(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str] = TEST_TEXTS, window: int = 2048,
                   n_windows: int = 2, row_chunk: int = 512, executor: Executor | None = None,
                   out: str | os.PathLike[str] | None = None, resume: bool = False) -> dict[str, Any]:
    """The perplexity table: every row, the model's own loss, % change against the dense row. The windows run
    by ``executor`` (default: this process); with ``out`` each finished one is journaled there
    (``perplexity.units.jsonl``) and ``resume`` keeps those an earlier run of the same settings finished."""
    units = window_units([None, *rows], texts, window, n_windows, row_chunk)
    journal = None if out is None else job_journal(
        out, "perplexity", s, rows=[r.key for r in rows], texts=list(texts), window=window, n_windows=n_windows,
        row_chunk=row_chunk)
    results = run_units(units, window_unit, executor or InProcess(s), journal, resume, desc="perplexity")
    own_nll = own_n = 0.0
    for u in units:
        if u.spec["row"] is None:
            own_nll, own_n = own_nll + results[u.key]["nll"], own_n + results[u.key]["tokens"]
    res = row_table(s, rows, texts, window, n_windows, results)
    dense = next((r for r in res if r["name"] == "dense"), None)
    for r in res:
        r["ppl_change_pct"] = None if dense is None else 100.0 * (r["ppl"] / dense["ppl"] - 1.0)
    return {"job": "perplexity", "texts": list(texts), "window": window, "n_windows": n_windows,
            "tokens_per_row": int(own_n), "model_ppl": math.exp(own_nll / own_n), "rows": res}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS + VARIANTS)
    p.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    p.add_argument("--texts", nargs="+", default=list(TEST_TEXTS))
    p.add_argument("--window", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--row-chunk", type=int, default=512, help="query rows per reference-reader call")
    add_resume_argument(p)
    add_executor_arguments(p)


def add_setup_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), a .gguf file or an HF directory")
    p.add_argument("--calibration", default=None, help="calibration artifact (.pt); computed if omitted")
    p.add_argument("--calib-tokens", type=int, default=16384, help="calibration tokens when computing it")
    p.add_argument("--calib-window", type=int, default=8192, help="tokens per calibration window")
    p.add_argument("--k-share", nargs="*", default=None, metavar="R=PHI",
                   help="flexible reader K share per rate (default: the frozen dev-text choice)")
    p.add_argument("--device", default="auto")
    p.add_argument("--codebook", default="gaussian-lloyd-tree", choices=CODEBOOKS,
                   help="the stored codes' codebook (a named option; FormatSpec.codebook)")
    p.add_argument("--out", required=True, help="output directory (JSON, Markdown, PNG)")


def parse_k_share(items: Sequence[str] | None) -> dict[float, float] | None:
    if not items:
        return None
    out = {}
    for it in items:
        r, phi = it.split("=")
        out[float(r)] = float(phi)
    return out


def run(args: argparse.Namespace) -> int:
    from .common import setup
    from .report import write_report

    check_executor_arguments(args)
    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, args.out,
              codebook=args.codebook)
    rows = system_rows(args.systems, args.rates, parse_k_share(args.k_share))
    t0 = time.perf_counter()
    with open_executor(args, s) as executor:
        res = run_perplexity(s, rows, args.texts, args.window, args.windows, args.row_chunk, executor, args.out,
                             args.resume)
    res["seconds"] = time.perf_counter() - t0
    res["workers"] = args.workers
    res["calibration_id"] = s.calibration.calibration_id
    res["format_id"] = s.codec.format_id
    res["codebook"] = s.codec.spec.codebook
    write_json(f"{args.out}/perplexity.json", res)
    write_report(args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("planekv.evaluation.perplexity", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
