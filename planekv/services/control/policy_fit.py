"""Does a placement policy fit its GPU tier? The one check every policy route (create, update, activate,
rollback) and the cache registry (``PUT /v1/caches/{sequence_id}``) run before they write.

A policy's hot planes of every cache registered under its name with ``n_tokens`` (each cache in its own
format's geometry, :func:`planekv.tiering.placement.hot_bytes`) must fit the policy's ``gpu`` tier
(``capacity_bytes``). A policy without a ``gpu`` tier, or with no such caches, is not checked. A policy that
does not fit raises :class:`PolicyDoesNotFit` (409) before anything is written, so the active version stays.

The check reads, then the route's Lua script writes: two requests racing (a cache registered while a policy
is activated) can each pass alone; the registry has no transaction across them today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from ...kvstore import FormatSpec
from ...tiering.errors import PolicyDoesNotFit
from ...tiering.placement import PlacementPolicy, hot_bytes
from .. import index as ix

GiB = 1 << 30
LISTED = 5  # caches named one by one in a refusal; the rest are counted


@dataclass(frozen=True)
class CacheLoad:
    """A registered cache as the check counts it: its format and length."""

    sequence_id: str
    format_id: str
    n_tokens: int


def _gib(n: int) -> str:
    return f"{n} bytes ({n / GiB:.2f} GiB)"


async def caches_under(redis: aioredis.Redis, policy_name: str) -> list[CacheLoad]:
    """The caches registered under ``policy_name`` with ``n_tokens`` (a scan of the cache registry)."""
    seqs = await redis.zrange(ix.K_CACHES, 0, -1)
    p = redis.pipeline(transaction=False)
    for s in seqs:
        p.hmget(ix.k_cache(s), "policy", "format_id", "n_tokens")
    rows = await p.execute() if seqs else []
    return [CacheLoad(s, fid, int(n)) for s, (pol, fid, n) in zip(seqs, rows, strict=True)
            if pol == policy_name and fid and n]


async def check_fit(redis: aioredis.Redis, name: str, policy: PlacementPolicy, what: str,
                    cache: CacheLoad | None = None) -> None:
    """Raise :class:`PolicyDoesNotFit` unless ``policy`` (as policy ``name``) fits its GPU tier with the caches
    registered under ``name``; ``cache``, when given, is counted in place of that sequence's registration (a
    registration being checked). ``what`` opens the message (e.g. "version 3 of policy p")."""
    gpu = policy.capacity("gpu")
    if gpu is None:
        return
    loads = [c for c in await caches_under(redis, name) if cache is None or c.sequence_id != cache.sequence_id]
    if cache is not None:
        loads.append(cache)
    if not loads:
        return
    fids = sorted({c.format_id for c in loads})
    p = redis.pipeline(transaction=False)
    for fid in fids:
        p.hget(ix.k_format(fid), "spec")
    specs = {fid: FormatSpec.from_dict(json.loads(raw))
             for fid, raw in zip(fids, await p.execute(), strict=True) if raw}
    need: list[tuple[CacheLoad, int]] = []
    for c in loads:
        spec = specs.get(c.format_id)
        if spec is None:  # formats are never deleted; a registration names a registered one
            continue
        try:
            need.append((c, hot_bytes(policy, spec, c.n_tokens)))
        except ValueError as exc:
            raise PolicyDoesNotFit(f"{what} cannot apply to cache {c.sequence_id} (format {c.format_id}), which "
                                   f"is registered under policy {name}: {exc}; nothing was changed") from None
    total = sum(b for _, b in need)
    if total <= gpu:
        return
    need.sort(key=lambda cb: -cb[1])
    listed = ", ".join(f"{c.sequence_id} (format {c.format_id}, {c.n_tokens} tokens, {b} bytes)"
                       for c, b in need[:LISTED])
    more = f" and {len(need) - LISTED} more" if len(need) > LISTED else ""
    h = policy.hot_planes
    raise PolicyDoesNotFit(
        f"{what} does not fit its gpu tier: the hot planes (default k={h.k}, v={h.v}"
        f"{f', {len(policy.layer_overrides)} layer overrides' if policy.layer_overrides else ''}) of the "
        f"{len(need)} caches counted under policy {name} need {_gib(total)}, the gpu tier holds {_gib(gpu)}; "
        f"caches counted: {listed}{more}. Lower the hot planes, raise the gpu tier's capacity_bytes, or register "
        f"fewer tokens (n_tokens) under this policy; nothing was changed")
