"""`planekv bench load` at a toy size: it starts redis-server, the control plane and the store, runs every operation
from 2 clients, reads back exactly what was put, writes its JSON and leaves no process behind (no times asserted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from planekv.bench.load import OPS, LoadConfig, parse_mix
from planekv.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed", allow_module_level=True)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_a_small_load_runs_every_operation_reads_right_and_stops_what_it_started(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    # 68 KiB frames, 16 keys, tiers of 0.25 + 0.5 MiB: the store spills and evicts during the run
    rc = main(["bench", "load", "--clients", "2", "--seconds", "2", "--max-requests", "400", "--block-pages", "8",
               "--keys-per-client", "8", "--memory-mib", "0.25", "--file-mib", "0.5", "--mix", "policy_put=5",
               "--json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0, res["errors"]
    assert res["wrong_reads"] == 0 and res["errors_5xx"] == 0, res["errors"]
    assert 0 < res["requests"] <= 400
    rows = {r["op"]: r for r in res["ops"]}
    assert set(rows) == set(OPS)
    for r in rows.values():
        assert r["count"] > 0 and r["answered"] > 0 and r["wrong_reads"] == 0
        assert {"req_per_s", "p50_ms", "p99_ms", "max_ms", "misses", "errors"} <= set(r)
        assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert not any(k.startswith("status 5") for k in r["errors"]), r
    procs = {p["name"]: p for p in res["processes"]}
    assert {"redis", "control", "store"} <= set(procs)
    for name in ("redis", "control", "store"):
        assert procs[name]["started_here"] and procs[name]["peak_rss_mib"] > 0
        assert gone(procs[name]["pid"]), f"{name} (pid {procs[name]['pid']}) is still running"
    # the capacities hold while the store evicts, but for the victims of the PUTs in flight (a victim is evicted
    # only once its PUT commits: one block per client at most, the blocks being of one size)
    for tier in res["store_tiers"].values():
        assert tier["samples"] > 0
        assert tier["max_used_bytes"] <= tier["capacity_bytes"] + 2 * res["frame_bytes"], tier
    assert res["meta"]["cpus"] and res["meta"]["date"]


def test_the_started_redis_requires_a_password_that_no_command_line_shows(tmp_path: Path) -> None:
    import redis

    from planekv.bench.load import started_services
    from planekv.services.launch import descendants
    from planekv.services.redis_auth import read_password_file

    with started_services(LoadConfig(memory_bytes=1 << 20, file_bytes=1 << 20), tmp_path, lambda s: None) as ep:
        password = read_password_file(tmp_path / "redis-password")
        assert (tmp_path / "redis-password").stat().st_mode & 0o777 == 0o600
        port = int(ep.services[0].url.rsplit(":", 1)[1].split("/")[0])
        with redis.Redis(port=port) as r, pytest.raises(redis.AuthenticationError):  # NOAUTH
            r.ping()
        pids = {s.pid for s in ep.services if s.pid} | {d for s in ep.services if s.pid for d in descendants(s.pid)}
        for pid in pids:
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        for log in tmp_path.glob("*.log"):
            assert password not in log.read_text(), log


def test_the_mix_and_the_bounds_are_checked() -> None:
    assert parse_mix("get=1, put=0")["get"] == 1.0
    with pytest.raises(ValueError, match="op=weight"):
        parse_mix("reads=3")
    with pytest.raises(ValueError, match="not all 0"):
        LoadConfig(mix=dict.fromkeys(OPS, 0.0))
    with pytest.raises(ValueError, match="clients"):
        LoadConfig(clients=0)
