"""Restarts and a hung Redis, on a cluster of this module's own (redis-server with its append-only
file, control plane, write-through store): Redis, the control plane and the store each restarted
lose no format, calibration, policy, cache or committed block; a hung Redis makes requests answer
503 within a bound (not hang) and everything works again once it resumes."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from planekv.tiering import BlockKey, encode_frame

from .conftest import Proc, client, start_control, start_redis, start_store
from .test_control import calibrated_spec, make_calibration, make_spec, put_calib
from .test_store_faults import assert_consistent, indexed
from .test_store_lifecycle import blocks
from .test_store_reconcile import a_block, publish_without_storing

HUNG_BOUND_S = 60.0  # the client's own timeout: a request still hanging after this has hung for good


@dataclass
class Cluster:
    workdir: Path
    redis: Proc
    control: Proc
    store: Proc

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis.port}/0"

    def store_args(self) -> tuple[str, ...]:
        return ("--write-through", "--spill-dir", str(self.workdir / "spill"), "--reconcile-interval-s", "0.5")

    def restart_redis(self) -> None:
        """SIGKILL (no shutdown save) and start again on the same directory and port."""
        self.redis.stop(signal.SIGKILL)
        # --appendfsync always: every acknowledged write is on disk before Redis answers, so the
        # kill can come at once (with everysec, up to a second of writes could be lost)
        self.redis = start_redis(self.workdir, port=self.redis.port, appendfsync="always")

    def restart_control(self) -> None:
        self.control.stop()
        self.control = start_control(self.workdir / "control", self.redis_url)

    def restart_store(self) -> None:
        self.store.stop()
        self.store = start_store(self.workdir, self.redis_url, *self.store_args(), port=self.store.port)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    d = tmp_path_factory.mktemp("cluster")
    (d / "control").mkdir()
    r = start_redis(d, appendfsync="always")
    url = f"redis://127.0.0.1:{r.port}/0"
    c = Cluster(d, r, start_control(d / "control", url), start_store(d, url, "--write-through", "--spill-dir",
                                                                        str(d / "spill"), "--reconcile-interval-s",
                                                                        "0.5"))
    yield c
    for p in (c.store, c.control, c.redis):
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)  # in case a test left it stopped
        p.stop()


def register_everything(ctl: httpx.Client) -> dict[str, str]:
    calib = make_calibration(21)
    assert put_calib(ctl, calib.calibration_id, calib.to_bytes()).status_code == 201
    spec = make_spec(calib)
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
    policy = f"pol-{uuid.uuid4().hex[:6]}"
    r = ctl.post("/v1/policies", json={"name": policy, "policy": {"hot_planes": {"k": 4, "v": 2}}})
    assert r.status_code == 201
    seq = f"seq-{uuid.uuid4().hex[:8]}"
    assert ctl.put(f"/v1/caches/{seq}", json={"format_id": spec.format_id, "policy": policy}).status_code == 201
    return {"calibration": calib.calibration_id, "format": spec.format_id, "policy": policy, "seq": seq}


def assert_registered(ctl: httpx.Client, reg: dict[str, str], n_blocks: int) -> None:
    assert ctl.get(f"/v1/calibrations/{reg['calibration']}").status_code == 200
    assert ctl.get(f"/v1/calibrations/{reg['calibration']}/artifact").status_code == 200
    assert ctl.get(f"/v1/formats/{reg['format']}").json()["format_id"] == reg["format"]
    assert ctl.get(f"/v1/policies/{reg['policy']}/active").json()["policy"]["hot_planes"] == {"k": 4, "v": 2}
    cache = ctl.get(f"/v1/caches/{reg['seq']}").json()
    assert cache["format_id"] == reg["format"] and cache["policy"] == reg["policy"]
    assert cache["tiers"]["file"]["blocks"] == n_blocks


def test_redis_control_plane_and_store_restarts_lose_nothing(cluster: Cluster):
    with client(cluster.control.url) as ctl:
        reg = register_everything(ctl)
    keys = [BlockKey(reg["format"], reg["seq"], "k", layer, 1, 0, 32, 3, 8) for layer in range(3)]
    bs = [(k, encode_frame(k, bytes([k.layer + 1]) * 300_000)) for k in keys]
    with client(cluster.store.url) as st:
        for k, f in bs:
            assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
    for restart in (cluster.restart_redis, cluster.restart_control, cluster.restart_store):
        restart()
        with client(cluster.control.url) as ctl, client(cluster.store.url) as st:
            assert_registered(ctl, reg, len(bs))
            assert assert_consistent(st, cluster.redis_url, bs) == {str(k) for k, _ in bs}, restart.__name__
            # a sequence keeps its one format across the restart
            other = calibrated_spec(ctl, make_calibration(22))
            assert ctl.post("/v1/formats", json=other.to_dict()).status_code in (200, 201)
            r = ctl.put(f"/v1/caches/{reg['seq']}", json={"format_id": other.format_id})
            assert r.status_code == 409 and "one format" in r.json()["detail"]


def test_a_delete_while_redis_is_down_is_refused_and_the_block_kept(cluster: Cluster):
    (k, f), = blocks(1)
    with client(cluster.store.url) as st:
        assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
        cluster.redis.stop(signal.SIGKILL)
        try:
            r = st.delete(f"/v1/blocks/{k}")
            assert r.status_code == 503 and "nothing was deleted" in r.json()["detail"], r.text
            assert st.get(f"/v1/blocks/{k}").content == f
            ready = st.get("/readyz")
            assert ready.status_code == 503 and "redis" in ready.json()["failing"]
        finally:
            cluster.redis = start_redis(cluster.workdir, port=cluster.redis.port, appendfsync="always")
        assert st.delete(f"/v1/blocks/{k}").status_code == 204
        assert st.get(f"/v1/blocks/{k}").status_code == 404
        assert indexed(cluster.redis_url, k.sequence_id, st.get("/v1/stats").json()["store_id"]) == set()


def test_periodic_reconciliation_clears_a_stale_index_entry(cluster: Cluster):
    k, f = a_block()
    with client(cluster.store.url) as st, client(cluster.control.url) as ctl:
        store_id = st.get("/v1/stats").json()["store_id"]
        publish_without_storing(cluster.redis_url, store_id, k, f)
        deadline = time.monotonic() + 30  # the store reconciles every 0.5 s (--reconcile-interval-s)
        while indexed(cluster.redis_url, k.sequence_id, store_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert indexed(cluster.redis_url, k.sequence_id, store_id) == set()
        assert ctl.delete(f"/v1/caches/{k.sequence_id}").status_code == 204


def test_a_hung_redis_answers_503_within_a_bound_and_recovers(cluster: Cluster):
    (k, f), (k2, f2) = blocks(2)
    with client(cluster.store.url) as st, client(cluster.control.url) as ctl:
        for c in (st, ctl):
            c.timeout = httpx.Timeout(HUNG_BOUND_S)
        assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
        os.kill(cluster.redis.proc.pid, signal.SIGSTOP)
        try:
            took: dict[str, float] = {}
            for name, call in (("control GET /v1/formats", lambda: ctl.get("/v1/formats")),
                               ("control /readyz", lambda: ctl.get("/readyz")),
                               ("store PUT", lambda: st.put(f"/v1/blocks/{k2}", content=f2)),
                               ("store DELETE", lambda: st.delete(f"/v1/blocks/{k}")),
                               ("store /readyz", lambda: st.get("/readyz"))):
                t0 = time.monotonic()
                r = call()
                took[name] = round(time.monotonic() - t0, 1)
                assert r.status_code == 503, (name, r.status_code, r.text)
                detail = r.json().get("detail") or r.json().get("checks", {}).get("redis", "")
                assert "Redis" in detail or "index" in detail or "Timeout" in detail, (name, detail)
            print(f"hung Redis: seconds to the 503: {took}")
            assert st.get(f"/v1/blocks/{k}").content == f  # reads need no Redis: still served
        finally:
            os.kill(cluster.redis.proc.pid, signal.SIGCONT)
        assert ctl.get("/v1/formats").status_code == 200
        assert st.post("/v1/reconcile").status_code == 200  # whatever the hung commands left is cleared
        assert st.put(f"/v1/blocks/{k2}", content=f2).status_code == 201
        assert st.get("/readyz").status_code == 200 and ctl.get("/readyz").status_code == 200
        assert assert_consistent(st, cluster.redis_url, [(k, f), (k2, f2)]) == {str(k), str(k2)}
