"""Teacher-forced perplexity (DESIGN section 7) for every system and budget.

Every position i of every layer reads the compressed cache of tokens [0, i] with its own depths,
exactly as decode step i would (``planekv.models.hf.teacher_forced``); errors of one layer's reads
propagate into the next layer's queries, keys and values, as in real decoding.

Runs directly (and as a Ray job entrypoint):
``python -m planekv.evaluation.perplexity --out DIR [--window 2048 --windows 2 --systems ...]``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from collections.abc import Sequence
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
from .jobs import job_main, progress, write_json
from .texts import TEST_TEXTS, tokenize_text, windows

log = logging.getLogger(__name__)


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


def evaluate_rows(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str], window: int, n_windows: int,
                  row_chunk: int = 512, desc: str = "perplexity") -> list[dict[str, Any]]:
    """Perplexity of every row over ``n_windows`` windows of ``window`` tokens of each text."""
    from ..models.hf import teacher_forced

    model, tok = s.lm.model, s.lm.tokenizer
    d = s.codec.spec.head_dim
    wins = {t: windows(tokenize_text(tok, t), window, n_windows) for t in texts}
    results = []
    jobs = [(r, t) for r in rows for t in texts]
    by_row: dict[str, dict[str, Any]] = {}
    for row, text in progress(jobs, total=len(jobs), desc=desc):
        system = build_system(row, s.codec)
        res = by_row.setdefault(row.key, {
            **row.to_dict(), "key": row.key, "label": label(row, system), "describe": system.describe(),
            "capacity_bits": system.capacity_bits(window, d), "texts": {}, "k_bits": 0.0, "v_bits": 0.0,
            "dense_bits": 0.0, "seconds": 0.0})
        nll = n = 0.0
        t0 = time.perf_counter()
        for w in wins[text]:
            with teacher_forced(system, row_chunk) as tally:
                a, b = window_nll(model, w)
            nll, n = nll + a, n + b
            res["k_bits"] += tally.k_bits
            res["v_bits"] += tally.v_bits
            res["dense_bits"] += tally.dense_bits
        res["seconds"] += time.perf_counter() - t0
        res["texts"][text] = {"nll": nll, "tokens": n, "ppl": math.exp(nll / n)}
        log.info("%s on %s: ppl %.4f (%.1f s)", res["label"], text, math.exp(nll / n), time.perf_counter() - t0)
    for res in by_row.values():
        nll = sum(v["nll"] for v in res["texts"].values())
        n = sum(v["tokens"] for v in res["texts"].values())
        res["ppl"] = math.exp(nll / n)
        res["read_fraction"] = (res["k_bits"] + res["v_bits"]) / res["dense_bits"]
        res["capacity_fraction"] = res["capacity_bits"] / 16.0
        results.append(res)
    return results


def run_perplexity(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str] = TEST_TEXTS, window: int = 2048,
                   n_windows: int = 2, row_chunk: int = 512) -> dict[str, Any]:
    """The perplexity table: every row, the model's own loss, % change against the dense row."""
    model, tok = s.lm.model, s.lm.tokenizer
    own_nll = own_n = 0.0
    for t in texts:
        for w in windows(tokenize_text(tok, t), window, n_windows):
            a, b = model_nll(model, w)
            own_nll, own_n = own_nll + a, own_n + b
    res = evaluate_rows(s, rows, texts, window, n_windows, row_chunk)
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

    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, args.out,
              codebook=args.codebook)
    rows = system_rows(args.systems, args.rates, parse_k_share(args.k_share))
    t0 = time.perf_counter()
    res = run_perplexity(s, rows, args.texts, args.window, args.windows, args.row_chunk)
    res["seconds"] = time.perf_counter() - t0
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
