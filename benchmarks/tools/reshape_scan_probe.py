"""Probe (GPU): a 1-D block reshaped to [rows, cols], scanned and summed along axis 1, against torch.

    python benchmarks/tools/reshape_scan_probe.py

KERNEL_NOTES run 67: a chunked counting sort built this way gave wrong outputs on the GPU while the
interpreter was right; this probe (equal to torch for every case it prints) cleared the reshape and
the scans, leaving the Value stage's per-step minimum path as the suspect.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _k(x_ptr, o1, o2, o3, N: tl.constexpr, C: tl.constexpr, I64: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    if I64:
        x = x.to(tl.int64)
    x2 = tl.reshape(x, [N // C, C])
    c = tl.cumsum(x2, 1)
    s = tl.sum(x2, 1)
    base = tl.cumsum(s, 0) - s
    tl.store(o1 + i, tl.reshape(c, [N]).to(tl.int32))
    tl.store(o2 + tl.arange(0, N // C), s.to(tl.int32))
    tl.store(o3 + i, tl.reshape(c + base[:, None], [N]).to(tl.int32))


def main():
    torch.manual_seed(0)
    for n, c, nw in ((1024, 64, 8), (1024, 128, 8), (1024, 256, 8), (1024, 128, 4), (256, 64, 8)):
        for i64 in (False, True):
            x = torch.randint(0, 3, (n,), dtype=torch.int32, device="cuda")
            o1 = torch.empty(n, dtype=torch.int32, device="cuda")
            o2 = torch.empty(n // c, dtype=torch.int32, device="cuda")
            o3 = torch.empty(n, dtype=torch.int32, device="cuda")
            _k[(1,)](x, o1, o2, o3, N=n, C=c, I64=i64, num_warps=nw)
            x2 = x.view(n // c, c).long()
            w1 = x2.cumsum(1).flatten().int()
            w2 = x2.sum(1).int()
            w3 = (x2.cumsum(1) + (x2.sum(1).cumsum(0) - x2.sum(1))[:, None]).flatten().int()
            print(f"N={n} C={c} warps={nw} int64={i64}: cumsum axis 1 {torch.equal(o1, w1)}, "
                  f"sum axis 1 {torch.equal(o2, w2)}, with row bases {torch.equal(o3, w3)}")


if __name__ == "__main__":
    main()
