"""Probes: the Key stage as a matrix product of plane bits, for codebooks linear in the planes.

    PYTHONPATH=. python benchmarks/tools/linear_key_probe.py            # sm_90a SASS, no GPU needed
    PYTHONPATH=. python benchmarks/tools/linear_key_probe.py --gpu --shapes b32-t32k ... --json out.json

With a linear codebook (``planekv.kvstore.UniformLinearTree``) the depth-t value of a code is
``a_t + sum_{j<t} w_tj b_j``, so a query head's logit over a token is

    base_g + sum_c wf_cg (a_{t_c} + sum_{j<t_c} w_{t_c j} b_cj) = base'_g + sum_{(c,j)} V_{(c,j) g} b_cj

with ``wf = q~ sigma_K`` (what ``_prep`` writes), ``base' = base + sum_c wf_c a_{t_c}`` and
``V_{(c,j) g} = wf_cg w_{t_c j}``: one product of the bits [tokens x pairs] with V [pairs x G] per
(sequence, KV head), the pairs (c, j) being the planes the channel depths read. The bits are an
fp16 MMA operand (2^-7 per set bit, so V is scaled by 2^7) and V is split into fp16 hi + lo, both
products accumulated in float32: float32-accurate logits.

Two kernels: ``_key_stage_lin`` here, with ``tl.dot`` (Triton moves the bit tile through shared
memory: 6-8 instructions per bit; not used), and ``planekv.kernels.linear._key_stage_mma``, which
builds mma.sync fragments in registers with inline PTX (GPU only; ~2.2 per bit; the FMA Key stage's
bodies take ~3.3 per bit at 3.5 bits per channel) and which the reader runs for linear codebooks.
Both are checked against the FMA Key stage (tests/kernels/test_linear.py: the first in Triton's
interpreter, the second's operands in the interpreter and by a torch emulation); on the GPU ``--gpu``
compares the second's logits and statistics with the FMA stage's at full size and times both, and
``--gpu --reader`` runs whole reader steps with it on and off, checked against the reference reader.
docs/KERNEL_NOTES.md runs 45-47.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from planekv.kernels.linear import _key_stage_mma, key_stage_mma, linear_fold, mma_operands
from planekv.kvstore import UniformLinearTree

KCH = 16  # pairs per MMA step (the K of one tl.dot)
_KCH = tl.constexpr(KCH)
BIT_SCALE = 128.0  # a set bit is fp16 0x2000 = 2^-7; V carries the 2^7


@triton.jit
def _key_stage_lin(kb_ptr, pt_ptr, len_ptr, plist_ptr, pcnt_ptr, vhi_ptr, vlo_ptr, base_ptr, logit_ptr, mstat_ptr,
                   sstat_ptr, scale, SLOTS, TMAX, KMAX, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, W: tl.constexpr, P: tl.constexpr, PPK: tl.constexpr):
    """Program (b*Hkv + h, split): N = PPK*P tokens (rows) of one (sequence, KV head). Per step of
    KCH pairs (c, j) from the head's list: one plane byte per 8 rows and pair, each row's bit as fp16
    2^-7 or 0 ([N / 8, 8, KCH] reshaped to [N, KCH]), and acc += bits @ V (hi, then lo). Epilogue as
    the FMA Key stage: logits (scaled, -inf past the sequence) and this split's softmax max and sum
    per query head."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    h = pid_bh % HKV
    T = tl.load(len_ptr + b)
    n_pages = tl.cdiv(T, P)
    NB: tl.constexpr = P // 8
    N: tl.constexpr = PPK * P
    NSPLIT = tl.num_programs(1)
    mm = tl.arange(0, N)
    tok = split * N + mm
    # one byte load per 8 rows: rows 8r..8r+7 are the bits of byte r of the program's plane rows
    rr = tl.arange(0, N // 8)
    pg8 = split * PPK + rr // NB
    page = tl.load(pt_ptr + pid_bh * SLOTS + pg8, mask=pg8 < n_pages, other=0).to(tl.int64)
    rbase = page * (W * D * NB) + rr % NB  # [N / 8]: plane 0, channel 0, the byte
    sh = 13 - tl.arange(0, 8)  # bit k of the byte -> bit 13 (fp16 2^-7)
    kk = tl.arange(0, _KCH)
    gg = tl.arange(0, 16)
    acc = tl.zeros([N, 16], dtype=tl.float32)
    n_pairs = tl.load(pcnt_ptr + pid_bh)
    for k0 in range(0, n_pairs, _KCH):
        ent = tl.load(plist_ptr + pid_bh * KMAX + k0 + kk)  # j << 8 | c
        off = (ent >> 8) * (D * NB) + (ent & 0xFF) * NB  # [KCH]
        byt = tl.load(kb_ptr + rbase[:, None] + off[None, :]).to(tl.int32)  # [N / 8, KCH]
        bits = (byt[:, None, :] << sh[None, :, None]) & 0x2000  # [N / 8, 8, KCH]
        bits = tl.reshape(bits, (N, _KCH)).to(tl.int16).to(tl.float16, bitcast=True)
        vrow = (pid_bh * KMAX + k0 + kk)[:, None] * 16 + gg[None, :]
        acc = tl.dot(bits, tl.load(vhi_ptr + vrow), acc)
        acc = tl.dot(bits, tl.load(vlo_ptr + vrow), acc)
    q0 = b * HQ + h * G
    base = tl.load(base_ptr + q0 + gg, mask=gg < G, other=0.0)
    lg = (acc + base[None, :]) * scale  # [N, 16]
    ok = (tok < T)[:, None] & (gg < G)[None, :]
    lg = tl.where(ok, lg, float("-inf"))
    tl.store(logit_ptr + (q0 + gg[None, :]) * TMAX + tok[:, None], lg, mask=ok)
    m = tl.max(lg, 0)  # [16]
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(lg - m_safe[None, :]), 0)
    sidx = (q0 + gg) * NSPLIT + split
    tl.store(mstat_ptr + sidx, m, mask=gg < G)
    tl.store(sstat_ptr + sidx, s, mask=gg < G)


