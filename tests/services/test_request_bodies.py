"""What a JSON request body may hold, on both live services: NaN / Infinity / overflowing numbers are
a 400 naming the field (they used to be a 500), a boolean is not a number (422), and the control
plane takes every codebook FormatSpec knows."""

from __future__ import annotations

import json

import pytest

from planekv.kvstore import CODEBOOKS
from planekv.services.control import routes_caches, routes_calibrations, routes_formats, routes_ops, routes_policies
from planekv.services.request_body import FiniteJSONRoute
from planekv.services.store import routes as store_routes

from .test_control import calibrated_spec, make_calibration, make_spec

STATS = {"mu_k": [[[0.0] * 8]], "sigma_k": [[[1.0] * 8]], "mu_v": [[[0.5] * 8]], "sigma_v": [[[2.0] * 8]]}


def post_raw(c, path: str, text: str):
    return c.post(path, content=text.encode(), headers={"content-type": "application/json"})


def test_every_router_reads_json_bodies_with_the_finite_check():
    routers = [m.router for m in (routes_caches, routes_calibrations, routes_formats, routes_ops, routes_policies)]
    routers += [routes_ops.probes, store_routes.router, store_routes.probes]
    assert all(r.route_class is FiniteJSONRoute for r in routers)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_control_plane_refuses_non_finite_numbers_naming_the_field(ctl, token):
    stats = json.dumps(STATS).replace("2.0", token, 1)  # sigma_v[0][0][0]
    r = post_raw(ctl, "/v1/calibrations", f'{{"statistics": {stats}}}')
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert f"body.statistics.sigma_v[0][0][0] is {token}" in detail and "finite" in detail


@pytest.mark.parametrize("token", ["NaN", "Infinity"])
def test_store_refuses_non_finite_numbers_naming_the_field(st, token):
    r = post_raw(st, "/v1/blocks:batch-get", f'{{"keys": ["a", {token}]}}')
    assert r.status_code == 400, r.text
    assert f"body.keys[1] is {token}" in r.json()["detail"]


def test_nan_inside_a_string_is_just_text(ctl):
    stats = {**STATS, "mu_k": [[[0.0625] * 8]]}  # statistics of this test alone: its calibration id is new
    r = ctl.post("/v1/calibrations", json={"statistics": stats, "meta": {"note": "NaN Infinity"}})
    assert r.status_code in (200, 201), r.text


def test_control_plane_refuses_a_boolean_for_a_number(ctl):
    spec = make_spec(make_calibration(40)).to_dict()
    for field, value in [("n_layers", True), ("width", False), ("v_run", True), ("rope_theta", True)]:
        r = ctl.post("/v1/formats", json={**spec, field: value})
        assert r.status_code == 422 and field in r.text, (field, r.text)
    r = ctl.post("/v1/policies", json={"name": "strict-bools", "policy": {"hot_planes": {"k": False, "v": 1}}})
    assert r.status_code == 422 and '"hot_planes","k"' in r.text.replace(" ", ""), r.text
    r = ctl.post("/v1/calibrations", json={"statistics": {**STATS, "mu_k": [[[True] * 8]]}})
    assert r.status_code == 422, r.text
    r = ctl.post("/v1/calibrations", json={"statistics": STATS, "seed_k": False})
    assert r.status_code == 422 and "seed_k" in r.text


def test_store_refuses_a_boolean_for_a_key(st):
    r = st.post("/v1/blocks:batch-get", json={"keys": [False]})
    assert r.status_code == 422 and "keys" in r.text


@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_control_plane_takes_every_codebook_formatspec_knows(ctl, codebook):
    spec = calibrated_spec(ctl, make_calibration(41), codebook=codebook)
    r = ctl.post("/v1/formats", json=spec.to_dict())
    assert r.status_code in (200, 201), r.text
    assert r.json()["format_id"] == spec.format_id and r.json()["spec"]["codebook"] == codebook
    assert ctl.post("/v1/formats", json={**spec.to_dict(), "codebook": "no-such-codebook"}).status_code == 422
