"""The demo job: encode K/V, read at several budgets with every system, tabulate.

Until the real-model evaluation lands this uses synthetic K/V (Gaussian with outlier channels and
queries that look at a few keys) in SmolLM2's attention geometry (9 query heads, 3 KV heads,
d = 64). ReadKV rows go through the real paged cache: K/V codes are appended to a
``PlaneKVCache`` and every decode step reads only the planes its depths ask for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kvstore import Codec, PlaneKVCache, ReadPolicy, capacity_for, dense_bytes, write_amortization
from .kvstore.reference import SYSTEM_NAMES, attention, make_system, readkv_decode
from .kvstore.synthetic import make_synthetic


@dataclass
class DemoRow:
    system: str
    target_rate: float
    bits_read: float  # measured logical read, bits per stored scalar
    capacity_bits: float  # stored bits per scalar
    rel_error: float  # ||out - dense|| / ||dense||, over all rows, heads and layers


def run_demo(n_tokens: int = 4096, batch: int = 4, n_layers: int = 2, rates: tuple[float, ...] = (4.0, 2.0),
             seed: int = 0) -> tuple[list[DemoRow], dict[str, float]]:
    syn = make_synthetic(n_tokens=n_tokens, n_rows=batch, n_layers=n_layers, n_q_heads=9, n_kv_heads=3,
                         head_dim=64, seed=seed)
    spec = syn.spec
    codec = Codec(spec, syn.calibration)
    d = spec.head_dim
    lengths = torch.full((batch,), n_tokens)

    # Each of the `batch` query rows is one sequence's decode step over the same K/V history.
    cache = PlaneKVCache(spec, batch)
    for layer in range(n_layers):
        kc = codec.encode_k(syn.k[layer], layer)
        vc = codec.encode_v(syn.v[layer], layer)
        cache.append(layer, kc[None].expand(batch, -1, -1, -1), vc[None].expand(batch, -1, -1, -1))

    refs = [attention(syn.q[layer], syn.k[layer], syn.v[layer], lengths) for layer in range(n_layers)]
    rows: list[DemoRow] = []
    for rate in rates:
        for name in SYSTEM_NAMES:
            if name == "dense" and rate != rates[0]:
                continue
            system = make_system(name, rate, codec)
            err_num = err_den = bits = scalars = 0.0
            for layer in range(n_layers):
                q = syn.q[layer]  # [Hq, batch, d]
                if name.startswith("readkv"):
                    pol: ReadPolicy = system.policy  # type: ignore[attr-defined]
                    out, st = readkv_decode(q.transpose(0, 1), cache, layer, codec, pol)
                    out = out.transpose(0, 1)
                else:
                    enc = system.encode(syn.k[layer], syn.v[layer], layer)
                    out, st = system.attend(q, enc, lengths)
                err_num += float((out - refs[layer]).pow(2).sum())
                err_den += float(refs[layer].pow(2).sum())
                bits += float(st.total_bits.sum())
                scalars += float((2 * st.tokens * d * spec.n_kv_heads).sum())
            rows.append(DemoRow(system.name, rate if name != "dense" else 16.0, bits / scalars,
                                system.capacity_bits(n_tokens, d), (err_num / err_den) ** 0.5))

    cap = capacity_for(spec, batch, n_tokens)
    dense = dense_bytes(spec.n_layers, batch, n_tokens, spec.n_kv_heads, d)
    facts = {
        "tokens": n_tokens, "batch": batch, "layers": n_layers,
        "capacity_bytes": cap.total_bytes, "dense_fp16_bytes": dense,
        "write_amortization_8192_128_8_4": write_amortization(8192, 128, 8, 4),
        "pages_in_use": cache.pages_in_use,
    }
    return rows, facts
