"""`planekv bench load`: N concurrent clients for M seconds against the store service and the control plane on
loopback (issue 32 item 7): throughput, p50 / p99 / max latency and errors per operation, wrong reads, the peak RSS
of every service process and of Redis, and the store's tier usage against its capacities while eviction runs.

Started here (unless ``--store-url`` and ``--control-url`` name running services), through
:mod:`planekv.services.launch` as `planekv up` starts them: a redis-server requiring a new random password (a 0600
file in the run's temporary dir) with an append-only file (fsync every second), the control plane and the store
(``python -m planekv.services.*``), each on a free loopback port, in a session of its own, with a random bearer
token; all of them are stopped by pid (their process groups) when the run ends, whatever ends it.

Each client is one asyncio task with its own connections and its own keys (sequence ``load-<run>-c<i>``), so it
knows what the store must answer: a GET of a block it stored must return the exact frame it PUT (anything else is
a *wrong read*), or 404 if the store evicted it (a *miss*, allowed: capacities are finite); a GET of a block it
deleted must be 404. Every loop is bounded twice, by ``seconds`` and by ``max_requests`` over all clients, and
every request by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import os
import platform
import random
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..kvstore import FormatSpec
from ..services.launch import (
    free_port,
    http_ok,
    new_secret_file,
    redis_command,
    redis_ping,
    spawn,
    stop_group,
    wait_ready,
)
from ..services.redis_auth import read_password_file
from ..tiering.frame import BlockKey, encode_frame

OPS = ("put", "get", "delete", "formats_get", "policies_get", "policy_put")
DEFAULT_MIX = {"put": 30.0, "get": 45.0, "delete": 8.0, "formats_get": 7.0, "policies_get": 8.0, "policy_put": 2.0}
MiB = 1 << 20
START_TIMEOUT_S = 60.0
KEEPALIVE_EXPIRY_S = 2.0
# the geometry of the registered format: a block is `block_pages` pages x 8 planes of one KV head, so a page is
# 8 planes x 64 tokens x head_dim/8 bytes = 8 KiB of payload
N_LAYERS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE, WIDTH = 8, 2, 128, 64, 8
PAGE_PAYLOAD = WIDTH * PAGE_SIZE * HEAD_DIM // 8
# placement policies the clients PUT (activated) in turn; an active one must always be one of these
POLICY_HOT_PLANES = ({"k": 4, "v": 2}, {"k": 6, "v": 3}, {"k": 8, "v": 4}, {"k": 2, "v": 2})


class LoadError(RuntimeError):
    """The load run could not be set up (a service did not start, the setup requests failed)."""


@dataclass
class LoadConfig:
    """What one load run does. ``mix``: relative weights of the operations (a weight of 0 leaves one out)."""

    clients: int = 16
    seconds: float = 60.0
    max_requests: int = 2_000_000  # over all clients together
    timeout_s: float = 10.0  # per request
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    block_pages: int = 128  # pages per block: 128 x 8 KiB = 1 MiB payload (PlacementPolicy's smallest block)
    keys_per_client: int = 16
    memory_bytes: int = 64 * MiB  # the started store's tiers, smaller than the working set so eviction runs
    file_bytes: int = 128 * MiB
    write_through: bool = False
    stats_interval_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.mix) - set(OPS)
        if unknown:
            raise ValueError(f"unknown operations in the mix: {sorted(unknown)}; known: {', '.join(OPS)}")
        if any(w < 0 for w in self.mix.values()) or not any(self.mix.values()):
            raise ValueError(f"mix weights must be >= 0 and not all 0, got {self.mix}")
        for name in ("clients", "max_requests", "block_pages", "keys_per_client"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.seconds > 0 and self.timeout_s > 0 and self.stats_interval_s > 0):
            raise ValueError("seconds, timeout_s and stats_interval_s must be > 0")
        if self.keys_per_client > 2 * N_LAYERS * 4096:
            raise ValueError(f"keys_per_client must be <= {2 * N_LAYERS * 4096}")

    @property
    def payload_bytes(self) -> int:
        return self.block_pages * PAGE_PAYLOAD


def parse_mix(text: str) -> dict[str, float]:
    """``put=30,get=45`` -> weights; operations not named keep their default weight."""
    mix = dict(DEFAULT_MIX)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, val = part.partition("=")
        if not sep or name.strip() not in OPS:
            raise ValueError(f"mix entry {part!r} is not op=weight with op one of {', '.join(OPS)}")
        mix[name.strip()] = float(val)
    return mix


# ---- the services: started and stopped by pid, or targeted ----

@dataclass
class Service:
    name: str
    url: str
    pid: int | None  # None: a targeted service whose pid was not given (no RSS)
    proc: subprocess.Popen[bytes] | None = None  # set when this run started it
    log: Path | None = None


@dataclass
class Endpoints:
    store: str
    control: str
    token: str | None
    services: list[Service]


def _spawn(name: str, cmd: list[str], env: dict[str, str], workdir: Path, url: str) -> Service:
    proc = spawn(cmd, env, workdir / f"{name}.log")
    return Service(name, url, proc.pid, proc, workdir / f"{name}.log")


def stop_service(s: Service) -> None:
    """Stop the process group this run started for ``s`` (SIGTERM, then SIGKILL; Redis's AOF-rewrite child
    included) and reap it. No-op for a targeted service."""
    if s.proc is None:
        return
    stop_group(s.proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.proc.wait(5.0)


@contextlib.contextmanager
def started_services(cfg: LoadConfig, workdir: Path, say: Callable[[str], None]) -> Iterator[Endpoints]:
    """redis-server (a new password, AOF fsynced every second), the control plane and the store on free loopback
    ports with a random token; yields their endpoints and stops every one of them by pid on the way out (store
    first)."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        raise LoadError("redis-server is not on the PATH (Debian: apt install redis-server)")
    token = secrets.token_hex(16)
    password_file = new_secret_file(workdir / "redis-password")  # workdir is mkdtemp's: 0700
    password = read_password_file(password_file)
    services: list[Service] = []
    try:
        rport = free_port()
        services.append(_spawn("redis", redis_command(redis_server, rport, workdir / "redis", password_file),
                               dict(os.environ), workdir, f"redis://127.0.0.1:{rport}/0"))
        wait_ready(services, lambda s: redis_ping(rport, password), time.monotonic() + 10.0, LoadError)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLANEKV_")}
        env.update(PLANEKV_DATA_DIR=str(workdir / "data"), PLANEKV_REDIS_URL=services[0].url,
                   PLANEKV_REDIS_PASSWORD_FILE=str(password_file), PLANEKV_API_TOKEN=token,
                   PLANEKV_LOG_LEVEL="WARNING")
        cport, sport = free_port(), free_port()
        web = [_spawn("control", [sys.executable, "-m", "planekv.services.control", "--port", str(cport)], env,
                      workdir, f"http://127.0.0.1:{cport}"),
               _spawn("store", [sys.executable, "-m", "planekv.services.store", "--port", str(sport),
                                "--memory-bytes", str(cfg.memory_bytes), "--file-bytes", str(cfg.file_bytes),
                                "--spill-dir", str(workdir / "spill"),
                                *(["--write-through"] if cfg.write_through else [])], env, workdir,
                      f"http://127.0.0.1:{sport}")]
        services += web
        wait_ready(web, lambda s: http_ok(s.url), time.monotonic() + START_TIMEOUT_S, LoadError)
        say(f"started redis (pid {services[0].pid}), control (pid {web[0].pid}) and store (pid {web[1].pid}) "
            f"in {workdir}")
        yield Endpoints(web[1].url, web[0].url, token, services)
    finally:
        for s in reversed(services):
            stop_service(s)


