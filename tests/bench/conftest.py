"""Kernel tests run Triton's interpreter on CPU tensors; it must be on before triton.jit runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
