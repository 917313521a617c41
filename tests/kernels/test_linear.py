"""The probe Key stages for codebooks linear in the planes (benchmarks/tools/linear_key_probe.py): plane
bits as an fp16 MMA operand give the FMA Key stage's logits and softmax statistics (float32 accuracy),
so the instruction counts and times reported (docs/KERNEL_NOTES.md runs 45-46) are those of correct
kernels. The mma-fragment kernel runs only on the GPU (inline PTX); its operands (plane-major pairs in
fragment order) are checked here by emulating its arithmetic in torch."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from planekv.kernels import TritonReader
from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.synthetic import make_synthetic

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "tools" / "linear_key_probe.py"
_spec = importlib.util.spec_from_file_location("linear_key_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)
KCH, key_stage_linear, linear_operands = probe.KCH, probe.key_stage_linear, probe.linear_operands


def _emulate_mma(k_pool: torch.Tensor, pt: torch.Tensor, lengths: list[int], ops: tuple, hq: int) -> torch.Tensor:
    """The mma kernel's arithmetic over its operands, in torch: for every step, lane q and register r,
    the byte at the fragment-order offset, each token's bit times V hi + lo of every column pair."""
    offf, vf, steps, base2 = ops
    bsz, hk, _ = pt.shape
    g = hq // hk
    # [bh, S, 2 words, 8 columns, 4 lanes, 2 halves] -> [bh, S, 8 columns, 4 lanes, 4 registers (h + 2 v)]
    v = vf.view(torch.float16).float().view(*vf.shape, 2).permute(0, 1, 3, 4, 2, 5).reshape(*vf.shape[:2], 8, 4, 4)
    offq = offf.transpose(2, 3)  # [bh, S, 4 lanes, 4 registers]
    out = torch.zeros(bsz, hq, max(lengths))
    for bi, t in enumerate(lengths):
        for h in range(hk):
            bh = bi * hk + h
            for tok in range(t):
                page = int(pt[bi, h, tok // 64])
                flat = k_pool[page].reshape(-1)  # [W * D * 8]: (j D + c) 8 + byte
                for s in range(int(steps[bh])):
                    byte = flat[offq[bh, s].long() + (tok % 64) // 8].long()  # [4 lanes, 4 registers]
                    bit = ((byte >> (tok % 8)) & 1).float() / 128.0
                    for n in range(g):
                        out[bi, h * g + n, tok] += float((bit * (v[bh, s, 2 * n] + v[bh, s, 2 * n + 1])).sum())
            out[bi, h * g: (h + 1) * g, :t] += base2[bi, h * g: (h + 1) * g, None]
    return out


@pytest.mark.parametrize("hq,hk,rate", [(4, 2, 2.0), (3, 1, 4.0)])
def test_bit_product_key_stage_equals_the_fma_one(hq: int, hk: int, rate: float) -> None:
    lengths = [150, 97]
    syn = make_synthetic(n_tokens=150, n_rows=2, n_layers=1, n_q_heads=hq, n_kv_heads=hk, head_dim=64,
                         seed=40 + hq)
    spec = dataclasses.replace(syn.spec, codebook="uniform-linear-c3")
    codec = Codec(spec, syn.calibration)
    cache = PlaneKVCache(spec, 2)
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    for b, t in enumerate(lengths):
        cache.append(0, kc[:, :t], vc[:, :t], seq=b)
    q = syn.q[0].transpose(0, 1).contiguous()
    reader = TritonReader(codec, ReadPolicy.flexible(rate, 0.875 if rate == 2.0 else 0.75), assembly="fma")
    plan = reader.plan(2, 150, "cpu", pages_per_program=2)
    reader.decode(q, cache, 0, plan=plan, scale=0.125)  # the FMA Key stage's logits and stats, and _prep's operands
    ops = linear_operands(codec.tree, plan.kdep, plan.wf, plan.base)
    plist, pcnt, vhi, vlo, base2 = ops
    # every pair (c, j < depth) once, channel order, padded to a multiple of KCH
    dep = plan.kdep.reshape(2 * hk, -1)
    assert torch.equal(pcnt, ((dep.sum(1) + KCH - 1) // KCH * KCH).int())
    first = plist[0, : int(dep[0].sum())]
    assert torch.equal(first & 0xFF, torch.repeat_interleave(torch.arange(64), dep[0]).int())
    logits = torch.full_like(plan.logits, float("nan"))
    mstat, sstat = torch.empty_like(plan.mstat), torch.empty_like(plan.sstat)
    pt = cache.page_table.to(torch.int32).contiguous()
    key_stage_linear(cache.k_pool[0], pt, cache.lengths[0].to(torch.int32), ops, logits, mstat, sstat, 0.125, hq,
                     pages_per_program=2)
    for b, t in enumerate(lengths):
        torch.testing.assert_close(logits[b, :, :t], plan.logits[b, :, :t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mstat, plan.mstat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sstat, plan.sstat, rtol=1e-4, atol=1e-5)
    if hq // hk <= 4:  # the mma kernel's operands (plane-major pairs in fragment order), emulated
        mops = probe.mma_operands(codec.tree, plan.kdep, plan.wf, plan.base, 64)
        emu = _emulate_mma(cache.k_pool[0], pt, lengths, mops, hq) * 0.125
        for b, t in enumerate(lengths):
            torch.testing.assert_close(emu[b, :, :t], plan.logits[b, :, :t], rtol=1e-5, atol=1e-5)


def test_operands_refuse_the_gaussian_tree() -> None:
    syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=1)
    codec = Codec(syn.spec, syn.calibration)
    with pytest.raises(TypeError, match="linear"):
        linear_operands(codec.tree, torch.zeros(1, 2, 64, dtype=torch.int32), torch.zeros(1, 2, 64, 2),
                        torch.zeros(1, 4))