# ---- peak RSS ----

def proc_memory(pid: int | None) -> dict[str, float | None]:
    """``peak_rss_mib`` (VmHWM: the highest resident set since the process started) and ``rss_mib`` (VmRSS, now)
    of a live process, in MiB; None where unknown."""
    out: dict[str, float | None] = {"peak_rss_mib": None, "rss_mib": None}
    if pid is None:
        return out
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, val = line.partition(":")
        if name in ("VmHWM", "VmRSS"):  # "  123456 kB"
            out["peak_rss_mib" if name == "VmHWM" else "rss_mib"] = int(val.split()[0]) / 1024
    return out


def proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds a live process has used (its children not included), None where unknown."""
    if pid is None:
        return None
    if pid == os.getpid():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


# ---- the workload ----

@dataclass
class OpStats:
    latencies_s: list[float] = field(default_factory=list)  # answered requests, whatever their status
    errors: Counter[str] = field(default_factory=Counter)  # "status 503", "timeout", "wrong bytes", ...
    sent: int = 0
    misses: int = 0  # a block this client had stored was gone (evicted): allowed, not an error
    wrong: int = 0  # wrong reads: other bytes than were PUT, or a deleted block served


class Budget:
    """Requests left over all clients and the deadline (monotonic s); one event loop, so no lock."""

    def __init__(self, requests: int, deadline: float) -> None:
        self.left, self.deadline = requests, deadline

    def take(self) -> bool:
        if self.left <= 0 or time.monotonic() >= self.deadline:
            return False
        self.left -= 1
        return True


@dataclass
class Shared:
    cfg: LoadConfig
    run_id: str
    store: str
    control: str
    headers: dict[str, str]
    format_id: str
    spec: dict[str, Any]
    policy: str
    stats: dict[str, OpStats]
    budget: Budget


def payload(key: BlockKey, gen: int, n: int) -> bytes:
    """``n`` bytes that differ for every (key, generation): a re-PUT after a DELETE has other bytes, so an old
    frame served again is caught."""
    seed = hashlib.blake2b(f"{key}#{gen}".encode(), digest_size=64).digest()
    return (seed * (n // 64 + 1))[:n]


class Client:
    """One client: its keys, what the store must hold under each, and one connection per service."""

    def __init__(self, i: int, sh: Shared) -> None:
        self.sh, self.cfg = sh, sh.cfg
        self.rng = random.Random(sh.cfg.seed * 1_000_003 + i)
        seq = f"load-{sh.run_id}-c{i}"
        pages = self.cfg.block_pages
        self.keys = [BlockKey(sh.format_id, seq, "kv"[j % 2], (j // 2) % N_LAYERS, i % N_KV_HEADS,
                              pages * (j // (2 * N_LAYERS)), pages * (j // (2 * N_LAYERS) + 1), 0, WIDTH)
                     for j in range(self.cfg.keys_per_client)]
        self.gen = [0] * len(self.keys)  # generation of the bytes last PUT under each key
        self.present = [False] * len(self.keys)  # acknowledged and not deleted (the store may still evict it)
        # after a PUT or DELETE whose answer was lost: the store holds frame(gen) or nothing, either is right
        self.uncertain = [False] * len(self.keys)
        self.ops = [op for op in OPS if self.cfg.mix.get(op, 0) > 0]
        self.weights = [self.cfg.mix[op] for op in self.ops]
        self.policy_turn = i

    def frame(self, j: int) -> bytes:
        k = self.keys[j]
        return encode_frame(k, payload(k, self.gen[j], self.cfg.payload_bytes))

    def pick(self, stored: bool) -> int:
        """A key believed stored (``stored``) or not, where there is one; else any."""
        keys = [j for j in range(len(self.keys)) if (self.present[j] or self.uncertain[j]) == stored]
        return self.rng.choice(keys) if keys else self.rng.randrange(len(self.keys))

    async def run(self) -> None:
        timeout = httpx.Timeout(self.cfg.timeout_s)
        # idle connections dropped before uvicorn's 5 s keep-alive closes them: at httpx's default (also 5 s) a
        # reuse racing the server's close fails as RemoteProtocolError, an artefact of the client, not a fault
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(headers=self.sh.headers, timeout=timeout, limits=limits) as http:
            while self.sh.budget.take():
                op = self.rng.choices(self.ops, self.weights)[0]
                await self.one(http, op)

    async def one(self, http: httpx.AsyncClient, op: str) -> None:
        st = self.sh.stats[op]
        st.sent += 1
        j, body, url, method = -1, None, "", "GET"
        if op in ("put", "get", "delete"):
            # PUTs mostly of keys not stored (1 in 5 again, idempotent); GETs and DELETEs mostly of stored ones
            j = self.pick(stored=self.rng.random() < (0.2 if op == "put" else 0.9))
            url = f"{self.sh.store}/v1/blocks/{self.keys[j]}"
            if op == "put":
                if not self.present[j] and not self.uncertain[j]:
                    self.gen[j] += 1  # new bytes under a key that is not stored
                method, body = "PUT", self.frame(j)
            elif op == "delete":
                method = "DELETE"
        elif op == "formats_get":
            url = f"{self.sh.control}/v1/formats" + (f"/{self.sh.format_id}" if self.rng.random() < 0.5 else "")
        elif op == "policies_get":
            url = f"{self.sh.control}/v1/policies" + (f"/{self.sh.policy}/active" if self.rng.random() < 0.5 else "")
        else:  # policy_put
            self.policy_turn += 1
            url, method = f"{self.sh.control}/v1/policies/{self.sh.policy}", "PUT"
            doc = {"policy": {"hot_planes": POLICY_HOT_PLANES[self.policy_turn % len(POLICY_HOT_PLANES)]},
                   "comment": "planekv bench load", "activate": True}
            body = json.dumps(doc).encode()
        headers = {"content-type": "application/octet-stream" if op == "put" else "application/json"} if body else None
        t0 = time.perf_counter()
        try:
            r = await http.request(method, url, content=body, headers=headers)
        except httpx.TimeoutException:
            st.errors["timeout"] += 1
            self.lost(op, j)
            return
        except httpx.HTTPError as exc:
            st.errors[type(exc).__name__] += 1
            self.lost(op, j)
            return
        st.latencies_s.append(time.perf_counter() - t0)
        self.check(op, j, r, st)

    def lost(self, op: str, j: int) -> None:
        if op in ("put", "delete"):
            self.uncertain[j] = True

    def check(self, op: str, j: int, r: httpx.Response, st: OpStats) -> None:
        code = r.status_code
        if op == "put":
            if code in (200, 201):
                self.present[j], self.uncertain[j] = True, False
            else:
                st.errors[f"status {code}"] += 1
                self.uncertain[j] = True  # a refused PUT may have left the old state or nothing
        elif op == "get":
            held = self.present[j] or self.uncertain[j]
            if code == 200:
                if not held or r.content != self.frame(j):
                    st.wrong += 1
                    st.errors["wrong bytes" if held else "deleted block served"] += 1
                self.present[j], self.uncertain[j] = True, False
            elif code == 404:
                if self.present[j] and not self.uncertain[j]:
                    st.misses += 1
                self.present[j] = self.uncertain[j] = False
            else:
                st.errors[f"status {code}"] += 1
        elif op == "delete":
            if code == 204:
                if not self.present[j] and not self.uncertain[j]:
                    st.errors["204 for a block never stored"] += 1
            elif code == 404:
                if self.present[j] and not self.uncertain[j]:
                    st.misses += 1
            else:
                st.errors[f"status {code}"] += 1
                self.uncertain[j] = self.present[j] or self.uncertain[j]
                return
            self.present[j] = self.uncertain[j] = False
        elif code not in ((200, 201) if op == "policy_put" else (200,)):
            st.errors[f"status {code}"] += 1
        elif not self.control_answer_right(op, r):
            st.wrong += 1
            st.errors["wrong answer"] += 1

    def control_answer_right(self, op: str, r: httpx.Response) -> bool:
        try:
            return self._control_answer_right(op, r)
        except (ValueError, KeyError, TypeError):  # not the JSON the route promises
            return False

    def _control_answer_right(self, op: str, r: httpx.Response) -> bool:
        d = r.json()
        url = str(r.request.url)
        if op == "formats_get":
            if url.endswith("/formats"):
                return self.sh.format_id in [f["format_id"] for f in d["formats"]]
            return d["format_id"] == self.sh.format_id and d["spec"] == self.sh.spec
        if op == "policies_get":
            if url.endswith("/policies"):
                return self.sh.policy in [p["name"] for p in d["policies"]]
            return d["name"] == self.sh.policy and d["policy"]["hot_planes"] in POLICY_HOT_PLANES
        return d["name"] == self.sh.policy and d["policy"]["hot_planes"] in POLICY_HOT_PLANES  # policy_put


@dataclass
class TierPeak:
    capacity_bytes: int = 0
    max_used_bytes: int = 0
    samples: int = 0


async def _watch_store(sh: Shared, tiers: dict[str, TierPeak], last: dict[str, Any]) -> None:
    """Sample the store's /v1/stats every stats_interval_s until the budget's deadline: the highest use of each
    tier against its capacity."""
    async with httpx.AsyncClient(headers=sh.headers, timeout=sh.cfg.timeout_s) as http:
        while time.monotonic() < sh.budget.deadline:
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                d = (await http.get(f"{sh.store}/v1/stats")).json()
                for name in ("memory", "file"):
                    t = tiers[name]
                    t.capacity_bytes = int(d[name]["capacity_bytes"])
                    t.max_used_bytes = max(t.max_used_bytes, int(d[name]["used_bytes"]))
                    t.samples += 1
                last.clear()
                last.update(d)
            await asyncio.sleep(min(sh.cfg.stats_interval_s, max(0.0, sh.budget.deadline - time.monotonic())))


def _setup(ep: Endpoints, run_id: str) -> tuple[str, dict[str, Any], str]:
    """Register a calibration, a format on it and a placement policy; (format_id, its spec, policy name)."""
    headers = {"authorization": f"Bearer {ep.token}"} if ep.token else {}
    with httpx.Client(base_url=ep.control, headers=headers, timeout=30.0) as c:
        ones = [[[1.0] * HEAD_DIM] * N_KV_HEADS] * N_LAYERS
        zeros = [[[0.0] * HEAD_DIM] * N_KV_HEADS] * N_LAYERS
        r = c.post("/v1/calibrations", json={"statistics": {"mu_k": zeros, "sigma_k": ones, "mu_v": zeros,
                                                            "sigma_v": ones}, "meta": {"by": "planekv bench load"}})
        if r.status_code not in (200, 201):
            raise LoadError(f"registering the calibration: {r.status_code} {r.text[:500]}")
        spec = FormatSpec(model_id=f"load-{run_id}", n_layers=N_LAYERS, n_q_heads=4 * N_KV_HEADS,
                          n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, calibration_id=r.json()["calibration_id"],
                          width=WIDTH, page_size=PAGE_SIZE)
        r = c.put(f"/v1/formats/{spec.format_id}", json=spec.to_dict())
        if r.status_code not in (200, 201):
            raise LoadError(f"registering the format: {r.status_code} {r.text[:500]}")
        policy = f"load-{run_id}"
        r = c.post("/v1/policies", json={"name": policy, "policy": {"hot_planes": POLICY_HOT_PLANES[0]},
                                         "comment": "planekv bench load"})
        if r.status_code != 201:
            raise LoadError(f"creating the placement policy: {r.status_code} {r.text[:500]}")
        r = c.get(f"/v1/formats/{spec.format_id}")  # the spec as the control plane serves it, to compare reads
        if r.status_code != 200:
            raise LoadError(f"reading the format back: {r.status_code} {r.text[:500]}")
        return spec.format_id, r.json()["spec"], policy


async def _run_clients(cfg: LoadConfig, sh: Shared) -> tuple[float, dict[str, TierPeak], dict[str, Any]]:
    tiers = {"memory": TierPeak(), "file": TierPeak()}
    last: dict[str, Any] = {}
    clients = [Client(i, sh) for i in range(cfg.clients)]
    t0 = time.monotonic()
    sh.budget.deadline = t0 + cfg.seconds
    tasks = [asyncio.create_task(_watch_store(sh, tiers, last)), *(asyncio.create_task(c.run()) for c in clients)]
    try:  # every request is bounded by timeout_s, so the tasks end by the deadline plus one timeout
        done, pending = await asyncio.wait(tasks, timeout=cfg.seconds + cfg.timeout_s + 30.0,
                                           return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
    wall = time.monotonic() - t0
    for t in done:
        t.result()  # a client that crashed raises here
    if pending:
        raise LoadError(f"{len(pending)} clients were still running {wall:.0f} s after the start")
    with contextlib.suppress(httpx.HTTPError, ValueError):  # final counters, after the last request
        async with httpx.AsyncClient(headers=sh.headers, timeout=cfg.timeout_s) as http:
            last.clear()
            last.update((await http.get(f"{sh.store}/v1/stats")).json())
    await _clean_up(sh, clients)
    return wall, tiers, last


async def _clean_up(sh: Shared, clients: list[Client]) -> None:
    """Delete the blocks the clients may have left (a targeted store keeps running); not counted."""
    async with httpx.AsyncClient(headers=sh.headers, timeout=sh.cfg.timeout_s) as http:
        for c in clients:
            for j, k in enumerate(c.keys):
                if c.present[j] or c.uncertain[j]:
                    with contextlib.suppress(httpx.HTTPError):
                        await http.delete(f"{sh.store}/v1/blocks/{k}")


def _ms(lat: list[float], q: float) -> float | None:
    """Nearest-rank quantile of ``lat`` (s) in ms."""
    if not lat:
        return None
    s = sorted(lat)
    return 1e3 * s[min(len(s) - 1, max(0, int(-(-q * len(s) // 1)) - 1))]


def op_rows(stats: dict[str, OpStats], wall: float) -> list[dict[str, Any]]:
    return [{"op": op, "count": st.sent, "answered": len(st.latencies_s), "req_per_s": st.sent / wall,
             "p50_ms": _ms(st.latencies_s, 0.50), "p99_ms": _ms(st.latencies_s, 0.99),
             "max_ms": 1e3 * max(st.latencies_s) if st.latencies_s else None, "misses": st.misses,
             "wrong_reads": st.wrong, "errors": dict(st.errors)} for op, st in stats.items() if st.sent]


def run_load(cfg: LoadConfig, store_url: str | None = None, control_url: str | None = None,
             token: str | None = None, pids: dict[str, int] | None = None,
             say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Start the services (or target ``store_url`` and ``control_url``), run the load, stop what was started;
    the result (see :func:`format_table` for the fields shown). ``pids``: targeted processes whose RSS to read."""
    if (store_url is None) != (control_url is None):
        raise LoadError("give both --store-url and --control-url, or neither (then both are started here)")
    run_id = secrets.token_hex(4)
    workdir = Path(tempfile.mkdtemp(prefix="planekv-load-"))
    try:
        with contextlib.ExitStack() as stack:
            if store_url is None:
                ep = stack.enter_context(started_services(cfg, workdir, say))
            else:
                assert control_url is not None
                ep = Endpoints(store_url.rstrip("/"), control_url.rstrip("/"), token,
                               [Service(n, "", p) for n, p in (pids or {}).items()])
            format_id, spec, policy = _setup(ep, run_id)
            sh = Shared(cfg, run_id, ep.store, ep.control, {"authorization": f"Bearer {ep.token}"} if ep.token else {},
                        format_id, spec, policy, {op: OpStats() for op in OPS}, Budget(cfg.max_requests, 0.0))
            say(f"{cfg.clients} clients for {cfg.seconds:g} s (at most {cfg.max_requests} requests), "
                f"{cfg.payload_bytes / MiB:g} MiB blocks, {cfg.keys_per_client} keys per client")
            watched = [(s.name, s.pid, s.proc is not None) for s in ep.services]
            watched.append(("bench client", os.getpid(), False))
            cpu0 = [proc_cpu_s(pid) for _, pid, _ in watched]
            wall, tiers, last = asyncio.run(_run_clients(cfg, sh))
            procs = []
            for (name, pid, here), c0 in zip(watched, cpu0, strict=True):
                c1 = proc_cpu_s(pid)
                cpu = c1 - c0 if c0 is not None and c1 is not None else None
                mem = proc_memory(pid) if name != "bench client" else \
                    {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_mib": None}
                procs.append({"name": name, "pid": pid, "started_here": here, **mem, "cpu_s": cpu,
                              "cores": cpu / wall if cpu is not None else None})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = op_rows(sh.stats, wall)
    errors = Counter[str]()
    for st in sh.stats.values():
        errors.update(st.errors)
    return {"wall_s": wall, "requests": sum(r["count"] for r in rows),
            "wrong_reads": sum(r["wrong_reads"] for r in rows), "misses": sum(r["misses"] for r in rows),
            "errors": dict(errors), "errors_5xx": sum(n for k, n in errors.items() if k.startswith("status 5")),
            "ops": rows, "processes": procs, "store_tiers": {k: asdict(v) for k, v in tiers.items()},
            "store_stats": last, "format_id": format_id, "frame_bytes": len(encode_frame(
                BlockKey(format_id, "x", "k", 0, 0, 0, 1, 0, 1), bytes(cfg.payload_bytes))), "config": asdict(cfg),
            "targeted": store_url is not None}


# ---- output ----

def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(res: dict[str, Any]) -> Any:
    """The per-operation table, the processes' peak RSS and the store's tier peaks (rich renderables)."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"planekv bench load: {res['config']['clients']} clients, {res['wall_s']:.1f} s, "
                    f"{res['requests']} requests, {res['wrong_reads']} wrong reads")
    for col in ("op", "requests", "req/s", "p50 ms", "p99 ms", "max ms", "misses", "wrong", "errors"):
        t.add_column(col, justify="left" if col in ("op", "errors") else "right")
    for r in res["ops"]:
        errs = ", ".join(f"{k}: {n}" for k, n in sorted(r["errors"].items())) or "0"
        t.add_row(r["op"], str(r["count"]), f"{r['req_per_s']:.1f}", _f(r["p50_ms"]), _f(r["p99_ms"]),
                  _f(r["max_ms"]), str(r["misses"]), str(r["wrong_reads"]), errs)
    p = Table(title="processes: peak RSS (VmHWM) and CPU during the load (cores = CPU s / wall s)")
    for col in ("process", "pid", "peak RSS MiB", "RSS at end MiB", "CPU s", "cores"):
        p.add_column(col, justify="left" if col == "process" else "right")
    for r in res["processes"]:
        p.add_row(r["name"], str(r["pid"]), _f(r["peak_rss_mib"]), _f(r["rss_mib"]), _f(r["cpu_s"]),
                  _f(r["cores"], ".2f"))
    s = Table(title=f"store tiers (/v1/stats every {res['config']['stats_interval_s']:g} s; "
                    f"blocks of {res['frame_bytes'] / MiB:.3g} MiB)")
    for col in ("tier", "capacity MiB", "max used MiB", "over capacity, blocks", "samples"):
        s.add_column(col, justify="left" if col == "tier" else "right")
    for name, v in res["store_tiers"].items():
        over = max(0, v["max_used_bytes"] - v["capacity_bytes"]) / res["frame_bytes"]
        s.add_row(name, f"{v['capacity_bytes'] / MiB:.1f}", f"{v['max_used_bytes'] / MiB:.1f}", f"{over:.2f}",
                  str(v["samples"]))
    return Group(t, p, s)


def result_to_json(res: dict[str, Any], path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, **res}, indent=2, default=str))


def host_meta() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "host": platform.node(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "cpu_model": cpu,
            "load_avg_at_start": os.getloadavg(), "python": platform.python_version()}
