"""The int8 bit-product stages for codebooks linear in the planes (planekv/kernels/key_stage_int8.py and
value_stage_int8.py) and what they depend on, checked on CPU.

Both kernels run only on a GPU (inline PTX), so their arithmetic is emulated here lane by lane in torch,
PTX fragment layouts included: the Key stage over the operands of ``imma_operands`` gives the FMA Key
stage's logits, and ``_lin_prep_i8`` (run in Triton's interpreter) writes exactly those operands; the Key
stage's byte-transposing plane loads, run by a small PTX emulator with the selectors the kernel computes,
give the words its byte loads would build; the Value stage over the depth-sorted token list of
``_value_order`` gives the FMA Value stage's partial sums. The depth-sorted list itself is checked against
the order computed in torch, and the FMA Value stage over it against the position-ordered one. Last, where
``resolve`` runs the int8 stages (and with what register caps) for a GPU and for the interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from planekv.kernels import ReaderConfig, TritonReader, value_stage_fma
from planekv.kernels.common import _XPOSE, _xpose_sel, xpose_selectors
from planekv.kernels.config import StepChoices, Target, resolve
from planekv.kernels.key_stage_int8 import _lin_prep_i8, imma_operands
from planekv.kernels.reader import VALUE_STAGES
from planekv.kernels.tables import linear_tables
from planekv.kvstore import Codec, PlaneKVCache, ReadPolicy
from planekv.kvstore.synthetic import make_synthetic

GPU, CPU = Target(True, 132), Target(False, 132)  # an H200's 132 SMs; the interpreter plans as the GPU would


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


def _decode_sorted(reader: TritonReader, q: torch.Tensor, cache: PlaneKVCache, plan, monkeypatch):
    """``reader.decode`` with the int8 Value stage's depth-sorted list (``_value_order`` with SORT, chosen by
    ``value_stage == "int8"``), the FMA Value stage running over it in the interpreter in place of the int8
    one (inline PTX): the list, depths, logits and statistics the int8 stage would read, and the FMA stage's
    partial sums over the same list."""
    assert plan.choices.value_stage == "fma" and plan.choices.compact  # the interpreter's plan
    plan.choices = dataclasses.replace(plan.choices, value_stage="int8")
    monkeypatch.setitem(VALUE_STAGES, "int8", value_stage_fma.launch)
    return reader.decode(q, cache, 0, plan=plan)


def test_operands_refuse_the_gaussian_tree() -> None:
    syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=4, n_kv_heads=2, head_dim=64, seed=1)
    codec = Codec(syn.spec, syn.calibration)
    with pytest.raises(TypeError, match="linear"):
        imma_operands(codec.tree, torch.zeros(1, 2, 64, dtype=torch.int32), torch.zeros(1, 2, 64, 2),
                      torch.zeros(1, 4), 64)


def _codec(hq: int, hk: int, d: int, linear: bool = True, page_size: int = 64) -> Codec:
    syn = make_synthetic(n_tokens=64, n_rows=1, n_layers=1, n_q_heads=hq, n_kv_heads=hk, head_dim=d, seed=2,
                         page_size=page_size)
    spec = dataclasses.replace(syn.spec, codebook="uniform-linear-c3") if linear else syn.spec
    return Codec(spec, syn.calibration)


POL = ReadPolicy.flexible(2.0, 0.875)
LARGE, SMALL = (64, 8192), (1, 4096)  # (batch, max_tokens): 64 x 8 1024-token programs per KV head; B = 1


def _choices(codec: Codec, step: tuple[int, int], target: Target, policy: ReadPolicy = POL, fixed_depth: int = 0,
             **config) -> StepChoices:
    """What a reader of ``codec`` would run for a step of ``step`` on ``target``."""
    reader = TritonReader(codec, policy, ReaderConfig(**config), fixed_depth)
    ch = resolve(reader.config, reader.shape, *step, target)
    assert ch.small == (step == SMALL)
    return ch


def test_int8_key_stage_is_chosen_for_linear_codebooks_on_the_gpu() -> None:
    """``resolve``: the int8 Key stage (``key_int8=True``, the default) wherever it can run: a linear
    codebook on a CUDA device, the FMA assembly, 64-token pages, up to 4 query heads per KV head, not the
    Full Reader; small steps and Key refinement too. Never in the interpreter, never for the Gaussian tree;
    ``key_int8=False`` turns it off, and a malformed value is refused."""
    lin, gauss = _codec(8, 2, 128), _codec(8, 2, 128, linear=False)
    assert _choices(lin, LARGE, GPU).key_stage == "int8" and _choices(lin, LARGE, CPU).key_stage == "fma"
    assert _choices(lin, SMALL, GPU).key_stage == "int8"  # small steps too
    assert _choices(gauss, LARGE, GPU).key_stage == "fma"
    refining = ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)
    assert _choices(lin, LARGE, GPU, refining).key_stage == "int8"  # with refinement
    assert _choices(lin, LARGE, GPU, key_int8=False).key_stage == "fma"
    assert _choices(_codec(8, 2, 64), LARGE, GPU).key_stage == "int8"  # d = 64
    assert _choices(_codec(4, 1, 128), LARGE, GPU).key_stage == "int8"  # 4 query heads per KV head
    assert _choices(_codec(6, 1, 128), LARGE, GPU).key_stage == "fma"  # 6: the FMA stages, not the int8 one
    assert _choices(_codec(9, 1, 128), LARGE, GPU).key_stage == "transpose"  # 9 query heads per KV head
    assert _choices(lin, LARGE, GPU, assembly="transpose").key_stage == "transpose"
    assert _choices(_codec(8, 2, 128, page_size=128), LARGE, GPU).key_stage == "fma"  # 128-token pages
    assert _choices(lin, LARGE, GPU, fixed_depth=4).key_stage == "fma"  # the Full Reader
    assert ReaderConfig().key_int8 is True  # the int8 stage by default
    with pytest.raises(ValueError, match="key_int8"):
        ReaderConfig(key_int8="int8")


def test_int8_value_stage_is_chosen_for_linear_codebooks_on_the_gpu() -> None:
    """``resolve``: the int8 Value stage where it can run (as the Key stage's, and only with the compacting
    stage, head_dim a multiple of 64, at most 8 planes) and, under ``value_int8="auto"`` (the default), where
    it measured faster: head_dim >= 128 and a step that is not small. ``value_int8=True`` forces it wherever
    it can run; never in the interpreter, never for the Gaussian tree."""
    lin, gauss = _codec(8, 2, 128), _codec(8, 2, 128, linear=False)
    lin64, lin9 = _codec(8, 2, 64), _codec(9, 1, 128)
    assert _choices(lin, LARGE, GPU).value_stage == "int8" and _choices(lin, LARGE, CPU).value_stage == "fma"
    assert _choices(lin, SMALL, GPU).value_stage == "fma" and _choices(gauss, LARGE, GPU).value_stage == "fma"
    assert _choices(lin64, LARGE, GPU).value_stage == "fma" and _choices(lin9, LARGE, GPU).value_stage != "int8"
    assert _choices(lin, LARGE, GPU, compact_values=False).value_stage == "fma"
    assert _choices(lin, LARGE, GPU, value_int8=False).value_stage == "fma"
    assert _choices(lin, LARGE, GPU, fixed_depth=4).value_stage == "fma"  # the Full Reader: nothing to compact
    assert _choices(lin64, LARGE, GPU, value_int8=True).value_stage == "int8"
    assert _choices(lin64, LARGE, CPU, value_int8=True).value_stage == "fma"
    assert _choices(lin, SMALL, GPU, value_int8=True).value_stage == "int8"  # small steps when forced
    assert _choices(gauss, LARGE, GPU, value_int8=True).value_stage == "fma"
    assert _choices(_codec(6, 1, 128), LARGE, GPU, value_int8=True).value_stage == "fma"  # 6 query heads per KV head
    assert _choices(_codec(8, 2, 32), LARGE, GPU, value_int8=True).value_stage == "fma"  # d = 32
    reader = TritonReader(lin, POL, ReaderConfig(value_int8=True))
    wide = dataclasses.replace(reader.shape, width=12)  # more than 8 planes
    assert resolve(reader.config, wide, *LARGE, GPU).value_stage == "fma"
    assert resolve(reader.config, reader.shape, *LARGE, GPU).value_stage == "int8"
    assert ReaderConfig().value_int8 == "auto"
    with pytest.raises(ValueError, match="value_int8"):
        ReaderConfig(value_int8="int4")


@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])  # 128: a minute in the interpreter
def test_depth_sorted_value_list(d: int, monkeypatch) -> None:
    """``_value_order`` with SORT (what the int8 Value stage reads: each step of its list loops over its
    first entry's planes) lists every block's depth > 0 tokens once, deepest first and in position order
    within a depth; the FMA Value stage over that list gives the same output."""
    codec, cache, q = _linear_cache(8, 2, 31 + d, [300, 97], d)
    policy = ReadPolicy.flexible(2.0, 0.75)
    runs = {}
    for sort in (False, True):
        reader = TritonReader(codec, policy)
        plan = reader.plan(2, 300, "cpu", block_tokens=128)
        plan.out.fill_(float("nan"))
        out, st = _decode_sorted(reader, q, cache, plan, monkeypatch) if sort else reader.decode(q, cache, 0, plan=plan)
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


@pytest.mark.parametrize("rate,blk", [(2.0, 512), (4.0, 256)])
def test_depth_sorted_list_over_blocks_of_several_chunks(rate: float, blk: int, monkeypatch) -> None:
    """The depth-sorted list's slots come from one prefix sum along 128-token chunks and per-chunk bases:
    over blocks of several chunks with mixed depths (and a block that ends mid-chunk) the list is entry for
    entry the stable sort by depth computed in torch from the step's depths: deepest first, position order
    within a depth."""
    codec, cache, q = _linear_cache(4, 2, 77, [700, 300], 64)
    w = codec.width
    reader = TritonReader(codec, ReadPolicy.flexible(rate, 0.75))
    plan = reader.plan(2, 700, "cpu", block_tokens=blk)
    plan.vord.fill_(-1)
    _, st = _decode_sorted(reader, q, cache, plan, monkeypatch)
    o1, c1, d1 = plan.vord, plan.vcnt, st.v_depths
    n_multi = 0
    for b, t in enumerate([700, 300]):
        for h in range(2):
            for k in range(-(-t // blk)):
                n = int(c1[b, h, k])
                dk = d1[b, h, k * blk: min(t, (k + 1) * blk)].long()
                live = torch.nonzero(dk > 0).flatten()
                want = sorted((((w - int(dk[i])) << 11) | int(i)) for i in live)  # (W - depth, position)
                assert n == len(want)
                assert o1[b, h, k * blk: k * blk + n].long().tolist() == want
                keys = o1[b, h, k * blk: k * blk + n].long()
                order = sorted(range(n), key=lambda i: (int(keys[i] >> 11), int(keys[i] & 2047)))
                assert order == list(range(n))  # (W - depth) ascending, then position
                pos = keys & 2047
                n_multi += int((pos >= 128).any() and (pos < 128).any() and (keys >> 11).unique().numel() > 2)
    assert n_multi > 0  # lists that span chunks with several depths were checked


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


def _emulate_value_imma(reader: TritonReader, plan, v_pool: torch.Tensor, pt: torch.Tensor, pair: bool
                        ) -> tuple[torch.Tensor, int]:
    """What ``_value_stage_imma`` writes to ``part``, lane by lane in torch: the block's scale from the
    split maxima, the list walk in steps of 32 entries (lane (gid, q): entries 4q..4q+3, 16+4q..16+4q+3),
    the plane bytes of its byte columns (each lane loads its own entry's row, the lane group transposes
    them: :data:`_XPOSE`, run by :func:`_run_ptx`) masked to each M-tile's bits, its B words (the bytes of Y =
    rint(p w / S): the top byte in even columns of n-tile 0, bytes 1 / 0 in n-tile 1), the warp's int8
    MMAs (:func:`_imma_m16n8k32`), and the epilogue. Also the largest |top byte| seen."""
    spec = reader.codec.spec
    hq, hk, d, w, p = spec.n_q_heads, spec.n_kv_heads, spec.head_dim, spec.width, spec.page_size
    g = hq // hk
    c = reader.constants(plan.device)
    lina, linw, wmax = c["lin_a"], c["lin_w"], reader.consts.wmax
    sel = torch.tensor([xpose_selectors(lane // 4) for lane in range(32)])
    blk_t, nblk, nsk = plan.choices.block_tokens, plan.n_blocks, plan.n_splits
    ts_tok = plan.choices.key_pages * p
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

@pytest.mark.parametrize("d,hq,hk,pair", [pytest.param(128, 8, 2, False, marks=pytest.mark.slow), (64, 6, 2, False),
                                          pytest.param(128, 8, 2, True, marks=pytest.mark.slow)])
def test_int8_value_stage_emulated(d: int, hq: int, hk: int, pair: bool, monkeypatch) -> None:
    """The int8 Value stage (GPU only: inline PTX), emulated lane by lane over the same step's depth-sorted
    list, logits and split statistics, writes the FMA Value stage's partial sums to float32 accuracy (each
    product resolves to 2^-22 of its block's largest): the per-block scale, the three bytes of Y in their
    n-tiles and columns, the in-place bits of each M-tile, the constant term and the store mapping are
    right, with plane pairs (``PAIR``) too."""
    codec, cache, q = _linear_cache(hq, hk, 90 + d, [300, 97], d)
    reader = TritonReader(codec, ReadPolicy.flexible(2.0, 0.75))
    plan = reader.plan(2, 300, "cpu", block_tokens=128)
    _decode_sorted(reader, q, cache, plan, monkeypatch)
    pt = cache.page_table.to(torch.int32)
    emu, top_max = _emulate_value_imma(reader, plan, cache.v_pool[0], pt, pair)
    assert top_max >= 32  # Y's top byte carries its high bits (|Y| up to 2^22)
    for b, t in enumerate([300, 97]):
        nb = -(-t // 128)
        torch.testing.assert_close(emu[b, :, :nb], plan.part[b, :, :nb], rtol=2e-5, atol=2e-6)
    assert float(plan.part[:, :, :1].abs().max()) > 0.01  # the partial sums are not trivially zero


def _run_ptx(asm: str, n_out: int, ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """A warp running ``asm`` (only ``.reg``, ``prmt.b32`` and ``shfl.sync.bfly.b32``, as
    :data:`planekv.kernels.common._XPOSE` uses): operands $0.. are the n_out outputs, then the inputs
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
    """The int8 bit-product Key stage (GPU only: inline PTX), emulated warp by warp
    over its operands, gives the FMA Key stage's logits to float32 accuracy: the pair order, the byte
    packing, the bits left in place as unsigned 2^k, the digits' fragment layout and their combination
    are right. And ``_lin_prep_i8`` (run in the interpreter) writes exactly the torch reference's operands."""
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

