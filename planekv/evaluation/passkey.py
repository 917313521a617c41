"""Passkey retrieval (DESIGN section 7): a 5-digit key at a random depth of filler text (emma);
contexts 2K, 4K and 8K tokens; exact match of the first 5-digit number generated.

One dense prefill per trial is shared by every system (the prefill is dense attention in all of
them); each system then writes the prompt's K/V into its own cache and decodes greedily, every
step reading the compressed cache (``planekv.models.hf.PlaneKVHFCache``). Trials are paired: the
same keys, depths and filler for every system.

The work is one unit per (context, trial) (``trial_unit``; ``units``), run in this process or, with
``planekv eval passkey ... --workers N``, by N Ray workers (``executors``); each finished trial is journaled in
``--out`` and ``--resume`` runs only the missing ones.

Runs directly (and as a Ray job entrypoint), in one process:
``python -m planekv.evaluation.passkey --out DIR [--contexts 2048 4096 8192 --trials 50 ...]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .common import (
    ALL_SYSTEMS,
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
from .perplexity import add_setup_arguments, parse_k_share
from .texts import FILLER_TEXT, tokenize_text
from .units import Executor, Unit, add_resume_argument, job_journal, run_units

if TYPE_CHECKING:
    from ..models.hf import PlaneKVHFCache

log = logging.getLogger(__name__)

PREFIX = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important info there.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? Answer with the five-digit number."
ANSWER_START = "The pass key is"  # the answer is begun for the model
MAX_NEW_TOKENS = 10
_KEY_RE = re.compile(r"\d{5}")


@dataclass(frozen=True)
class Trial:
    context: int  # prompt tokens
    key: str  # five digits
    depth: float  # where the needle sits in the filler, 0 = start, 1 = end
    offset: int  # first filler token

    def to_dict(self) -> dict[str, Any]:
        return {"context": self.context, "key": self.key, "depth": self.depth, "offset": self.offset}


def make_trials(context: int, n: int, seed: int, filler_tokens: int) -> list[Trial]:
    """``n`` trials with keys, depths (uniform in [0, 1]) and filler offsets from ``seed``."""
    rng = random.Random(f"{seed}-{context}")
    out = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        out.append(Trial(context, key, round(rng.uniform(0.0, 1.0), 4),
                         rng.randint(0, max(0, filler_tokens - context - 1))))
    return out


def build_prompt(tok: Any, filler: torch.Tensor, trial: Trial, template: str = "chat") -> torch.Tensor:
    """Token ids [context] of the prompt: prefix, filler with the needle at ``trial.depth``, question.

    ``template="chat"`` wraps it as one user turn of the tokenizer's chat template, the assistant's
    answer started with "The pass key is" (instruct models); ``"raw"`` is plain text completion."""
    enc = lambda s: torch.tensor(tok(s, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa: E731
    pre, needle = enc(PREFIX), enc(NEEDLE.format(key=trial.key))
    if template == "chat" and getattr(tok, "chat_template", None):
        marker = "@@PLANEKV@@"
        text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                       add_generation_prompt=True)
        head, tail = text.split(marker)
        lead = enc(head)
        q = torch.cat([enc(QUESTION + tail), enc(ANSWER_START)])
    else:
        lead = torch.tensor([] if tok.bos_token_id is None else [tok.bos_token_id], dtype=torch.long)
        q = enc(f"{QUESTION} {ANSWER_START}")
    n_fill = trial.context - lead.numel() - pre.numel() - needle.numel() - q.numel()
    if n_fill < 1:
        raise ValueError(f"context {trial.context} is too short for the passkey template")
    fill = filler[trial.offset: trial.offset + n_fill]
    if fill.numel() < n_fill:
        raise ValueError("filler text too short for this context")
    at = int(round(trial.depth * n_fill))
    ids = torch.cat([lead, pre, fill[:at], needle, fill[at:], q])
    assert ids.numel() == trial.context
    return ids


def parse_answer(text: str) -> str | None:
    """The first run of exactly five digits in the generated text, or None."""
    m = _KEY_RE.search(text)
    return m.group(0) if m else None


def dense_prefill(model: Any, ids: torch.Tensor) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """(first generated token, K per layer, V per layer) from one dense prefill of ids [N]."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model(ids[None].to(dev), past_key_values=cache, use_cache=True)
    first = int(out.logits[0, -1].argmax())
    return first, [lay.keys for lay in cache.layers], [lay.values for lay in cache.layers]


