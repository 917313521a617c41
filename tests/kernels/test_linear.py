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


def _linear_cache(hq: int, hk: int, seed: int, lengths: list[int]) -> tuple[Codec, PlaneKVCache, torch.Tensor]:
    """A uniform-linear-c3 codec, a cache of ``lengths`` tokens per sequence (d = 64) and queries."""
    syn = make_synthetic(n_tokens=max(lengths), n_rows=len(lengths), n_layers=1, n_q_heads=hq, n_kv_heads=hk,
                         head_dim=64, seed=seed)
    spec = dataclasses.replace(syn.spec, codebook="uniform-linear-c3")
    codec = Codec(spec, syn.calibration)
    cache = PlaneKVCache(spec, len(lengths))
    kc, vc = codec.encode_k(syn.k[0], 0), codec.encode_v(syn.v[0], 0)
    for b, t in enumerate(lengths):
        cache.append(0, kc[:, :t], vc[:, :t], seq=b)
    return codec, cache, syn.q[0].transpose(0, 1).contiguous()


@pytest.mark.parametrize("hq,hk,rate", [(4, 2, 2.0), (3, 1, 4.0)])
def test_bit_product_key_stage_equals_the_fma_one(hq: int, hk: int, rate: float) -> None:
    lengths = [150, 97]
    codec, cache, q = _linear_cache(hq, hk, 40 + hq, lengths)
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


def test_lin_prep_writes_the_reference_operands() -> None:
    """``_lin_prep`` (the reader's operand kernel, run here in the interpreter) writes what the torch
    reference ``mma_operands`` builds: the same steps, offsets, V halves and base'."""
    from planekv.kernels.linear import _lin_prep, linear_tables, mma_operands

    codec, cache, q = _linear_cache(8, 2, 9, [150, 97])
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    plan = reader.plan(2, 150, "cpu")
    assert not plan.key_mma  # the interpreter cannot run the kernel's inline PTX
    reader.decode(q, cache, 0, plan=plan)
    offf, vf, steps, base2 = mma_operands(codec.tree, plan.kdep, plan.wf, plan.base, 64)
    bh, smax = 4, 64 * 8 // 16
    off = torch.full((bh, smax, 16), -1, dtype=torch.int32)
    v = torch.full((bh, smax, 128), float("nan"), dtype=torch.float16)
    nst, b2 = torch.zeros(bh, dtype=torch.int32), torch.zeros(2, 8)
    a, wt = linear_tables(codec.tree)
    _lin_prep[(bh,)](plan.kdep, plan.wf, plan.base, a, wt.reshape(-1).contiguous(), off, v, nst, b2, smax, HQ=8,
                     HKV=2, G=4, D=64, W=8, P=64, num_warps=4)
    assert torch.equal(nst, steps)
    for i in range(bh):
        n = int(steps[i])
        assert torch.equal(off[i, :n], offf[i, :n].reshape(n, 16))
        assert torch.equal(v[i, :n].view(torch.int32).reshape(n, 2, 8, 4), vf[i, :n])
    torch.testing.assert_close(b2, base2, rtol=1e-6, atol=1e-5)


def test_bit_product_key_stage_is_chosen_for_linear_codebooks_on_the_gpu() -> None:
    """TritonReader.key_mma ("auto"): a linear codebook on a CUDA device with up to 4 query heads per KV
    head, head_dim >= 128 and a step that is not small (where it measured faster);
    True forces it wherever it can run; never in the interpreter, never for the Gaussian tree."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    pol = ReadPolicy.flexible(2.0, 0.875)

    def codecs(hq: int, hk: int, d: int) -> tuple[Codec, Codec]:
        syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=hq, n_kv_heads=hk, head_dim=d, seed=2)
        return Codec(dataclasses.replace(syn.spec, codebook="uniform-linear-c3"), syn.calibration), \
            Codec(syn.spec, syn.calibration)

    lin, gauss = codecs(8, 2, 128)
    assert TritonReader(lin, pol)._key_mma(cuda) and not TritonReader(lin, pol)._key_mma(cpu)
    assert not TritonReader(lin, pol)._key_mma(cuda, small=True)
    assert not TritonReader(gauss, pol)._key_mma(cuda)
    assert TritonReader(lin, ReadPolicy.flexible(2.0, 0.875, key_refine=0.3))._key_mma(cuda)  # with refinement
    forced, off = TritonReader(lin, pol), TritonReader(lin, pol)
    forced.key_mma, off.key_mma = True, False
    assert forced._key_mma(cuda, small=True) and not off._key_mma(cuda)
    lin64, _ = codecs(8, 2, 64)
    assert not TritonReader(lin64, pol)._key_mma(cuda)  # d = 64: measured slower
    forced64 = TritonReader(lin64, pol)
    forced64.key_mma = True
    assert forced64._key_mma(cuda)
    lin9, _ = codecs(9, 1, 128)
    assert not TritonReader(lin9, pol)._key_mma(cuda)  # 9 query heads per KV head
