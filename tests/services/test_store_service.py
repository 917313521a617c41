"""The store service over HTTP (a real uvicorn process): blocks in, blocks out, every bad input a 4xx
that says what is wrong, spilling under pressure, metrics, the bearer token, the Redis block index."""

from __future__ import annotations

import struct
import uuid

import httpx
import pytest

from planekv.tiering import HEADER_BYTES, BlockKey, encode_frame, iter_frames, verify_frame

from .conftest import Proc, client

PAYLOAD = 600 * 1024  # frame = 4 KiB + 600 KiB: three fit the fixture's 2 MiB memory tier


def fid() -> str:
    return uuid.uuid4().hex[:16]


def seq() -> str:
    return f"seq-{uuid.uuid4().hex[:8]}"


def block(fmt: str, sq: str, layer: int = 0, n: int = PAYLOAD, kind: str = "v") -> tuple[BlockKey, bytes]:
    k = BlockKey(fmt, sq, kind, layer, 0, 0, 64, 2, 8)
    return k, encode_frame(k, bytes([layer % 251 + 1]) * n)


def put(c: httpx.Client, k: BlockKey, frame: bytes) -> httpx.Response:
    return c.put(f"/v1/blocks/{k}", content=frame, headers={"content-type": "application/octet-stream"})


def test_put_get_head_delete_round_trip(st):
    k, f = block(fid(), seq())
    r = put(st, k, f)
    assert r.status_code == 201 and r.json()["created"] and r.json()["size"] == len(f)
    g = st.get(f"/v1/blocks/{k}")
    assert g.status_code == 200 and g.content == f and g.headers["content-type"] == "application/octet-stream"
    assert verify_frame(g.content, k).key == k
    h = st.head(f"/v1/blocks/{k}")
    assert h.status_code == 200 and int(h.headers["content-length"]) == len(f)
    assert st.delete(f"/v1/blocks/{k}").status_code == 204
    r = st.get(f"/v1/blocks/{k}")
    assert r.status_code == 404 and str(k) in r.json()["detail"]
    assert st.delete(f"/v1/blocks/{k}").status_code == 404
    assert st.head(f"/v1/blocks/{k}").status_code == 404


def test_blocks_are_immutable(st):
    k, f = block(fid(), seq())
    assert put(st, k, f).status_code == 201
    again = put(st, k, f)
    assert again.status_code == 200 and not again.json()["created"]
    other = encode_frame(k, b"\x07" * PAYLOAD)
    r = put(st, k, other)
    assert r.status_code == 409 and "immutable" in r.json()["detail"] and r.json()["error"] == "BlockExists"
    assert st.get(f"/v1/blocks/{k}").content == f


def test_batch_get_returns_the_frames_found_in_order(st):
    fmt, sq = fid(), seq()
    blocks = [block(fmt, sq, layer, n=5000) for layer in range(3)]
    for k, f in blocks:
        assert put(st, k, f).status_code == 201
    missing = BlockKey(fmt, sq, "v", 9, 0, 0, 64, 2, 8)
    r = st.post("/v1/blocks:batch-get", json={"keys": [str(blocks[2][0]), str(missing), str(blocks[0][0])]})
    assert r.status_code == 200 and r.headers["x-planekv-missing"] == "1"
    got = [(h.key, bytes(p)) for h, p in iter_frames(r.content)]
    assert [g[0] for g in got] == [blocks[2][0], blocks[0][0]]
    bad = st.post("/v1/blocks:batch-get", json={"keys": ["nope"]})
    assert bad.status_code == 400 and "nope" in bad.json()["detail"]
    assert st.post("/v1/blocks:batch-get", json={"keys": []}).status_code == 422


@pytest.mark.parametrize("damage, error, words", [
    ("magic", "BadMagic", "magic"),
    ("version", "UnknownFrameVersion", "version 7"),
    ("truncate", "FrameTruncated", "truncated"),
    ("checksum", "ChecksumMismatch", "checksum"),
    ("empty", "FrameTruncated", "truncated"),
])
def test_a_damaged_frame_is_refused_with_what_is_wrong(st, damage, error, words):
    k, f = block(fid(), seq(), n=10_000)
    b = bytearray(f)
    if damage == "magic":
        b[:8] = b"XXXXXXXX"
    elif damage == "version":
        struct.pack_into("<H", b, 8, 7)
    elif damage == "truncate":
        b = b[:-5000]
    elif damage == "checksum":
        b[HEADER_BYTES + 17] ^= 0x40
    elif damage == "empty":
        b = bytearray()
    r = put(st, k, bytes(b))
    assert r.status_code == 400, r.text
    assert r.json()["error"] == error and words in r.json()["detail"]
    assert st.get(f"/v1/blocks/{k}").status_code == 404  # nothing half-written is visible


def test_a_frame_put_under_another_key_or_format_is_refused(st):
    fmt, sq = fid(), seq()
    k, f = block(fmt, sq)
    other_key = BlockKey(fmt, sq, "v", 1, 0, 0, 64, 2, 8)
    r = put(st, other_key, f)
    assert r.status_code == 400 and r.json()["error"] == "BlockKeyMismatch"
    other_fmt = BlockKey(fid(), sq, "v", 0, 0, 0, 64, 2, 8)
    r = put(st, other_fmt, f)
    assert r.status_code == 409 and r.json()["error"] == "FormatMismatch" and fmt in r.json()["detail"]


