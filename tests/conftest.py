"""Suite-wide: without a GPU, Triton kernels run in Triton's interpreter. The variable must be set
before any test module imports planekv.kernels (triton.jit reads it at decoration time)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
