"""PlaneKV: a KV-cache store for long-context LLM decoding.

Subpackages (dependencies point down): ``kvstore`` (format, codec, layout, allocator, reference
reader, baselines, accounting) is the ground; ``kernels`` and ``tiering`` build on it; ``services``
on tiering; ``orchestration`` on all; ``cli`` on top.
"""

__version__ = "0.1.0"
