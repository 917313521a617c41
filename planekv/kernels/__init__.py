"""planekv.kernels: Triton decode kernels (encode/append, Key stage, Value allocation, Value stage),
dense and baseline kernels, and dispatch (GPU, or Triton's interpreter on CPU). Builds on kvstore.

Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU tensors.
"""

from .reader import Plan, TritonReader, readkv_decode

__all__ = ["Plan", "TritonReader", "readkv_decode"]
