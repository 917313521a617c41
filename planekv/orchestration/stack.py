"""`planekv up / down / status`: the whole stack on one machine, without containers.

Processes, each in a session of its own, logging to ``<data_dir>/stack/logs/<name>.log``:

- **redis**: ``redis-server`` from a config file (planekv.services.launch): a password (``requirepass``, from
  ``<data_dir>/stack/redis-password``, mode 0600, made once per data dir), an append-only file in
  ``<data_dir>/stack/redis`` so the control plane's metadata survives a restart of the stack, loopback only;
- **control** and **store**: ``planekv control`` / ``planekv store`` against that Redis (its URL and the password
  file reach them by environment, ``PLANEKV_REDIS_URL`` and ``PLANEKV_REDIS_PASSWORD_FILE``, never by command
  line);
- **ray**: ``ray start --head --block`` (GCS on its own port, never Redis's; the jobs API on the dashboard port),
  loopback only, with Ray's token authentication on (the token in ``<data_dir>/stack/ray-token``, mode 0600);
- **worker-<i>**: ``python -m planekv.orchestration.worker_host``, a Ray driver that owns one
  :class:`~planekv.orchestration.worker.PlaneWorker` actor (one per GPU; one CPU worker where there is none) and
  serves its ``/healthz`` and Prometheus ``/metrics``.

``up`` writes ``<data_dir>/stack/stack.json`` (mode 0600: every pid, port and address; no password) before it
waits, so ``down`` stops exactly what ``up`` started, even an ``up`` that failed half-way; a second ``up`` while
one runs refuses. Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from planekv.kvstore.atomic import atomic_write_bytes
from planekv.services.launch import (
    alive,
    free_ports,
    http_ok,
    new_secret_file,
    port_busy,
    redis_command,
    redis_ping,
    spawn,
    stop_group,
    wait_ready,
)
from planekv.services.redis_auth import RedisPasswordError, read_password_file, redact_url

log = logging.getLogger(__name__)

STATE = "stack.json"
START_TIMEOUT_S = 120.0
REDIS_PASSWORD = "redis-password"


class StackError(RuntimeError):
    """The stack cannot be brought up or down as asked (the message says why and what to do)."""


@dataclass
class Ports:
    redis: int = 6381
    control: int = 8080
    store: int = 8090
    ray_gcs: int = 6380
    ray_dashboard: int = 8265
    worker_metrics: int = 8095  # worker i serves on this port + i

    @classmethod
    def free(cls) -> Ports:
        """Distinct ports free on 127.0.0.1 now (for a second stack beside the default one, and tests)."""
        return cls(*free_ports(6))


@dataclass
class Component:
    name: str
    pid: int
    port: int
    url: str  # where it answers (redis://, http://)
    log: str


@dataclass
class StackState:
    data_dir: str
    started: float
    ports: dict[str, int]
    api_token: str | None
    components: list[Component] = field(default_factory=list)
    worker_gpu_share: float = 1.0  # of its GPU each PlaneWorker takes (state files before it: the whole GPU)

    def save(self, path: Path) -> None:
        atomic_write_bytes(path, json.dumps(asdict(self), indent=2).encode())

    @classmethod
    def load(cls, path: Path) -> StackState:
        raw = json.loads(path.read_text())
        raw["components"] = [Component(**c) for c in raw["components"]]
        return cls(**raw)


def stack_dir(data_dir: Path) -> Path:
    return Path(data_dir).expanduser() / "stack"


def ray_temp_dir(data_dir: Path) -> Path:
    """Ray's session files: under the system's temp dir with a short name, as Ray's Unix socket paths must stay
    under 108 bytes (a deep data dir would break the dashboard), one per data dir."""
    digest = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"planekv-ray-{digest}"


RAY_INTERNAL_PORTS = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
                      "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")


def ray_internal_port_args() -> list[str]:
    """Free ports for the Ray head's internal servers: Ray's fixed defaults (52365, 10001, ...) would collide with
    another Ray on the same machine (a second stack, a test cluster)."""
    return [f"--{name}={port}" for name, port in zip(RAY_INTERNAL_PORTS, free_ports(len(RAY_INTERNAL_PORTS)),
                                                      strict=True)]


def running(data_dir: Path) -> StackState | None:
    """The stack recorded under ``data_dir`` if any of its processes is alive."""
    path = stack_dir(data_dir) / STATE
    if not path.exists():
        return None
    state = StackState.load(path)
    return state if any(alive(c.pid) for c in state.components) else None


# ---- health probes ----

def probe(c: Component, state: StackState) -> bool:
    if c.name == "redis":
        return redis_ping(c.port, _redis_password(state))
    if c.name == "ray":
        return http_ok(c.url, _ray_token(state), "/api/version")
    return http_ok(c.url)


def _redis_password(state: StackState) -> str | None:
    try:
        return read_password_file(stack_dir(Path(state.data_dir)) / REDIS_PASSWORD)
    except RedisPasswordError:
        return None  # probed as unhealthy


def _ray_token(state: StackState) -> str | None:
    path = Path(state.data_dir) / "stack" / "ray-token"
    return path.read_text().strip() if path.exists() else None


# ---- up ----

# Of its GPU a PlaneWorker takes: the rest is for the evaluation workers of `planekv eval --address stack`, which
# would otherwise wait for a GPU the stack's workers hold (seen on a one-GPU H100, 2026-12-05).
WORKER_GPU_SHARE = 0.5


def _planekv(*args: str) -> list[str]:
    return [sys.executable, "-m", "planekv.cli", *args]


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no driver: CPU workers
        return 0


def up(data_dir: Path, ports: Ports | None = None, workers: int | None = None, api_token: str | None = None,
       worker_args: list[str] | None = None, timeout: float = START_TIMEOUT_S,
       say: Callable[[str], None] | None = None, worker_gpu_share: float = WORKER_GPU_SHARE) -> StackState:
    """Start the stack under ``data_dir`` and wait until every process is healthy (or raise StackError after
    stopping what was started). ``workers``: PlaneWorkers to start (default: one per GPU, one without);
    ``worker_gpu_share``: of its GPU each takes (Ray's fractional GPUs; the rest is left to evaluation workers
    that join the stack, ``planekv eval ... --workers N --address stack``)."""
    if not 0.0 < worker_gpu_share <= 1.0:
        raise StackError(f"worker_gpu_share must be in (0, 1], got {worker_gpu_share}")
    say = say or log.info
    data_dir = Path(data_dir).expanduser()
    sd = stack_dir(data_dir)
    if running(data_dir) is not None:
        raise StackError(f"a PlaneKV stack is already running from {sd} (see `planekv status`); "
                         "`planekv down` stops it")
    ports = ports or Ports()
    n_gpus = _gpus()
    n_workers = workers if workers is not None else max(1, n_gpus)
    wanted = {**{k: v for k, v in asdict(ports).items() if k != "worker_metrics"},
              **{f"worker-{i}": ports.worker_metrics + i for i in range(n_workers)}}
    busy = [f"{k} ({p})" for k, p in wanted.items() if port_busy(p)]
    if busy:
        raise StackError(f"ports in use on 127.0.0.1: {', '.join(busy)}; stop what holds them or choose others "
                         "(`planekv up --free-ports` picks free ones)")
    redis_server = shutil.which("redis-server")
    ray_bin = shutil.which("ray", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if redis_server is None:
        raise StackError("redis-server is not on the PATH (Debian: apt install redis-server)")
    if ray_bin is None:
        raise StackError("the `ray` command is not installed: pip install 'planekv[cluster]'")
    sd.mkdir(parents=True, exist_ok=True)
    logs = sd / "logs"
    token_path = new_secret_file(sd / "ray-token")
    password_file = new_secret_file(sd / REDIS_PASSWORD)
    try:
        redis_argv = redis_command(redis_server, ports.redis, sd / "redis", password_file)
    except RedisPasswordError as exc:
        raise StackError(f"{exc} (delete it and `planekv up` makes a new one)") from None
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PLANEKV_", "RAY_AUTH"))}
    base_env.pop("TRITON_INTERPRET", None)
    redis_url = f"redis://127.0.0.1:{ports.redis}/0"
    env = dict(base_env, PLANEKV_DATA_DIR=str(data_dir),
               PLANEKV_CONTROL__PORT=str(ports.control), PLANEKV_STORE__PORT=str(ports.store),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path), RAY_USAGE_STATS_ENABLED="0",
               # single node: Ray keeps its node address on loopback (it would resolve 127.0.0.1 to a routable one)
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if api_token:
        env["PLANEKV_API_TOKEN"] = api_token
    # only the services talk to Redis: Ray and the workers never see its address or password file
    service_env = dict(env, PLANEKV_REDIS_URL=redis_url, PLANEKV_REDIS_PASSWORD_FILE=str(password_file))
    state = StackState(str(data_dir), time.time(), wanted, api_token, worker_gpu_share=worker_gpu_share)
    state_path = sd / STATE
    t0 = time.monotonic()

    def start(name: str, cmd: list[str], port: int, url: str, env: dict[str, str] = env) -> None:
        proc = spawn(cmd, env, logs / f"{name}.log")
        state.components.append(Component(name, proc.pid, port, url, str(logs / f"{name}.log")))
        state.save(state_path)  # recorded before any wait: `down` finds it whatever happens next

    try:
        start("redis", redis_argv, ports.redis, redis_url)
        start("ray", [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
                      f"--port={ports.ray_gcs}", "--dashboard-host=127.0.0.1",
                      f"--dashboard-port={ports.ray_dashboard}", "--include-dashboard=true",
                      f"--num-cpus={max(2, os.cpu_count() or 2)}", f"--num-gpus={n_gpus}",
                      "--disable-usage-stats", f"--temp-dir={ray_temp_dir(data_dir)}", *ray_internal_port_args()],
              ports.ray_gcs, f"http://127.0.0.1:{ports.ray_dashboard}")
        _wait(state, ["redis"], t0 + timeout, say)
        start("control", _planekv("control", "--port", str(ports.control)), ports.control,
              f"http://127.0.0.1:{ports.control}", service_env)
        start("store", _planekv("store", "--port", str(ports.store)), ports.store,
              f"http://127.0.0.1:{ports.store}", service_env)
        _wait(state, ["ray"], t0 + timeout, say)
        for i in range(n_workers):
            port = ports.worker_metrics + i
            start(f"worker-{i}", [sys.executable, "-m", "planekv.orchestration.worker_host", "--address",
                                  f"127.0.0.1:{ports.ray_gcs}", "--index", str(i), "--port", str(port),
                                  "--gpus", str(worker_gpu_share) if i < n_gpus else "0", "--control-url",
                                  f"http://127.0.0.1:{ports.control}", *(worker_args or [])],
                  port, f"http://127.0.0.1:{port}")
        _wait(state, [c.name for c in state.components if c.name not in ("redis", "ray")], t0 + timeout, say)
    except BaseException:
        down(data_dir, say=say)
        raise
    say(f"PlaneKV stack healthy in {time.monotonic() - t0:.1f} s")
    return state


def _wait(state: StackState, names: list[str], deadline: float, say: Callable[[str], None]) -> None:
    wait_ready([c for c in state.components if c.name in names], lambda c: probe(c, state), deadline, StackError,
               lambda c: say(f"{c.name} healthy at {redact_url(c.url)}"))


# ---- down and status ----

def down(data_dir: Path, say: Callable[[str], None] | None = None) -> list[str]:
    """Stop every process the recorded stack started (workers first, Redis last); returns their names. Nothing
    recorded: nothing to do."""
    say = say or log.info
    path = stack_dir(Path(data_dir).expanduser()) / STATE
    if not path.exists():
        return []
    state = StackState.load(path)
    order = sorted(state.components, key=lambda c: (not c.name.startswith("worker"), c.name == "redis"))
    stopped = []
    for c in order:
        if stop_group(c.pid):
            stopped.append(c.name)
            say(f"stopped {c.name} (pid {c.pid})")
    path.unlink(missing_ok=True)
    return stopped


def status(data_dir: Path) -> list[dict[str, Any]]:
    """Every recorded process: name, pid, address (a password in it redacted), alive, healthy."""
    path = stack_dir(Path(data_dir).expanduser()) / STATE
    if not path.exists():
        return []
    state = StackState.load(path)
    return [{"name": c.name, "pid": c.pid, "url": redact_url(c.url), "alive": alive(c.pid),
             "healthy": alive(c.pid) and probe(c, state), "log": c.log} for c in state.components]
