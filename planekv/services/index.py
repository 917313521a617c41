"""Redis key schema (metadata only, never block bytes) and the block index the store publishes.

Keys (all under ``pkv:``):

================================  ====================================================================
``pkv:blocks:<sequence_id>``      hash ``<block key>@<store id>`` -> JSON {format_id, size, checksum,
                                  tiers, gen, store}: where each block of a sequence is, per store
``pkv:store:<store id>:keys``     set of this store's fields above (cleared and republished at start)
``pkv:stores``                    hash store id -> JSON {url, capacities, started_at}
``pkv:heartbeats``                hash store id -> Redis time (unix s) of its last heartbeat (every
                                  ``HEARTBEAT_INTERVAL_S``; ``POST /v1/stores/{id}/forget`` needs it old)
``pkv:tierstats``                 hash ``<tier>:blocks`` / ``<tier>:bytes`` over all stores
``pkv:cache:<sequence_id>``       hash: the cache registry entry (format_id, created_at, ...)
``pkv:caches``                    zset of sequence ids by creation time
``pkv:format:<format_id>``        hash {spec (canonical JSON), created_at}; ``pkv:formats`` zset
``pkv:calibration:<id>``          hash of artifact metadata; ``pkv:calibrations`` zset by version
``pkv:policy:<name>`` ...         hash {active, ...}, lists ``:versions``, ``:stack``, ``:history``
================================  ====================================================================

Block index updates are Lua scripts, so the per-tier totals and the entries never disagree, and a
late event of one incarnation of a key (``gen``) cannot touch the next one.

A store that never comes back (killed, its data gone, or restarted under another id: the default id is
host:port) leaves its entries behind, and the control plane refuses to delete their caches. Rule: a
running store writes a heartbeat every ``HEARTBEAT_INTERVAL_S`` (also before it republishes at start);
the control plane forgets a store id, removing its entries, only once that heartbeat is older than a
grace period (``FORGET_GRACE_S`` by default, at least ``FORGET_MIN_GRACE_S``), checked in the same Lua
script that removes them. A live store that was forgotten (stopped longer than the grace) finds its
record gone at its next heartbeat and republishes what it holds.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from ..kvstore.errors import FormatMismatch
from ..tiering.blockstore import BlockInfo

if TYPE_CHECKING:
    from ..settings import Settings

log = logging.getLogger(__name__)

P = "pkv:"
K_STORES = P + "stores"
K_HEARTBEATS = P + "heartbeats"
K_TIERSTATS = P + "tierstats"
K_CACHES = P + "caches"
K_FORMATS = P + "formats"
K_CALIBRATIONS = P + "calibrations"
K_CALIBRATION_SEQ = P + "calibrations:seq"
K_POLICIES = P + "policies"
CHANNEL_POLICY = P + "policy-activated"

HEARTBEAT_INTERVAL_S = 1.0  # a store's heartbeat period (seconds)
FORGET_MIN_GRACE_S = 5.0  # the shortest heartbeat silence after which a store id may be forgotten
FORGET_GRACE_S = 30.0  # the default silence (``POST /v1/stores/{id}/forget?grace_s=``)


def k_blocks(sequence_id: str) -> str:
    return f"{P}blocks:{sequence_id}"


def k_store_keys(store_id: str) -> str:
    return f"{P}store:{store_id}:keys"


def k_cache(sequence_id: str) -> str:
    return f"{P}cache:{sequence_id}"


def k_format(format_id: str) -> str:
    return f"{P}format:{format_id}"


def k_calibration(calibration_id: str) -> str:
    return f"{P}calibration:{calibration_id}"


def k_policy(name: str, part: str = "") -> str:
    return f"{P}policy:{name}" + (f":{part}" if part else "")


# KEYS: blocks hash, store set, tierstats, cache hash, caches zset, format hash
# ARGV: field, value json, size, tiers csv, format_id, sequence_id, now, force ("1": skip the format checks),
#       require ("1": the format must be registered)
_COMMIT = """
if ARGV[8] ~= '1' and ARGV[9] == '1' and redis.call('EXISTS', KEYS[6]) == 0 then
  return redis.error_reply('NOFORMAT')
end
local fid = redis.call('HGET', KEYS[4], 'format_id')
if fid and fid ~= ARGV[5] and ARGV[8] ~= '1' then
  return redis.error_reply('FORMAT ' .. fid)
end
if not fid then
  redis.call('HSET', KEYS[4], 'format_id', ARGV[5], 'created_at', ARGV[7], 'source', 'store')
  redis.call('ZADD', KEYS[5], 'NX', ARGV[7], ARGV[6])
