"""Teacher-forced perplexity (DESIGN section 7) for every system and budget.

Every position i of every layer reads the compressed cache of tokens [0, i] with its own depths,
exactly as decode step i would (``planekv.models.hf.teacher_forced``); errors of one layer's reads
propagate into the next layer's queries, keys and values, as in real decoding.

With ``--tiered-hot H`` each ReadKV row is also read as decode steps, one token per step through
``PlaneKVHFCache`` with the window's own tokens as inputs (``decode_nll``): once with every plane on the device
(the all-GPU row, ``SystemRow.decode``) and once per H from a tiered cache with H hot planes (docs/TIERING.md),
where position t reads what decode step t has resident (hot planes, the open page, what prefetch promoted after
step t - 1), the caps counted as the decode path counts them. The two differ only by tiering.

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
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..kvstore import CODEBOOKS
from .common import (
    ALL_SYSTEMS,
    RATES,
    VARIANTS,
    Setup,
    SystemRow,
    add_tier_budget_arguments,
    build_system,
    check_hot_planes,
    check_tier_budgets,
    label,
    system_rows,
    tier_budgets,
    tiered_rows,
)
from .executors import InProcess, add_executor_arguments, check_executor_arguments, open_executor
from .jobs import job_main, write_json
from .texts import TEST_TEXTS, tokenize_text, windows
from .units import Executor, Unit, add_resume_argument, job_journal, run_units

log = logging.getLogger(__name__)

MODEL_ROW = "model"  # the row part of the unit keys of the model's own loss (no PlaneKV)
TIER_BITS = ("cap_bits", "wanted_bits", "beyond_hot_bits", "served_bits")  # a tiered row's StepTally, bits


def window_nll(model: Any, ids: torch.Tensor) -> tuple[float, int]:
    """(sum of next-token NLL in nats, number of predicted tokens) for one window [N]."""
    dev = next(model.parameters()).device
    x = ids[None].to(dev)
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum")
    return float(nll), ids.numel() - 1


def decode_nll(model: Any, cache: Any, ids: torch.Tensor) -> tuple[float, int]:
    """(sum of next-token NLL in nats, number of predicted tokens) for one window [N] run as decode steps through
    ``cache`` (a fresh ``PlaneKVHFCache`` made with ``dense_prefill=False``), one token per step, the window's own
    tokens as inputs: every token, the first included, is written and then reads the cache as a decode step does
    (so every position reads compressed K/V, as in ``readkv_teacher_forced``)."""
    dev = next(model.parameters()).device
    x = ids.to(dev)
    nll = 0.0
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for t in range(ids.numel() - 1):
            logits = model(x[None, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[t + 1]))
    return nll, ids.numel() - 1


def model_nll(model: Any, ids: torch.Tensor) -> tuple[float, int]:
    """The model's own loss (its default dense attention, no PlaneKV) over one window."""
    return window_nll(model, ids)


def _unit_key(row_key: str, text: str, index: int) -> str:
    return f"{row_key}|{text}|{index}"


def window_units(rows: Sequence[SystemRow | None], texts: Sequence[str], window: int, n_windows: int,
                 row_chunk: int = 512, promotion_mib: float = 64.0, key_page_mib: float = 0.0) -> list[Unit]:
    """One unit per (row, text, window index), in that order; a None row is the model's own loss. Tiered rows
    carry their promotion cache and Key page slots (MiB; the latter only when not 0)."""
    return [Unit(_unit_key(MODEL_ROW if row is None else row.key, text, i),
                 {"row": None if row is None else row.to_dict(), "text": text, "window": window,
                  "n_windows": n_windows, "index": i, "row_chunk": row_chunk,
                  **(tier_budgets(promotion_mib, key_page_mib) if row is not None and row.hot is not None else {})})
            for row in rows for text in texts for i in range(n_windows)]


