"""planekv.models: running real language models with PlaneKV (transformers integration).

Sits above ``kvstore`` (and ``kernels``, whose reader plugs into ``hf.READERS``); ``evaluation``
builds on it. Importing it needs the ``eval`` extra (transformers, gguf, accelerate).
"""

from .hf import (
    ATTN_IMPLEMENTATION,
    READERS,
    Geometry,
    LoadedModel,
    PlaneKVHFCache,
    ReadTally,
    Tiering,
    format_spec,
    geometry,
    get_reader,
    load_model,
    make_cache,
    register_attention,
    smollm2_gguf,
    teacher_forced,
    use_planekv_attention,
)

__all__ = [
    "ATTN_IMPLEMENTATION", "READERS", "Geometry", "LoadedModel", "PlaneKVHFCache", "ReadTally", "Tiering",
    "format_spec", "geometry", "get_reader", "load_model", "make_cache", "register_attention", "smollm2_gguf",
    "teacher_forced", "use_planekv_attention",
]