def greedy_decode(model: Any, cache: PlaneKVHFCache, first: int, tok: Any, max_new: int = MAX_NEW_TOKENS) -> str:
    """Greedy continuation after the prefill; stops at five digits, EOS or ``max_new`` tokens."""
    dev = next(model.parameters()).device
    gen = [first]
    for _ in range(max_new - 1):
        text = tok.decode(gen, skip_special_tokens=True)
        if parse_answer(text) or gen[-1] == tok.eos_token_id:
            break
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            out = model(torch.tensor([[gen[-1]]], device=dev), past_key_values=cache, use_cache=True)
        gen.append(int(out.logits[0, -1].argmax()))
    return tok.decode(gen, skip_special_tokens=True)


def trial_units(plan: dict[int, list[SystemRow]], trials: dict[int, int], seed: int, filler_tokens: int,
                reader: str = "reference", template: str = "chat", promotion_mib: float = 64.0,
                key_page_mib: float = 0.0) -> list[Unit]:
    """One unit per (context, trial index), contexts in ``plan``'s order; each unit runs the context's rows."""
    return [Unit(f"{ctx}|{i}", {"trial": trial.to_dict(), "rows": [r.to_dict() for r in rows], "reader": reader,
                                "template": template, **tier_budgets(promotion_mib, key_page_mib)})
            for ctx, rows in plan.items() for i, trial in enumerate(make_trials(ctx, trials[ctx], seed, filler_tokens))]


