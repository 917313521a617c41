"""The control plane's Redis Lua scripts: each metadata update that must be atomic (check, then
write) runs as one script. The sources are the ``lua/*.lua`` files of this package; each file's
header says its KEYS, ARGV and answers."""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import resources

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript


def lua_source(name: str) -> str:
    """The source of ``lua/<name>.lua`` (shipped as package data)."""
    return (resources.files(__package__) / "lua" / f"{name}.lua").read_text()


@dataclass(frozen=True)
class ControlScripts:
    """Every script, registered on one Redis client (``await scripts.format_put(keys=..., args=...)``).
    A field's name is its file's name."""

    format_put: AsyncScript
    calibration_put: AsyncScript
    policy_create: AsyncScript
    policy_update: AsyncScript
    policy_activate: AsyncScript
    policy_rollback: AsyncScript
    cache_put: AsyncScript
    store_forget: AsyncScript

    @classmethod
    def register(cls, redis: aioredis.Redis) -> ControlScripts:
        return cls(**{f.name: redis.register_script(lua_source(f.name)) for f in fields(cls)})
