"""A placement policy must fit its gpu tier: the hot planes of the caches registered under it (n_tokens, each in
its own format) may not need more bytes than the tier's capacity_bytes. Every policy route and the cache registry
refuse what does not fit with 409 PolicyDoesNotFit, naming the numbers, and change nothing."""

from __future__ import annotations

import uuid

import httpx

from planekv.tiering import PlacementPolicy, hot_bytes
from planekv.tiering.placement import HotPlanes

from .test_control import calibrated_spec, make_calibration

GPU = 1 << 20  # the gpu tier of these policies: 1 MiB
SMALL = {"k": 2, "v": 2}  # 2 layers x 2 KV heads x d=64: 8192 bytes per 64 tokens
BIG = {"k": 4, "v": 2}  # 12288 bytes per 64 tokens


def _doc(hot: dict[str, int], gpu: int | None = GPU, **kw: object) -> dict[str, object]:
    tiers = [{"name": "memory", "capacity_bytes": 1 << 30}]
    if gpu is not None:
        tiers.insert(0, {"name": "gpu", "capacity_bytes": gpu})
    return {"hot_planes": hot, "tiers": tiers, **kw}


def _need(spec, hot: dict[str, int], *n_tokens: int) -> int:
    policy = PlacementPolicy(hot_planes=HotPlanes(**hot))
    return sum(hot_bytes(policy, spec, n) for n in n_tokens)


def _format(ctl: httpx.Client, seed: int, **kw: object):
    spec = calibrated_spec(ctl, make_calibration(seed, **kw))
    assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
    return spec


def _cache(ctl: httpx.Client, spec, policy: str, n_tokens: int, seq: str | None = None) -> httpx.Response:
    seq = seq or f"seq-{uuid.uuid4().hex[:8]}"
    return ctl.put(f"/v1/caches/{seq}", json={"format_id": spec.format_id, "n_tokens": n_tokens, "policy": policy})


def _active(ctl: httpx.Client, name: str) -> int:
    return ctl.get(f"/v1/policies/{name}/active").json()["version"]


def _refused(r: httpx.Response, *numbers: int) -> str:
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["error"] == "PolicyDoesNotFit"
    for n in numbers:
        assert str(n) in body["detail"], (n, body["detail"])
    assert "nothing was changed" in body["detail"]
    return body["detail"]


def test_a_version_that_does_not_fit_is_refused_and_the_active_one_stays(ctl):
    spec = _format(ctl, 40)
    name = f"fit-{uuid.uuid4().hex[:6]}"
    r = ctl.post("/v1/policies", json={"name": name, "policy": _doc(BIG, format_id=spec.format_id)})
    assert r.status_code == 201, r.text
    seq = f"seq-{uuid.uuid4().hex[:8]}"
    assert _cache(ctl, spec, name, 4096, seq).status_code == 201  # 786432 bytes of 1 MiB
    every = {"k": 8, "v": 8}
    need = _need(spec, every, 4096)
    assert need == 2 * GPU
    for activate in (False, True):
        r = ctl.put(f"/v1/policies/{name}", json={"policy": _doc(every, format_id=spec.format_id),
                                                 "activate": activate})
        detail = _refused(r, GPU, need)
        assert seq in detail and "4096 tokens" in detail and "gpu tier's capacity_bytes" in detail
        assert _active(ctl, name) == 1
        assert len(ctl.get(f"/v1/policies/{name}/versions").json()["versions"]) == 1
    # the same planes with a gpu tier that holds them: accepted
    r = ctl.put(f"/v1/policies/{name}", json={"policy": _doc(every, gpu=need, format_id=spec.format_id),
                                             "activate": True})
    assert r.status_code == 201 and r.json()["version"] == 2 and _active(ctl, name) == 2
    # no gpu tier: nothing to check
    r = ctl.put(f"/v1/policies/{name}", json={"policy": _doc(every, gpu=None, format_id=spec.format_id)})
    assert r.status_code == 201 and r.json()["version"] == 3