def trial_unit(s: Setup, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One trial (``spec`` of trial_units) for every row of its context: one dense prefill, then each row writes the
    prompt's K/V into its own cache and decodes greedily. Row key -> {hit, answer, text, k_bits, v_bits,
    dense_bits, cap_bits, wanted_bits (tiered rows; else None), seconds}. Rows with a hot depth read a tiered cache
    (docs/TIERING.md) with a promotion cache of ``promotion_mib`` and ``key_page_mib`` of Key page slots."""
    from ..models.hf import Tiering, make_cache

    model, tok = s.lm.model, s.lm.tokenizer
    trial = Trial(**spec["trial"])
    ids = build_prompt(tok, tokenize_text(tok, FILLER_TEXT), trial, spec["template"])
    first, keys, values = dense_prefill(model, ids)
    out = {}
    for row in (SystemRow(**r) for r in spec["rows"]):
        t0 = time.perf_counter()
        tiering = None if row.hot is None else Tiering(row.hot, ids.numel() + MAX_NEW_TOKENS + 1,
                                                         int(spec["promotion_mib"] * (1 << 20)),
                                                         key_page_bytes=int(spec.get("key_page_mib", 0.0) * (1 << 20)))
        cache = make_cache(model, build_system(row, s.codec), reader=spec["reader"], tiering=tiering)
        cache.prefill_from(keys, values)
        text = greedy_decode(model, cache, first, tok)
        ans = parse_answer(text)
        tier = None if tiering is None else cache.tier_tally
        out[row.key] = {"hit": ans == trial.key, "answer": ans, "text": text, "k_bits": float(cache.tally.k_bits),
                        "v_bits": float(cache.tally.v_bits), "dense_bits": float(cache.tally.dense_bits),
                        "cap_bits": None if tier is None else float(tier.capped_bits),
                        "wanted_bits": None if tier is None else float(tier.wanted_bits),
                        "seconds": time.perf_counter() - t0}
    return out


def run_passkey(s: Setup, plan: dict[int, list[SystemRow]], trials: dict[int, int], seed: int = 0,
                reader: str = "reference", template: str = "chat",
                on_partial: Callable[[dict[str, Any]], None] | None = None, promotion_mib: float = 64.0,
                executor: Executor | None = None, out: str | os.PathLike[str] | None = None,
                resume: bool = False, key_page_mib: float = 0.0) -> dict[str, Any]:
    """Passkey hits for each context length and its rows (``plan``: context -> rows, in that order), the trials
    run by ``executor`` (default: this process). ``on_partial`` receives the results of the trials finished so
    far (partial JSON) now and then. With ``out`` each finished trial is journaled there
    (``passkey.units.jsonl``) and ``resume`` keeps those an earlier run of the same settings finished (another
    number of trials keeps the same trials: trial i does not depend on how many there are)."""
    filler_tokens = tokenize_text(s.lm.tokenizer, FILLER_TEXT).numel()
    units = trial_units(plan, trials, seed, filler_tokens, reader, template, promotion_mib, key_page_mib)
    tiered = any(r.hot is not None for rows in plan.values() for r in rows)
    journal = None if out is None else job_journal(
        out, "passkey", s, plan={str(c): [r.key for r in rows] for c, rows in plan.items()}, seed=seed,
        reader=reader, template=template, **(tier_budgets(promotion_mib, key_page_mib) if tiered else {}))

    def summary(results: Mapping[str, Any]) -> dict[str, Any]:
        return _summary(s, plan, units, results, seed, trials, reader, template,
                        tier_budgets(promotion_mib, key_page_mib))

    results = run_units(units, trial_unit, executor or InProcess(s), journal, resume, desc="passkey",
                        on_partial=None if on_partial is None else lambda done: on_partial(summary(done)))
    return summary(results)


def _summary(s: Setup, plan: dict[int, list[SystemRow]], units: Sequence[Unit], results: Mapping[str, Any],
             seed: int, trials: dict[int, int], reader: str, template: str,
             budgets: dict[str, float]) -> dict[str, Any]:
    """The passkey result of the finished units among ``units`` (summed in unit order)."""
    d = s.codec.spec.head_dim
    out_rows: dict[str, dict[str, Any]] = {}
    details: list[dict[str, Any]] = []
    for unit in units:
        if unit.key not in results:
            continue
        trial = Trial(**unit.spec["trial"])
        for row in plan[trial.context]:
            r = results[unit.key][row.key]
            res = out_rows.get(f"{row.key}@{trial.context}")
            if res is None:
                system = build_system(row, s.codec)
                res = out_rows[f"{row.key}@{trial.context}"] = {
                    **row.to_dict(), "key": row.key, "context": trial.context, "label": label(row, system),
                    "capacity_bits": system.capacity_bits(trial.context, d), "hits": 0, "trials": 0,
                    "k_bits": 0.0, "v_bits": 0.0, "dense_bits": 0.0, "seconds": 0.0}
            res["hits"] += int(r["hit"])
            res["trials"] += 1
            for k in ("k_bits", "v_bits", "dense_bits"):
                res[k] += r[k]
            if r["cap_bits"] is not None:
                res["cap_bits"] = res.get("cap_bits", 0.0) + r["cap_bits"]
                res["wanted_bits"] = res.get("wanted_bits", 0.0) + r["wanted_bits"]
            res["seconds"] += r["seconds"]
            details.append({**trial.to_dict(), "system": row.key, "answer": r["answer"], "hit": r["hit"],
                            "text": r["text"]})
    rows_out = list(out_rows.values())
    for res in rows_out:
        res["hit_rate"] = res["hits"] / res["trials"]
        res["read_fraction"] = (res["k_bits"] + res["v_bits"]) / res["dense_bits"] if res["dense_bits"] else None
        res["capacity_fraction"] = res["capacity_bits"] / 16.0
        if res.get("wanted_bits"):
            res["cap_rate"] = res["cap_bits"] / res["wanted_bits"]
    for res in rows_out:
        dense = next((r for r in rows_out if r["name"] == "dense" and r["context"] == res["context"]), None)
        res["vs_dense"] = None if not dense or not dense["hits"] else res["hits"] / dense["hits"]
    return {"job": "passkey", "seed": seed, "trials": {str(c): n for c, n in trials.items()},
            "reader": reader, "template": template, **budgets, "question": QUESTION,
            "answer_start": ANSWER_START,
            "rows": rows_out, "details": details}


def parse_plan(contexts: Sequence[int], systems: Sequence[str], rates: Sequence[float],
               long_systems: Sequence[str] | None, long_rates: Sequence[float] | None,
               k_share: dict[float, float] | None, hots: Sequence[int] = ()) -> dict[int, list[SystemRow]]:
    """All ``systems`` x ``rates`` at every context but the longest, where ``long_systems`` x
    ``long_rates`` run instead (when given); each ReadKV row also read from a tiered cache at each of
    ``hots`` hot planes."""
    plan = {}
    longest = max(contexts)
    for c in contexts:  # in the order given
        if c == longest and long_systems:
            rows = system_rows(long_systems, long_rates or rates, k_share)
        else:
            rows = system_rows(systems, rates, k_share)
        plan[c] = tiered_rows(rows, hots)
    return plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_setup_arguments(p)
    p.add_argument("--contexts", nargs="+", type=int, default=[8192, 4096, 2048],
                   help="prompt tokens (run in this order)")
    p.add_argument("--trials", nargs="+", type=int, default=[50],
                   help="trials per context (one value for all, or one per context)")
    p.add_argument("--systems", nargs="+", default=list(ALL_SYSTEMS), choices=ALL_SYSTEMS + VARIANTS)
    p.add_argument("--rates", nargs="+", type=float, default=[4.0, 2.0])
    p.add_argument("--long-systems", nargs="*", default=["dense", "readkv-flexible", "readkv-constrained"],
                   choices=ALL_SYSTEMS + VARIANTS, help="systems at the longest context (empty: --systems)")
    p.add_argument("--long-rates", nargs="*", type=float, default=[2.0], help="rates at the longest context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reader", default="reference", help="decode reader (planekv.models.hf.READERS)")
    p.add_argument("--template", default="chat", choices=["chat", "raw"], help="prompt as a chat turn or raw text")
    p.add_argument("--tiered-hot", nargs="*", type=int, default=[], metavar="H",
                   help="also read every ReadKV row from a tiered cache with H hot planes (docs/TIERING.md)")
    add_tier_budget_arguments(p)
    add_resume_argument(p)
    add_executor_arguments(p)


def run(args: argparse.Namespace) -> int:
    from .common import setup
    from .report import write_report

    check_executor_arguments(args)
    check_hot_planes(args.tiered_hot)
    check_tier_budgets(args.promotion_mib, args.key_page_mib)
    trials = args.trials if len(args.trials) == len(args.contexts) else [args.trials[0]] * len(args.contexts)
    s = setup(args.model, args.calibration, args.device, args.calib_tokens, args.calib_window, args.out,
              codebook=args.codebook)
    plan = parse_plan(args.contexts, args.systems, args.rates, args.long_systems, args.long_rates,
                      parse_k_share(args.k_share), args.tiered_hot)
    t0 = time.perf_counter()
    with open_executor(args, s) as executor:
        res = run_passkey(s, plan, dict(zip(args.contexts, trials, strict=True)), args.seed, args.reader,
                          args.template, on_partial=lambda r: write_json(f"{args.out}/passkey.json", r),
                          promotion_mib=args.promotion_mib, executor=executor, out=args.out, resume=args.resume,
                          key_page_mib=args.key_page_mib)
    res["seconds"] = time.perf_counter() - t0
    res["workers"] = args.workers
    res["calibration_id"] = s.calibration.calibration_id
    res["codebook"] = s.codec.spec.codebook
    write_json(f"{args.out}/passkey.json", res)
    write_report(args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("planekv.evaluation.passkey", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
