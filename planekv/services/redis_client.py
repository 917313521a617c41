"""How both services connect to Redis: authenticated, every command bounded in time, retried only to reconnect.

The password comes from ``redis_password_file`` (a file, so it is in no command line or environment listing) or,
failing that, from the URL itself (``redis://:PASSWORD@host:port/db``); a URL is logged and reported only through
``redact_url`` (:mod:`planekv.services.redis_auth`). :func:`check_redis` runs before a service starts serving, so a
missing password file, a wrong password or an unreachable Redis stops it with one line naming the cause, not a
stack trace.

A restarted Redis leaves dead pooled connections: a command that fails with a connection error is
retried on a new connection (twice, short backoff). A *hung* Redis (stopped, swapping) is not
retried: the command fails after one ``REDIS_TIMEOUT_S`` and the route answers 503, instead of the
client library's default of four timed-out attempts.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ..settings import Settings
from .redis_auth import RedisPasswordError, read_password_file, redact_url

__all__ = ["RedisPasswordError", "check_redis", "redact_url", "redis_async", "redis_sync"]

REDIS_TIMEOUT_S = 5.0  # one command, seconds
REDIS_CONNECT_TIMEOUT_S = 3.0
RECONNECT_RETRIES = 2


def _connection_kwargs(settings: Settings) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                  decode_responses=True)
    if settings.redis_password_file is not None:
        if urlsplit(settings.redis_url).password is not None:
            raise RedisPasswordError(f"the Redis URL {redact_url(settings.redis_url)} carries a password and "
                                     f"redis_password_file ({settings.redis_password_file}) names another: give "
                                     "the password one way")
        kwargs["password"] = read_password_file(settings.redis_password_file)
    return kwargs


def redis_sync(settings: Settings) -> redis.Redis:
    """A client of ``settings.redis_url``, authenticated (RedisPasswordError if the password file is unusable)."""
    return redis.Redis.from_url(
        settings.redis_url, **_connection_kwargs(settings),
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RECONNECT_RETRIES,
                    supported_errors=(redis.ConnectionError,)))


def redis_async(settings: Settings) -> aioredis.Redis:
    """The asyncio twin of :func:`redis_sync`."""
    return aioredis.Redis.from_url(
        settings.redis_url, **_connection_kwargs(settings),
        retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), RECONNECT_RETRIES,
                         supported_errors=(redis.ConnectionError,)))


def check_redis(service: str, settings: Settings) -> None:
    """Raise SystemExit with one line saying what to fix unless Redis answers PING with these settings' password."""
    where = redact_url(settings.redis_url)
    try:
        client = redis_sync(settings)
    except RedisPasswordError as exc:
        raise SystemExit(f"the {service} cannot start: {exc}") from None
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        source = _password_source(settings)
        if source is None:
            raise SystemExit(f"the {service} cannot start: Redis at {where} requires a password ({exc}); set "
                             "PLANEKV_REDIS_PASSWORD_FILE to a file holding it") from None
        raise SystemExit(f"the {service} cannot start: Redis at {where} refused the password {source} ({exc}); "
                         "it must hold Redis's requirepass") from None
    except redis.RedisError as exc:
        raise SystemExit(f"the {service} could not reach Redis at {where} ({exc}); start redis-server or set "
                         "PLANEKV_REDIS_URL") from None
    finally:
        client.close()


def _password_source(settings: Settings) -> str | None:
    if settings.redis_password_file is not None:
        return f"from the file {settings.redis_password_file}"
    return "given in the URL" if urlsplit(settings.redis_url).password is not None else None
