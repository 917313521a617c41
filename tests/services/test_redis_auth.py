"""The services authenticate to Redis (planekv.services.redis_client): with the password file or a password in the
URL, never showing it; an unusable password file, a wrong password or none stops a service at once with one line
naming the cause and the file, not a stack trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from planekv.services.launch import free_port
from planekv.services.redis_auth import RedisPasswordError, read_password_file, redact_url

from .conftest import Proc, redis_password_file, service_env, start_service

START_TIMEOUT_S = 60


def test_a_url_is_shown_with_its_password_redacted() -> None:
    assert redact_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert redact_url("redis://kv:s3cret@redis:6379/0") == "redis://kv:***@redis:6379/0"
    assert redact_url("rediss://:p%40ss@h:1/2") == "rediss://:***@h:1/2"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_a_password_file_must_hold_one_line(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("abc\n")
    assert read_password_file(tmp_path / "pw") == "abc"
    (tmp_path / "two").write_text("abc\ndef\n")
    with pytest.raises(RedisPasswordError, match="several lines"):
        read_password_file(tmp_path / "two")
    with pytest.raises(RedisPasswordError, match=f"{tmp_path / 'none'}.*PLANEKV_REDIS_PASSWORD_FILE"):
        read_password_file(tmp_path / "none")


def run_service(which: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a service that should refuse to start; its exit status and output."""
    cmd = [sys.executable, "-m", f"planekv.services.{which}", "--port", str(free_port())]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)


@pytest.mark.parametrize("which", ["control", "store"])
def test_a_wrong_or_missing_password_file_stops_a_service_with_one_line_naming_it(tmp_path, redis_url, which):
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    cases = {wrong: "refused the password from the file", tmp_path / "missing": "cannot read the Redis password file"}
    for path, what in cases.items():
        env = service_env(redis_url, tmp_path, PLANEKV_REDIS_PASSWORD_FILE=str(path))
        p = run_service(which, env)
        out = p.stdout + p.stderr
        assert p.returncode != 0, out
        assert what in out and str(path) in out, out
        assert "Traceback" not in out, out


def test_a_service_without_a_password_is_told_that_redis_requires_one(tmp_path, redis_url):
    env = service_env(redis_url, tmp_path)
    del env["PLANEKV_REDIS_PASSWORD_FILE"]
    p = run_service("control", env)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "requires a password" in out and "PLANEKV_REDIS_PASSWORD_FILE" in out, out
    assert "Traceback" not in out, out


def test_a_password_in_the_url_works_and_is_logged_redacted(tmp_path, redis_server: Proc):
    password = read_password_file(redis_password_file())
    p = start_control_with_url(tmp_path, f"redis://:{password}@127.0.0.1:{redis_server.port}/0")
    try:
        log = p.log.read_text()
        assert f"redis://:***@127.0.0.1:{redis_server.port}/0" in log, log
        assert password not in log
        assert password.encode() not in Path(f"/proc/{p.proc.pid}/cmdline").read_bytes()
    finally:
        p.stop()


def start_control_with_url(data_dir: Path, url: str) -> Proc:
    """The control plane given Redis's password in its URL only (no password file), logging at INFO (its startup
    line names the Redis URL)."""
    env = service_env(url, data_dir, PLANEKV_LOG_LEVEL="INFO")
    del env["PLANEKV_REDIS_PASSWORD_FILE"]
    port = free_port()
    return start_service([sys.executable, "-m", "planekv.services.control", "--port", str(port)], port, env,
                         data_dir / f"control-{port}.log", data_dir)
