"""Where kernels run: on a CUDA device, or through Triton's interpreter on CPU tensors.

The interpreter is chosen by ``TRITON_INTERPRET=1`` *before* the kernel modules are imported
(Triton reads it when ``@triton.jit`` runs); tests set it in their conftest.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> torch.device:
    """All tensors on one device that can run the kernels; raises with what to do otherwise."""
    devs = {t.device for t in tensors}
    if len(devs) != 1:
        raise ValueError(f"kernel inputs are on several devices: {sorted(map(str, devs))}")
    dev = devs.pop()
    if dev.type == "cuda":
        return dev
    if dev.type == "cpu" and interpreting():
        return dev
    raise RuntimeError(
        f"Triton kernels need CUDA tensors (got {dev}); on a CPU set TRITON_INTERPRET=1 before importing "
        "planekv.kernels to run them in Triton's interpreter, or use planekv.kvstore.reference")
