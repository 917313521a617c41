"""One tiered decode step of one layer (the torch reference of docs/TIERING.md's read path).

The step reads within the cache's residency at the moment of the read (``TieredCache.residency``: hot planes, the
open page, the promotion cache), counts what it capped, then lets the prefetcher promote what it asked for past
the hot planes, for the next step of this layer. On the GPU the promotions are copies on their own stream that the
next step's allocations see if they have landed; here they land at once (the same plan, the same caps when they
do).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kvstore import Codec, ReadPolicy
from ..kvstore.reference import readkv_decode
from ..kvstore.stats import ReadStats
from .prefetch import Prefetcher, StepTally
from .tiered_cache import TieredCache

Read = Callable[[torch.Tensor, TieredCache, int, float | None], tuple[torch.Tensor, ReadStats]]


def tiered_decode_step(q: torch.Tensor, cache: TieredCache, layer: int, codec: Codec, policy: ReadPolicy,
                       prefetcher: Prefetcher | None = None, tally: StepTally | None = None,
                       scale: float | None = None, read: Read | None = None) -> tuple[torch.Tensor, ReadStats]:
    """q [B, Hq, d] -> out [B, Hq, d] (float32), stats (with caps, see ``readkv_rows``); then prefetch. ``read``
    (q, cache, layer, scale) -> (out, stats) replaces the reference read (e.g. ``TritonReader.decode_tiered``)."""
    residency = cache.residency(layer)
    if read is None:
        out, stats = readkv_decode(q, cache, layer, codec, policy, scale=scale, residency=residency)
    else:
        out, stats = read(q, cache, layer, scale)
    if tally is not None:
        tally.add(layer, stats, cache.hot_k[layer], cache.hot_v[layer], codec.spec.page_size)
    if prefetcher is not None:
        plan = prefetcher.run(cache, layer, stats, residency)
        if tally is not None:
            tally.fetched_for_next(layer, plan)
    return out, stats