def window_unit(s: Setup, spec: dict[str, Any]) -> dict[str, Any]:
    """One window (``spec`` of window_units) read teacher-forced by its row, as decode steps (decode and tiered
    rows), or by the model itself: {nll (nats), tokens (predicted), k_bits, v_bits, dense_bits (logical read),
    seconds}; a tiered row adds its StepTally in bits: cap_bits, wanted_bits (read + capped), beyond_hot_bits
    (asked for past the hot planes), served_bits (of those, read from the promotion cache)."""
    from ..models.hf import Tiering, make_cache, teacher_forced

    ids = windows(tokenize_text(s.lm.tokenizer, spec["text"]), spec["window"], spec["n_windows"])[spec["index"]]
    t0 = time.perf_counter()
    row = None if spec["row"] is None else SystemRow(**spec["row"])
    tier: dict[str, float] = {}
    if row is None:
        nll, n = model_nll(s.lm.model, ids)
        k_bits = v_bits = dense_bits = 0.0
    elif row.decode or row.hot is not None:
        tiering = None if row.hot is None else Tiering(row.hot, ids.numel(), int(spec["promotion_mib"] * (1 << 20)),
                                                         key_page_bytes=int(spec.get("key_page_mib", 0.0) * (1 << 20)))
        cache = make_cache(s.lm.model, build_system(row, s.codec), tiering=tiering, dense_prefill=False)
        nll, n = decode_nll(s.lm.model, cache, ids)
        k_bits, v_bits, dense_bits = float(cache.tally.k_bits), float(cache.tally.v_bits), float(cache.tally.dense_bits)
        if tiering is not None:
            t = cache.tier_tally
            tier = dict(zip(TIER_BITS, map(float, (t.capped_bits, t.wanted_bits, t.beyond_hot_bits, t.served_bits)),
                            strict=True))
    else:
        with teacher_forced(build_system(row, s.codec), spec["row_chunk"]) as tally:
            nll, n = window_nll(s.lm.model, ids)
        k_bits, v_bits, dense_bits = float(tally.k_bits), float(tally.v_bits), float(tally.dense_bits)
    return {"nll": nll, "tokens": n, "k_bits": k_bits, "v_bits": v_bits, "dense_bits": dense_bits, **tier,
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
                for k in TIER_BITS:
                    if k in w:
                        res[k] = res.get(k, 0.0) + w[k]
            res["texts"][text] = {"nll": nll, "tokens": n, "ppl": math.exp(nll / n)}
        nll = sum(v["nll"] for v in res["texts"].values())
        n = sum(v["tokens"] for v in res["texts"].values())
        res["ppl"] = math.exp(nll / n)
        res["read_fraction"] = (res["k_bits"] + res["v_bits"]) / res["dense_bits"]
        res["capacity_fraction"] = res["capacity_bits"] / 16.0
        if res.get("wanted_bits"):
            res["cap_rate"] = res["cap_bits"] / res["wanted_bits"]  # share of the bits asked for that were capped
        if res.get("beyond_hot_bits"):
            res["promotion_hit_rate"] = res["served_bits"] / res["beyond_hot_bits"]  # past h, read from promotion
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


def decode_rows(rows: Sequence[SystemRow], hots: Sequence[int]) -> list[SystemRow]:
    """``rows`` (teacher-forced), then, with ``hots``, each ReadKV row read as decode steps with every plane on the
    device (the all-GPU row of its tiered rows) followed by the same from a tiered cache at each of ``hots``."""
    check_hot_planes(hots)
    if not hots:
        return list(rows)
    steps = [replace(r, decode=True) for r in rows if r.name.startswith("readkv")]
    return [*rows, *(x for r in steps for x in tiered_rows([r], hots))]


def run_perplexity(s: Setup, rows: Sequence[SystemRow], texts: Sequence[str] = TEST_TEXTS, window: int = 2048,
                   n_windows: int = 2, row_chunk: int = 512, executor: Executor | None = None,
                   out: str | os.PathLike[str] | None = None, resume: bool = False,
                   promotion_mib: float = 64.0, key_page_mib: float = 0.0) -> dict[str, Any]:
    """The perplexity table: every row, the model's own loss, % change against the dense row; a tiered row also
    against its all-GPU decode row (``vs_all_gpu_pct``: % of that row's perplexity; ``vs_all_gpu_pp``: its
    change against dense minus that row's, in percentage points) when both were run. The windows run by
    ``executor`` (default: this process); with ``out`` each finished one is journaled there
    (``perplexity.units.jsonl``) and ``resume`` keeps those an earlier run of the same settings finished. Tiered
    rows read with a promotion cache of ``promotion_mib`` and ``key_page_mib`` of Key page slots."""
    units = window_units([None, *rows], texts, window, n_windows, row_chunk, promotion_mib, key_page_mib)
    tiered = any(r.hot is not None for r in rows)
    journal = None if out is None else job_journal(
        out, "perplexity", s, rows=[r.key for r in rows], texts=list(texts), window=window, n_windows=n_windows,
        row_chunk=row_chunk, **(tier_budgets(promotion_mib, key_page_mib) if tiered else {}))
    results = run_units(units, window_unit, executor or InProcess(s), journal, resume, desc="perplexity")
    own_nll = own_n = 0.0
    for u in units:
        if u.spec["row"] is None:
            own_nll, own_n = own_nll + results[u.key]["nll"], own_n + results[u.key]["tokens"]
    res = row_table(s, rows, texts, window, n_windows, results)
    dense = next((r for r in res if r["name"] == "dense"), None)
    for r in res:
        r["ppl_change_pct"] = None if dense is None else 100.0 * (r["ppl"] / dense["ppl"] - 1.0)
    by_key = {r["key"]: r for r in res}
    for r in res:
        base = by_key.get(replace(SystemRow(r["name"], r["rate"], r["k_share"]), decode=True).key)
        if r["hot"] is not None and base is not None:
            r["all_gpu_key"] = base["key"]
            r["vs_all_gpu_pct"] = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
            r["vs_all_gpu_pp"] = None if dense is None else r["ppl_change_pct"] - base["ppl_change_pct"]
    return {"job": "perplexity", "texts": list(texts), "window": window, "n_windows": n_windows,
            "tokens_per_row": int(own_n), "model_ppl": math.exp(own_nll / own_n), "rows": res,
            **(tier_budgets(promotion_mib, key_page_mib) if tiered else {})}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS + VARIANTS)
    p.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    p.add_argument("--texts", nargs="+", default=list(TEST_TEXTS))
    p.add_argument("--window", type=int, default=2048, help="tokens per window")
    p.add_argument("--windows", type=int, default=2, help="windows per text")
    p.add_argument("--row-chunk", type=int, default=512, help="query rows per reference-reader call")
    p.add_argument("--tiered-hot", nargs="*", type=int, default=[], metavar="H",
                   help="also read every ReadKV row as decode steps, all-GPU and from a tiered cache with H hot "
                        "planes (docs/TIERING.md)")
    add_tier_budget_arguments(p)
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
    check_hot_planes(args.tiered_hot)
    check_tier_budgets(args.promotion_mib, args.key_page_mib)
    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, args.out,
              codebook=args.codebook)
    rows = decode_rows(system_rows(args.systems, args.rates, parse_k_share(args.k_share)), args.tiered_hot)
    t0 = time.perf_counter()
    with open_executor(args, s) as executor:
        res = run_perplexity(s, rows, args.texts, args.window, args.windows, args.row_chunk, executor, args.out,
                             args.resume, args.promotion_mib, args.key_page_mib)
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
