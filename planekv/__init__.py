"""PlaneKV: a KV-cache store for long-context LLM decoding.

Subpackages (dependencies point down; tests/test_import_graph.py): ``kvstore`` (format, codec, layout,
allocator, reference reader, baselines, accounting) is the ground; ``kernels`` and ``tiering`` build on
it; ``services`` (on tiering) and ``models`` (on kernels) side by side; ``evaluation`` on models;
``bench`` and ``orchestration`` on all of those; ``demo`` and ``cli`` on top.
"""

__version__ = "0.1.0"
