"""planekv.services.launch, what `planekv up`, `planekv bench load` and these fixtures start Redis with: a 0600
config file requiring a password that appears in no command line, and a ping that authenticates."""

from __future__ import annotations

import socket
import stat
from pathlib import Path

import pytest
import redis

from planekv.services.launch import new_secret_file, port_busy, redis_command, redis_ping
from planekv.services.redis_auth import RedisPasswordError, read_password_file

from .conftest import Proc, redis_password_file


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_a_new_secret_file_is_private_random_and_kept(tmp_path: Path) -> None:
    a = new_secret_file(tmp_path / "a")
    b = new_secret_file(tmp_path / "b")
    assert mode(a) == 0o600 and len(read_password_file(a)) == 64
    assert read_password_file(a) != read_password_file(b)
    before = a.read_text()
    assert new_secret_file(a) == a and a.read_text() == before  # an existing file is kept


def test_redis_command_puts_the_password_in_a_private_config_file_not_the_argv(tmp_path: Path) -> None:
    pw = new_secret_file(tmp_path / "pw")
    old = tmp_path / "data" / "redis.conf"
    old.parent.mkdir()
    old.write_text("stale")
    old.chmod(0o644)
    argv = redis_command("redis-server", 6399, tmp_path / "data", pw, appendfsync="always")
    assert argv == ["redis-server", str(old)]
    conf = old.read_text()
    assert mode(old) == 0o600  # recreated private, whatever mode the old one had
    assert f'requirepass "{read_password_file(pw)}"' in conf
    for line in ("port 6399", "bind 127.0.0.1", "protected-mode yes", "appendonly yes", "appendfsync always",
                 'save ""', f'dir "{(tmp_path / "data").resolve()}"'):
        assert line in conf.splitlines(), line
    assert not any(read_password_file(pw) in a for a in argv)


def test_redis_command_refuses_an_unusable_password_file_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RedisPasswordError, match=str(tmp_path / "missing")):
        redis_command("redis-server", 6399, tmp_path, tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(RedisPasswordError, match="empty"):
        redis_command("redis-server", 6399, tmp_path, tmp_path / "empty")
    with pytest.raises(ValueError, match="appendfsync"):
        redis_command("redis-server", 6399, tmp_path, new_secret_file(tmp_path / "pw"), appendfsync="sometimes")


def test_the_fixtures_redis_refuses_a_client_without_the_password(redis_server: Proc) -> None:
    port = redis_server.port
    with redis.Redis(port=port) as r, pytest.raises(redis.AuthenticationError):  # NOAUTH
        r.ping()
    with redis.Redis(port=port, password="wrong") as r, pytest.raises(redis.AuthenticationError):  # WRONGPASS
        r.ping()
    password = read_password_file(redis_password_file())
    assert not redis_ping(port, None) and not redis_ping(port, "wrong") and redis_ping(port, password)
    with redis.Redis(port=port, password=password) as r:
        assert r.ping()


def test_the_password_is_in_no_command_line_environment_or_log_of_the_fixtures(redis_server, control, store):
    from planekv.services.launch import descendants

    password = read_password_file(redis_password_file()).encode()
    pids = {p.proc.pid for p in (redis_server, control, store)}
    pids |= {d for p in list(pids) for d in descendants(p)}
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert password not in cmdline, cmdline
        assert password not in Path(f"/proc/{pid}/environ").read_bytes(), pid
        assert b"--redis-url" not in cmdline
    for p in (redis_server, control, store):
        assert password.decode() not in p.log.read_text()


def test_a_port_is_busy_while_listened_on_and_free_once_only_time_wait_is_left() -> None:
    """A stack just stopped leaves its server-side connections in TIME_WAIT; servers bind such a port again
    (SO_REUSEADDR), so `planekv up` must not call it busy (it did on the GPU machine, 2026-12-05)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    assert port_busy(port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side of the connection waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    assert not port_busy(port)
    with socket.socket() as plain:  # what the probe did before: a bind without SO_REUSEADDR is refused
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
