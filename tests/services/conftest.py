"""Real processes on free loopback ports: a redis-server, the control plane and the store service
(uvicorn), each started once per session, waited for with a bounded loop and stopped by pid.

Every Redis here is started as PlaneKV's launchers start it (planekv.services.launch: a config file with
``requirepass``), with one password per test session in a 0600 file; the services get that file
(``PLANEKV_REDIS_PASSWORD_FILE``), and tests that talk to Redis themselves use :func:`redis_client`."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from planekv.services.launch import free_port, new_secret_file, redis_command, redis_ping, spawn
from planekv.services.redis_auth import read_password_file

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
redis = pytest.importorskip("redis")

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
TOKEN = "test-token-0123"
START_TIMEOUT_S = 60.0

if not os.path.exists(REDIS_SERVER):
    pytest.skip("redis-server is not installed", allow_module_level=True)


@functools.cache
def redis_password_file() -> Path:
    """The file holding the password every Redis of this session requires (mode 0600, removed at exit)."""
    d = Path(tempfile.mkdtemp(prefix="planekv-test-secrets-"))
    atexit.register(shutil.rmtree, d, True)
    return new_secret_file(d / "redis-password")


def redis_client(redis_url: str) -> redis.Redis:
    """A client of a Redis these fixtures started, authenticated with the session's password."""
    return redis.Redis.from_url(redis_url, password=read_password_file(redis_password_file()), decode_responses=True)


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    data_dir: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return ""


def start_redis(workdir: Path, port: int | None = None, appendfsync: str = "everysec") -> Proc:
    """A redis-server started as PlaneKV's launchers start it (planekv.services.launch: the session's password,
    an append-only file) in ``workdir``; started again on the same ``workdir`` and ``port`` it reloads what it
    had."""
    port = port or free_port()
    log = workdir / f"redis-{port}.log"
    proc = spawn(redis_command(REDIS_SERVER, port, workdir, redis_password_file(), appendfsync), dict(os.environ),
                 log)
    p = Proc(proc, port, log)
    password = read_password_file(redis_password_file())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {p.tail()}")
        if redis_ping(port, password, timeout=0.5):
            return p
        time.sleep(0.05)
    p.stop(signal.SIGKILL)
    raise TimeoutError(f"redis-server did not answer PING on {port}")


def service_env(redis_url: str | None, data_dir: Path, token: str | None = TOKEN, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLANEKV_")}
    env.update({"PLANEKV_DATA_DIR": str(data_dir), "PLANEKV_LOG_LEVEL": "WARNING"})
    if redis_url:
        env["PLANEKV_REDIS_URL"] = redis_url
        env["PLANEKV_REDIS_PASSWORD_FILE"] = str(redis_password_file())
    if token:
        env["PLANEKV_API_TOKEN"] = token
    env.update(extra)
    return env


def start_service(cmd: list[str], port: int, env: dict[str, str], log: Path, data_dir: Path) -> Proc:
    """Start ``cmd`` (which must serve /healthz on ``port``) and wait until it answers 200."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    p = Proc(proc, port, log, data_dir)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{p.tail()}")
        try:
            if httpx.get(f"{p.url}/healthz", timeout=1.0).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    p.stop(signal.SIGKILL)
    raise TimeoutError(f"{' '.join(cmd)} did not answer /healthz within {START_TIMEOUT_S} s:\n{p.tail()}")


def start_store(data_dir: Path, redis_url: str | None, *args: str, port: int | None = None,
                token: str | None = TOKEN, **env_extra: str) -> Proc:
    port = port or free_port()
    # the block-protocol tests use throwaway format ids; test_version_safety runs with the default (true)
    env_extra.setdefault("PLANEKV_STORE__REQUIRE_REGISTERED_FORMAT", "false")
    cmd = [sys.executable, "-m", "planekv.services.store", "--port", str(port), *args]
    if redis_url is None:
        cmd.append("--no-redis-index")
    return start_service(cmd, port, service_env(redis_url, data_dir, token, **env_extra),
                         data_dir / f"store-{port}.log", data_dir)


def start_control(data_dir: Path, redis_url: str, token: str | None = TOKEN) -> Proc:
    port = free_port()
    planekv = Path(sys.executable).with_name("planekv")
    cmd = [str(planekv), "control", "--port", str(port)] if planekv.exists() else \
        [sys.executable, "-m", "planekv.services.control", "--port", str(port)]
    return start_service(cmd, port, service_env(redis_url, data_dir, token), data_dir / f"control-{port}.log",
                         data_dir)


def client(url: str, token: str | None = TOKEN) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url, headers=headers, timeout=30.0)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[Proc]:
    p = start_redis(tmp_path_factory.mktemp("redis"))
    yield p
    p.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: Proc) -> str:
    return f"redis://127.0.0.1:{redis_server.port}/0"


@pytest.fixture(scope="session")
def control(tmp_path_factory, redis_url: str) -> Iterator[Proc]:
    p = start_control(tmp_path_factory.mktemp("control"), redis_url)
    yield p
    p.stop()


@pytest.fixture(scope="session")
def store(tmp_path_factory, redis_url: str) -> Iterator[Proc]:
    """A store with a 2 MiB memory tier and a 64 MiB file tier (so spilling is easy to provoke)."""
    d = tmp_path_factory.mktemp("store")
    p = start_store(d, redis_url, "--memory-bytes", str(2 << 20), "--file-bytes", str(64 << 20),
                    "--spill-dir", str(d / "spill"), PLANEKV_STORE__MAX_BLOCK_BYTES=str(8 << 20))
    yield p
    p.stop()


@pytest.fixture()
def ctl(control: Proc) -> Iterator[httpx.Client]:
    with client(control.url) as c:
        yield c


@pytest.fixture()
def st(store: Proc) -> Iterator[httpx.Client]:
    with client(store.url) as c:
        yield c