def _grid_choices(hq: int, hk: int, d: int, batch: int, tokens: int, target: Target) -> StepChoices:
    """The choices of a step of ``batch`` x ``tokens`` for a linear codebook of that geometry."""
    reader = TritonReader(_codec(8, 2, 64), POL)
    shape = dataclasses.replace(reader.shape, n_q_heads=hq, n_kv_heads=hk, head_dim=d)
    return resolve(reader.config, shape, batch, tokens, target)


def test_int8_key_stage_register_cap_follows_the_grid() -> None:
    """The int8 Key stage's register cap: 64 registers (8 programs per SM instead of 7) only where its grid
    of 4-page programs is between one and eight such waves, and only on the GPU."""
    big = _grid_choices(16, 8, 128, 32, 32768, GPU)  # B=32 T=32768, 8 KV heads: 32 waves
    assert big.key_stage == "int8" and big.key_pages == 4
    assert big.key_int8_maxnreg is None
    assert _grid_choices(4, 1, 256, 32, 32768, GPU).key_int8_maxnreg == 64  # d=256, one KV head: 4 waves
    assert _grid_choices(9, 3, 64, 32, 8192, GPU).key_int8_maxnreg == 64  # SmolLM2's geometry at B=32 T=8192
    assert _grid_choices(16, 8, 128, 1, 8192, GPU).key_int8_maxnreg is None  # B=1 T=8192: under one wave
    assert _grid_choices(4, 1, 256, 32, 32768, CPU).key_int8_maxnreg is None


def test_int8_value_stage_register_cap_follows_its_form() -> None:
    """The int8 Value stage's register cap: 200 for the software-pipelined loop (``PIPELINED``, chosen for
    widths that are a multiple of 4, the default 8 planes among them), 128 for the one-step loop."""
    reader = TritonReader(_codec(8, 2, 128), POL)
    ch = resolve(reader.config, reader.shape, *LARGE, GPU)
    assert ch.value_stage == "int8" and ch.value_int8_pipelined and ch.value_int8_maxnreg == 200
    six = resolve(reader.config, dataclasses.replace(reader.shape, width=6), *LARGE, GPU)
    assert six.value_stage == "int8" and not six.value_int8_pipelined and six.value_int8_maxnreg == 128
