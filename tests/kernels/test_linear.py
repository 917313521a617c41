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
import triton
import triton.language as tl

from planekv.kernels import TritonReader
from planekv.kernels.linear import _xpose_sel
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


def _linear_cache(hq: int, hk: int, seed: int, lengths: list[int], d: int = 64
                  ) -> tuple[Codec, PlaneKVCache, torch.Tensor]:
    """A uniform-linear-c3 codec, a cache of ``lengths`` tokens per sequence and queries."""
    syn = make_synthetic(n_tokens=max(lengths), n_rows=len(lengths), n_layers=1, n_q_heads=hq, n_kv_heads=hk,
                         head_dim=d, seed=seed)
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
    head, wherever it measured faster (the int8 form everywhere; the fp16 forms with head_dim >= 128 and a
    step that is not small); True forces it wherever it can run; never in the interpreter, never for
    the Gaussian tree."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    pol = ReadPolicy.flexible(2.0, 0.875)

    def codecs(hq: int, hk: int, d: int) -> tuple[Codec, Codec]:
        syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=hq, n_kv_heads=hk, head_dim=d, seed=2)
        return Codec(dataclasses.replace(syn.spec, codebook="uniform-linear-c3"), syn.calibration), \
            Codec(syn.spec, syn.calibration)

    lin, gauss = codecs(8, 2, 128)
    assert TritonReader(lin, pol)._key_mma(cuda) and not TritonReader(lin, pol)._key_mma(cpu)
    assert TritonReader(lin, pol)._key_mma(cuda, small=True)  # the int8 form: small steps too
    assert not TritonReader(gauss, pol)._key_mma(cuda)
    assert TritonReader(lin, ReadPolicy.flexible(2.0, 0.875, key_refine=0.3))._key_mma(cuda)  # with refinement
    fp16 = TritonReader(lin, pol)
    fp16.key_bits = "shifted"  # the fp16 form: only where it measured faster
    assert fp16._key_mma(cuda) and not fp16._key_mma(cuda, small=True)
    forced, off = TritonReader(lin, pol), TritonReader(lin, pol)
    forced.key_mma, off.key_mma = True, False
    forced.key_bits = "shifted"
    assert forced._key_mma(cuda, small=True) and not off._key_mma(cuda)
    lin64, _ = codecs(8, 2, 64)
    assert TritonReader(lin64, pol)._key_mma(cuda)  # d = 64: the int8 form measured faster
    fp16_64 = TritonReader(lin64, pol)
    fp16_64.key_bits = "shifted"
    assert not fp16_64._key_mma(cuda)  # the fp16 form measured slower there
    fp16_64.key_mma = True
    assert fp16_64._key_mma(cuda)
    lin9, _ = codecs(9, 1, 128)
    assert not TritonReader(lin9, pol)._key_mma(cuda)  # 9 query heads per KV head
    # the Value stage's bit product (value_mma): the same choice, and only with the compacting stage
    assert TritonReader(lin, pol)._value_mma(cuda) and not TritonReader(lin, pol)._value_mma(cpu)
    assert not TritonReader(lin, pol)._value_mma(cuda, small=True) and not TritonReader(gauss, pol)._value_mma(cuda)
    assert not TritonReader(lin64, pol)._value_mma(cuda) and not TritonReader(lin9, pol)._value_mma(cuda)
    assert not TritonReader(lin, pol, compact_values=False)._value_mma(cuda)
    vforced = TritonReader(lin64, pol)
    vforced.value_mma = True
    assert vforced._value_mma(cuda) and not vforced._value_mma(cpu)
    bad = TritonReader(lin, pol)
    assert bad.key_bits == "int8" and bad._bits("key_bits") < 0  # the int8 stage by default
    bad.key_bits = "signed"
    with pytest.raises(ValueError, match="key_bits"):
        bad._bits("key_bits")
    assert bad.value_bits == "int8" and bad._bits("value_bits") < 0  # the int8 Value stage by default
    bad.value_bits = "int4"
    with pytest.raises(ValueError, match="value_bits"):
        bad._bits("value_bits")