end
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old then
  local o = cjson.decode(old)
  for _, t in ipairs(o.tiers) do
    redis.call('HINCRBY', KEYS[3], t .. ':blocks', -1)
    redis.call('HINCRBY', KEYS[3], t .. ':bytes', -o.size)
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
for t in string.gmatch(ARGV[4], '[^,]+') do
  redis.call('HINCRBY', KEYS[3], t .. ':blocks', 1)
  redis.call('HINCRBY', KEYS[3], t .. ':bytes', tonumber(ARGV[3]))
end
return 1
"""

# KEYS: blocks hash, tierstats; ARGV: field, gen, new value json, new tiers csv
_CHANGE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return 0 end
local o = cjson.decode(old)
if o.gen ~= ARGV[2] then return 0 end
for _, t in ipairs(o.tiers) do
  redis.call('HINCRBY', KEYS[2], t .. ':blocks', -1)
  redis.call('HINCRBY', KEYS[2], t .. ':bytes', -o.size)
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
for t in string.gmatch(ARGV[4], '[^,]+') do
  redis.call('HINCRBY', KEYS[2], t .. ':blocks', 1)
  redis.call('HINCRBY', KEYS[2], t .. ':bytes', o.size)
end
return 1
"""

# KEYS: blocks hash, store set, tierstats; ARGV: field, gen ('*' = any)
_REMOVE = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
if not old then return 0 end
local o = cjson.decode(old)
if ARGV[2] ~= '*' and o.gen ~= ARGV[2] then return 0 end
for _, t in ipairs(o.tiers) do
  redis.call('HINCRBY', KEYS[3], t .. ':blocks', -1)
  redis.call('HINCRBY', KEYS[3], t .. ':bytes', -o.size)
end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


# KEYS: heartbeats hash, stores hash; ARGV: store id, its stores record (JSON)
# Returns 1 if the stores record was missing (first beat, or the store was forgotten) and is now written.
_BEAT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.3f', tonumber(t[1]) + tonumber(t[2]) / 1e6))
return redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
"""


class FormatConflict(FormatMismatch):
    """The sequence is registered under another format (raised by on_commit; answered 409)."""


class FormatNotRegistered(FormatMismatch):
    """The block's format is not registered at the control plane (raised by on_commit; answered 409)."""


