"""`planekv up / status / down` on loopback: the whole stack as processes (redis, Ray head, control, store, one CPU
PlaneWorker on the tiny model), a client that sends requests, a placement policy changed through the REST API and
followed by the worker, Redis requiring a password that nothing shows, and a `down` that leaves no process behind."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")

from planekv.orchestration import stack  # noqa: E402
from planekv.orchestration.stack import Ports, StackError  # noqa: E402
from planekv.services.launch import alive, descendants  # noqa: E402

pytestmark = pytest.mark.slow
LISTEN = "0A"


def _listening(pids: set[int]) -> list[str]:
    """host:port (hex host as /proc/net shows it) of every TCP socket the processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == LISTEN and f[9] in inodes:
                out.append(f[1])
    return out


def _loopback(addr: str) -> bool:
    host = addr.split(":")[0]
    return host in ("0100007F", "00000000000000000000000001000000",  # 127.0.0.1, ::1
                    "0000000000000000FFFF00000100007F")  # ::ffff:127.0.0.1


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory, tiny_model_dir):
    data_dir = tmp_path_factory.mktemp("stack")
    ports = Ports.free()
    state = stack.up(data_dir, ports, workers=1, worker_args=["--model", str(tiny_model_dir), "--calib-tokens",
                                                              "512"], timeout=120)
    yield data_dir, state
    stack.down(data_dir)


def test_up_starts_every_process_healthy_and_on_loopback_only(running_stack):
    data_dir, state = running_stack
    rows = stack.status(data_dir)
    assert [r["name"] for r in rows] == ["redis", "ray", "control", "store", "worker-0"]
    assert all(r["alive"] and r["healthy"] for r in rows), rows
    family = {c.pid for c in state.components} | {p for c in state.components for p in descendants(c.pid)}
    addrs = _listening(family)
    assert addrs and all(_loopback(a) for a in addrs), addrs


def _family(state: stack.StackState) -> set[int]:
    return {c.pid for c in state.components} | {p for c in state.components for p in descendants(c.pid)}


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process ended meanwhile
        return b""


def test_redis_requires_a_password_that_no_command_line_log_state_or_status_shows(running_stack, capsys):
    import redis

    from planekv.cli import main

    data_dir, state = running_stack
    sd = stack.stack_dir(data_dir)
    password = (sd / "redis-password").read_text().strip()
    for private in (sd / "redis-password", sd / "redis" / "redis.conf", sd / "stack.json"):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    port = next(c.port for c in state.components if c.name == "redis")
    with redis.Redis(port=port) as r, pytest.raises(redis.AuthenticationError, match="(?i)auth"):  # NOAUTH
        r.ping()
    with redis.Redis(port=port, password=password) as r:
        assert r.ping()
    pids = _family(state)
    for pid in pids:
        cmdline = _read(f"/proc/{pid}/cmdline")
        assert password.encode() not in cmdline and b"--redis-url" not in cmdline, cmdline
        assert password.encode() not in _read(f"/proc/{pid}/environ"), pid
    for c in state.components:  # only the services are told where Redis and its password file are
        environ = _read(f"/proc/{c.pid}/environ")
        assert (b"PLANEKV_REDIS_PASSWORD_FILE=" in environ) == (c.name in ("control", "store")), c.name
    for log in (sd / "logs").glob("*.log"):
        assert password not in log.read_text(errors="replace"), log
    assert password not in (sd / "stack.json").read_text()
    assert main(["status", "--data-dir", str(data_dir)]) == 0
    out = capsys.readouterr().out
    assert "redis" in out and password not in out


def test_a_second_up_refuses_while_one_runs(running_stack):
    data_dir, _ = running_stack
    with pytest.raises(StackError, match="already running"):
        stack.up(data_dir, Ports.free())


def test_a_client_generates_and_the_worker_follows_the_policy_set_through_the_api(running_stack):
    import ray

    from planekv.orchestration import connect

    data_dir, state = running_stack
    control = next(c.url for c in state.components if c.name == "control")
    try:
        cluster = connect(data_dir)
        cluster.wait_ready(timeout=300)
        prompt = "It was a truth universally acknowledged, that a single man in possession of a good fortune " * 3
        before = cluster.generate([prompt], max_new_tokens=4, rate=4.0, chat=False)[0]
        assert before["new_tokens"] == 4 and before["hot_planes"] is None  # no policy yet: all planes resident
        r = httpx.post(f"{control}/v1/policies", json={"name": "default", "policy": {"hot_planes": {"k": 2, "v": 2}}})
        assert r.status_code == 201, r.text
        after = before
        for _ in range(20):  # the worker asks the control plane again after POLICY_TTL_S (1 s)
            after = cluster.generate([prompt], max_new_tokens=4, rate=4.0, chat=False)[0]
            if after["hot_planes"] is not None:
                break
            time.sleep(0.5)
        assert after["hot_planes"] == 2 and after["tier_bytes"]["host"] > 0
        stats = cluster.stats()[0]
        assert stats["policy_version"] == 1 and stats["requests"]["generate"] >= 2
        metrics = httpx.get(next(c.url for c in state.components if c.name == "worker-0") + "/metrics").text
        assert 'planekv_worker_policy_version{worker="worker-0"} 1.0' in metrics
    finally:
        ray.shutdown()


def test_down_stops_exactly_what_up_started_and_leaves_no_process(tmp_path, tiny_model_dir):
    ports = Ports.free()
    state = stack.up(tmp_path, ports, workers=1, worker_args=["--model", str(tiny_model_dir), "--calib-tokens", "512"],
                     timeout=120)
    family = {c.pid for c in state.components} | {p for c in state.components for p in descendants(c.pid)}
    assert len(family) > len(state.components)  # Ray's and the services' own children are counted too
    stopped = stack.down(tmp_path)
    assert sorted(stopped) == sorted(c.name for c in state.components)
    assert not [p for p in family if alive(p)]
    assert stack.status(tmp_path) == [] and stack.running(tmp_path) is None
    assert stack.down(tmp_path) == []  # nothing recorded: nothing to do