@pytest.mark.parametrize("d", [64, 128])
def test_depth_sorted_value_list(d: int) -> None:
    """``_value_order`` with SORT (what the bit-product Value stage reads: each step of 16 entries loops
    over its first entry's planes) lists every block's depth > 0 tokens once, deepest first and in
    position order within a depth; the FMA Value stage over that list gives the same output."""
    codec, cache, q = _linear_cache(8, 2, 31 + d, [300, 97], d)
    policy = ReadPolicy.flexible(2.0, 0.75)
    runs = {}
    for sort in (False, True):
        reader = TritonReader(codec, policy)
        plan = reader.plan(2, 300, "cpu", block_tokens=128)
        plan.vsort = sort
        plan.out.fill_(float("nan"))
        out, st = reader.decode(q, cache, 0, plan=plan)
        runs[sort] = (out.clone(), st, plan.vord.clone(), plan.vcnt.clone())
    (o0, s0, _, c0), (o1, s1, vord, c1) = runs[False], runs[True]
    assert torch.equal(s0.v_depths, s1.v_depths) and torch.equal(c0, c1)
    torch.testing.assert_close(o1, o0, rtol=1e-5, atol=1e-6)
    n_mixed = 0
    for b, t in enumerate([300, 97]):
        for h in range(2):
            depths = s1.v_depths[b, h]
            for blk in range(-(-t // 128)):
                n = int(c1[b, h, blk])
                keys = vord[b, h, blk * 128: blk * 128 + n].long()
                dep, pos = codec.width - (keys >> 11), (keys & 2047) + blk * 128
                want = torch.nonzero(depths[blk * 128: min(t, blk * 128 + 128)] > 0).flatten() + blk * 128
                assert n == want.numel() and sorted(pos.tolist()) == want.tolist()
                assert torch.equal(dep, depths[pos].long())
                order = sorted(range(n), key=lambda i: (-int(dep[i]), int(pos[i])))
                assert order == list(range(n))
                n_mixed += int(dep.unique().numel() > 1)
    assert n_mixed > 0  # blocks of mixed depths were sorted



def _mma_m16n8k16(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """mma.sync.m16n8k16 (row.col, f16 in, f32 accumulate) over a warp's registers, as PTX lays the
    fragments out: a [32 lanes, 4 registers, 2 halves] fp16, b [32, 2, 2], c / d [32, 4] float32; lane
    4 gid + q holds A rows gid / gid + 8 and columns 2q, 2q+1 / 2q+8, 2q+9, B rows 2q, 2q+1 / 2q+8, 2q+9
    of column gid, C rows gid / gid + 8 of columns 2q, 2q+1."""
    am = torch.zeros(16, 16)
    bm = torch.zeros(16, 8)
    for lane in range(32):
        g, q = divmod(lane, 4)
        for r, (row, col) in enumerate(((g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8))):
            am[row, col: col + 2] = a[lane, r].float()
        for r, k in enumerate((2 * q, 2 * q + 8)):
            bm[k: k + 2, g] = b[lane, r].float()
    dm = am.double() @ bm.double()
    out = c.clone()
    for lane in range(32):
        g, q = divmod(lane, 4)
        out[lane] += torch.tensor([dm[g, 2 * q], dm[g, 2 * q + 1], dm[g + 8, 2 * q], dm[g + 8, 2 * q + 1]]).float()
    return out


def _halves(word: torch.Tensor) -> torch.Tensor:
    """int32 words [...] -> their two 16-bit halves [..., 2] as fp16 (low half first)."""
    return torch.stack([(word & 0xFFFF), (word >> 16) & 0xFFFF], -1).to(torch.int16).view(torch.float16)


def _emulate_value_mma(reader: TritonReader, plan, v_pool: torch.Tensor, pt: torch.Tensor, bits: str) -> torch.Tensor:
    """What ``_value_stage_mma`` writes to ``part``, lane by lane in torch: its list walk in steps of 16
    entries, each lane's plane bytes packed into fragment registers as ``_mma_asm`` builds them, its B
    words (the entries' p w halves), the warp's MMAs (:func:`_mma_m16n8k16`) and the store mapping."""
    from planekv.kernels.linear import MMA_BITS

    assert bits in MMA_BITS and bits != "in-place"  # the emulation builds shifted or signed bits
    spec = reader.codec.spec
    hq, hk, d, w, p = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.width, spec.page_size
    g = hq // hk
    c = reader._consts[plan.device]
    signed = bits == "signed"
    lina, linw = (c["lin_c"], c["lin_wm"]) if signed else (c["lin_a"], c["lin_w"])
    vs = reader._vscale
    blk_t, nblk, nb8 = plan.block_tokens, plan.n_blocks, d // 8
    cw = 128 if d >= 128 else 64
    two = d >= 128
    part = torch.zeros_like(plan.part)
    lanes = torch.arange(32)
    gid, q = lanes // 4, lanes % 4
    gc, lo = gid // 2, (gid % 2).float()
    for bi in range(plan.batch):
        for h in range(hk):
            m = plan.mstat[bi, h * g: (h + 1) * g]
            mg = m.max(1).values
            zs = (plan.sstat[bi, h * g: (h + 1) * g] * torch.exp(m - mg[:, None])).sum(1)
            for blk in range(nblk):
                n_items = int(plan.vcnt[bi, h, blk])
                lst = plan.vord[bi, h, blk * blk_t: blk * blk_t + n_items].long()
                for wq in range(d // cw):
                    bc = (cw // 8) * wq + gid  # and bc + 8 for M-tiles 4-7
                    acc = [torch.zeros(32, 4) for _ in range(8 if two else 4)]
                    asum = torch.zeros(32)
                    for k in range(-(-n_items // 16)):
                        ents = [16 * k + 2 * q + o for o in (0, 1, 8, 9)]  # each [32]
                        live = [e < n_items for e in ents]
                        kv = [torch.where(lv, lst[e.clamp(max=max(n_items - 1, 0))], w << 11)
                              for e, lv in zip(ents, live, strict=True)]
                        dep = [w - (x >> 11) for x in kv]
                        pos = [blk * blk_t + (x & 2047) for x in kv]
                        prob = []
                        for s_, ps in zip(dep, pos, strict=True):
                            ok = (s_ > 0) & (gc < g)
                            gg = gc.clamp(max=g - 1)
                            lg = plan.logits[bi, h * g + gg, ps.clamp(max=plan.max_tokens - 1)]
                            prob.append(torch.where(ok, torch.exp(lg - mg[gg]) / zs[gg] * vs, torch.zeros(())))
                        asum += sum(pr * lina[s_] for pr, s_ in zip(prob, dep, strict=True))
                        for j in range(w - int(lst[16 * k] >> 11)):
                            byte = []
                            for s_, ps in zip(dep, pos, strict=True):
                                page = pt[bi, h, ps // p].long()
                                row = v_pool[page, j, ps % p]  # [32 lanes, d / 8] bytes
                                b0 = row[lanes, bc].long()
                                b1 = row[lanes, (bc + 8) % nb8].long()
                                byte.append((torch.where(j < s_, b0, 0), torch.where(j < s_, b1, 0)))
                            bw = []
                            for pr, s_ in zip(prob, dep, strict=True):
                                x = pr * linw[s_ * w + j]
                                bw.append((x - lo * x.half().float()).half())
                            bfrag = torch.stack([torch.stack(bw[:2], -1), torch.stack(bw[2:], -1)], 1)
                            for col in range(2 if two else 1):
                                z01 = byte[0][col] | (byte[1][col] << 16)
                                z23 = byte[2][col] | (byte[3][col] << 16)
                                for i in range(4):
                                    regs = []
                                    for z, sh in ((z01, 13 - 2 * i), (z01, 12 - 2 * i), (z23, 13 - 2 * i),
                                                  (z23, 12 - 2 * i)):
                                        if signed:
                                            r = ((z << (sh + 2)) & 0x80008000) | 0x3C003C00
                                        else:
                                            r = (z << sh) & 0x20002000
                                        regs.append(_halves(r))
                                    t = 4 * col + i
                                    acc[t] = _mma_m16n8k16(torch.stack(regs, 1), bfrag, acc[t])
                    inv = 1.0 / vs * (1.0 if signed else 128.0)
                    ab = torch.zeros(32)
                    for n in range(g):
                        ab = torch.where(q == n, asum[gid == 2 * n].sum() / vs, ab)
                    for t, a in enumerate(acc):
                        col, i = divmod(t, 4)
                        for r in range(2):
                            ch = 8 * (bc + 8 * col) + 2 * i + r
                            val = (a[:, 2 * r] + a[:, 2 * r + 1]) * inv + ab
                            for lane in range(32):
                                if q[lane] < g:
                                    part[bi, h * g + q[lane], blk, ch[lane]] = val[lane]
    return part


@pytest.mark.parametrize("d,bits", [(128, "signed"), (64, "signed"), (128, "shifted")])
def test_bit_product_value_stage_emulated(d: int, bits: str) -> None:
    """The bit-product Value stage's arithmetic (GPU only: inline PTX), emulated lane by lane over the
    same step's depth-sorted list, logits and statistics, writes the FMA Value stage's partial sums
    (float32 accuracy): the fragment layouts, the byte columns of each lane, the signed or shifted
    bits, the B halves and scales, the constant term and the store mapping are right."""
    codec, cache, q = _linear_cache(8, 2, 70 + d, [300, 97], d)
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.75))
    plan = reader.plan(2, 300, "cpu", block_tokens=128)
    plan.vsort = True
    reader.decode(q, cache, 0, plan=plan)
    pt = cache.page_table.to(torch.int32)
    emu = _emulate_value_mma(reader, plan, cache.v_pool[0], pt, bits)
    for b, t in enumerate([300, 97]):
        nb = -(-t // 128)
        torch.testing.assert_close(emu[b, :, :nb], plan.part[b, :, :nb], rtol=2e-5, atol=2e-6)
    assert float(plan.part[:, :, :1].abs().max()) > 0.01  # the partial sums are not trivially zero


def _imma_m16n8k32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """mma.sync.m16n8k32 (row.col, u8 A, s8 B, s32 accumulate) over a warp's registers, as PTX lays the
    fragments out: a [32 lanes, 4 registers, 4 bytes] (unsigned), b [32, 2, 4] (signed), c / d [32, 4]
    int64; lane 4 gid + q holds A row gid (registers 0, 2) / gid + 8 (1, 3) at columns 4q..4q+3 (0, 1) /
    16+4q.. (2, 3), B rows 4q.. / 16+4q.. of column gid, C rows gid / gid + 8 of columns 2q, 2q+1."""
    am = torch.zeros(16, 32, dtype=torch.int64)
    bm = torch.zeros(32, 8, dtype=torch.int64)
    for lane in range(32):
        g, q = divmod(lane, 4)
        for r, (row, col) in enumerate(((g, 4 * q), (g + 8, 4 * q), (g, 16 + 4 * q), (g + 8, 16 + 4 * q))):
            am[row, col: col + 4] = a[lane, r]
        for r, k in enumerate((4 * q, 16 + 4 * q)):
            bm[k: k + 4, g] = b[lane, r]
    dm = am @ bm
    out = c.clone()
    for lane in range(32):
        g, q = divmod(lane, 4)
        out[lane] += torch.stack([dm[g, 2 * q], dm[g, 2 * q + 1], dm[g + 8, 2 * q], dm[g + 8, 2 * q + 1]])
    return out


def _emulate_imma(k_pool: torch.Tensor, pt: torch.Tensor, lengths: list[int], ops: tuple, hq: int) -> torch.Tensor:
    """What ``_key_stage_imma`` computes before the scale, warp by warp in torch: per page and step each
    lane's eight offsets and bytes packed into two words (byte k of word v: list entry 16 v + 4 q + k),
    M-tile i's A registers those words masked to bits 2i / 2i + 1, its B words the digits, the warp's
    int8 MMAs (:func:`_imma_m16n8k32`), and the epilogue's mapping of accumulators to tokens and digits."""
    offf, vd, steps, base2, sg = ops
    bsz, hk, _ = pt.shape
    g = hq // hk
    out = torch.zeros(bsz, hq, max(lengths))
    lane = torch.arange(32)
    gid, qq = lane // 4, lane % 4
    for bi, t in enumerate(lengths):
        for h in range(hk):
            bh = bi * hk + h
            for pg in range(-(-t // 64)):
                flat = k_pool[int(pt[bi, h, pg])].reshape(-1).long()
                acc = torch.zeros(4, 2, 32, 4, dtype=torch.int64)  # [M-tile, n-tile, lane, register]
                for s in range(int(steps[bh])):
                    off = offf[bh, s].long()  # [v, k, q]
                    byts = flat[off[:, :, qq] + gid]  # [v, k, lanes]
                    words = byts.permute(2, 0, 1)  # [lanes, v, k]: byte k of word v
                    bw = vd[bh, s][gid, qq].long()  # [lanes, n-tile, v, k]
                    for i in range(4):
                        lo, hi = words & (1 << 2 * i), words & (2 << 2 * i)
                        a = torch.stack([lo[:, 0], hi[:, 0], lo[:, 1], hi[:, 1]], 1)
                        for n in range(2):
                            acc[i, n] = _imma_m16n8k32(a, bw[:, n], acc[i, n])
                for i in range(4):
                    for row in range(2):  # token 8 gid + 2i + row
                        k = 2 * i + row
                        tok = pg * 64 + 8 * gid + k
                        d0, d1 = acc[i, 0, :, 2 * row].double(), acc[i, 0, :, 2 * row + 1].double()
                        d2 = acc[i, 1, :, 2 * row].double()
                        assert not acc[i, 1, :, 2 * row + 1].any()  # the zero columns
                        val = (d0 + (d1 + d2 / 254.0) / 254.0) / 2 ** k
                        for lq in range(32):
                            n = int(qq[lq])
                            if n < g and tok[lq] < t:
                                qh = h * g + n
                                out[bi, qh, tok[lq]] = float(val[lq]) * float(sg[bi, qh]) + float(base2[bi, qh])
    return out


@pytest.mark.parametrize("hq,hk,d", [(4, 1, 64), (8, 2, 64), (3, 1, 64)])
def test_int8_key_stage_emulated(hq: int, hk: int, d: int) -> None:
    """The int8 bit-product Key stage (``key_bits="int8"``; GPU only: inline PTX), emulated warp by warp
    over its operands, gives the FMA Key stage's logits to float32 accuracy: the pair order, the byte
    packing, the bits left in place as unsigned 2^k, the digits' fragment layout and their combination
    are right. And ``_lin_prep_i8`` (run in the interpreter) writes exactly the torch reference's operands."""
    from planekv.kernels.linear import _lin_prep_i8, imma_operands, linear_tables

    lengths = [150, 97]
    codec, cache, q = _linear_cache(hq, hk, 90 + hq, lengths, d)
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    plan = reader.plan(2, 150, "cpu", pages_per_program=2)
    reader.decode(q, cache, 0, plan=plan, scale=0.125)
    ops = imma_operands(codec.tree, plan.kdep, plan.wf, plan.base, 64)
    offf, vd, steps, base2, sg = ops
    assert int(vd[..., 0, :, :, :, :].abs().max()) == 127  # digit 0 spans the int8 range
    pt = cache.page_table.to(torch.int32).contiguous()
    emu = _emulate_imma(cache.k_pool[0], pt, lengths, ops, hq) * 0.125
    for b, t in enumerate(lengths):
        torch.testing.assert_close(emu[b, :, :t], plan.logits[b, :, :t], rtol=1e-5, atol=2e-5)
    # the operand kernel, poisoned buffers
    bh, smax = 2 * hk, d * 8 // 32
    off = torch.full((bh, smax * 32), -1, dtype=torch.int32)
    vdk = torch.full((bh, smax * 512), 0x55, dtype=torch.int8)
    nst, b2, vs = torch.zeros(bh, dtype=torch.int32), torch.zeros(2, hq), torch.zeros(2, hq)
    a, wt = linear_tables(codec.tree)
    _lin_prep_i8[(bh, 8)](plan.kdep, plan.wf, plan.base, a, wt.reshape(-1).contiguous(), off, vdk, nst, b2, vs, smax,
                        HQ=hq, HKV=hk, G=hq // hk, D=d, W=8, P=64, num_warps=4)
    assert torch.equal(nst, steps)
    for i in range(bh):
        n = int(steps[i])
        assert torch.equal(off[i, : n * 32], offf[i, :n].reshape(-1))
        assert torch.equal(vdk[i, : n * 512], vd[i, :n].reshape(-1))
    torch.testing.assert_close(b2, base2, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(vs, sg, rtol=1e-6, atol=0)


def test_a_plan_runs_only_with_the_key_bits_it_was_made_for() -> None:
    """The int8 and fp16 bit-product Key stages split the pages differently (4 / 8 per program), so a
    plan records which one it was made for (and its pages per split), and a reader whose key_bits
    changed since refuses it instead of covering only part of the tokens."""
    codec, cache, q = _linear_cache(8, 2, 5, [150, 97])
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    plan = reader.plan(2, 150, "cpu")
    assert not plan.key_mma and not plan.key_int8 and plan.mma_pages == 0  # never in the interpreter
    plan.key_mma, plan.key_int8, plan.mma_pages = True, True, reader.imma_warps  # as a GPU plan would be
    reader.key_bits = "shifted"
    with pytest.raises(ValueError, match="key_bits"):
        reader.decode(q, cache, 0, plan=plan)



def test_int8_key_stage_register_cap_follows_the_grid(monkeypatch) -> None:
    """``imma_maxnreg="auto"`` caps the int8 Key stage at 64 registers (8 programs per SM instead of 7)
    only where its grid is between one and eight such waves (KERNEL_NOTES run 86); an explicit value is
    used as given, and a malformed one is refused before any launch."""
    codec, _, _ = _linear_cache(8, 2, 5, [150, 97])
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: type("Props", (), {"multi_processor_count": 132}))
    cuda = torch.device("cuda")
    assert reader.imma_maxnreg == "auto"
    assert reader._imma_maxnreg(256 * 128, cuda) is None  # B=32 T=32768, 8 KV heads: 32 waves
    assert reader._imma_maxnreg(32 * 128, cuda) == 64  # d=256, one KV head: 4 waves
    assert reader._imma_maxnreg(96 * 32, cuda) == 64  # SmolLM2's geometry at B=32 T=8192
    assert reader._imma_maxnreg(8 * 32, cuda) is None  # B=1 T=8192: under one wave
    assert reader._imma_maxnreg(4096, torch.device("cpu")) is None
    reader.imma_maxnreg = 80
    assert reader._imma_maxnreg(256 * 128, cuda) == 80
    reader.imma_maxnreg = "fast"
    with pytest.raises(ValueError, match="imma_maxnreg"):
        reader._imma_maxnreg(4096, cuda)


def test_int8_value_stage_register_cap_follows_its_form() -> None:
    """``value_maxnreg="auto"``: 128 registers for the one-step int8 Value stage, no cap for the pipelined
    form 1, 200 for form 2 (the default; KERNEL_NOTES runs 82, 89, 92); an explicit count applies to all."""
    codec, _, _ = _linear_cache(8, 2, 5, [64])
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    assert reader.vimma_prefetch == 2 and reader.value_maxnreg == "auto"
    assert [reader._value_maxnreg(f) for f in (0, 1, 2)] == [128, None, 200]
    reader.value_maxnreg = 168
    assert [reader._value_maxnreg(f) for f in (0, 1, 2)] == [168] * 3
    reader.value_maxnreg = None
    assert reader._value_maxnreg(0) is None
    reader.value_maxnreg = "many"
    with pytest.raises(ValueError, match="value_maxnreg"):
        reader._value_maxnreg(2)

@pytest.mark.parametrize("rate,blk", [(2.0, 512), (4.0, 256)])
def test_chunked_depth_order_equals_the_block_wide_one(rate: float, blk: int) -> None:
    """``order_chunked`` (the depth-sorted list's slots from one prefix sum along 128-token chunks) writes
    the list of the two block-wide prefix sums entry for entry, over blocks of several chunks with mixed
    depths (and a block that ends mid-chunk): deepest first, position order within a depth."""
    codec, cache, q = _linear_cache(4, 2, 77, [1100, 300], 64)
    got = []
    for chunked in (0, 1):
        reader = TritonReader(codec, ReadPolicy.flexible(rate, 0.75))
        reader.order_chunked = chunked
        plan = reader.plan(2, 1100, "cpu", block_tokens=blk)
        plan.vsort = True
        plan.vord.fill_(-1)
        _, st = reader.decode(q, cache, 0, plan=plan)
        got.append((plan.vord.clone(), plan.vcnt.clone(), st.v_depths))
    (o0, c0, d0), (o1, c1, d1) = got
    assert torch.equal(c1, c0) and torch.equal(d1, d0)
    n_multi = 0
    for b, t in enumerate([1100, 300]):
        for h in range(2):
            for k in range(-(-t // blk)):
                n = int(c1[b, h, k])
                assert torch.equal(o1[b, h, k * blk: k * blk + n], o0[b, h, k * blk: k * blk + n])
                keys = o1[b, h, k * blk: k * blk + n].long()
                order = sorted(range(n), key=lambda i: (int(keys[i] >> 11), int(keys[i] & 2047)))
                assert order == list(range(n))  # (W - depth) ascending, then position
                pos = keys & 2047
                n_multi += int((pos >= 128).any() and (pos < 128).any() and (keys >> 11).unique().numel() > 2)
    assert n_multi > 0  # lists that span chunks with several depths were checked


def _emulate_value_imma(reader: TritonReader, plan, v_pool: torch.Tensor, pt: torch.Tensor, pair: bool
                        ) -> tuple[torch.Tensor, int]:
    """What ``_value_stage_imma`` writes to ``part``, lane by lane in torch: the block's scale from the
    split maxima, the list walk in steps of 32 entries (lane (gid, q): entries 4q..4q+3, 16+4q..16+4q+3),
    the plane bytes of its byte columns (each lane loads its own entry's row, the lane group transposes
    them: :data:`_XPOSE`, run by :func:`_run_ptx`) masked to each M-tile's bits, its B words (the bytes of Y =
    rint(p w / S): the top byte in even columns of n-tile 0, bytes 1 / 0 in n-tile 1), the warp's int8
    MMAs (:func:`_imma_m16n8k32`), and the epilogue. Also the largest |top byte| seen."""
    from planekv.kernels.linear import _XPOSE, xpose_selectors

    spec = reader.codec.spec
    hq, hk, d, w, p = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.width, spec.page_size
    g = hq // hk
    c = reader._consts[plan.device]
    lina, linw, wmax = c["lin_a"], c["lin_w"], reader._wmax
    sel = torch.tensor([xpose_selectors(lane // 4) for lane in range(32)])
    blk_t, nblk, nsk = plan.block_tokens, plan.n_blocks, plan.n_splits
    ts_tok = plan.split_pages * p
    cw = 128 if d >= 128 else 64
    two = d >= 128
    kw = 2.0 ** 22 / wmax
    part = torch.zeros_like(plan.part)
    lanes = torch.arange(32)
    gid, q = lanes // 4, lanes % 4
    gc, odd = gid // 2, gid % 2
    top_max = 0
    for bi in range(plan.batch):
        for h in range(hk):
            m = plan.mstat[bi, h * g: (h + 1) * g]
            mg = m.max(1).values
            mg = torch.where(mg == float("-inf"), torch.zeros(()), mg)
            zs = (plan.sstat[bi, h * g: (h + 1) * g] * torch.exp(m - mg[:, None])).sum(1)
            zs = torch.where(zs > 0, zs, torch.ones(()))
            for blk in range(nblk):
                s_lo, s_hi = blk * blk_t // ts_tok, min(((blk + 1) * blk_t - 1) // ts_tok, nsk - 1)
                mb = m[:, s_lo: s_hi + 1].max(1).values
                mb = torch.where(mb == float("-inf"), mg, mb)
                sq = torch.exp(mb - mg) / zs * (wmax / 2.0 ** 22)
                n_items = int(plan.vcnt[bi, h, blk])
                lst = plan.vord[bi, h, blk * blk_t: blk * blk_t + n_items].long()
                for wq in range(d // cw):
                    bc = (cw // 8) * wq + gid
                    acc0 = [torch.zeros(32, 4, dtype=torch.int64) for _ in range(8 if two else 4)]
                    acc1 = [torch.zeros(32, 4, dtype=torch.int64) for _ in range(8 if two else 4)]
                    asum = torch.zeros(32)
                    for k in range(-(-n_items // 32)):
                        ents = [32 * k + 4 * q + o for o in (0, 1, 2, 3, 16, 17, 18, 19)]
                        kv = [torch.where(e < n_items, lst[e.clamp(max=max(n_items - 1, 0))], w << 11) for e in ents]
                        dep = [w - (x >> 11) for x in kv]
                        pos = [blk * blk_t + (x & 2047) for x in kv]
                        pv = []
                        for s_, ps in zip(dep, pos, strict=True):
                            gg = gc.clamp(max=g - 1)
                            lg = plan.logits[bi, h * g + gg, ps.clamp(max=plan.max_tokens - 1)]
                            pv.append(torch.where((s_ > 0) & (gc < g), torch.exp(lg - mb[gg]) * kw, torch.zeros(())))
                        asum += sum(x * lina[s_] for x, s_ in zip(pv, dep, strict=True))
                        npl = w - int(lst[32 * k] >> 11)
                        npl = min(w, -(-npl // 2) * 2) if pair else npl  # pairs: planes at or past depths add 0
                        # the lane's own entry 4q + gid % 4 + 16 (gid // 4): its row's bytes from byte column
                        # (cw / 8) wq, transposed in the lane group (_XPOSE) into the eight entries' bytes
                        e_own = 32 * k + 4 * q + gid % 4 + 16 * (gid // 4)
                        kvo = torch.where(e_own < n_items, lst[e_own.clamp(max=max(n_items - 1, 0))], w << 11)
                        dep_o, pos_o = w - (kvo >> 11), blk * blk_t + (kvo & 2047)
                        for j in range(npl):
                            row = v_pool[pt[bi, h, pos_o // p].long(), j, pos_o % p].long()  # [32 lanes, d / 8]
                            row = torch.where((j < dep_o)[:, None], row, 0)
                            cols = []
                            for col in range(2 if two else 1):
                                b8 = row[:, (cw // 8) * wq + 8 * col + torch.arange(8)]  # [32 lanes, 8 bytes]
                                lo = sum(b8[:, i] << 8 * i for i in range(4))
                                hi = sum(b8[:, 4 + i] << 8 * i for i in range(4))
                                x, y = _run_ptx(_XPOSE.value, 2, [lo, hi, *sel.T])
                                cols.append(torch.stack([(x >> 8 * i) & 255 for i in range(4)]
                                                        + [(y >> 8 * i) & 255 for i in range(4)], 1))
                            y = [torch.round(x * linw[s_ * w + j]).long() for x, s_ in zip(pv, dep, strict=True)]
                            top = [v >> 16 for v in y]
                            top_max = max(top_max, max(int(t.abs().max()) for t in top))
                            n0 = torch.stack([torch.where(odd == 1, 0, t) for t in top], 1).view(32, 2, 4)
                            n1 = torch.stack([torch.where(odd == 1, v & 255, (v >> 8) & 255) for v in y], 1)
                            n1 = n1.view(32, 2, 4)
                            for col in range(2 if two else 1):
                                xb = cols[col]  # [32, 8 entries]: byte column bc + 8 col
                                for i in range(4):
                                    lo, hi = 1 << (2 * i), 2 << (2 * i)
                                    a = torch.stack([xb[:, :4] & lo, xb[:, :4] & hi, xb[:, 4:] & lo, xb[:, 4:] & hi], 1)
                                    t = 4 * col + i
                                    acc0[t] = _imma_m16n8k32(a, n0, acc0[t])
                                    acc1[t] = _imma_m16n8k32(a, n1, acc1[t])
                    ab = torch.zeros(32)
                    for n in range(g):
                        ab = torch.where(q == n, asum[gid == 2 * n].sum(), ab)
                    for t in range(len(acc0)):
                        col, i = divmod(t, 4)
                        for r in range(2):
                            ch = 8 * (bc + 8 * col) + 2 * i + r
                            v = acc0[t][:, 2 * r] * 65536.0 + acc1[t][:, 2 * r] * 256.0 + acc1[t][:, 2 * r + 1]
                            val = (v.double() / 2 ** (2 * i + r) + ab.double()) * sq[q.clamp(max=g - 1)].double()
                            for lane in range(32):
                                if q[lane] < g:
                                    part[bi, h * g + q[lane], blk, ch[lane]] = float(val[lane])
    return part, top_max


@pytest.mark.parametrize("d,hq,hk,pair", [(128, 8, 2, False), (64, 6, 2, False), (128, 8, 2, True)])
def test_int8_value_stage_emulated(d: int, hq: int, hk: int, pair: bool) -> None:
    """The int8 Value stage (``value_bits="int8"``; GPU only: inline PTX), emulated lane by lane over the
    same step's depth-sorted list, logits and split statistics, writes the FMA Value stage's partial
    sums to float32 accuracy (each product resolves to 2^-22 of its block's largest): the per-block
    scale, the three bytes of Y in their n-tiles and columns, the in-place bits of each M-tile, the
    constant term and the store mapping are right, with plane pairs too."""
    codec, cache, q = _linear_cache(hq, hk, 90 + d, [300, 97], d)
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.75))
    plan = reader.plan(2, 300, "cpu", block_tokens=128)
    plan.vsort = True
    reader.decode(q, cache, 0, plan=plan)
    pt = cache.page_table.to(torch.int32)
    emu, top_max = _emulate_value_imma(reader, plan, cache.v_pool[0], pt, pair)
    assert top_max >= 32  # Y's top byte carries its high bits (|Y| up to 2^22)
    for b, t in enumerate([300, 97]):
        nb = -(-t // 128)
        torch.testing.assert_close(emu[b, :, :nb], plan.part[b, :, :nb], rtol=2e-5, atol=2e-6)
    assert float(plan.part[:, :, :1].abs().max()) > 0.01  # the partial sums are not trivially zero


def _run_ptx(asm: str, n_out: int, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """A warp running ``asm`` (only ``.reg``, ``prmt.b32`` and ``shfl.sync.bfly.b32``, as
    :data:`planekv.kernels.linear._XPOSE` uses): operands $0.. are the n_out outputs, then the inputs
    (int64 tensors of the 32 lanes' 32-bit values)."""
    regs: dict[str, torch.Tensor] = {f"${n_out + i}": x.long() & 0xFFFFFFFF for i, x in enumerate(ins)}
    lanes = torch.arange(32)

    def val(tok: str) -> torch.Tensor:
        return regs[tok] if tok in regs else torch.full((32,), int(tok, 0), dtype=torch.int64)

    for stmt in filter(None, (s.strip(" {}") for s in asm.split(";"))):
        op, _, args = stmt.partition(" ")
        a = [t.strip() for t in args.split(",")]
        if op == ".reg":
            continue
        if op == "prmt.b32":
            x, y, c = val(a[1]), val(a[2]), val(a[3])
            src = torch.stack([(x >> 8 * i) & 0xFF for i in range(4)] + [(y >> 8 * i) & 0xFF for i in range(4)], 1)
            regs[a[0]] = sum(src[lanes, (c >> 4 * i) & 0xF] << 8 * i for i in range(4))
        elif op == "shfl.sync.bfly.b32":
            regs[a[0]] = val(a[1])[lanes ^ int(a[2], 0)]
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return [regs[f"${i}"] for i in range(n_out)]


@triton.jit
def _sel_probe(out_ptr):
    """Each lane's eight transpose selectors (lane 4g + q: group index g), as the Key stage computes them."""
    lane = tl.arange(0, 32)
    s0, s1, s2, s3, s4, s5, s6, s7 = _xpose_sel(lane // 4)
    o = out_ptr + lane * 8
    tl.store(o, s0)
    tl.store(o + 1, s1)
    tl.store(o + 2, s2)
    tl.store(o + 3, s3)
    tl.store(o + 4, s4)
    tl.store(o + 5, s5)
    tl.store(o + 6, s6)
    tl.store(o + 7, s7)


def test_int8_key_stage_transposed_loads_give_the_byte_loads_operands() -> None:
    """The int8 Key stage's plane loads (GPU only: inline PTX): each lane loads the whole 8-byte word of one
    pair and the lanes of each group swap bytes (:data:`_XPOSE`, run here by a small PTX emulator with the selectors
    the kernel computes, in the interpreter), and every lane ends with the two words x, y that its eight
    byte loads build, for every page and step of a real step's operands; a broken selector fails it."""
    from planekv.kernels.linear import _XPOSE, imma_operands, xpose_selectors

    sel = torch.zeros(32 * 8, dtype=torch.int32)
    _sel_probe[(1,)](sel)
    sel = sel.view(32, 8).long()
    assert torch.equal(sel, torch.tensor([xpose_selectors(lane // 4) for lane in range(32)]))
    codec, cache, q = _linear_cache(8, 2, 11, [150, 97])
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.875))
    plan = reader.plan(2, 150, "cpu")
    reader.decode(q, cache, 0, plan=plan)
    offf, _, steps, _, _ = imma_operands(codec.tree, plan.kdep, plan.wf, plan.base, 64)
    lane = torch.arange(32)
    gid, qq = lane // 4, lane % 4
    pt = cache.page_table
    bad = sel.clone()
    bad[:, 6] = bad[:, 6] ^ 0x0001  # one byte of stage C's new low word from the wrong place
    checked = 0
    for bh in range(pt.shape[0] * pt.shape[1]):
        for pg in range(2):
            flat = cache.k_pool[0][int(pt.view(-1, pt.shape[2])[bh, pg])].reshape(-1).long()
            for s in range(int(steps[bh])):
                off = offf[bh, s].long()  # [v, k, q]
                byts = flat[off[:, :, qq] + gid]  # [v, k, lanes]: byte g of pair 16 v + 4 q + k
                want = [sum(byts[v, k] << 8 * k for k in range(4)) for v in range(2)]
                wo = off.reshape(-1)[lane]  # lane 4g + q: the word of list entry 4g + q
                lo = sum(flat[wo + k] << 8 * k for k in range(4))
                hi = sum(flat[wo + 4 + k] << 8 * k for k in range(4))
                x, y = _run_ptx(_XPOSE.value, 2, [lo, hi, *sel.T])
                assert torch.equal(x, want[0]) and torch.equal(y, want[1]), (bh, pg, s)
                xb, yb = _run_ptx(_XPOSE.value, 2, [lo, hi, *bad.T])
                assert not (torch.equal(xb, want[0]) and torch.equal(yb, want[1]))
                checked += 1
    assert checked >= 8
