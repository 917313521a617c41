"""planekv.kernels: the Triton decode read (ReadKV's two stages and Key refinement), the encode/append kernel
and the FP8 baseline, with their launchers; the GPU, or Triton's interpreter on CPU tensors.

Builds on kvstore only. Set ``TRITON_INTERPRET=1`` before importing this package to run the kernels on CPU
tensors. docs/KERNELS.md maps each stage to its kernel family and file.
"""

from .config import ReaderConfig, StepChoices
from .encode import Encoder
from .fp8 import FP8Decode, quantize_fp8
from .plan import Plan
from .reader import TritonReader, readkv_decode, readkv_decode_rows

__all__ = ["Encoder", "FP8Decode", "Plan", "ReaderConfig", "StepChoices", "TritonReader", "quantize_fp8",
           "readkv_decode", "readkv_decode_rows"]
