"""Calibration from text (DESIGN section 1, step 2): statistics of K (after RoPE) and V.

Runs the model densely over windows of the calibration text and streams every layer's cached K/V
into :class:`planekv.kvstore.CalibrationBuilder`. Keys are taken from the cache, i.e. after RoPE, as
they are stored. Windows are as long as the contexts the cache will serve (default 8192 tokens),
because the statistics of rotated keys depend on the range of positions seen.

Runs directly: ``python -m planekv.evaluation.calibrate --model smollm2 --text northanger_abbey --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..kvstore import Calibration, CalibrationBuilder, FormatSpec
from .jobs import job_main, resolve_device
from .texts import CALIBRATION_TEXT, tokenize_text, windows

log = logging.getLogger(__name__)


def calibrate_model(model: Any, tok: Any, text: str = CALIBRATION_TEXT, max_tokens: int = 16384,
                    window: int = 8192, model_id: str = "model", seed_k: int = FormatSpec.seed_k,
                    seed_v: int = FormatSpec.seed_v) -> Calibration:
    """Calibration of ``model`` on ``text``: ``max_tokens // window`` windows of ``window`` tokens
    (at least one, shortened to the text)."""
    ids = tokenize_text(tok, text, max_tokens)
    window = min(window, ids.numel())
    n_win = max(1, min(max_tokens, ids.numel()) // window)
    return calibrate_windows(model, windows(ids, window, n_win), model_id, seed_k, seed_v, {"text": text})


def calibrate_windows(model: Any, wins: Sequence[torch.Tensor], model_id: str = "model",
                      seed_k: int = FormatSpec.seed_k, seed_v: int = FormatSpec.seed_v,
                      meta: dict[str, Any] | None = None) -> Calibration:
    """Calibration from token windows (each [N] ids): K after RoPE and V of every layer, streamed."""
    from transformers import DynamicCache

    from ..models.hf import geometry

    g = geometry(model)
    dev = next(model.parameters()).device
    builder = CalibrationBuilder(g.n_layers, g.n_kv_heads, g.head_dim, seed_k, seed_v)
    t0 = time.perf_counter()
    for i, w in enumerate(wins):
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model(w[None].to(dev), past_key_values=cache, use_cache=True)
        for layer in range(g.n_layers):
            lay = cache.layers[layer]
            builder.add(layer, lay.keys[0], lay.values[0])
        log.info("calibration window %d/%d (%d tokens) done", i + 1, len(wins), w.numel())
    info = {"model_id": model_id, "n_windows": len(wins), "window_tokens": int(wins[0].numel()),
            "position": "rope-before-cache", "seconds": round(time.perf_counter() - t0, 1), **(meta or {})}
    return builder.build(info)


def register_with_control_plane(calibration: Calibration, url: str | None, token: str | None = None,
                                timeout_s: float = 2.0) -> tuple[bool, str]:
    """Try to register the artifact with a control plane; (registered?, message). Never raises."""
    from .client import register_calibration
    return register_calibration(calibration, url, token, timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    return job_main("planekv.evaluation.calibrate", __doc__, add_arguments, run, argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), a .gguf file or an HF directory")
    p.add_argument("--text", default=CALIBRATION_TEXT, help="a shipped text name or a file path")
    p.add_argument("--max-tokens", type=int, default=16384, help="tokens of the text to use")
    p.add_argument("--window", type=int, default=8192, help="tokens per forward pass")
    p.add_argument("--out", default="results/calibration", help="directory (or .pt path) for the artifact")
    p.add_argument("--device", default="auto")
    p.add_argument("--control-url", default=None, help="control plane URL to register the artifact with")
    p.add_argument("--no-register", action="store_true", help="never contact a control plane")


def run(args: argparse.Namespace) -> int:
    from ..models.hf import load_model

    lm = load_model(args.model, device=resolve_device(args.device))
    calib = calibrate_model(lm.model, lm.tokenizer, args.text, args.max_tokens, args.window, lm.model_id)
    out = Path(args.out)
    path = out if out.suffix == ".pt" else out / f"calibration-{calib.calibration_id}.pt"
    calib.save(path)
    info = {"calibration_id": calib.calibration_id, "path": str(path), "model_id": lm.model_id,
            "text": args.text, "n_tokens": calib.meta.get("n_tokens")}
    if args.no_register:
        info["registered"], info["register_message"] = False, "registration disabled (--no-register)"
    else:
        url, token = args.control_url, None
        if url is None:
            url, token = _settings_control()
        ok, msg = register_with_control_plane(calib, url, token)
        info["registered"], info["register_message"] = ok, msg
    log.info("calibration %s written to %s; %s", calib.calibration_id, path, info["register_message"])
    print(json.dumps(info, indent=2))
    return 0


def _settings_control() -> tuple[str | None, str | None]:
    """The control plane URL and token from settings; (None, None) if settings do not load."""
    try:
        from ..settings import load_settings

        s = load_settings()
        return s.control.url, s.api_token
    except Exception as exc:  # settings are optional here
        log.debug("settings unavailable: %s", exc)
        return None, None


if __name__ == "__main__":
    raise SystemExit(main())