def test_a_bound_policy_without_caches_is_not_limited_by_them(ctl):
    spec = _format(ctl, 41)
    name = f"fit-{uuid.uuid4().hex[:6]}"
    r = ctl.post("/v1/policies", json={"name": name, "policy": _doc({"k": 8, "v": 8}, gpu=0,
                                                                    format_id=spec.format_id)})
    assert r.status_code == 201, r.text


def test_activate_and_rollback_to_a_version_the_grown_caches_no_longer_fit_are_refused(ctl):
    spec = _format(ctl, 42)
    name = f"fit-{uuid.uuid4().hex[:6]}"
    assert ctl.post("/v1/policies", json={"name": name, "policy": _doc(BIG)}).status_code == 201  # v1
    a, b = f"seq-{uuid.uuid4().hex[:8]}", f"seq-{uuid.uuid4().hex[:8]}"
    assert _cache(ctl, spec, name, 4096, a).status_code == 201  # BIG: 786432
    r = ctl.put(f"/v1/policies/{name}", json={"policy": _doc(SMALL), "activate": True})  # v2
    assert r.status_code == 201 and _active(ctl, name) == 2
    assert _cache(ctl, spec, name, 2048, b).status_code == 201  # SMALL: 786432; BIG would need 1179648
    need = _need(spec, BIG, 4096, 2048)
    assert need == 1179648 > GPU
    _refused(ctl.post(f"/v1/policies/{name}/rollback"), GPU, need)
    assert _active(ctl, name) == 2
    _refused(ctl.post(f"/v1/policies/{name}/activate", json={"version": 1}), GPU, need)
    assert _active(ctl, name) == 2
    events = [e["action"] for e in ctl.get(f"/v1/policies/{name}/history").json()["events"]]
    assert events == ["created", "updated", "activated"]
    # the caches shrink again: the rollback goes through
    assert ctl.delete(f"/v1/caches/{b}").status_code == 204
    r = ctl.post(f"/v1/policies/{name}/rollback")
    assert r.status_code == 200 and r.json()["active_version"] == 1


def test_a_cache_registration_that_would_overflow_the_gpu_tier_is_refused(ctl):
    small = _format(ctl, 43)
    wide = _format(ctl, 44, d=128)  # another format under the same (unbound) policy: its own geometry counts
    name = f"fit-{uuid.uuid4().hex[:6]}"
    assert ctl.post("/v1/policies", json={"name": name, "policy": _doc(BIG)}).status_code == 201
    a, b = f"seq-{uuid.uuid4().hex[:8]}", f"seq-{uuid.uuid4().hex[:8]}"
    assert _cache(ctl, small, name, 4096, a).status_code == 201  # 786432
    need = _need(small, BIG, 4096) + _need(wide, BIG, 1024)
    assert need == 786432 + 393216 > GPU
    detail = _refused(_cache(ctl, wide, name, 1024, b), GPU, need)
    assert f"registering cache {b}" in detail and a in detail and wide.format_id in detail
    assert ctl.get(f"/v1/caches/{b}").status_code == 404
    # a registration is counted once: growing a cache checks its new length in place of the old one
    r = ctl.put(f"/v1/caches/{a}", json={"format_id": small.format_id, "n_tokens": 5000})
    assert r.status_code == 200 and _need(small, BIG, 5000) == 970752
    _refused(ctl.put(f"/v1/caches/{a}", json={"format_id": small.format_id, "n_tokens": 6000}),
             GPU, _need(small, BIG, 6000))
    assert ctl.get(f"/v1/caches/{a}").json()["n_tokens"] == 5000
    # a cache whose format the policy cannot apply to (width 4 against W = 8) is refused, naming why
    narrow = calibrated_spec(ctl, make_calibration(45), width=4)
    assert ctl.post("/v1/formats", json=narrow.to_dict()).status_code == 201
    r = _cache(ctl, narrow, name, 64)
    assert r.status_code == 409 and r.json()["error"] == "PolicyDoesNotFit" and "width" in r.json()["detail"]
    # without a policy nothing is counted
    assert ctl.put(f"/v1/caches/{b}", json={"format_id": wide.format_id, "n_tokens": 1 << 20}).status_code == 201
