"""Registering a calibration with the control plane (PUT /v1/calibrations/{id}): created, already
there, refused, unreachable, and never a non-loopback address."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest
import torch

pytest.importorskip("httpx")

from planekv.evaluation.client import is_loopback_url, register_calibration  # noqa: E402
from planekv.kvstore import Calibration, calibrate  # noqa: E402


def _calib() -> Calibration:
    g = torch.Generator().manual_seed(0)
    return calibrate(torch.randn(1, 1, 16, 8, generator=g), torch.randn(1, 1, 16, 8, generator=g), 1, 2)


class _Store(http.server.BaseHTTPRequestHandler):
    seen: dict[str, bytes] = {}
    token: str | None = "s3cret"

    def do_PUT(self) -> None:  # noqa: N802
        if self.token and self.headers.get("authorization") != f"Bearer {self.token}":
            self.send_response(401)
            self.end_headers()
            return
        body = self.rfile.read(int(self.headers["content-length"]))
        cid = self.path.rsplit("/", 1)[-1]
        ok = self.path.startswith("/v1/calibrations/") and Calibration.from_bytes(body).calibration_id == cid
        status = 400 if not ok else (200 if self.seen.get(cid) == body else 201)
        self.seen[cid] = body
        self.send_response(status)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Store)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_registers_then_reports_already_there(server):
    c = _calib()
    ok, msg = register_calibration(c, server, token="s3cret")
    assert ok and "created" in msg
    ok, msg = register_calibration(c, server, token="s3cret")
    assert ok and "already registered" in msg


def test_refusal_is_reported(server):
    ok, msg = register_calibration(_calib(), server, token="wrong")
    assert not ok and "401" in msg


def test_unreachable_and_unconfigured():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    ok, msg = register_calibration(_calib(), f"http://127.0.0.1:{port}", timeout_s=0.5)
    assert not ok and "not reachable" in msg
    assert register_calibration(_calib(), None) == (False, "no control plane configured; artifact not registered")


def test_only_loopback_is_contacted():
    assert is_loopback_url("http://127.0.0.1:8080") and is_loopback_url("http://localhost:8080")
    ok, msg = register_calibration(_calib(), "http://192.0.2.1:8080")
    assert not ok and "not a loopback address" in msg