def test_bad_keys_and_oversized_bodies_are_4xx(st):
    r = st.get("/v1/blocks/not-a-key")
    assert r.status_code == 422 and "pattern" in r.text
    fmt = fid()
    r = st.get(f"/v1/blocks/{fmt}:s:k:0:0:5-5:0-1")  # matches the pattern, empty page range
    assert r.status_code == 400 and "page range" in r.json()["detail"]
    big = b"\0" * ((8 << 20) + 1)
    r = st.put(f"/v1/blocks/{fmt}:s:k:0:0:0-1:0-1", content=big)
    assert r.status_code == 413 and "limit" in r.json()["detail"]


def test_pressure_spills_to_the_file_tier_and_every_block_stays_readable(st):
    fmt, sq = fid(), seq()
    blocks = [block(fmt, sq, layer) for layer in range(6)]
    for k, f in blocks:
        assert put(st, k, f).status_code == 201
    listed = {b["key"]: b["tiers"] for b in st.get("/v1/blocks", params={"sequence_id": sq}).json()["blocks"]}
    assert listed[str(blocks[0][0])] == ["file"] and listed[str(blocks[-1][0])] == ["memory"]
    for k, f in blocks:
        g = st.get(f"/v1/blocks/{k}")
        assert g.status_code == 200 and g.content == f
    stats = st.get("/v1/stats").json()
    assert stats["memory"]["used_bytes"] <= stats["memory"]["capacity_bytes"]
    assert stats["counters"]["spills"] >= 3 and stats["counters"]["gets_file"] >= 3


def test_metrics_expose_counters_and_tier_gauges(st, store: Proc):
    k, f = block(fid(), seq(), n=4096)
    put(st, k, f)
    st.get(f"/v1/blocks/{k}")
    text = httpx.get(f"{store.url}/metrics").text  # no token needed for metrics
    for name in ("planekv_store_puts_total", "planekv_store_gets_memory_total", "planekv_store_spills_total",
                 'planekv_store_used_bytes{tier="memory"}', 'planekv_store_capacity_bytes{tier="file"}',
                 'planekv_store_http_requests_total{method="PUT",route="/v1/blocks/{key}",status="201"}'):
        assert name in text, name


def test_bearer_token_is_required_and_accepted(store: Proc):
    k, f = block(fid(), seq(), n=4096)
    with client(store.url, token=None) as anon, client(store.url, token="wrong") as wrong, client(store.url) as ok:
        r = anon.put(f"/v1/blocks/{k}", content=f)
        assert r.status_code == 401 and "Bearer" in r.json()["detail"] and r.headers["www-authenticate"] == "Bearer"
        assert wrong.get(f"/v1/blocks/{k}").status_code == 401
        assert ok.put(f"/v1/blocks/{k}", content=f).status_code == 201
        assert anon.get("/healthz").status_code == 200  # liveness stays open
        assert "bearer" in str(anon.get("/openapi.json").json()["components"]["securitySchemes"]).lower()


def test_block_index_in_redis_feeds_the_cache_registry(st, ctl):
    fmt, sq = fid(), seq()
    blocks = [block(fmt, sq, layer, kind=kind) for layer in range(2) for kind in ("k", "v")]
    for k, f in blocks:
        assert put(st, k, f).status_code == 201
    detail = ctl.get(f"/v1/caches/{sq}")
    assert detail.status_code == 200, detail.text
    d = detail.json()
    assert d["format_id"] == fmt and d["source"] == "store"
    held = {t: v["blocks"] for t, v in d["tiers"].items()}
    assert sum(held.values()) == 4 and set(held) <= {"memory", "file"}
    assert all(v["planes"] in ({"k": ["2-8"], "v": ["2-8"]}, {"k": ["2-8"], "v": []}, {"k": [], "v": ["2-8"]})
               for v in d["tiers"].values())
    # a sequence has one format: a block of another format is refused by the index
    k2, f2 = block(fid(), sq, layer=5)
    r = put(st, k2, f2)
    assert r.status_code == 409 and "one format" in r.json()["detail"]
    assert st.get(f"/v1/blocks/{k2}").status_code == 404
    # the registry entry cannot go while blocks exist; after deleting them it can
    assert ctl.delete(f"/v1/caches/{sq}").status_code == 409
    for k, _ in blocks:
        assert st.delete(f"/v1/blocks/{k}").status_code == 204
    assert ctl.get(f"/v1/caches/{sq}").json()["tiers"] == {}
    assert ctl.delete(f"/v1/caches/{sq}").status_code == 204


def test_a_block_damaged_on_disk_fails_its_checksum_on_read(st, store: Proc):
    from planekv.tiering import PosixFileTier

    fmt, sq = fid(), seq()
    blocks = [block(fmt, sq, layer) for layer in range(5)]  # the first ones spill to the file tier
    for k, f in blocks:
        assert put(st, k, f).status_code == 201
    k0 = blocks[0][0]
    path = PosixFileTier(store.data_dir / "spill", fsync=False).path(k0)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 1000] ^= 0x01
    path.write_bytes(raw)
    r = st.get(f"/v1/blocks/{k0}")
    assert r.status_code == 404 and "failed verification" in r.json()["detail"] and r.json()["error"] == \
        "ChecksumMismatch"
    assert st.get(f"/v1/blocks/{k0}").status_code == 404  # discarded (the file is kept as *.corrupt)
    assert path.with_name(path.name + ".corrupt").exists()
    assert st.get(f"/v1/blocks/{blocks[1][0]}").content == blocks[1][1]
