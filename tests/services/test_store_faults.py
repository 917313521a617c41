"""The store's commit and delete protocols under faults, in a real store process armed with
failpoints (planekv.tiering.failpoints, via PLANEKV_FAILPOINTS): killed (SIGKILL) at each step and
restarted, a full disk, a read-only tier. After each: every acknowledged block is served with its
bytes, nothing half-visible, and the Redis index lists exactly what the store holds."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from planekv.tiering import BlockKey

from .conftest import Proc, client, redis_client, start_store
from .test_store_lifecycle import blocks

FRAME = 4096 + 303104  # the frame of a 300 000-byte payload (test_store_lifecycle.blocks)
AS_ROOT = os.geteuid() == 0  # chmod does not stop root from writing: a failpoint stands in for it


def store_args(spill: Path) -> tuple[str, ...]:
    """Write-through, a file tier of two frames: a third block must evict one."""
    return ("--write-through", "--spill-dir", str(spill), "--memory-bytes", str(4 * FRAME),
            "--file-bytes", str(2 * FRAME))


def listed(c: httpx.Client, seq: str) -> set[str]:
    return {b["key"] for b in c.get("/v1/blocks", params={"sequence_id": seq}).json()["blocks"]}


def indexed(redis_url: str, seq: str, store_id: str) -> set[str]:
    """The block keys the Redis index says this store holds for ``seq``."""
    r = redis_client(redis_url)
    try:
        return {f.rsplit("@", 1)[0] for f in r.hkeys(f"pkv:blocks:{seq}") if f.endswith(f"@{store_id}")}
    finally:
        r.close()


def assert_consistent(c: httpx.Client, redis_url: str, bs: list[tuple[BlockKey, bytes]]) -> set[str]:
    """Every block is served whole or not at all; the store's listing and the index agree. Returns
    the keys held."""
    seq = bs[0][0].sequence_id
    held = set()
    for k, f in bs:
        r = c.get(f"/v1/blocks/{k}")
        assert r.status_code in (200, 404), r.text
        if r.status_code == 200:
            assert r.content == f  # never other bytes
            held.add(str(k))
    assert listed(c, seq) == held
    assert indexed(redis_url, seq, c.get("/v1/stats").json()["store_id"]) == held
    return held


def killed(p: Proc) -> bool:
    return p.proc.wait(30) == -signal.SIGKILL


@pytest.mark.parametrize("point", ["put.after_file_write", "put.after_publish", "put.during_evict"])
def test_a_store_killed_at_each_step_of_a_put_loses_no_acknowledged_block(tmp_path, redis_url, point):
    spill = tmp_path / "spill"
    bs = blocks(3)
    (ka, fa), (kb, fb), (kc, fc) = bs
    s = start_store(tmp_path, redis_url, *store_args(spill), PLANEKV_FAILPOINTS=f"{point}=kill@3")
    with client(s.url) as c:
        assert c.put(f"/v1/blocks/{ka}", content=fa).status_code == 201
        assert c.put(f"/v1/blocks/{kb}", content=fb).status_code == 201
        with pytest.raises(httpx.TransportError):  # the third put dies at the failpoint, unanswered
            c.put(f"/v1/blocks/{kc}", content=fc)
    assert killed(s)
    s2 = start_store(tmp_path, redis_url, *store_args(spill), port=s.port)
    try:
        with client(s2.url) as c:
            held = assert_consistent(c, redis_url, bs)
            assert {str(ka), str(kb)} <= held  # both acknowledged blocks survive the unanswered put
        assert not list(spill.rglob(".tmp-*"))
    finally:
        s2.stop()


def test_a_store_killed_between_the_index_and_the_file_of_a_delete_keeps_the_block_whole(tmp_path, redis_url):
    spill = tmp_path / "spill"
    bs = blocks(2)
    (ka, fa), (kb, fb) = bs
    s = start_store(tmp_path, redis_url, *store_args(spill), PLANEKV_FAILPOINTS="delete.after_index=kill")
    with client(s.url) as c:
        for k, f in bs:
            assert c.put(f"/v1/blocks/{k}", content=f).status_code == 201
        with pytest.raises(httpx.TransportError):
            c.delete(f"/v1/blocks/{ka}")
    assert killed(s)
    s2 = start_store(tmp_path, redis_url, *store_args(spill), port=s.port)
    try:
        with client(s2.url) as c:
            assert assert_consistent(c, redis_url, bs) == {str(ka), str(kb)}  # the unanswered DELETE undone
            assert c.delete(f"/v1/blocks/{ka}").status_code == 204
            assert assert_consistent(c, redis_url, bs) == {str(kb)}
        assert len(list(spill.rglob("*.blk"))) == 1
    finally:
        s2.stop()


def test_a_full_disk_answers_507_and_evicts_no_other_block(tmp_path, redis_url):
    spill = tmp_path / "spill"
    bs = blocks(3)
    (ka, fa), (kb, fb), (kc, fc) = bs
    # the third file write (block C's) fails as a full disk would
    s = start_store(tmp_path, redis_url, *store_args(spill), PLANEKV_FAILPOINTS="file.write=oserror:ENOSPC@3")
    try:
        with client(s.url) as c:
            assert c.put(f"/v1/blocks/{ka}", content=fa).status_code == 201
            assert c.put(f"/v1/blocks/{kb}", content=fb).status_code == 201
            r = c.put(f"/v1/blocks/{kc}", content=fc)
            assert r.status_code == 507 and "No space left on device" in r.json()["detail"]
            assert assert_consistent(c, redis_url, bs) == {str(ka), str(kb)}  # A, the LRU victim, kept
            assert c.get("/v1/stats").json()["file"]["used_bytes"] == 2 * FRAME
            ready = c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["failing"] == ["file_tier"]
            assert "No space left" in ready.json()["checks"]["file_tier"]
            assert c.get("/healthz").status_code == 200  # liveness: the process answers
    finally:
        s.stop()


def test_a_delete_on_a_read_only_tier_is_refused_and_the_block_stays_listed(tmp_path, redis_url):
    spill = tmp_path / "spill"
    bs = blocks(1)
    (ka, fa), = bs
    env = {"PLANEKV_FAILPOINTS": "file.delete=oserror:EROFS"} if AS_ROOT else {}
    s = start_store(tmp_path, redis_url, *store_args(spill), **env)
    dirs = [spill, *(p for p in spill.rglob("*") if p.is_dir())]
    try:
        with client(s.url) as c:
            assert c.put(f"/v1/blocks/{ka}", content=fa).status_code == 201
            for d in dirs:
                d.chmod(0o555)
            r = c.delete(f"/v1/blocks/{ka}")
            assert r.status_code == 503 and r.json()["error"] == "BlockUndeletable", r.text
            assert "could not be deleted" in r.json()["detail"] and "kept" in r.json()["detail"]
            assert assert_consistent(c, redis_url, bs) == {str(ka)}  # still stored, served and indexed
            ready = c.get("/readyz")
            assert ready.status_code == 503 and "file_tier" in ready.json()["failing"]
            assert c.get("/metrics").text.count("planekv_store_delete_failures_total 1.0") == 1
    finally:
        s.stop()
        for d in dirs:
            d.chmod(0o755)
    s2 = start_store(tmp_path, redis_url, *store_args(spill), port=s.port)  # writable again, unarmed
    try:
        with client(s2.url) as c:
            assert assert_consistent(c, redis_url, bs) == {str(ka)}  # not back from the dead: never gone
            assert c.delete(f"/v1/blocks/{ka}").status_code == 204
            assert assert_consistent(c, redis_url, bs) == set()
            assert c.get("/readyz").json()["status"] == "ready"
        assert not list(spill.rglob("*.blk"))
    finally:
        s2.stop()
