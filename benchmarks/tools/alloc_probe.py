"""Probe for a one- or two-pass Value allocation: what a wide histogram of the Value keys costs.

    PYTHONPATH=. python benchmarks/tools/alloc_probe.py --shape b32-t32k [--reps 20]

The Value allocation of the Triton reader finds lambda with 8 radix passes of 4 bits each
(``tl.histogram`` with 16 bins per pass; docs/KERNEL_NOTES.md). Fewer passes need wider digits.
This probe takes the Value importances of one real decode step of the benchmark's data (a
``TritonReader`` run) and times, per variant, one pass over them (CUDA events, median):

- ``hist16``: the current pass, ``tl.histogram`` of the top 4 bits of the KS keys of every token;
- ``hist2048``: ``tl.histogram`` of an 11-bit digit of the keys (2048 bins), one pass;
- ``atomic2048``: the same 11-bit digit counted by global atomic adds (one per key);
- ``atomic2048_imp``: 2048 bins of the importances alone (one atomic per token; the KS keys of a
  token are its importance times KS fixed gains, so their counts follow from this histogram shifted
  by each gain, up to the bin width);

and reports how many keys share the bin of lambda at 11 bits (what a second, exact pass would
still have to resolve).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from planekv.kernels import TritonReader
from planekv.kernels.bench import SHAPES, _gen, _policy


@triton.jit
def _probe_hist(vimp_ptr, r_ptr, out_ptr, T, TMAX, BLK: tl.constexpr, KS_PAD: tl.constexpr, NB: tl.constexpr,
                SHIFT: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: tl.histogram of key >> SHIFT into NB bins (keys = imp x r_k); MODE 1: atomics per key;
    MODE 2: atomics per token of imp >> SHIFT."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    pos = blk * BLK + tl.arange(0, BLK)
    ok = pos < T
    imp = tl.load(vimp_ptr + row * TMAX + pos, mask=ok, other=0.0)
    if MODE == 2:
        dig = imp.to(tl.int32, bitcast=True) >> SHIFT
        tl.atomic_add(out_ptr + row * NB + dig, 1, mask=ok)
    else:
        kk = tl.arange(0, KS_PAD)
        r = tl.load(r_ptr + kk)
        key = (imp[None, :] * r[:, None]).to(tl.int32, bitcast=True)
        dig = key >> SHIFT
        msk = ok[None, :] & (r[:, None] > 0)
        if MODE == 0:
            h = tl.histogram(tl.reshape(dig, [KS_PAD * BLK]), NB, mask=tl.reshape(msk, [KS_PAD * BLK]))
            bins = tl.arange(0, NB)
            tl.atomic_add(out_ptr + row * NB + bins, h, mask=h > 0)
        else:
            tl.atomic_add(out_ptr + row * NB + dig, 1, mask=msk)


def _time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="b32-t32k", choices=sorted(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    s = _gen(SHAPES[args.shape], dev, 0, None)
    t = s.k.shape[2]
    reader = TritonReader(s.codec, _policy("readkv-flex-r2", None))
    plan = reader.plan(s.q.shape[0], t, dev)
    reader.run(plan, s.q, s.cache.k_pool[0], s.cache.v_pool[0], s.page_table, s.lengths, 0)
    # the importances of this step (the Value stage leaves them in plan.vimp), and the exact lambda
    # (the last radix selection's prefix) of the first group
    vimp = plan.vimp.reshape(-1, plan.max_tokens).contiguous()
    rows = vimp.shape[0]
    r = reader._on(dev)["rv"]
    ks_pad = r.numel()
    blk = 1024
    grid = (rows, triton.cdiv(t, blk))
    variants = {"hist16": (0, 16, 27), "hist2048": (0, 2048, 20), "atomic2048": (1, 2048, 20),
                "atomic2048_imp": (2, 2048, 20)}
    res = {}
    for name, (mode, nb, shift) in variants.items():
        out = torch.zeros(rows, nb, dtype=torch.int32, device=dev)

        def step(mode=mode, nb=nb, shift=shift, out=out):
            out.zero_()
            _probe_hist[grid](vimp, r, out, t, plan.max_tokens, BLK=blk, KS_PAD=ks_pad, NB=nb, SHIFT=shift, MODE=mode,
                              num_warps=4)

        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            res[name] = _time(step, args.reps)
        total = int(out.sum())
        res[name + "_count"] = total
    keys = (vimp[: reader.codec.spec.n_kv_heads][..., :t, None] * r[None, None, :]).flatten()
    keys = keys[r.repeat(reader.codec.spec.n_kv_heads * t) > 0]
    lam = float(torch.sort(keys, descending=True).values[int(plan.vdep[0].long().sum()) - 1])
    bits = torch.tensor([lam], dtype=torch.float32).view(torch.int32).item() >> 20
    same = int(((keys.view(torch.int32) >> 20) == bits).sum())
    print(f"shape {args.shape}, {rows} (sequence, KV head) rows x {t} tokens, KS = {int((r > 0).sum())}")
    for name in variants:
        ms = res.get(name)
        timing = f"{ms:.4f} ms" if ms is not None else "(not timed on CPU)"
        print(f"{name}: {timing}, counted {res[name + '_count']}")
    print(f"group 0: {keys.numel()} keys, {same} of them in lambda's 11-bit bin ({100 * same / keys.numel():.2f}%)")
    count = int(plan.vdep[0].long().sum())
    lo, hi, n_cand = bracket(vimp[: reader.codec.spec.n_kv_heads][..., :t].flatten(), r[r > 0], count)
    ok = lo < lam <= hi
    print(f"conservative bracket from the 2048-bin importance histogram: ({lo:.4e}, {hi:.4e}], lambda "
          f"{lam:.4e} {'inside' if ok else 'OUTSIDE'}; {n_cand} candidate keys ({100 * n_cand / keys.numel():.2f}%)")


def bracket(imp: torch.Tensor, r: torch.Tensor, count: int, shift: int = 20) -> tuple[float, float, int]:
    """(L_lo, L_hi] holding lambda (the count-th largest key imp_i x r_k), found from the histogram of
    the importances' top bits alone, with one bin of margin on each side for the float32 product's
    rounding; and how many keys fall inside (what an exact second pass would have to rank)."""
    nb = 1 << (31 - shift)
    bins = (imp.float().contiguous().view(torch.int32) >> shift).long()
    hist = torch.bincount(bins, minlength=nb)
    above = torch.cat([hist.flip(0).cumsum(0).flip(0), hist.new_zeros(1)]).cpu()  # above[b] = #{bin >= b}

    def bound(x: int, margin: int) -> int:  # keys > x (bit pattern), counted at bin edges
        y = (torch.tensor([x], dtype=torch.int32).view(torch.float32) / r.float().cpu()).view(torch.int32)
        b = (y.long() >> shift) + margin
        return int(above[b.clamp(0, nb)].sum())

    def search(pred) -> int:  # smallest bit pattern x in [0, 0x7F800000] with pred(x), pred monotone
        a, z = 0, 0x7F800000
        while a < z:
            mid = (a + z) // 2
            a, z = (a, mid) if pred(mid) else (mid + 1, z)
        return a

    hi = search(lambda x: bound(x, -1) < count)  # surely fewer than count keys above: lambda <= hi
    lo = search(lambda x: bound(x, 2) < count) - 1  # the largest x that surely has >= count above
    lo_f, hi_f = (torch.tensor([v], dtype=torch.int32).view(torch.float32).item() for v in (max(lo, 0), hi))
    keys = (imp.float()[:, None] * r.float()[None, :]).flatten().cpu()
    return lo_f, hi_f, int(((keys > lo_f) & (keys <= hi_f)).sum())


if __name__ == "__main__":
    main()
