"""FP8 e4m3 per-head-scale decode kernel (interpreter) against float attention on the dequantized cache."""

from __future__ import annotations

import torch

from planekv.kernels.fp8 import FP8Decode, quantize_fp8
from planekv.kvstore.reference import attention


def test_fp8_decode_matches_dequantized_attention() -> None:
    g = torch.Generator().manual_seed(5)
    b, hq, hk, t, d = 2, 8, 2, 150, 64
    q = torch.randn(b, hq, d, generator=g).half()
    k = torch.randn(b, hk, t, d, generator=g) * 3
    v = torch.randn(b, hk, t, d, generator=g)
    k8, ks = quantize_fp8(k)
    v8, vs = quantize_fp8(v)
    f = FP8Decode(hq, hk, d)
    plan = f.plan(b, t, "cpu", n_splits=3)
    plan["out"].fill_(float("nan"))
    lengths = torch.tensor([t, t - 33], dtype=torch.int32)
    out = f.run(plan, q, k8, v8, ks, vs, lengths)
    for i in range(b):
        kk = k8[i].float() * ks[:, None, None]
        vv = v8[i].float() * vs[:, None, None]
        ref = attention(q[i].float()[:, None], kk, vv, lengths[i : i + 1].long())[:, 0]
        # fp16 operands on the tensor cores: about 1e-3 relative
        assert ((out[i] - ref).norm() / ref.norm()).item() < 2e-3
