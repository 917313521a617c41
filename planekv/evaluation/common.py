"""Shared pieces of the evaluation jobs: the compared systems, the frozen K/V split and the
model/calibration setup (devices, progress and the job entry point are in ``jobs``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..kvstore import Calibration, Codec, ReadPolicy
from ..kvstore.baselines import KVSystem
from ..kvstore.policy import PLANEKV_KEY_REFINE
from ..kvstore.reference import ReadKV, make_system
from .jobs import resolve_device

log = logging.getLogger(__name__)

# Every row of DESIGN section 7 (fixed-bit baselines at the bits matching R).
ALL_SYSTEMS = ("dense", "readkv-flexible", "readkv-constrained", "full-reader", "turboquant", "kivi", "sparq",
               "fp8")
# Named variants (not rows of DESIGN section 7; evaluated on request):
# readkv-flexible-hw = the flexible reader with ReadPolicy.value_head_weight;
# readkv-flexible-kv = the flexible reader with ReadPolicy.key_variance_correction;
# readkv-flexible-sink = the flexible reader with ReadPolicy.sink_keys = 1;
# readkv-flexible-stv = the flexible reader with ReadPolicy.single_token_values;
# readkv-flexible-kr = the flexible reader with a third stage, ReadPolicy.key_refine = 0.3 (30% of the Key
# budget refines the tokens of largest p^2 to full depth; chosen on the dev text, EVALUATION.md);
# readkv-flexible-kr16 = the same in aligned blocks of 16 positions (key_refine 0.2: its dev choice).
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"readkv-flexible-hw": {"value_head_weight": True},
                                              "readkv-flexible-kv": {"key_variance_correction": True},
                                              "readkv-flexible-sink": {"sink_keys": 1},
                                              "readkv-flexible-stv": {"single_token_values": True},
                                              "readkv-flexible-kr": {"key_refine": PLANEKV_KEY_REFINE},
                                              "readkv-flexible-kr16": {"key_refine": 0.2, "key_refine_block": 16}}
VARIANTS = tuple(VARIANT_OPTIONS)
FLEXIBLE = ("readkv-flexible", *VARIANTS)
RATES = (4.0, 2.0)
RATE_FREE = ("dense", "fp8")  # their read does not depend on R: one row each
K_SHARE_FILE = "k_share.json"


# ---- the frozen K/V split of the flexible reader -----------------------------------------------


def k_share_path() -> Path:
    return Path(str(resources.files("planekv.evaluation") / K_SHARE_FILE))


def default_k_share(rate: float, path: str | os.PathLike[str] | None = None) -> float:
    """The flexible reader's K share chosen on the dev text (split search), for the nearest rate;
    0.5 if no choice was frozen yet."""
    p = Path(path) if path else k_share_path()
    if not p.is_file():
        return 0.5
    data = json.loads(p.read_text())
    table = {float(r): float(v) for r, v in data["k_share"].items()}
    return table[min(table, key=lambda r: abs(r - rate))]


# ---- systems -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SystemRow:
    """One row of a result table: a system at a rate R (bits per scalar; 16 for dense)."""

    name: str  # one of ALL_SYSTEMS
    rate: float
    k_share: float | None = None  # flexible reader only
    hot: int | None = None  # ReadKV decode rows: read from a tiered cache with this many hot planes
    # perplexity: read one token per decode step through PlaneKVHFCache (as passkey decodes), not teacher-forced
    decode: bool = False

    @property
    def key(self) -> str:
        k = f"{self.name}@{self.rate:g}"
        k = k if self.k_share is None else f"{k}/k{self.k_share:g}"
        k = f"{k}/decode" if self.decode else k
        return k if self.hot is None else f"{k}/h{self.hot}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def system_rows(names: Iterable[str], rates: Iterable[float],
                k_share: dict[float, float] | None = None) -> list[SystemRow]:
    """Rows for ``names`` x ``rates`` (dense and fp8 once each)."""
    rows: list[SystemRow] = []
    rates = list(rates)
    for name in names:
        if name not in ALL_SYSTEMS + VARIANTS:
            raise ValueError(f"unknown system {name!r}; known: {ALL_SYSTEMS + VARIANTS}")
        if name in RATE_FREE:
            rows.append(SystemRow(name, 16.0 if name == "dense" else 8.0))
            continue
        for r in rates:
            ks = None
            if name in FLEXIBLE:
                ks = (k_share or {}).get(r, default_k_share(r))
            rows.append(SystemRow(name, r, ks))
    return rows


def check_hot_planes(hots: Iterable[int], width: int = 8) -> None:
    """Refuse ``--tiered-hot`` values outside [0, W] (W planes stored per scalar) before anything loads."""
    bad = [h for h in hots if not 0 <= h <= width]
    if bad:
        raise ValueError(f"--tiered-hot takes hot planes h in [0, {width}] (W = {width} planes stored; h = {width}: "
                         f"every plane on the device), got {bad}")


def add_tier_budget_arguments(p: argparse.ArgumentParser) -> None:
    """``--promotion-mib`` and ``--key-page-mib``: the tiered cache's budgets, as every job that reads tiered rows
    takes them (checked by :func:`check_tier_budgets`)."""
    p.add_argument("--promotion-mib", type=float, default=64.0, help="the tiered cache's promotion cache, MiB")
    p.add_argument("--key-page-mib", type=float, default=0.0,
                   help="the tiered cache's Key page slots for Key refinement, MiB (0: refined tokens of sealed pages "
                        "read at their channels' resident depths)")


def check_tier_budgets(promotion_mib: float, key_page_mib: float) -> None:
    """Refuse negative ``--promotion-mib`` / ``--key-page-mib`` before anything loads."""
    for flag, mib in (("--promotion-mib", promotion_mib), ("--key-page-mib", key_page_mib)):
        if mib < 0:
            raise ValueError(f"{flag} must be >= 0, got {mib}")


def tier_budgets(promotion_mib: float, key_page_mib: float) -> dict[str, float]:
    """The tiered cache's budgets as a unit, journal and result record them: Key page slots only when not 0, so
    that the units and journals of runs without them keep their keys (``--resume`` finds them)."""
    return {"promotion_mib": promotion_mib, **({"key_page_mib": key_page_mib} if key_page_mib else {})}


def tiered_rows(rows: Iterable[SystemRow], hots: Iterable[int], decode: bool = False) -> list[SystemRow]:
    """``rows``, then for each ReadKV row a copy read from a tiered cache at each of ``hots`` hot planes (read by
    decode steps when ``decode``)."""
    rows, hots = list(rows), list(hots)
    check_hot_planes(hots)
    return rows + [replace(r, hot=h, decode=decode or r.decode) for r in rows if r.name.startswith("readkv")
                   for h in hots]


def build_system(row: SystemRow, codec: Codec | None) -> KVSystem:
    """The KVSystem of a row (ReadKV rows need the codec)."""
    if row.name in VARIANT_OPTIONS:
        if codec is None:
            raise ValueError(f"{row.name} needs a codec")
        ks = row.k_share if row.k_share is not None else 0.5
        return ReadKV(codec, ReadPolicy.flexible(row.rate, ks, codec.width, **VARIANT_OPTIONS[row.name]))
    if row.name == "readkv-flexible":
        return make_system(row.name, row.rate, codec, k_share=row.k_share if row.k_share is not None else 0.5)
    return make_system(row.name, row.rate, codec)


def label(row: SystemRow, system: KVSystem) -> str:
    if isinstance(system, ReadKV):
        pol = system.policy
        s = f"ReadKV (8,{row.rate:g}) {pol.reader}"
        s += f" (K share {pol.k_share:g})" if pol.reader == "flexible" else ""
        s += " + head weight" if pol.value_head_weight else ""
        s += " + key variance" if pol.key_variance_correction else ""
        s += f" + {pol.sink_keys} sink key" if pol.sink_keys else ""
        s += f" + Key refinement {pol.key_refine:g}" if pol.key_refine else ""
        s += f" (blocks of {pol.key_refine_block})" if pol.key_refine and pol.key_refine_block > 1 else ""
        s += " + single-token values" if pol.single_token_values else ""
        s += ", decode steps" if row.decode else ""
        return s + (f", tiered h = {row.hot}" if row.hot is not None else "")
    return system.name


# ---- model setup ----------------------------------------------------------------------------------


@dataclass
class Setup:
    """A loaded model with its calibration and codec."""

    lm: Any  # planekv.models.hf.LoadedModel
    calibration: Calibration
    codec: Codec
    device: torch.device


def setup(model: str | None, calibration: str | os.PathLike[str] | Calibration | None, device: str = "auto",
          calib_tokens: int = 16384, calib_window: int = 8192,
          cache_dir: str | os.PathLike[str] | None = None, codebook: str = "gaussian-lloyd-tree") -> Setup:
    """Load the model; take ``calibration`` (an artifact, or a .pt path to load it from) or compute it on the
    calibration text (saved under ``cache_dir`` when given); the format stores codes of ``codebook``
    (``planekv.kvstore.CODEBOOKS``)."""
    from ..models.hf import format_spec, load_model
    from .calibrate import calibrate_model

    dev = resolve_device(device)
    lm = load_model(model, device=dev)
    if isinstance(calibration, Calibration):
        calib = calibration
    elif calibration:
        calib = Calibration.load(calibration)
    else:
        calib = calibrate_model(lm.model, lm.tokenizer, max_tokens=calib_tokens, window=calib_window,
                                model_id=lm.model_id)
        if cache_dir:
            p = calib.save(Path(cache_dir) / f"calibration-{calib.calibration_id}.pt")
            log.info("calibration %s saved to %s", calib.calibration_id, p)
    spec = format_spec(lm.model, calib, lm.model_id, lm.revision, codebook=codebook)
    return Setup(lm, calib, Codec(spec, calib), dev)
