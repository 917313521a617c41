"""What the store service's routes share, and how a route gets it.

The app's lifespan builds the block store and puts a :class:`StoreContext` on ``app.state.store``;
a route takes it as a parameter typed :data:`Context` (a FastAPI dependency, invisible in the
OpenAPI schema). The Prometheus registry is on ``app.state.registry`` from the start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from prometheus_client import CollectorRegistry

from ...settings import StoreService
from ...tiering import BlockStore
from .reconcile import Reconciler

if TYPE_CHECKING:
    from ..index import RedisBlockIndex


@dataclass(frozen=True)
class StoreContext:
    config: StoreService  # settings.store
    store_id: str  # this store's name in the block index
    store: BlockStore
    index: RedisBlockIndex | None  # the Redis block index it publishes to (None: disabled)
    reconciler: Reconciler


def store_context(request: Request) -> StoreContext:
    return request.app.state.store


def store_registry(request: Request) -> CollectorRegistry:
    return request.app.state.registry


Context = Annotated[StoreContext, Depends(store_context)]
Registry = Annotated[CollectorRegistry, Depends(store_registry)]