def linear_operands(tree: UniformLinearTree, kdep: torch.Tensor, wf: torch.Tensor, base: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's operands from the channel depths ``kdep`` [B, Hkv, D], the weights ``wf`` [B, Hkv,
    D, G] and ``base`` [B, Hq] of one step: (pair lists [B*Hkv, KMAX] int32 (j << 8 | c, channel
    order, padded with zero-weight copies of pair 0 to a multiple of KCH), their lengths [B*Hkv],
    V hi and lo [B*Hkv, KMAX, 16] fp16 (2^7 V), base' [B, Hq] f32)."""
    bsz, hk, d = kdep.shape
    g = wf.shape[-1]
    w = tree.depth
    dev = kdep.device
    dep, wt, base2 = linear_fold(tree, kdep, wf, base)  # base2: [B, Hkv, G]
    jj = torch.arange(w, device=dev)
    live = (jj[None, None, None, :] < dep[..., None]).reshape(bsz * hk, d * w)  # pairs (c, j), c-major
    v = (wf[..., None, :] * wt[dep][..., None]).reshape(bsz * hk, d * w, g)  # [BH, D*W, G]
    ent = ((jj[None, :] << 8) | torch.arange(d, device=dev)[:, None]).reshape(d * w).int()  # [D*W]
    cnt = live.sum(1)
    kmax = max(KCH, -(-int(cnt.max()) // KCH) * KCH)
    pos = torch.cumsum(live.int(), 1) - 1
    plist = torch.full((bsz * hk, kmax), int(ent[0]), dtype=torch.int32, device=dev)
    vf = torch.zeros(bsz * hk, kmax, 16, dtype=torch.float32, device=dev)
    rows = torch.arange(bsz * hk, device=dev)[:, None].expand(-1, d * w)
    plist[rows[live], pos[live]] = ent[None, :].expand(bsz * hk, -1)[live]
    vf[rows[live], pos[live], :g] = v[live] * BIT_SCALE
    if float(vf.abs().max()) > 60000.0:
        raise ValueError("2^7 V exceeds the fp16 range; the prototype has no other scaling")
    vhi = vf.half()
    vlo = (vf - vhi.float()).half()
    pcnt = ((cnt + KCH - 1) // KCH * KCH).int()
    return plist, pcnt, vhi.contiguous(), vlo.contiguous(), base2.reshape(bsz, hk * g).contiguous()


def key_stage_linear(k_pool: torch.Tensor, page_table: torch.Tensor, lengths: torch.Tensor,
                     ops: tuple[torch.Tensor, ...], logits: torch.Tensor, mstat: torch.Tensor, sstat: torch.Tensor,
                     scale: float, n_q_heads: int, pages_per_program: int, num_warps: int = 4) -> None:
    """Launch the prototype over the operands of :func:`linear_operands` (page_table [B, Hkv, slots],
    logits [B, Hq, TMAX], stats [B, Hq, splits])."""
    plist, pcnt, vhi, vlo, base2 = ops
    bsz, hk, slots = page_table.shape
    _, w, d, nb = k_pool.shape
    p = nb * 8
    nsplit = mstat.shape[2]
    _key_stage_lin[(bsz * hk, nsplit)](k_pool, page_table, lengths, plist, pcnt, vhi, vlo, base2, logits, mstat,
                                       sstat, scale, slots, logits.shape[2], plist.shape[1], HQ=n_q_heads, HKV=hk,
                                       G=n_q_heads // hk, D=d, W=w, P=p, PPK=pages_per_program,
                                       num_warps=num_warps)


def _probe_rate(data, shape, rate: float, share: float, reps: int) -> dict:  # noqa: ANN001
    """One shape and rate (see :func:`gpu_main`)."""
    import math

    from planekv.kernels import TritonReader
    from planekv.kernels.bench import _time_graphs
    from planekv.kernels.decode import _key_stage_f
    from planekv.kvstore import ReadPolicy

    dev = data.q.device
    b, t, hq, hk, d = shape.batch, shape.tokens, shape.n_q_heads, shape.n_kv_heads, shape.head_dim
    w, p = data.spec.width, data.spec.page_size
    reader = TritonReader(data.codec, ReadPolicy.flexible(rate, share))
    plan = reader.plan(b, t, dev)
    scale = 1.0 / math.sqrt(d)
    kp, vp = data.cache.k_pool[0], data.cache.v_pool[0]
    reader.run(plan, data.q.float(), kp, vp, data.page_table, data.lengths, 0, scale)
    torch.cuda.synchronize()
    ref_lg = plan.logits.clone()
    c = reader._consts[plan.device]
    slots = data.page_table.shape[2]
    fma_warps = max(1, min(reader.num_warps, plan.key_ch * plan.pages_per_program * p // 256))

    def fma() -> None:
        _key_stage_f[(b * hk, plan.n_splits)](kp, data.page_table, data.lengths, plan.kord, plan.kcnt, plan.wf,
                                              plan.base, c["tabf"], plan.logits, plan.mstat, plan.sstat, scale, slots,
                                              t, HQ=hq, HKV=hk, G=hq // hk, D=d, W=w, P=p, PPK=plan.pages_per_program,
                                              KLOOP=plan.key_loop, CH=plan.key_ch, num_warps=fma_warps)

    ops = mma_operands(data.codec.tree, plan.kdep, plan.wf, plan.base.view(b, hq), p)
    res = {"shape": shape.name, "rate": rate, "pairs_per_head": 16 * float(ops[2].float().mean())}
    gm_ref = plan.mstat.max(-1).values
    z_ref = (plan.sstat * torch.exp(plan.mstat - gm_ref[..., None])).sum(-1)
    for nw, pf in ((4, 0), (4, 1), (4, 2), (2, 2), (8, 2)):
        n_spl = math.ceil(t / (nw * p))
        lg = torch.full_like(plan.logits, float("nan"))
        ms, ss = torch.empty(b, hq, n_spl, device=dev), torch.empty(b, hq, n_spl, device=dev)

        def mma(lg=lg, ms=ms, ss=ss, nw=nw, pf=pf) -> None:
            key_stage_mma(kp, data.page_table, data.lengths, ops, lg, ms, ss, scale, hq, num_warps=nw, prefetch=pf)

        mma()
        torch.cuda.synchronize()
        tag = f"mma_w{nw}_pf{pf}"
        res[f"{tag}_logit_err"] = float(((lg - ref_lg).abs() / ref_lg.abs().clamp(min=1.0)).max())
        gm = ms.max(-1).values
        z = (ss * torch.exp(ms - gm[..., None])).sum(-1)
        res[f"{tag}_stat_err"] = float(max((gm - gm_ref).abs().max(), ((z - z_ref) / z_ref).abs().max()))
        res[f"{tag}_ms"], _ = _time_graphs([mma], reps)
    res["fma_ms"], _ = _time_graphs([fma], reps)
    return res


def _probe_reader(data, shape, rate: float, share: float, reps: int) -> dict:  # noqa: ANN001
    """The whole decode step with the linear codebook: the reader with its bit-product Key stage
    (default on the GPU) and with ``key_mma=False`` (the FMA Key stage), each checked against the
    reference reader at full size and timed (median of graph replays), with the per-kernel timeline."""
    from planekv.kernels import TritonReader
    from planekv.kernels.bench import _check, _time_graphs, _timeline_or_error
    from planekv.kvstore import ReadPolicy

    res: dict = {"shape": shape.name, "rate": rate}
    for mma in (True, False):
        reader = TritonReader(data.codec, ReadPolicy.flexible(rate, share))
        reader.key_mma = mma
        plan = reader.plan(shape.batch, shape.tokens, data.q.device)
        assert plan.key_mma == mma
        tag = "mma" if mma else "fma"
        res[f"{tag}_check"] = _check(reader, plan, data, data.codec)
        kp, vp = data.cache.k_pool[0], data.cache.v_pool[0]

        def step(reader=reader, plan=plan, kp=kp, vp=vp) -> None:
            reader.run(plan, data.q, kp, vp, data.page_table, data.lengths, 0)

        res[f"{tag}_ms"], graphs = _time_graphs([step], reps)
        res[f"{tag}_timeline"] = _timeline_or_error(graphs[0])
    return res


def _emit(rows: list[dict], res: dict) -> None:
    """Print a result row as one JSON line (progress while a call runs) and keep it."""
    import json

    print(json.dumps(res), flush=True)
    rows.append(res)


def _write(rows: list[dict], out: str | None) -> int:
    import json

    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def ragged_main(out: str | None, settings: str = "", v_run: int = 1) -> int:
    """Whole reader steps with the bit-product Key stage forced on (``key_mma=True``) over sequences
    of ragged lengths (mid-page ends, one token, shorter than one 512-token split), every sequence
    checked against the reference reader, for each shape and both readers' flexible rates; ``settings``
    (``name=value,...``) set on each reader first; ``v_run``: the format's V layout (FormatSpec.v_run)."""

    from planekv.kernels import TritonReader
    from planekv.kernels.bench import SHAPES, _check, _gen, apply_settings, parse_settings
    from planekv.kvstore import ReadPolicy

    rows = []
    cases = {"b32-t32k": [32768, 32767, 20001, 513, 64, 1, 4095, 12345], "b1-t8k": [5000],
             "smollm2-b32-t8k": [8192, 8191, 3000, 511, 65, 2, 4097, 7000], "d256-b32-t32k": [32768, 777, 31000]}
    for name, lens in cases.items():
        shape = SHAPES[name]
        data = _gen(shape, torch.device("cuda"), 0, None, codebook="uniform-linear-c3", v_run=v_run)
        data.lengths[: len(lens)] = torch.tensor(lens, dtype=torch.int32, device=data.lengths.device)
        for pol in (ReadPolicy.flexible(2.0, 0.875), ReadPolicy.flexible(4.0, 0.75),
                    ReadPolicy.flexible(2.0, 0.875, key_refine=0.3)):
            reader = TritonReader(data.codec, pol)
            reader.key_mma = True
            apply_settings(reader, parse_settings(settings))
            plan = reader.plan(shape.batch, shape.tokens, data.q.device)
            _emit(rows, {"shape": name, "settings": settings, "v_run": v_run, "rate": pol.rate,
                         "key_refine": pol.key_refine, "key_mma": plan.key_mma,
                         **_check(reader, plan, data, data.codec, n_seq=len(lens))})
    return _write(rows, out)


def gpu_main(shapes: list[str], reps: int, out: str | None, reader_steps: bool = False) -> int:
    """On the GPU: for each shape and rate, the flexible reader's step with the linear codebook, then
    the FMA Key stage (as the reader launches it) and :func:`_key_stage_mma` on its operands: logits
    and global softmax statistics compared, each timed alone (median of CUDA-graph replays), SDPA
    timed in the same run."""

    from planekv.kernels.bench import SHAPES, _gen, _time_graphs

    rows = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for name in shapes:
        shape = SHAPES[name]
        data = _gen(shape, torch.device("cuda"), 0, None, codebook="uniform-linear-c3")
        qs = data.q[:, :, None]
        sdpa_ms, _ = _time_graphs([lambda data=data, qs=qs: sdpa(qs, data.k, data.v, enable_gqa=True)], reps)
        for rate, share in ((2.0, 0.875), (4.0, 0.75)):
            probe = _probe_reader if reader_steps else _probe_rate
            _emit(rows, {"sdpa_ms": sdpa_ms, **probe(data, shape, rate, share, reps)})
    return _write(rows, out)


def main() -> int:
    import argparse
    import os
    import re
    import runpy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="check and time the mma probe on the GPU")
    ap.add_argument("--shapes", nargs="+", default=["b32-t32k"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--reader", action="store_true", help="with --gpu: whole reader steps, key_mma on and off")
    ap.add_argument("--ragged", action="store_true", help="on the GPU: ragged-length steps checked, key_mma on")
    ap.add_argument("--set", default="", help="with --ragged: reader settings name=value[,name=value]")
    ap.add_argument("--v-run", type=int, default=1, choices=(1, 2, 4, 8),
                    help="with --ragged: the format's V layout")
    args = ap.parse_args()
    if args.ragged:
        return ragged_main(args.json, args.set, args.v_run)
    if args.gpu:
        return gpu_main(args.shapes, args.reps, args.json, args.reader)

    cc = runpy.run_path(os.path.join(os.path.dirname(__file__), "compile_check.py"), run_name="compile_check")
    sig = dict(kb_ptr="*u8", pt_ptr="*i32", len_ptr="*i32", plist_ptr="*i32", pcnt_ptr="*i32", vhi_ptr="*fp16",
               vlo_ptr="*fp16", base_ptr="*fp32", logit_ptr="*fp32", mstat_ptr="*fp32", sstat_ptr="*fp32",
               scale="fp32", SLOTS="i32", TMAX="i32", KMAX="i32")
    geo = dict(HQ=32, HKV=8, G=4, D=128, W=8, P=64)
    runs = [("tl.dot", _key_stage_lin, sig, dict(geo, PPK=ppk), nw, ppk * 64 * KCH // (32 * nw))
            for ppk, nw in ((2, 4), (4, 4), (16, 8))]
    sig_mma = dict(kb_ptr="*u8", pt_ptr="*i32", len_ptr="*i32", off_ptr="*i32", vf_ptr="*i32", nst_ptr="*i32",
                   base_ptr="*fp32", logit_ptr="*fp32", mstat_ptr="*fp32", sstat_ptr="*fp32", scale="fp32",
                   SLOTS="i32", TMAX="i32", SMAX="i32")
    runs += [("mma fragments", _key_stage_mma, sig_mma, dict(geo, NWARP=nw, PREFETCH=pf), nw, 64 * KCH // 32)
             for nw, pf in ((4, 0), (8, 2))]
    with __import__("tempfile").TemporaryDirectory() as sd:
        for i, (name, fn, sg, consts, nw, bits) in enumerate(runs):
            cc["compile_one"](fn, sg, consts, num_warps=nw, sass_dir=sd, tag=f"-{i}")
            sass = open(os.path.join(sd, f"{fn.__name__}-{i}.sass")).read()
            # the K loop: the backward branch's target .. the branch
            back = [(int(a, 16), int(t, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4})\*/\s+@!?P\d BRA 0x([0-9a-f]+)",
                                                                     sass) if int(t, 16) < int(a, 16)]
            end, start = back[0]
            n_instr = (end - start) // 16 + 1
            extra = {k: v for k, v in consts.items() if k in ("PPK", "NWARP", "PREFETCH")}
            print(f"{name} {extra}, {nw} warps: {n_instr} instructions per K step, {bits} bits per thread: "
                  f"{n_instr / bits:.1f} per bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
