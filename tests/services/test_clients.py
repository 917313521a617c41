"""StoreClient and ControlClient against the real services (the session's redis, control plane and store):
typed answers, errors with the service's detail, retries only where they are safe."""

from __future__ import annotations

import socket
import uuid

import httpx
import pytest

from planekv.services.clients import ControlClient, ServiceError, StoreClient
from planekv.tiering import BlockError, BlockKey, PlacementPolicy, encode_frame

from .conftest import TOKEN
from .test_control import make_calibration, make_spec


@pytest.fixture()
def control_client(control):
    with ControlClient(control.url, TOKEN, timeout_s=10) as c:
        yield c


@pytest.fixture()
def store_client(store):
    with StoreClient(store.url, TOKEN, timeout_s=10) as c:
        yield c


def test_a_cache_lifecycle_through_both_clients(control_client, store_client):
    calib = make_calibration(71)
    meta = control_client.register_calibration(calib.calibration_id, calib.to_bytes())
    assert meta.calibration_id == calib.calibration_id
    assert control_client.calibration_artifact(calib.calibration_id) == calib.to_bytes()
    spec = make_spec(calib)
    entry = control_client.register_format(spec.to_dict())
    assert entry.format_id == spec.format_id and control_client.get_format(spec.format_id) is not None
    seq = f"seq-{uuid.uuid4().hex[:8]}"
    assert control_client.register_cache(seq, spec.format_id, n_tokens=128).format_id == spec.format_id

    key = BlockKey(spec.format_id, seq, "v", 0, 0, 0, 64, 2, 8)
    frame = encode_frame(key, b"\x05" * 8192)
    put = store_client.put_block(frame)
    assert put.created and put.key == str(key) and not store_client.put_block(frame).created
    assert store_client.get_block(key) == frame and store_client.has_block(key)
    assert [b.key for b in store_client.list_blocks(sequence_id=seq).blocks] == [str(key)]
    with pytest.raises(ServiceError) as refused:  # the store still holds a block of it
        control_client.delete_cache(seq)
    assert refused.value.status == 409 and "DELETE them at the store first" in refused.value.detail
    assert store_client.delete_block(key) and not store_client.delete_block(key)
    assert store_client.get_block(key) is None
    assert control_client.delete_cache(seq) and control_client.get_cache(seq) is None


def test_policies_through_the_control_client(control_client):
    name = f"p-{uuid.uuid4().hex[:6]}"
    assert control_client.active_policy(name) is None
    made = control_client.create_policy(name, PlacementPolicy(hot_planes={"k": 4, "v": 2}))
    assert made.active_version == 1
    v2 = control_client.update_policy(name, PlacementPolicy(hot_planes={"k": 3, "v": 3}), activate=True)
    assert v2.version == 2 and v2.active
    active = control_client.active_policy(name)
    assert active is not None and active.policy.hot_planes.k == 3
    assert control_client.activate_policy(name, 1).active_version == 1


def test_errors_carry_the_services_detail(control, control_client, store_client):
    with ControlClient(control.url, token="wrong-token") as bad:
        with pytest.raises(ServiceError) as e:
            bad.register_format({"model_id": "x"})
    assert e.value.status == 401
    calib = make_calibration(72)
    control_client.register_calibration(calib.calibration_id, calib.to_bytes())
    spec = make_spec(calib)
    control_client.register_format(spec.to_dict())
    key = BlockKey(spec.format_id, f"seq-{uuid.uuid4().hex[:8]}", "k", 0, 0, 0, 64, 2, 8)
    store_client.put_block(encode_frame(key, b"\x01" * 4096))
    with pytest.raises(ServiceError) as e:  # blocks are immutable: other bytes under the key
        store_client.put_block(encode_frame(key, b"\x02" * 4096))
    assert e.value.status == 409 and str(key) in e.value.detail
    assert store_client.delete_block(key)
    with pytest.raises(BlockError, match="magic"):  # not a frame: refused here, before any request
        store_client.put_block(b"not a frame" + bytes(5000))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_service_is_retried_with_backoff_then_reported(caplog):
    with StoreClient(f"http://127.0.0.1:{_closed_port()}", retries=2, backoff_s=0.01, timeout_s=2) as c:
        with caplog.at_level("INFO", logger="planekv.services.clients"), pytest.raises(ServiceError) as e:
            c.list_blocks()
    assert e.value.status == 0 and "after 3 tries" in str(e.value)
    assert caplog.text.count("trying again") == 2


def test_a_lost_answer_is_retried_only_when_the_request_is_idempotent():
    calls: list[str] = []

    def flaky(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) == 1:
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return httpx.Response(200, json={"policies": []})

    with ControlClient("http://control.test", retries=3, backoff_s=0, transport=httpx.MockTransport(flaky)) as c:
        assert c.request("GET", "/v1/policies").json() == {"policies": []}
        assert calls == ["GET", "GET"]
        calls.clear()
        with pytest.raises(ServiceError, match="not retried"):
            c.request("POST", "/v1/policies", json={})
        assert calls == ["POST"]


def test_bad_client_settings_are_refused():
    with pytest.raises(ValueError, match="timeout_s"):
        StoreClient("http://127.0.0.1:1", timeout_s=0)
