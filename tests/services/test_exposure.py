"""A service refuses to listen on a non-loopback address without an API token unless
--allow-no-token is given (then it warns); on loopback it starts without one, as before."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from planekv.services.exposure import check_exposure, is_loopback
from planekv.settings import load_settings

from .conftest import free_port, service_env, start_store


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("10.1.2.3", False), ("node-1.example", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_check_exposure(caplog):
    check_exposure("store service", "127.0.0.1", load_settings(api_token=None))
    check_exposure("store service", "0.0.0.0", load_settings(api_token="secret"))
    with pytest.raises(SystemExit, match="refusing to start the store service on 0.0.0.0 without an API token"):
        check_exposure("store service", "0.0.0.0", load_settings(api_token=None))
    check_exposure("store service", "0.0.0.0", load_settings(api_token=None, allow_no_token=True))
    assert "WITHOUT AN API TOKEN" in caplog.text


@pytest.mark.parametrize("module", ["planekv.services.control", "planekv.services.store"])
def test_a_non_loopback_host_without_a_token_is_refused(tmp_path, module):
    cmd = [sys.executable, "-m", module, "--host", "0.0.0.0", "--port", str(free_port()),
           "--redis-url", "redis://127.0.0.1:1/0"]
    done = subprocess.run(cmd, env=service_env(None, tmp_path, token=None), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert "without an API token" in done.stderr and "--allow-no-token" in done.stderr


def test_allow_no_token_starts_and_warns(tmp_path):
    s = start_store(tmp_path, None, "--host", "0.0.0.0", "--allow-no-token", token=None)
    try:
        assert httpx.get(f"{s.url}/v1/stats", timeout=10).status_code == 200  # no token asked
    finally:
        s.stop()
    assert "WITHOUT AN API TOKEN" in s.tail()
