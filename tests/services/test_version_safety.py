"""Version safety across the store and the control plane: data of one format is never stored or
read under another, and nothing of an unknown format or frame version is accepted."""

from __future__ import annotations

import struct
import uuid

from planekv.tiering import BlockKey, encode_frame

from .conftest import client, start_store
from .test_control import calibrated_spec, make_calibration


def test_the_store_refuses_blocks_of_a_format_the_control_plane_does_not_know(tmp_path, redis_url, ctl):
    s = start_store(tmp_path, redis_url, "--spill-dir", str(tmp_path / "spill"),
                    PLANEKV_STORE__REQUIRE_REGISTERED_FORMAT="true")  # the default, stated
    spec = calibrated_spec(ctl, make_calibration(31))
    seq = f"seq-{uuid.uuid4().hex[:8]}"
    k = BlockKey(spec.format_id, seq, "k", 0, 0, 0, 64, 2, 8)
    frame = encode_frame(k, b"\x01" * 5000)
    try:
        with client(s.url) as st:
            r = st.put(f"/v1/blocks/{k}", content=frame)
            assert r.status_code == 409 and r.json()["error"] == "FormatNotRegistered", r.text
            assert "register it first" in r.json()["detail"]
            assert st.get(f"/v1/blocks/{k}").status_code == 404  # nothing stored
            assert ctl.get(f"/v1/caches/{seq}").status_code == 404  # nothing registered
            assert ctl.post("/v1/formats", json=spec.to_dict()).status_code == 201
            assert st.put(f"/v1/blocks/{k}", content=frame).status_code == 201
            assert st.get(f"/v1/blocks/{k}").content == frame
            # a frame of a frame version this build does not read: 400 naming the version
            k2 = BlockKey(spec.format_id, seq, "k", 1, 0, 0, 64, 2, 8)
            bad = bytearray(encode_frame(k2, b"\x01" * 5000))
            struct.pack_into("<H", bad, 8, 7)  # the frame version field
            r = st.put(f"/v1/blocks/{k2}", content=bytes(bad))
            assert r.status_code == 400 and r.json()["error"] == "UnknownFrameVersion" and "7" in r.json()["detail"]
            # the sequence now has this format: a block of another (registered) format is refused
            other = calibrated_spec(ctl, make_calibration(32))
            assert ctl.post("/v1/formats", json=other.to_dict()).status_code == 201
            k3 = BlockKey(other.format_id, seq, "k", 0, 0, 0, 64, 2, 8)
            r = st.put(f"/v1/blocks/{k3}", content=encode_frame(k3, b"\x02" * 5000))
            assert r.status_code == 409 and "one format" in r.json()["detail"]
            r = ctl.put(f"/v1/caches/{seq}", json={"format_id": other.format_id})
            assert r.status_code == 409 and "one format" in r.json()["detail"]
    finally:
        s.stop()
