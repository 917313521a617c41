"""How both services connect to Redis: every command bounded in time, retried only to reconnect.

A restarted Redis leaves dead pooled connections: a command that fails with a connection error is
retried on a new connection (twice, short backoff). A *hung* Redis (stopped, swapping) is not
retried: the command fails after one ``REDIS_TIMEOUT_S`` and the route answers 503, instead of the
client library's default of four timed-out attempts.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

REDIS_TIMEOUT_S = 5.0  # one command, seconds
REDIS_CONNECT_TIMEOUT_S = 3.0
RECONNECT_RETRIES = 2


def redis_sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S, decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RECONNECT_RETRIES,
                    supported_errors=(redis.ConnectionError,)))


def redis_async(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S, decode_responses=True,
        retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), RECONNECT_RETRIES,
                         supported_errors=(redis.ConnectionError,)))
