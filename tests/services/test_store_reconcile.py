"""Reconciliation of the store's Redis index with its tiers (planekv.services.store.reconcile):
the stuck state of issue 32 (the index lists a block the store lacks, so the control plane refuses
to delete the cache while the store answers 404) is cleared, and a block whose file vanished is
dropped from the store and the index."""

from __future__ import annotations

import uuid

from planekv.services.index import RedisBlockIndex
from planekv.tiering import BlockInfo, BlockKey, encode_frame, verify_frame

from .conftest import Proc, redis_client


def a_block(payload: int = 5000) -> tuple[BlockKey, bytes]:
    k = BlockKey(uuid.uuid4().hex[:16], f"seq-{uuid.uuid4().hex[:8]}", "k", 0, 0, 0, 64, 2, 8)
    return k, encode_frame(k, b"\x05" * payload)


def publish_without_storing(redis_url: str, store_id: str, k: BlockKey, frame: bytes) -> None:
    """What a PUT during a hung Redis, or a store killed -9 in write-back mode, can leave: the index
    entry of a block the store does not hold (here written straight to Redis)."""
    r = redis_client(redis_url)
    try:
        info = BlockInfo(k, len(frame), verify_frame(frame, k).checksum, ("memory",))
        RedisBlockIndex(r, store_id).on_commit(info, uuid.uuid4().hex)
    finally:
        r.close()


def test_an_index_entry_without_a_block_is_reconciled_so_the_cache_can_be_deleted(st, ctl, redis_url):
    k, f = a_block()
    seq = k.sequence_id
    publish_without_storing(redis_url, st.get("/v1/stats").json()["store_id"], k, f)
    # the stuck state: the store has no such block, the control plane says a store holds it
    assert st.get(f"/v1/blocks/{k}").status_code == 404
    r = ctl.delete(f"/v1/caches/{seq}")
    assert r.status_code == 409 and "stores still hold 1 blocks" in r.json()["detail"]
    rep = st.post("/v1/reconcile")
    assert rep.status_code == 200 and rep.json()["index_removed"] >= 1, rep.text
    assert ctl.get(f"/v1/caches/{seq}").json()["tiers"] == {}
    assert ctl.delete(f"/v1/caches/{seq}").status_code == 204
    metrics = st.get("/metrics").text
    assert "planekv_store_reconcile_index_removed_total" in metrics and "planekv_store_reconcile_runs_total" in metrics


def test_a_block_whose_file_vanished_is_dropped_from_the_store_and_the_index(st, ctl, store: Proc):
    k, f = a_block(3 << 20)  # larger than the fixture's 2 MiB memory tier: stored on the file tier only
    r = st.put(f"/v1/blocks/{k}", content=f)
    assert r.status_code == 201 and r.json()["tiers"] == ["file"]
    assert store.data_dir is not None
    files = list((store.data_dir / "spill" / k.format_id / k.sequence_id).glob("*.blk"))
    assert len(files) == 1
    files[0].unlink()  # removed behind the store's back
    rep = st.post("/v1/reconcile").json()
    assert rep["missing_files"] == 1
    assert st.get(f"/v1/blocks/{k}").status_code == 404
    assert st.get("/v1/blocks", params={"sequence_id": k.sequence_id}).json()["blocks"] == []
    assert ctl.get(f"/v1/caches/{k.sequence_id}").json()["tiers"] == {}
    assert ctl.delete(f"/v1/caches/{k.sequence_id}").status_code == 204
    assert "planekv_store_missing_files_total 1.0" in st.get("/metrics").text


def test_readiness_reports_each_dependency(st, ctl):
    r = st.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "failing": [],
                        "checks": {"redis": "ok", "file_tier": "ok", "reconciled": "ok"}}
    assert ctl.get("/readyz").json()["checks"] == {"redis": "ok"}


def test_a_held_block_missing_from_the_index_is_republished(st, redis_url):
    k, f = a_block()
    assert st.put(f"/v1/blocks/{k}", content=f).status_code == 201
    store_id = st.get("/v1/stats").json()["store_id"]
    r = redis_client(redis_url)
    try:
        assert r.hdel(f"pkv:blocks:{k.sequence_id}", f"{k}@{store_id}") == 1  # lost behind the store's back
        assert st.post("/v1/reconcile").json()["republished"] >= 1
        assert r.hexists(f"pkv:blocks:{k.sequence_id}", f"{k}@{store_id}")
    finally:
        r.close()