class RedisBlockIndex:
    """A :class:`~planekv.tiering.BlockListener` that keeps ``pkv:blocks:*`` in step with one store."""

    def __init__(self, client: redis.Redis, store_id: str, info: dict[str, Any] | None = None,
                 require_format: bool = False) -> None:
        self.r = client
        self.require_format = require_format  # refuse new blocks of formats the control plane lacks
        self.store_id = store_id
        self.info = info or {}
        self._commit = client.register_script(_COMMIT)
        self._change = client.register_script(_CHANGE)
        self._remove = client.register_script(_REMOVE)
        self._beat = client.register_script(_BEAT)
        self.started_at = time.time()

    @classmethod
    def connect(cls, settings: Settings, store_id: str, info: dict[str, Any] | None = None,
                require_format: bool = False) -> RedisBlockIndex:
        """The index in the Redis of ``settings`` (redis_url, redis_password_file), checked with a PING."""
        from .redis_client import redis_sync

        client = redis_sync(settings)
        client.ping()
        index = cls(client, store_id, info, require_format)
        index.beat()  # alive before anything is republished: a forget in flight stops here
        return index

    def _field(self, info: BlockInfo) -> str:
        return f"{info.key}@{self.store_id}"

    def _value(self, info: BlockInfo, gen: str) -> str:
        return json.dumps({"format_id": info.key.format_id, "size": info.size, "checksum": f"{info.checksum:016x}",
                           "tiers": list(info.tiers), "gen": gen, "store": self.store_id}, separators=(",", ":"))

    def _commit_one(self, info: BlockInfo, gen: str, force: bool, client: Any = None) -> None:
        seq = info.key.sequence_id
        try:
            self._commit(keys=[k_blocks(seq), k_store_keys(self.store_id), K_TIERSTATS, k_cache(seq), K_CACHES,
                               k_format(info.key.format_id)],
                         args=[self._field(info), self._value(info, gen), info.size, ",".join(info.tiers),
                               info.key.format_id, seq, f"{time.time():.3f}", "1" if force else "0",
                               "1" if self.require_format else "0"],
                         client=client)
        except redis.ResponseError as exc:
            if str(exc).startswith("NOFORMAT"):
                raise FormatNotRegistered(f"format {info.key.format_id} is not registered at the control plane; "
                                          "register it first (PUT /v1/formats/{format_id}), then PUT the "
                                          "block again") from None
            if str(exc).startswith("FORMAT "):
                raise FormatConflict(f"sequence {seq} is registered with format {str(exc)[7:]}, not "
                                     f"{info.key.format_id}; a sequence has one format") from None
            raise

    # ---- BlockListener ----

    def on_commit(self, info: BlockInfo, gen: str) -> None:
        self._commit_one(info, gen, force=False)

    def on_change(self, info: BlockInfo, gen: str) -> None:
        self._change(keys=[k_blocks(info.key.sequence_id), K_TIERSTATS],
                     args=[self._field(info), gen, self._value(info, gen), ",".join(info.tiers)])

    def on_remove(self, info: BlockInfo, gen: str, reason: str) -> None:
        self._remove(keys=[k_blocks(info.key.sequence_id), k_store_keys(self.store_id), K_TIERSTATS],
                     args=[self._field(info), gen])

    def _record(self) -> str:
        return json.dumps({**self.info, "started_at": self.started_at})

    def beat(self) -> bool:
        """Write this store's heartbeat (Redis time); True if its ``pkv:stores`` record was missing (a
        first start without a file tier, or the store was forgotten: its entries are gone, republish)."""
        return bool(self._beat(keys=[K_HEARTBEATS, K_STORES], args=[self.store_id, self._record()]))

    def on_rebuild(self, blocks: list[tuple[BlockInfo, str]]) -> None:
        self.beat()
        self.drop_store()
        self.r.hset(K_STORES, self.store_id, self._record())
        pipe = self.r.pipeline(transaction=False)
        for info, gen in blocks:
            self._commit_one(info, gen, force=True, client=pipe)
        pipe.execute()

    # ---- reconciliation (planekv.services.store.reconcile) ----

    def published(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        """This store's entries as the index holds them: field ``<key>@<store>`` -> (gen, tiers);
        a field whose entry is gone maps to ("", ())."""
        fields = sorted(self.r.smembers(k_store_keys(self.store_id)))
        pipe = self.r.pipeline(transaction=False)
        for field in fields:
            pipe.hget(k_blocks(field.rsplit("@", 1)[0].split(":")[1]), field)
        out: dict[str, tuple[str, tuple[str, ...]]] = {}
        for field, raw in zip(fields, pipe.execute(), strict=True):
            v = json.loads(raw) if raw else {}
            out[field] = (v.get("gen", ""), tuple(v.get("tiers", ())))
        return out

    def field_of(self, info: BlockInfo) -> str:
        return self._field(info)

    def withdraw(self, field: str, gen: str) -> None:
        """Remove this store's entry ``field`` if it is still incarnation ``gen``."""
        seq = field.rsplit("@", 1)[0].split(":")[1]
        self._remove(keys=[k_blocks(seq), k_store_keys(self.store_id), K_TIERSTATS], args=[field, gen or "*"])

    def republish(self, info: BlockInfo, gen: str) -> None:
        """(Re)write the entry of a block this store holds (no format check: it is stored already)."""
        self._commit_one(info, gen, force=True)

    # ---- lifecycle ----

    def drop_store(self, gone: bool = False) -> None:
        """Remove every entry of this store (it is going away, or about to republish); ``gone``: also its
        heartbeat (a clean shutdown: nothing is left to forget)."""
        fields = self.r.smembers(k_store_keys(self.store_id))
        pipe = self.r.pipeline(transaction=False)
        if gone:
            pipe.hdel(K_HEARTBEATS, self.store_id)
        for field in fields:
            key = field.rsplit("@", 1)[0]
            seq = key.split(":")[1]
            self._remove(keys=[k_blocks(seq), k_store_keys(self.store_id), K_TIERSTATS], args=[field, "*"],
                         client=pipe)
        pipe.delete(k_store_keys(self.store_id))
        pipe.hdel(K_STORES, self.store_id)
        pipe.execute()
        log.info("block index: %d entries of store %s removed", len(fields), self.store_id)


def summarize_blocks(entries: dict[str, str]) -> dict[str, Any]:
    """Planes per tier of one sequence from its ``pkv:blocks:<seq>`` hash.

    Returns {tier: {"blocks", "bytes", "planes": {"k": ["b0-b1", ...], "v": [...]}, "stores": [...]}}.
    """
    tiers: dict[str, dict[str, Any]] = {}
    for field, raw in entries.items():
        key = field.rsplit("@", 1)[0]
        parts = key.split(":")
        kind, planes = parts[2], parts[6]
        v = json.loads(raw)
        for t in v["tiers"]:
            s = tiers.setdefault(t, {"blocks": 0, "bytes": 0, "planes": {"k": set(), "v": set()}, "stores": set()})
            s["blocks"] += 1
            s["bytes"] += int(v["size"])
            s["planes"][kind].add(planes)
            s["stores"].add(v["store"])

    def order(p: str) -> tuple[int, int]:
        a, b = p.split("-")
        return int(a), int(b)

    return {t: {"blocks": s["blocks"], "bytes": s["bytes"],
                "planes": {k: sorted(v, key=order) for k, v in s["planes"].items()},
                "stores": sorted(s["stores"])} for t, s in sorted(tiers.items())}
