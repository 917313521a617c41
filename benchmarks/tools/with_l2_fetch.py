"""Run a Python script with the device's L2 fetch granularity set (``cudaLimitMaxL2FetchGranularity``).

    PYTHONPATH=. python benchmarks/tools/with_l2_fetch.py 32 benchmarks/tools/ab_knobs.py --shapes b32-t32k ...

The first argument is the granularity in bytes (0-128, a hint to the driver; ``none`` leaves it as it is),
the rest is the script and its arguments, run in this process after the limit is set on the current CUDA
context (the one torch uses), so that every kernel the script launches runs under it. The granularity
before and after is printed. KERNEL_NOTES run 110 measured the stages at 32, 64 (the default) and 128 bytes.
"""

from __future__ import annotations

import ctypes
import glob
import os
import runpy
import sys

import torch

LIMIT_MAX_L2_FETCH_GRANULARITY = 0x05  # cudaLimit enum value


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch loaded (its wheel's copy where there is one)."""
    root = os.path.dirname(torch.__file__)
    for pat in ("../nvidia/cu*/lib/libcudart.so*", "../nvidia/cuda_runtime/lib/libcudart.so*", "lib/libcudart*.so*"):
        found = sorted(glob.glob(os.path.join(root, pat)))
        if found:
            return ctypes.CDLL(found[0])
    return ctypes.CDLL("libcudart.so")


def main() -> int:
    if len(sys.argv) < 3:
        raise SystemExit("usage: with_l2_fetch.py BYTES|none SCRIPT [ARGS...]")
    gran, script = sys.argv[1], sys.argv[2]
    if gran != "none" and not (gran.isdigit() and 0 <= int(gran) <= 128):
        raise SystemExit(f"the granularity is 0-128 bytes or 'none', got {gran!r}")
    if not torch.cuda.is_available():
        raise SystemExit("with_l2_fetch.py needs a GPU")
    torch.zeros(1, device="cuda")  # the primary context, as the script will use it
    rt = _cudart()
    val = ctypes.c_size_t(0)
    if rt.cudaDeviceGetLimit(ctypes.byref(val), LIMIT_MAX_L2_FETCH_GRANULARITY) != 0:
        raise SystemExit("cudaDeviceGetLimit failed")
    print(f"L2 fetch granularity: {val.value} bytes", flush=True)
    if gran != "none":
        if rt.cudaDeviceSetLimit(LIMIT_MAX_L2_FETCH_GRANULARITY, ctypes.c_size_t(int(gran))) != 0:
            raise SystemExit("cudaDeviceSetLimit failed")
        rt.cudaDeviceGetLimit(ctypes.byref(val), LIMIT_MAX_L2_FETCH_GRANULARITY)
        print(f"L2 fetch granularity now: {val.value} bytes", flush=True)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
