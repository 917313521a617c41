"""The store across restarts and failures: the index is rebuilt from disk after a kill, a clean
shutdown persists memory-only blocks, and a failed write (disk or Redis) leaves nothing visible."""

from __future__ import annotations

import signal
import uuid

from planekv.tiering import BlockKey, encode_frame

from .conftest import client, start_redis, start_store


def blocks(n: int, size: int = 300_000) -> list[tuple[BlockKey, bytes]]:
    fmt, sq = uuid.uuid4().hex[:16], f"seq-{uuid.uuid4().hex[:8]}"
    out = []
    for layer in range(n):
        k = BlockKey(fmt, sq, "k", layer, 1, 0, 32, 3, 8)
        out.append((k, encode_frame(k, bytes([layer + 1]) * size)))
    return out


def test_index_is_rebuilt_from_disk_after_a_kill(tmp_path, redis_url, ctl):
    spill = tmp_path / "spill"
    s = start_store(tmp_path, redis_url, "--write-through", "--spill-dir", str(spill))
    bs = blocks(3)
    with client(s.url) as c:
        for k, f in bs:
            assert c.put(f"/v1/blocks/{k}", content=f).status_code == 201
    s.stop(signal.SIGKILL)  # no shutdown hook runs
    seq_dir = spill / bs[0][0].format_id / bs[0][0].sequence_id
    (seq_dir / ".tmp-torn").write_bytes(b"half a frame that never committed")
    s2 = start_store(tmp_path, redis_url, "--write-through", "--spill-dir", str(spill), port=s.port)
    try:
        with client(s2.url) as c:
            for k, f in bs:
                r = c.get(f"/v1/blocks/{k}")
                assert r.status_code == 200 and r.content == f
            st = c.get("/v1/stats").json()
            assert st["blocks"] == 3 and st["file"]["blocks"] == 3 and st["memory"]["blocks"] == 0
        assert not (seq_dir / ".tmp-torn").exists()
        d = ctl.get(f"/v1/caches/{bs[0][0].sequence_id}").json()
        assert d["tiers"]["file"]["blocks"] == 3 and "memory" not in d["tiers"]  # republished, stale entries gone
    finally:
        s2.stop()


def test_clean_shutdown_persists_blocks_held_only_in_memory(tmp_path):
    spill = tmp_path / "spill"
    # write-back, no Redis index, no token (then no route asks for one)
    s = start_store(tmp_path, None, "--spill-dir", str(spill), token=None)
    bs = blocks(3)
    with client(s.url, token=None) as c:
        assert "securitySchemes" not in c.get("/openapi.json").json().get("components", {})
        for k, f in bs:
            assert c.put(f"/v1/blocks/{k}", content=f).json()["tiers"] == ["memory"]
    s.stop(signal.SIGTERM)
    s2 = start_store(tmp_path, None, "--spill-dir", str(spill), port=s.port, token=None)
    try:
        with client(s2.url, token=None) as c:
            assert all(c.get(f"/v1/blocks/{k}").content == f for k, f in bs)
    finally:
        s2.stop()


def test_a_failed_disk_write_publishes_nothing(tmp_path, redis_url, ctl):
    spill = tmp_path / "spill"
    (k, f), = blocks(1)
    spill.mkdir()
    (spill / k.format_id).write_bytes(b"a file where the format's directory must go")  # makes the write fail
    s = start_store(tmp_path, redis_url, "--write-through", "--spill-dir", str(spill))
    try:
        with client(s.url) as c:
            r = c.put(f"/v1/blocks/{k}", content=f)
            assert r.status_code == 507 and "file tier failed" in r.json()["detail"]
            assert c.get(f"/v1/blocks/{k}").status_code == 404
            assert c.get("/v1/blocks", params={"format_id": k.format_id}).json()["blocks"] == []
            st = c.get("/v1/stats").json()
            assert st["memory"]["used_bytes"] == 0 and st["file"]["used_bytes"] == 0
            assert ctl.get(f"/v1/caches/{k.sequence_id}").status_code == 404  # no metadata was published
            (spill / k.format_id).unlink()
            assert c.put(f"/v1/blocks/{k}", content=f).status_code == 201  # the key is free
        assert not list(spill.rglob(".tmp-*"))
    finally:
        s.stop()


def test_an_unreachable_index_undoes_the_write(tmp_path):
    r = start_redis(tmp_path)
    s = start_store(tmp_path, f"redis://127.0.0.1:{r.port}/0", "--write-through", "--spill-dir", str(tmp_path / "sp"))
    try:
        (k, f), = blocks(1)
        r.stop(signal.SIGKILL)
        with client(s.url) as c:
            resp = c.put(f"/v1/blocks/{k}", content=f)
            assert resp.status_code == 503 and "undone" in resp.json()["detail"]
            assert c.get(f"/v1/blocks/{k}").status_code == 404
            assert c.get("/v1/stats").json()["file"]["used_bytes"] == 0
        assert not list((tmp_path / "sp").rglob("*.blk"))
    finally:
        s.stop()
        r.stop()
