"""One tiered decode step of one layer (the torch reference of docs/TIERING.md's read path).

The step reads within the cache's residency at the moment of the read (``TieredCache.residency``: hot planes, the
open page, the promotion cache), counts what it capped, then lets the prefetcher promote what it asked for past
the hot planes, for the next step of this layer. The promotions are copies made before the call returns, on the
current stream (a copy stream of their own is not built; docs/TIERING.md, "What is next").

Deadline: with ``ReadPolicy.deadline_ms`` (or ``deadline``, a ``time.monotonic()`` time) the step's prefetch brings
from the remote tier only what arrives by the deadline, counted from the step's start; what does not is left for a
later step and read at the resident depth meanwhile (a cap, counted). The read itself never waits on a tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..kvstore import Codec, ReadPolicy, Residency
from ..kvstore.reference import readkv_decode
from ..kvstore.stats import ReadStats
from .prefetch import Prefetcher, StepTally
from .tiered_cache import TieredCache

Read = Callable[[torch.Tensor, TieredCache, int, float | None], tuple[torch.Tensor, ReadStats]]


def tiered_decode_step(q: torch.Tensor, cache: TieredCache, layer: int, codec: Codec, policy: ReadPolicy,
                       prefetcher: Prefetcher | None = None, tally: StepTally | None = None,
                       scale: float | None = None, read: Read | None = None,
                       deadline: float | None = None,
                       residency: Residency | None = None) -> tuple[torch.Tensor, ReadStats]:
    """q [B, Hq, d] -> out [B, Hq, d] (float32), stats (with caps, see ``readkv_rows``); then prefetch. ``read``
    (q, cache, layer, scale) -> (out, stats) replaces the reference read (e.g. ``TritonReader.decode_tiered``).
    ``deadline`` (``time.monotonic()`` seconds; default: the step's start plus ``policy.deadline_ms``, if set):
    remote fetches of the prefetch that do not arrive by then are skipped (the module docstring). ``residency``:
    ``cache.residency(layer)`` if the caller has it already (a caller that runs the prefetch itself)."""
    deadline = step_deadline(policy, deadline)
    if residency is None:
        residency = cache.residency(layer)
    if read is None:
        out, stats = readkv_decode(q, cache, layer, codec, policy, scale=scale, residency=residency)
    else:
        out, stats = read(q, cache, layer, scale)
    if tally is not None:
        tally.add(layer, stats, cache.hot_k[layer], cache.hot_v[layer], codec.spec.page_size)
    if prefetcher is not None:
        plan = prefetcher.run(cache, layer, stats, residency, deadline=deadline)
        if tally is not None:
            tally.fetched_for_next(layer, plan)
    return out, stats


def step_deadline(policy: ReadPolicy, deadline: float | None = None) -> float | None:
    """The step's deadline (``time.monotonic()`` seconds): ``deadline`` if given, else ``policy.deadline_ms`` from
    now, else None."""
    if deadline is None and policy.deadline_ms is not None:
        return time.monotonic() + policy.deadline_ms / 1e3
    return deadline
