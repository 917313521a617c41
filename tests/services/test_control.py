"""The control plane over HTTP (a real uvicorn process over a real redis-server): formats,
calibrations, placement policies, the cache registry, stats, metrics and the bearer token."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch

from planekv.kvstore import Calibration, FormatSpec, calibrate

from .conftest import TOKEN, Proc, client, redis_client


def make_calibration(seed: int, layers: int = 2, heads: int = 2, d: int = 64, **meta: object) -> Calibration:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(layers, heads, 64, d, generator=g), torch.randn(layers, heads, 64, d, generator=g)
    return calibrate(k, v, seed_k=FormatSpec.seed_k, seed_v=FormatSpec.seed_v, meta=dict(meta))


def make_spec(calib: Calibration, model: str | None = None, **kw: object) -> FormatSpec:
    return FormatSpec(model_id=model or f"toy-{uuid.uuid4().hex[:6]}", n_layers=calib.n_layers, n_q_heads=4,
                      n_kv_heads=calib.n_kv_heads, head_dim=calib.head_dim, calibration_id=calib.calibration_id, **kw)


def put_calib(c: httpx.Client, cid: str, blob: bytes) -> httpx.Response:
    return c.put(f"/v1/calibrations/{cid}", content=blob, headers={"content-type": "application/octet-stream"})


def calibrated_spec(c: httpx.Client, calib: Calibration, model: str | None = None, **kw: object) -> FormatSpec:
    """A spec on ``calib``, whose calibration is registered first (a format's calibration must be)."""
    r = put_calib(c, calib.calibration_id, calib.to_bytes())
    assert r.status_code in (200, 201), r.text
    return make_spec(calib, model, **kw)


# ---- calibrations


def test_calibration_upload_round_trip(ctl):
    calib = make_calibration(1, note="round trip")
    blob = calib.to_bytes()
    r = put_calib(ctl, calib.calibration_id, blob)
    assert r.status_code == 201, r.text
    meta = r.json()
    assert meta["calibration_id"] == calib.calibration_id and meta["bytes"] == len(blob)
    assert (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"]) == (2, 2, 64) and meta["source"] == "upload"
    assert meta["meta"]["note"] == "round trip"
    art = ctl.get(f"/v1/calibrations/{calib.calibration_id}/artifact")
    assert art.status_code == 200 and art.content == blob
    back = Calibration.from_bytes(art.content)
    assert back.calibration_id == calib.calibration_id and torch.equal(back.sigma_k, calib.sigma_k)
    listed = ctl.get("/v1/calibrations").json()["calibrations"]
    assert [c["calibration_id"] for c in listed].count(calib.calibration_id) == 1
    assert ctl.get(f"/v1/calibrations/{calib.calibration_id}").json()["version"] == meta["version"]


def test_calibrations_are_immutable_and_versioned(ctl):
    calib = make_calibration(2)
    assert put_calib(ctl, calib.calibration_id, calib.to_bytes()).status_code == 201
    again = put_calib(ctl, calib.calibration_id, calib.to_bytes())
    assert again.status_code == 200  # same bytes: idempotent
    other = Calibration(calib.mu_k, calib.sigma_k, calib.mu_v, calib.sigma_v, calib.seed_k, calib.seed_v,
                        meta={"other": "meta"})  # same statistics, so the same id, other bytes
    assert other.calibration_id == calib.calibration_id
    r = put_calib(ctl, calib.calibration_id, other.to_bytes())
    assert r.status_code == 409 and "immutable" in r.json()["detail"]
    assert ctl.get(f"/v1/calibrations/{calib.calibration_id}/artifact").content == calib.to_bytes()
    later = make_calibration(3)
    v1 = ctl.get(f"/v1/calibrations/{calib.calibration_id}").json()["version"]
    v2 = put_calib(ctl, later.calibration_id, later.to_bytes()).json()["version"]
    assert v2 > v1


def test_bad_calibration_uploads_are_400_with_a_reason(ctl):
    calib = make_calibration(4)
    blob = calib.to_bytes()
    r = put_calib(ctl, "0123456789abcdef", blob)
    assert r.status_code == 400 and f"PUT it at /v1/calibrations/{calib.calibration_id}" in r.json()["detail"]
    r = put_calib(ctl, calib.calibration_id, b"not an artifact")
    assert r.status_code == 400 and "not a calibration artifact" in r.json()["detail"]
    r = put_calib(ctl, calib.calibration_id, blob[: len(blob) // 2])
    assert r.status_code == 400 and "not a valid calibration artifact" in r.json()["detail"]
    assert put_calib(ctl, calib.calibration_id, b"").status_code == 400
    assert ctl.get(f"/v1/calibrations/{calib.calibration_id}").status_code == 404  # nothing half-registered
    assert ctl.get("/v1/calibrations/0123456789abcdef/artifact").status_code == 404


@pytest.mark.parametrize("where", ["../../outside.bin", "{outside}"])
def test_the_artifact_route_serves_only_files_in_the_calibration_directory(ctl, control: Proc, redis_url, where):
    import hashlib

    from planekv.services import index as ix

    calib = make_calibration(30 + len(where))
    assert put_calib(ctl, calib.calibration_id, calib.to_bytes()).status_code == 201
    assert control.data_dir is not None
    secret = control.data_dir / "outside.bin"  # next to data_dir/control/calibrations, not in it
    secret.write_bytes(b"not for clients")
    key = ix.k_calibration(calib.calibration_id)
    with redis_client(redis_url) as r:
        honest = r.hgetall(key)
        # the worst case: the record names the file and carries its sha256, so the checksum would pass
        r.hset(key, mapping={"file": where.format(outside=secret),
                             "sha256": hashlib.sha256(secret.read_bytes()).hexdigest()})
        try:
            art = ctl.get(f"/v1/calibrations/{calib.calibration_id}/artifact")
            assert art.status_code == 500 and b"not for clients" not in art.content
            assert "outside the calibration directory" in art.json()["detail"]
        finally:
            r.hset(key, mapping=honest)
    assert ctl.get(f"/v1/calibrations/{calib.calibration_id}/artifact").content == calib.to_bytes()


def test_calibration_computed_from_statistics_or_samples(ctl):
    stats = {"mu_k": [[[0.0] * 8]], "sigma_k": [[[1.0] * 8]], "mu_v": [[[0.5] * 8]], "sigma_v": [[[2.0] * 8]]}
    r = ctl.post("/v1/calibrations", json={"statistics": stats, "meta": {"why": "test"}})
    assert r.status_code in (200, 201) and r.json()["source"] in ("computed", "upload")
    cid = r.json()["calibration_id"]
    calib = Calibration.from_bytes(ctl.get(f"/v1/calibrations/{cid}/artifact").content)
    assert torch.allclose(calib.sigma_v, torch.full((1, 1, 8), 2.0))
    samples = {"k": [[[[0.1 * i + j for j in range(8)] for i in range(5)]]],
               "v": [[[[0.3 * i - j for j in range(8)] for i in range(5)]]]}
    assert ctl.post("/v1/calibrations", json={"samples": samples}).status_code in (200, 201)
    bad = ctl.post("/v1/calibrations", json={"statistics": {**stats, "sigma_k": [[[1.0] * 7]]}})
    assert bad.status_code == 400 and "shape" in bad.json()["detail"]
    both = ctl.post("/v1/calibrations", json={"statistics": stats, "samples": samples})
    assert both.status_code == 422 and "exactly one" in both.text


def test_the_evaluation_client_contract(control: Proc):
    from planekv.evaluation.client import register_calibration

    calib = make_calibration(5)
    ok, msg = register_calibration(calib, control.url, TOKEN)
    assert ok and "created" in msg
    ok, msg = register_calibration(calib, control.url, TOKEN)
    assert ok and "same bytes" in msg
    ok, msg = register_calibration(calib, control.url, None)
    assert not ok and "401" in msg


# ---- formats


def test_format_registration_is_idempotent_and_conflicts_are_409(ctl):
    calib = make_calibration(6)
    spec = calibrated_spec(ctl, calib)
    r = ctl.put(f"/v1/formats/{spec.format_id}", json=spec.to_dict())
    assert r.status_code == 201 and r.json()["format_id"] == spec.format_id
    assert FormatSpec.from_dict(r.json()["spec"]) == spec
    assert ctl.put(f"/v1/formats/{spec.format_id}", json=spec.to_dict()).status_code == 200
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 200
    # another spec under this id
    other = make_spec(calib, page_size=128)
    r = ctl.put(f"/v1/formats/{spec.format_id}", json=other.to_dict())
    assert r.status_code == 409 and other.format_id in r.json()["detail"]
    assert ctl.get(f"/v1/formats/{spec.format_id}").json()["spec"]["page_size"] == 64
    assert spec.format_id in [f["format_id"] for f in ctl.get("/v1/formats").json()["formats"]]
    # the V run layout is part of the identity and survives the round trip
    runs = make_spec(calib, v_run=4)
    r = ctl.post("/v1/formats", json=runs.to_dict())
    assert r.status_code == 201 and r.json()["format_id"] == runs.format_id != spec.format_id
    assert FormatSpec.from_dict(ctl.get(f"/v1/formats/{runs.format_id}").json()["spec"]).v_run == 4


def test_a_format_that_contradicts_its_calibration_is_409(ctl):
    calib = make_calibration(7)
    assert put_calib(ctl, calib.calibration_id, calib.to_bytes()).status_code == 201
    bad = FormatSpec(model_id="toy", n_layers=3, n_q_heads=4, n_kv_heads=2, head_dim=64,
                     calibration_id=calib.calibration_id)
    r = ctl.post("/v1/formats", json=bad.to_dict())
    assert r.status_code == 409 and "calibration" in r.json()["detail"]
    assert ctl.get(f"/v1/formats/{bad.format_id}").status_code == 404


def test_a_format_naming_an_unregistered_calibration_is_409_and_registers_nothing(ctl):
    calib = make_calibration(12)
    spec = make_spec(calib)
    for r in (ctl.post("/v1/formats", json=spec.to_dict()), ctl.put(f"/v1/formats/{spec.format_id}",
                                                                     json=spec.to_dict())):
        assert r.status_code == 409 and r.json()["error"] == "CalibrationNotRegistered", r.text
        detail = r.json()["detail"]
        assert calib.calibration_id in detail and f"PUT /v1/calibrations/{calib.calibration_id}" in detail
    assert ctl.get(f"/v1/formats/{spec.format_id}").status_code == 404
    assert spec.format_id not in [f["format_id"] for f in ctl.get("/v1/formats").json()["formats"]]
    # registered as the message says, the same request succeeds
    assert put_calib(ctl, calib.calibration_id, calib.to_bytes()).status_code == 201
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
    assert ctl.get(f"/v1/formats/{spec.format_id}").json()["spec"]["calibration_id"] == calib.calibration_id


def test_an_invalid_spec_is_422_with_the_rule(ctl):
    spec = make_spec(make_calibration(8)).to_dict()
    r = ctl.post("/v1/formats", json={**spec, "n_q_heads": 3})
    assert r.status_code == 422 and "multiple of n_kv_heads" in r.text
    r = ctl.post("/v1/formats", json={**spec, "surprise": 1})
    assert r.status_code == 422 and "surprise" in r.text
    r = ctl.post("/v1/formats", json={**spec, "width": 6, "v_run": 4})
    assert r.status_code == 422 and "v_run" in r.text


# ---- placement policies


def test_policy_create_update_activate_rollback_history(ctl):
    name = f"pol-{uuid.uuid4().hex[:6]}"
    r = ctl.post("/v1/policies", json={"name": name, "policy": {"hot_planes": {"k": 4, "v": 2}}, "comment": "first"})
    assert r.status_code == 201 and r.json()["active_version"] == 1
    assert ctl.post("/v1/policies", json={"name": name, "policy": {}}).status_code == 409
    r = ctl.put(f"/v1/policies/{name}", json={"policy": {"hot_planes": {"k": 6, "v": 3}}})
    assert r.status_code == 201 and r.json()["version"] == 2 and not r.json()["active"]
    same = ctl.put(f"/v1/policies/{name}", json={"policy": {"hot_planes": {"k": 6, "v": 3}}})
    assert same.status_code == 200 and same.json()["version"] == 2  # no duplicate version
    r = ctl.put(f"/v1/policies/{name}", json={"policy": {"hot_planes": {"k": 2, "v": 2}, "prefetch_depth": 4},
                                             "activate": True})
    assert r.status_code == 201 and r.json()["version"] == 3 and r.json()["active"]
    assert ctl.post(f"/v1/policies/{name}/activate", json={"version": 2}).json()["active_version"] == 2
    active = ctl.get(f"/v1/policies/{name}/active")
    assert active.json()["policy"]["hot_planes"] == {"k": 6, "v": 3} and active.headers["etag"] == f'"{name}:2"'
    assert ctl.post(f"/v1/policies/{name}/rollback").json()["active_version"] == 3
    assert ctl.post(f"/v1/policies/{name}/rollback").json()["active_version"] == 1
    r = ctl.post(f"/v1/policies/{name}/rollback")
    assert r.status_code == 409 and "roll back" in r.json()["detail"]
    events = [(e["action"], e["version"]) for e in ctl.get(f"/v1/policies/{name}/history").json()["events"]]
    assert events == [("created", 1), ("updated", 2), ("updated", 3), ("activated", 3), ("activated", 2),
                      ("rolled_back", 3), ("rolled_back", 1)]
    versions = ctl.get(f"/v1/policies/{name}/versions").json()["versions"]
    assert [v["version"] for v in versions] == [1, 2, 3] and [v["active"] for v in versions] == [True, False, False]
    assert ctl.get(f"/v1/policies/{name}/versions/3").json()["policy"]["prefetch_depth"] == 4
    assert ctl.get(f"/v1/policies/{name}/versions/9").status_code == 404
    assert ctl.post(f"/v1/policies/{name}/activate", json={"version": 9}).status_code == 404
    assert name in [p["name"] for p in ctl.get("/v1/policies").json()["policies"]]


@pytest.mark.parametrize("policy, words", [
    ({"hot_planes": {"k": 9, "v": 1}}, "less than or equal to 8"),
    ({"width": 4, "hot_planes": {"k": 6, "v": 1}}, "exceed the width"),
    ({"block_bytes": (1 << 20) + 1}, "multiple of 4096"),
    ({"block_bytes": 4096}, "greater than or equal to 1048576"),
    ({"tiers": [{"name": "file", "capacity_bytes": 1}, {"name": "gpu", "capacity_bytes": 1}]}, "fastest first"),
    ({"tiers": []}, "at least 1"),
    ({"eviction": "random"}, "lru"),
    ({"fetch_deadline_ms": 0}, "greater than 0"),
    ({"layer_overrides": [{"layers": [1], "hot_planes": {"k": 1, "v": 1}},
                          {"layers": [1], "hot_planes": {"k": 2, "v": 2}}]}, "two overrides"),
])
def test_invalid_policies_are_422_with_the_rule(ctl, policy, words):
    r = ctl.post("/v1/policies", json={"name": f"bad-{uuid.uuid4().hex[:6]}", "policy": policy})
    assert r.status_code == 422 and words in r.text, r.text


def test_a_policy_bound_to_a_format_is_checked_against_it(ctl):
    spec = calibrated_spec(ctl, make_calibration(9))
    name = f"pol-{uuid.uuid4().hex[:6]}"
    r = ctl.post("/v1/policies", json={"name": name, "policy": {"format_id": spec.format_id}})
    assert r.status_code == 400 and "not registered" in r.json()["detail"]
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
    over = {"format_id": spec.format_id, "layer_overrides": [{"layers": [7], "hot_planes": {"k": 1, "v": 1}}]}
    r = ctl.post("/v1/policies", json={"name": name, "policy": over})
    assert r.status_code == 400 and "has 2 layers" in r.json()["detail"]
    assert ctl.post("/v1/policies", json={"name": name, "policy": {"format_id": spec.format_id}}).status_code == 201


# ---- cache registry, stats, metrics, auth


def test_cache_registry(ctl):
    spec = calibrated_spec(ctl, make_calibration(10))
    sq = f"seq-{uuid.uuid4().hex[:8]}"
    r = ctl.put(f"/v1/caches/{sq}", json={"format_id": spec.format_id})
    assert r.status_code == 400 and "not registered" in r.json()["detail"]
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
    r = ctl.put(f"/v1/caches/{sq}", json={"format_id": spec.format_id, "n_tokens": 4096,
                                          "hot_planes": {"k": 3, "v": 2}})
    assert r.status_code == 201, r.text
    d = r.json()
    assert d["format_id"] == spec.format_id and d["n_tokens"] == 4096
    assert d["tiers"] == {"gpu": {"blocks": 0, "bytes": 0, "planes": {"k": ["0-3"], "v": ["0-2"]}, "stores": []}}
    assert ctl.put(f"/v1/caches/{sq}", json={"format_id": spec.format_id, "n_tokens": 5000}).status_code == 200
    other = calibrated_spec(ctl, make_calibration(11))
    ctl.post("/v1/formats", json=other.to_dict())
    r = ctl.put(f"/v1/caches/{sq}", json={"format_id": other.format_id})
    assert r.status_code == 409 and "one format" in r.json()["detail"]
    listed = ctl.get("/v1/caches", params={"limit": 10_000}).json()
    assert sq in [c["sequence_id"] for c in listed["caches"]] and listed["total"] >= 1
    assert ctl.delete(f"/v1/caches/{sq}").status_code == 204
    assert ctl.get(f"/v1/caches/{sq}").status_code == 404
    assert ctl.delete(f"/v1/caches/{sq}").status_code == 404


def test_stats_and_metrics(ctl, control: Proc):
    s = ctl.get("/v1/stats").json()
    assert {"formats", "calibrations", "policies", "caches", "stores", "tiers"} <= set(s)
    ctl.get("/v1/formats")
    text = httpx.get(f"{control.url}/metrics").text
    assert "planekv_control_formats " in text and "planekv_control_calibrations " in text
    assert 'planekv_control_http_requests_total{method="GET",route="/v1/formats",status="200"}' in text
    assert "planekv_control_http_request_seconds_bucket" in text


def test_bearer_token_is_required_and_accepted(control: Proc):
    with client(control.url, token=None) as anon, client(control.url, token="nope") as wrong:
        for method, path in (("GET", "/v1/formats"), ("POST", "/v1/policies"), ("GET", "/v1/stats"),
                             ("PUT", "/v1/calibrations/0123456789abcdef")):
            for c in (anon, wrong):
                r = c.request(method, path)
                assert r.status_code == 401 and "Bearer" in r.json()["detail"], (method, path)
        assert anon.get("/healthz").json()["status"] == "ok"
        assert anon.get("/readyz").json() == {"status": "ready", "failing": [], "checks": {"redis": "ok"}}
        schema = anon.get("/openapi.json").json()
        assert "HTTPBearer" in schema["components"]["securitySchemes"]
    with client(control.url) as ok:
        assert ok.get("/v1/formats").status_code == 200


def test_oversized_bodies_are_413(ctl):
    r = ctl.put("/v1/calibrations/0123456789abcdef", content=b"\0" * ((64 << 20) + 1))
    assert r.status_code == 413 and "limit" in r.json()["detail"]
